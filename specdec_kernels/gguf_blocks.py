"""GGUF weight blocks: formats, quantisation, dequantisation, and a weight container for
``ops.quantized_linear``.

A linear weight [N, H] in a GGUF file is a run of blocks per row (llama.cpp's formats):
``uint8 [N, H / block_size * block_bytes]`` plus its GGML type id (the values of
``gguf.GGMLQuantizationType``). ``QuantizedWeight`` holds such bytes with the type and the
logical shape; the model keeps it instead of a dequantised fp32 matrix and multiplies with
``ops.quantized_linear``, which streams the bytes as they are.

``quantize`` and ``dequantize`` here are torch versions of ``gguf.quantize`` /
``gguf.dequantize`` (gguf-py's quants.py) giving the same bytes and the same fp32 values
(tests/test_linear.py checks that), vectorised over whole tensors: fast enough to quantise
a checkpoint on load.

Formats (``TYPES``): name -> (type id, weights per block, bytes per block)
    F32 (0): 1, 4      F16 (1): 1, 2      BF16 (30): 1, 2
    Q4_0 (2): 32, 18   fp16 d; 16 bytes of nibbles; w = d * (q - 8)
    Q4_1 (3): 32, 20   fp16 d, fp16 m; 16 bytes of nibbles; w = d * q + m
    Q8_0 (8): 32, 34   fp16 d; 32 int8 q; w = q * d
(byte j of the nibbles holds weight j in its low and weight j + 16 in its high 4 bits).

``pack_int8_activation`` repacks Q4_0 / Q4_1 / Q8_0 blocks 16 rows at a time for
``ops.int8_activation_linear`` (activations quantised to int8, integer dot products);
``QuantizedWeight.with_int8_activations`` attaches that packing to a weight, and ``ops.linear``
then uses it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from . import checks, ops

__all__ = ["TYPES", "F32", "F16", "Q4_0", "Q4_1", "Q8_0", "BF16", "type_id", "type_name", "block_size",
           "block_bytes", "row_bytes", "quantize", "dequantize", "pack_int8_activation", "INT8_ACTIVATION_TYPES",
           "QuantizedWeight"]

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPES = {name: (tid, size, nbytes) for tid, (name, size, nbytes) in ops.GGUF_BLOCK_FORMATS.items()}


def type_id(block_type) -> int:
    """The GGML type id of ``block_type``: an id (int or ``gguf.GGMLQuantizationType``) or a
    name such as "Q4_1" (case-insensitive); ValueError for formats quantized_linear does not read."""
    if isinstance(block_type, str):
        name = block_type.upper()
        if name not in TYPES:
            raise ValueError(f"block type must be one of {', '.join(TYPES)}, got {block_type!r}")
        return TYPES[name][0]
    tid = int(block_type)
    if tid not in ops.GGUF_BLOCK_FORMATS:
        raise ValueError(f"block type must be one of {checks.gguf_block_types_text()}, got {block_type!r}")
    return tid


def type_name(block_type) -> str:
    return ops.GGUF_BLOCK_FORMATS[type_id(block_type)][0]


def block_size(block_type) -> int:
    """Weights per block (32 for the quantised types, 1 for F32/F16/BF16)."""
    return ops.GGUF_BLOCK_FORMATS[type_id(block_type)][1]


def block_bytes(block_type) -> int:
    """Bytes per block."""
    return ops.GGUF_BLOCK_FORMATS[type_id(block_type)][2]


def row_bytes(block_type, H: int) -> int:
    """Bytes of one weight row of H weights (H must be a multiple of the block size)."""
    size = block_size(block_type)
    if H % size != 0:
        raise ValueError(f"a {type_name(block_type)} row must hold a multiple of {size} weights, got H = {H}")
    return H // size * block_bytes(block_type)


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes [start, start + 2) of each block, as fp32 [..., 1] (exact)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15: low nibbles (weights 0..15), then high."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def dequantize(blocks: torch.Tensor, block_type, shape: Sequence[int] | None = None) -> torch.Tensor:
    """fp32 values of GGUF blocks, exactly as ``gguf.dequantize`` computes them.

    blocks: uint8 [..., row_bytes] (CPU or any device). Returns fp32 [..., H] (or ``shape``).
    """
    tid = type_id(block_type)
    checks.check_tensor(blocks, "blocks", dtype=torch.uint8)
    if blocks.dim() == 0:
        raise ValueError("blocks must have at least one dimension")
    _, size, nbytes = ops.GGUF_BLOCK_FORMATS[tid]
    if blocks.shape[-1] % nbytes != 0:
        raise ValueError(f"blocks.shape[-1] must be a multiple of the {type_name(tid)} block bytes {nbytes}, "
                         f"got {list(blocks.shape)}")
    lead = blocks.shape[:-1]
    b = blocks.reshape(*lead, blocks.shape[-1] // nbytes, nbytes)
    if tid == F32:
        w = b.contiguous().view(torch.float32)
    elif tid == F16:
        w = b.contiguous().view(torch.float16).float()
    elif tid == BF16:
        w = b.contiguous().view(torch.bfloat16).float()
    elif tid == Q4_0:
        w = _f16_field(b, 0) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
    elif tid == Q4_1:
        w = _f16_field(b, 0) * _nibbles(b[..., 4:]).float() + _f16_field(b, 2)
    else:  # Q8_0
        w = b[..., 2:].contiguous().view(torch.int8).float() * _f16_field(b, 0)
    w = w.reshape(*lead, -1)
    return w.reshape(tuple(shape)) if shape is not None else w


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """gguf's np_roundf: round to nearest, ties away from zero, in fp32 like numpy."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d == 0 (gguf: np.where(d == 0, 0, 1 / d))."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def quantize(weight: torch.Tensor, block_type) -> "QuantizedWeight":
    """GGUF blocks of ``weight`` (a float tensor [N, H], CPU), the bytes ``gguf.quantize``
    writes for Q4_0, Q4_1, Q8_0 (llama.cpp's reference quantisers), BF16, F16 and F32.

    H must be a multiple of the block size. NaN weights are not supported.
    """
    tid = type_id(block_type)
    checks.check_tensor(weight, "weight", dims=2)
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    N, H = weight.shape
    row_bytes(tid, H)  # checks H
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if tid == F32:
        raw = w.view(torch.uint8)
    elif tid == F16:
        raw = w.half().view(torch.uint8)
    elif tid == BF16:
        raw = w.bfloat16().view(torch.uint8)
    else:
        blocks = w.reshape(N, H // 32, 32)
        if tid == Q8_0:
            d = blocks.abs().amax(dim=-1, keepdim=True) / 127
            q = _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
            fields = [d.half().view(torch.uint8), q]
        else:
            if tid == Q4_0:
                imax = blocks.abs().argmax(dim=-1, keepdim=True)
                d = blocks.gather(-1, imax) / -8
                q = (blocks * _inverse(d) + 8.5).trunc()
                header = [d.half().view(torch.uint8)]
            else:  # Q4_1
                lo = blocks.amin(dim=-1, keepdim=True)
                d = (blocks.amax(dim=-1, keepdim=True) - lo) / 15
                q = ((blocks - lo) * _inverse(d) + 0.5).trunc()
                header = [d.half().view(torch.uint8), lo.half().view(torch.uint8)]
            q = q.to(torch.uint8).clamp(0, 15)
            fields = header + [q[..., :16] | (q[..., 16:] << 4)]
        raw = torch.cat(fields, dim=-1)
    return QuantizedWeight(raw.reshape(N, -1).contiguous(), tid, (N, H))


INT8_ACTIVATION_TYPES = (Q4_0, Q4_1, Q8_0)  # the block types int8_activation_linear reads


def pack_int8_activation(blocks: torch.Tensor, block_type) -> torch.Tensor:
    """GGUF blocks uint8 [N, row_bytes] of a Q4_0 / Q4_1 / Q8_0 weight [N, H] repacked for
    ``ops.int8_activation_linear``: uint8 [ceil(N / 16), H / 32, group block bytes].

    Group g, block b holds block b of rows 16g .. 16g + 15 (rows past N are zeros): their 16
    fp16 scales d (32 bytes), for Q4_1 their 16 fp16 mins m (32 bytes), then the weights
    word-interleaved, one 4-byte word per row in each 64 bytes (one int32 lane per row of a
    vector dot product): Q4 blocks as 4 chunks, chunk k holding each row's qs[4k .. 4k + 4)
    (weights 4k + t in the low, 16 + 4k + t in the high nibbles); Q8_0 as 8 steps, step k
    holding each row's q[4k .. 4k + 4) plus 128 (unsigned bytes for vpdpbusd)."""
    tid = type_id(block_type)
    if tid not in INT8_ACTIVATION_TYPES:
        raise ValueError(f"int8-activation packing reads Q4_0, Q4_1 and Q8_0 blocks, got {type_name(tid)}")
    nbytes = block_bytes(tid)
    checks.check_tensor(blocks, "blocks", dtype=torch.uint8, dims=2)
    N, rb = blocks.shape
    if rb % nbytes != 0:
        raise ValueError(f"blocks.shape[1] must be a multiple of the {type_name(tid)} block bytes {nbytes}, "
                         f"got {list(blocks.shape)}")
    nb, G = rb // nbytes, -(-N // 16)
    b = torch.zeros(G * 16, nb, nbytes, dtype=torch.uint8, device=blocks.device)
    b[:N] = blocks.reshape(N, nb, nbytes)
    b = b.view(G, 16, nb, nbytes).transpose(1, 2)  # [G, nb, 16 rows, block bytes]
    fields = [b[..., 0:2].reshape(G, nb, 32)]  # d of the 16 rows
    if tid == Q4_1:
        fields.append(b[..., 2:4].reshape(G, nb, 32))  # m
    start = 4 if tid == Q4_1 else 2
    if tid == Q8_0:
        words = b[..., start:start + 32].reshape(G, nb, 16, 8, 4) ^ 128  # q + 128 as uint8
    else:
        words = b[..., start:start + 16].reshape(G, nb, 16, 4, 4)
    fields.append(words.transpose(2, 3).reshape(G, nb, -1))  # [chunk/step, row, byte]
    return torch.cat(fields, dim=-1).contiguous()


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [N, H] held as GGUF blocks.

    blocks: uint8 [N, row_bytes(block_type, H)], contiguous; block_type: GGML type id;
    shape: (N, H), the logical shape (GGUF files list it reversed, as [H, N]);
    int8_packed: None, or ``pack_int8_activation(blocks)``: then ``ops.linear`` multiplies
    with ``int8_activation_linear`` (activations quantised to int8) instead of
    ``quantized_linear`` (see ``with_int8_activations``).
    Row operations (``rows``, ``cat``) move whole rows of blocks: a row gather of the
    uint8 matrix is a row gather of the weight (they drop the int8 packing).
    """

    blocks: torch.Tensor
    block_type: int
    shape: tuple[int, int]
    int8_packed: torch.Tensor | None = None

    def __post_init__(self):
        tid = type_id(self.block_type)
        object.__setattr__(self, "block_type", tid)
        if len(self.shape) != 2:
            raise ValueError(f"shape must be (N, H), got {self.shape}")
        N, H = (int(s) for s in self.shape)
        object.__setattr__(self, "shape", (N, H))
        checks.check_tensor(self.blocks, "blocks", dtype=torch.uint8, shape=(N, row_bytes(tid, H)))
        if not self.blocks.is_contiguous():
            raise ValueError("blocks must be contiguous")

    @classmethod
    def from_gguf(cls, tensor) -> "QuantizedWeight":
        """From a 2-d ``gguf.ReaderTensor`` (its bytes are copied out of the file mapping).
        The file's shape [H, N] is reversed to (N, H); rows stay in the file's order (undo
        llama.cpp's attn_q/attn_k RoPE permutation with ``rows``)."""
        if len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name}: a linear weight has 2 dimensions, got shape {list(tensor.shape)}")
        H, N = (int(s) for s in tensor.shape)
        data = np.array(tensor.data, copy=True).view(np.uint8).reshape(N, -1)
        return cls(torch.from_numpy(data), int(tensor.tensor_type), (N, H))

    @property
    def type_name(self) -> str:
        return type_name(self.block_type)

    @property
    def nbytes(self) -> int:
        """Bytes a product with this weight streams."""
        return self.blocks.numel()

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def to(self, device) -> "QuantizedWeight":
        packed = None if self.int8_packed is None else self.int8_packed.to(device)
        return QuantizedWeight(self.blocks.to(device), self.block_type, self.shape, packed)

    def with_int8_activations(self) -> "QuantizedWeight":
        """This weight with its int8-activation packing attached (``ops.linear`` then uses
        ``int8_activation_linear``); the weight itself when its type has no such kernel
        (only Q4_0, Q4_1 and Q8_0 have one)."""
        if self.block_type not in INT8_ACTIVATION_TYPES or self.int8_packed is not None:
            return self
        return QuantizedWeight(self.blocks, self.block_type, self.shape,
                               pack_int8_activation(self.blocks, self.block_type))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, H], the values gguf.dequantize gives."""
        return dequantize(self.blocks, self.block_type, self.shape)

    def rows(self, index) -> "QuantizedWeight":
        """The weight made of rows ``index`` (int64 [R] or a slice), e.g. a permutation."""
        if isinstance(index, slice):
            blocks = self.blocks[index]
        else:
            index = torch.as_tensor(index, dtype=torch.int64, device=self.blocks.device)
            checks.check_tensor(index, "index", dims=1)
            blocks = self.blocks.index_select(0, index)
        return QuantizedWeight(blocks.contiguous(), self.block_type, (blocks.shape[0], self.shape[1]))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [*ids.shape, H]: the dequantised rows ``ids`` (an embedding lookup that
        dequantises only the rows it reads)."""
        checks.check_tensor(ids, "ids", dtype=(torch.int64, torch.int32), device=self.blocks.device)
        rows = self.blocks.index_select(0, ids.reshape(-1).long())
        return dequantize(rows, self.block_type).reshape(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] (fp32/bf16/fp16) @ weight^T (+ bias) -> fp32 [..., N]: the one product of
        a block weight (the model's ``linear`` calls this; ``ops.linear`` takes tensors only),
        through ``quantized_linear``, or through
        ``int8_activation_linear`` when the weight carries its int8 packing
        (``with_int8_activations``). Both are batch-invariant (a row's result does not depend
        on the other rows), which keeps speculative greedy output bit-identical to
        autoregressive output. The blocks were validated when the weight was built and the
        kernels check x and the bias, so this hot path (~200 calls per decode step) calls the
        ops directly, without the wrappers' Python checks (under cProfile they took ~5% of a
        step)."""
        N, H = self.shape
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != H:
            raise ValueError(f"x must have shape [..., {H}] for a weight of shape {list(self.shape)}, "
                             f"got {list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.device != self.blocks.device:
            raise ValueError(f"x is on {x.device}, the weight on {self.blocks.device}")
        flat = x.reshape(-1, H)
        flat = flat if flat.is_contiguous() else flat.contiguous()
        out = torch.empty((flat.shape[0], N), dtype=torch.float32, device=x.device)
        if self.int8_packed is not None:
            torch.ops.specdec.int8_activation_linear(flat, self.int8_packed, self.block_type, bias, out)
        else:
            torch.ops.specdec.quantized_linear(flat, self.blocks, self.block_type, bias, out)
        return out.reshape(*x.shape[:-1], N)

    @staticmethod
    def cat(weights: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
        """Rows of several weights of one type and H stacked (e.g. a fused q|k|v projection)."""
        if len(weights) == 0:
            raise ValueError("cat needs at least one weight")
        first = weights[0]
        for i, w in enumerate(weights):
            if w.block_type != first.block_type or w.shape[1] != first.shape[1]:
                raise ValueError(f"weights[{i}] is {w.type_name} {list(w.shape)}; cat needs one block type and H "
                                 f"({first.type_name}, H = {first.shape[1]})")
        blocks = torch.cat([w.blocks for w in weights], dim=0)
        return QuantizedWeight(blocks, first.block_type, (blocks.shape[0], first.shape[1]))

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.type_name}, shape={list(self.shape)}, {self.nbytes / 2**20:.2f} MiB, "
                f"device={self.device})")
