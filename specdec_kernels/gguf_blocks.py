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
    Q5_0 (6): 32, 22   fp16 d; uint32 of fifth bits; 16 bytes of nibbles; w = d * (q - 16)
    Q5_1 (7): 32, 24   fp16 d, fp16 m; uint32 of fifth bits; 16 bytes of nibbles; w = d * q + m
    Q8_0 (8): 32, 34   fp16 d; 32 int8 q; w = q * d
    Q4_K (12): 256, 144  fp16 d, fp16 dmin; 12 bytes of 6-bit scales sc / mins m of the 8
                         sub-blocks of 32; 128 bytes of nibbles; w = (d * sc) * q - dmin * m
    Q5_K (13): 256, 176  as Q4_K, with 32 bytes of fifth bits before the nibbles
    Q6_K (14): 256, 210  128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales of
                         16 weights each, fp16 d; w = (d * scale) * (q - 32)
(in a 32-weight block, byte j of the nibbles holds weight j in its low and weight j + 16 in
its high 4 bits, and bit j of the uint32 is weight j's fifth bit; the K-quant layouts are
spelled out in ``dequantize``).

``pack_int8_activation`` repacks Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks 16
rows at a time for ``ops.int8_activation_linear`` (activations quantised to int8, integer dot
products);
``QuantizedWeight.with_int8_activations`` attaches that packing to a weight, and its ``linear``
then uses it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from . import checks, ops

__all__ = ["TYPES", "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "type_id",
           "type_name", "block_size", "block_bytes", "row_bytes", "quantize", "dequantize", "pack_int8_activation",
           "INT8_ACTIVATION_TYPES", "QuantizedWeight"]

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
K_QUANTS = (Q4_K, Q5_K, Q6_K)  # super-blocks of 256 weights
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
    """Weights per block (256 for the K-quants, 32 for the other quantised types, 1 for
    F32/F16/BF16)."""
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
    """[..., n] bytes -> [..., 2n] values 0..15: low nibbles (weights 0..n-1), then high."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 8n] values 0/1: bit j is bit j % 8 of byte j // 8 (a
    little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., :, None] >> shifts) & 1).reshape(*packed.shape[:-1], -1)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 scale bytes [..., 12] -> (sc, m) uint8 [..., 8], 6 bits each.
    Bytes 0-3 / 4-7 hold sc[0..3] / m[0..3] in their low 6 bits and the top 2 bits of
    sc[4..7] / m[4..7] in their top 2 bits; bytes 8-11 hold the low 4 bits of sc[4..7] (low
    nibble) and of m[4..7] (high nibble)."""
    d, m, low = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (low & 15) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (low >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def _dequantize_k(b: torch.Tensor, tid: int) -> torch.Tensor:
    """K-quant super-blocks [..., nb, block bytes] -> fp32 [..., nb, 256]."""
    lead = b.shape[:-1]
    if tid == Q6_K:
        # Weight 128 i + 32 t + l (i < 2, t < 4, l < 32): low 4 bits in ql[64 i + 32 (t % 2) + l]
        # (high nibble for t >= 2), high 2 bits in qh[32 i + l] >> 2 t; scale e // 16.
        ql = b[..., 0:128].reshape(*lead, 2, 64)
        low = torch.stack([ql & 15, ql >> 4], dim=-2).reshape(*lead, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
        high = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 3
        q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(*lead, 16, 16)
        scale = _f16_field(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()  # exact
        return (scale[..., None] * q).reshape(*lead, 256)
    # Q4_K / Q5_K: sub-block s < 8 of 32 weights; its nibbles in bytes 32 (s // 2) .. + 32 of
    # qs (high nibbles for odd s); Q5_K's fifth bit of weight l is bit s of qh[l].
    sc, mn = _k_scales_mins(b[..., 4:16])
    scale = _f16_field(b, 0) * sc  # [..., 8], exact
    offset = _f16_field(b, 2) * mn  # exact
    qs_at = 16 if tid == Q4_K else 48
    qs = b[..., qs_at:qs_at + 128].reshape(*lead, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*lead, 8, 32)
    if tid == Q5_K:
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
        q = q | (((b[..., 16:48].reshape(*lead, 1, 32) >> shifts) & 1) << 4)
    return (scale[..., None] * q.float() - offset[..., None]).reshape(*lead, 256)


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
    b = blocks.reshape(-1, nbytes)
    if tid in (F32, F16, BF16):  # a view or one conversion
        w = _dequantize_blocks(b, tid)
    else:
        w = _by_chunks(b, size, lambda chunk: _dequantize_blocks(chunk, tid))
    w = w.reshape(*lead, -1)
    return w.reshape(tuple(shape)) if shape is not None else w


def _dequantize_blocks(b: torch.Tensor, tid: int) -> torch.Tensor:
    """Blocks uint8 [n, block bytes] of type ``tid`` -> fp32 [n, block size] (``dequantize``)."""
    if tid == F32:
        return b.contiguous().view(torch.float32)
    if tid == F16:
        return b.contiguous().view(torch.float16).float()
    if tid == BF16:
        return b.contiguous().view(torch.bfloat16).float()
    if tid == Q4_0:
        return _f16_field(b, 0) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
    if tid == Q4_1:
        return _f16_field(b, 0) * _nibbles(b[..., 4:]).float() + _f16_field(b, 2)
    if tid == Q5_0:
        q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)
        return _f16_field(b, 0) * (q.to(torch.int16) - 16).float()
    if tid == Q5_1:
        q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4)
        return _f16_field(b, 0) * q.float() + _f16_field(b, 2)
    if tid == Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).float() * _f16_field(b, 0)
    return _dequantize_k(b, tid)


CHUNK_VALUES = 1 << 18  # weights (de)quantised at a time on CPU: 1 MB of fp32


def _by_chunks(rows: torch.Tensor, width: int, fn) -> torch.Tensor:
    """``fn`` (rows [n, ...] -> [n, width]) applied to ``rows`` [R, ...], on CPU CHUNK_VALUES
    weights at a time into one output [R, width]. Every block is (de)quantised alone, so the
    result is the same; but a whole weight's temporaries (several times its fp32 size, each
    a fresh allocation whose pages the kernel must zero) made loading a model mostly system
    time, where chunks reuse the same few cache-sized buffers."""
    R = rows.shape[0]
    step = max(1, CHUNK_VALUES // width)
    if rows.device.type != "cpu" or R <= step:
        return fn(rows)
    first = fn(rows[:step])
    out = torch.empty(R, first.shape[-1], dtype=first.dtype)
    out[:step] = first
    for i in range(step, R, step):
        out[i:i + step] = fn(rows[i:i + step])
    return out


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """gguf's np_roundf: round to nearest, ties away from zero, in fp32 like numpy."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d == 0 (gguf: np.where(d == 0, 0, 1 / d))."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., 8n] values 0/1 -> [..., n] bytes, bit j in bit j % 8 of byte j // 8 (inverse of _bits)."""
    weights = (2 ** torch.arange(8, device=bits.device)).to(torch.uint8)
    return (bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 2n] values (low 4 bits used) -> [..., n] bytes: q[j] low, q[n + j] high (inverse of _nibbles)."""
    n = q.shape[-1] // 2
    return (q[..., :n] & 15) | ((q[..., n:] & 15) << 4)


def _quantize_legacy(blocks: torch.Tensor, tid: int) -> list[torch.Tensor]:
    """The fields of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks [R, 32], as gguf.quantize computes them."""
    if tid == Q8_0:
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        q = _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        return [d.half().view(torch.uint8), q]
    levels = 15 if tid in (Q4_0, Q4_1) else 31
    if tid in (Q4_0, Q5_0):  # symmetric: d = the value of largest magnitude / -(levels + 1) / 2
        imax = blocks.abs().argmax(dim=-1, keepdim=True)
        d = blocks.gather(-1, imax) / -((levels + 1) // 2)
        q = (blocks * _inverse(d) + ((levels + 1) // 2 + 0.5)).trunc()
        header = [d.half().view(torch.uint8)]
    else:  # Q4_1 / Q5_1: d = (max - min) / levels, m = min
        lo = blocks.amin(dim=-1, keepdim=True)
        d = (blocks.amax(dim=-1, keepdim=True) - lo) / levels
        q = ((blocks - lo) * _inverse(d) + 0.5).trunc()
        header = [d.half().view(torch.uint8), lo.half().view(torch.uint8)]
    q = q.to(torch.uint8).clamp(0, levels)
    if levels == 31:
        header.append(_pack_bits(q >> 4))
    return header + [_pack_nibbles(q)]


def _quantize_k(blocks: torch.Tensor, tid: int) -> list[torch.Tensor]:
    """The fields of K-quant super-blocks [R, 256] by a simple rule (not llama.cpp's
    importance-weighted search): per sub-block the range is split evenly, the sub-block scales
    (and mins) are quantised to 6 bits (Q6_K: 8 bits) against the super-block's largest one,
    then each weight to the nearest level of its sub-block's stored scale."""
    R = blocks.shape[0]
    if tid == Q6_K:
        sub = blocks.reshape(R, 16, 16)
        sub_scale = sub.abs().amax(-1) / 31  # levels -31..31 of the stored -32..31
        d = (sub_scale.amax(-1, keepdim=True) / 127).half()
        sc = (sub_scale * _inverse(d.float())).round().clamp(0, 127)
        scale = d.float() * sc
        q = (sub * _inverse(scale)[..., None]).round().clamp(-32, 31).to(torch.int16) + 32  # [R, 16, 16]
        q = q.to(torch.uint8).reshape(R, 2, 128)  # e = 128 i + r, r = 32 t + l
        ql = _pack_nibbles(q)  # byte 64 i + r' holds r' (low) and 64 + r' (high)
        t = q.reshape(R, 2, 4, 32) >> 4
        qh = t[:, :, 0] | (t[:, :, 1] << 2) | (t[:, :, 2] << 4) | (t[:, :, 3] << 6)
        return [ql.reshape(R, 128), qh.reshape(R, 64), sc.to(torch.int8).view(torch.uint8), d.view(torch.uint8)]
    levels = 15 if tid == Q4_K else 31
    sub = blocks.reshape(R, 8, 32)
    lo = sub.amin(-1).clamp(max=0)  # the format subtracts dmin * m with m >= 0: the offset is <= 0
    sub_scale, sub_min = (sub.amax(-1) - lo) / levels, -lo
    d = (sub_scale.amax(-1, keepdim=True) / 63).half()
    dmin = (sub_min.amax(-1, keepdim=True) / 63).half()
    sc = (sub_scale * _inverse(d.float())).round().clamp(0, 63).to(torch.uint8)
    m = (sub_min * _inverse(dmin.float())).round().clamp(0, 63).to(torch.uint8)
    scale, offset = d.float() * sc.float(), dmin.float() * m.float()
    q = ((sub + offset[..., None]) * _inverse(scale)[..., None]).round().clamp(0, levels).to(torch.uint8)
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], dim=-1)
    qs = _pack_nibbles(q.reshape(R, 4, 64)).reshape(R, 128)  # byte 32 t + l: sub-blocks 2t (low), 2t + 1 (high)
    fields = [d.view(torch.uint8), dmin.view(torch.uint8), scales]
    if tid == Q5_K:
        fields.append(_pack_bits((q >> 4).transpose(1, 2).reshape(R, 256)))  # bit 8 l + s: sub-block s, weight l
    return fields + [qs]


def quantize(weight: torch.Tensor, block_type) -> "QuantizedWeight":
    """GGUF blocks of ``weight`` (a float tensor [N, H], CPU). For Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0 (llama.cpp's reference quantisers), BF16, F16 and F32 these are the bytes
    ``gguf.quantize`` writes. gguf-py has no quantiser for the K-quants (Q4_K, Q5_K, Q6_K):
    theirs is a simple one of our own (``_quantize_k``, not llama.cpp's importance-weighted
    search), whose blocks ``gguf.dequantize`` reads; its error is a little above llama.cpp's.

    H must be a multiple of the block size (256 for the K-quants). NaN weights are not supported.
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
        size = block_size(tid)
        blocks = w.reshape(N * (H // size), size)
        quantize_blocks = _quantize_k if tid in K_QUANTS else _quantize_legacy
        raw = _by_chunks(blocks, size, lambda chunk: torch.cat(quantize_blocks(chunk, tid), dim=-1))
    return QuantizedWeight(raw.reshape(N, -1).contiguous(), tid, (N, H))


INT8_ACTIVATION_TYPES = tuple(checks.INT8_ACTIVATION_FORMATS)  # the block types int8_activation_linear reads


def _int8_type(block_type) -> int:
    """The GGML type id of a block type int8_activation_linear reads (id or name), else ValueError."""
    names = {f[0]: tid for tid, f in checks.INT8_ACTIVATION_FORMATS.items()}
    tid = names.get(block_type.upper()) if isinstance(block_type, str) else int(block_type)
    if tid not in checks.INT8_ACTIVATION_FORMATS:
        shown = block_type if isinstance(block_type, str) else checks.GGUF_BLOCK_FORMATS.get(tid, (block_type,))[0]
        raise ValueError(f"int8-activation packing reads {', '.join(names)} blocks, got {shown}")
    return tid


def _block_integers(b: torch.Tensor, tid: int):
    """GGUF blocks uint8 [..., block bytes] -> (fp16 fields, per-sub-block integer fields, q): the
    fp16 scales as raw bytes [..., 2] each (d; Q4_1 / Q5_1: m; K-quants: dmin), the small
    integer scales (Q4_K / Q5_K: sc and mn [..., 8]; Q6_K: the int8 scales [..., 16], as bytes),
    and the stored weight integers q uint8 [..., S, 32] of the S sub-blocks of 32 (S = 1 or 8;
    Q8_0: q + 128; the others unsigned: Q4 0..15, Q5 0..31, Q6_K 0..63)."""
    if tid in (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1):
        halves = tid in (Q4_1, Q5_1)
        f16 = [b[..., 0:2]] + ([b[..., 2:4]] if halves else [])
        at = 4 if halves else 2
        if tid == Q8_0:
            return f16, [], (b[..., 2:34] ^ 128)[..., None, :]
        high = None
        if tid in (Q5_0, Q5_1):
            high, at = _bits(b[..., at:at + 4]), at + 4
        qs = b[..., at:at + 16]
        q = torch.cat([qs & 15, qs >> 4], dim=-1)
        return f16, [], (q if high is None else q | (high << 4))[..., None, :]
    if tid in (Q4_K, Q5_K):
        sc, mn = _k_scales_mins(b[..., 4:16])
        qs = b[..., -128:].reshape(*b.shape[:-1], 4, 1, 32)  # 32 bytes per pair of sub-blocks
        q = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32)
        if tid == Q5_K:  # bit s of qh[i]: the high bit of weight i of sub-block s
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
            q = q | (((b[..., None, 16:48] >> shifts) & 1) << 4)
        return [b[..., 0:2], b[..., 2:4]], [sc, mn], q
    # Q6_K: ql 128, qh 64, int8 scales 16, fp16 d. Weight 128h + 64s + k (k < 64) has low bits
    # ql[64h + k] >> 4s; weight 128h + 32t + k (k < 32) has high bits qh[32h + k] >> 2t.
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    high = torch.cat([(qh >> (2 * t)) & 3 for t in range(4)], dim=-2).reshape(*lead, 8, 32)
    return [b[..., 208:210]], [b[..., 192:208]], low | (high << 4)


def _words(q: torch.Tensor, steps: int) -> torch.Tensor:
    """[..., 16 rows, 32] bytes -> [..., 64 * steps]: step k holds each row's bytes
    4k .. 4k + 3 (row l at bytes 4l .. 4l + 3 of the step)."""
    return q.reshape(*q.shape[:-2], 16, steps, 4).transpose(-3, -2).reshape(*q.shape[:-2], 64 * steps)


def _weight_fields(q: torch.Tensor, tid: int) -> list[torch.Tensor]:
    """The packed weight bytes of sub-blocks q uint8 [..., 16 rows, 32] (see pack_int8_activation)."""
    if tid == Q8_0:
        return [_words(q, 8)]
    fields = [_words((q[..., :16] & 15) | ((q[..., 16:] & 15) << 4), 4)]  # nibbles: weights t and 16 + t
    high = q >> 4
    if tid in (Q5_0, Q5_1, Q5_K):  # byte 4l + t, bit k: the fifth bit of weight 4k + t
        k = torch.arange(8, dtype=torch.uint8, device=q.device)
        bits = (high.reshape(*q.shape[:-1], 8, 4) << k[:, None]).sum(-2, dtype=torch.uint8)
        fields.append(bits.reshape(*q.shape[:-2], 64))
    elif tid == Q6_K:  # two vectors (weights 0..15, 16..31); byte 4l + t, bits 2k, 2k + 1: weight 4k + t
        k = torch.arange(4, dtype=torch.uint8, device=q.device)
        for half in (high[..., :16], high[..., 16:]):
            bits = (half.reshape(*q.shape[:-1], 4, 4) << (2 * k)[:, None]).sum(-2, dtype=torch.uint8)
            fields.append(bits.reshape(*q.shape[:-2], 64))
    return fields


def pack_int8_activation(blocks: torch.Tensor, block_type) -> torch.Tensor:
    """GGUF blocks uint8 [N, row_bytes] of a weight [N, H] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    Q5_K, Q6_K) repacked for ``ops.int8_activation_linear``: uint8 [ceil(N / 16), H / B,
    record bytes], B the format's block size (32; 256 for the K-quants).

    Record (g, b) holds block b of rows 16g .. 16g + 15 (rows past N are zeros). Its fields,
    each the 16 rows side by side (row l's entry at l), then the weights of its sub-blocks of 32:
      Q4_0 / Q5_0 / Q8_0: fp16 d[16];  Q4_1 / Q5_1: fp16 d[16], fp16 m[16];
      Q4_K / Q5_K: fp16 d[16], fp16 dmin[16], uint8 sc[8][16], uint8 mn[8][16] (the 6-bit
          scales and mins of sub-block s at [s][l]);
      Q6_K: fp16 d[16], int8 sc[16][16] (the scale of weights 16s .. 16s + 15 at [s][l]);
    then per sub-block of 32 weights (one for the 32-blocks, 8 for the K-quants), the weights
    word-interleaved, one 4-byte word per row in each 64 bytes (one int32 lane per row of a
    vector dot product; byte 4l + t belongs to row l):
      Q8_0: 8 steps, step k = each row's q[4k + t] plus 128 (unsigned bytes for vpdpbusd);
      the others: 4 chunks of nibbles, chunk k byte 4l + t = weight 4k + t (low 4 bits of the
      stored integer) | weight 16 + 4k + t (high nibble); then
      Q5_*: 64 bytes, byte 4l + t bit k = the fifth bit of weight 4k + t (k < 8);
      Q6_K: 2 x 64 bytes (weights 0..15, then 16..31 of the sub-block), byte 4l + t bits
      2k, 2k + 1 = the two high bits of weight 4k + t of that half (k < 4).
    Bits per weight: Q4_K 4.625 (GGUF 4.5), Q5_K 5.625 (5.5), Q6_K 6.5625 (6.5625); the 32-blocks
    as in GGUF (Q5_0 5.5, Q5_1 6)."""
    tid = _int8_type(block_type)
    name, size, nbytes, _ = checks.INT8_ACTIVATION_FORMATS[tid]
    checks.check_tensor(blocks, "blocks", dtype=torch.uint8, dims=2)
    N, rb = blocks.shape
    if rb % nbytes != 0:
        raise ValueError(f"blocks.shape[1] must be a multiple of the {name} block bytes {nbytes}, "
                         f"got {list(blocks.shape)}")
    nb, G = rb // nbytes, -(-N // 16)
    b = torch.zeros(G * 16, nb, nbytes, dtype=torch.uint8, device=blocks.device)
    b[:N] = blocks.reshape(N, nb, nbytes)
    b = b.view(G, 16, nb, nbytes).transpose(1, 2)  # [G, nb, 16 rows, block bytes]
    f16, small, q = _block_integers(b, tid)
    fields = [f.reshape(G, nb, 32) for f in f16]
    fields += [s.transpose(-1, -2).reshape(G, nb, -1) for s in small]  # [sub-block][row]
    per_sub = _weight_fields(q.transpose(2, 3), tid)  # each [G, nb, S, bytes]
    fields.append(torch.cat(per_sub, dim=-1).reshape(G, nb, -1))
    return torch.cat(fields, dim=-1).contiguous()


def attach_int8_packing(weights: Sequence["QuantizedWeight"], rows_per_task: int = 4096) -> list:
    """Each of ``weights`` with its int8-activation packing attached (``pack_int8_activation``;
    a weight already packed, or of a type without such a kernel, as it is), bit-identical to
    packing each whole; a weight listed twice is packed once.

    Packing is many small uint8 torch ops, and torch's own threads make them slower (3x at 2
    threads with one core busy). So the rows are packed in tasks of ``rows_per_task`` (a
    multiple of 16: a packed record holds 16 rows, so a row range's records are its own), on
    a pool of as many workers as torch had threads, each on one torch thread. (The 1.5B's LM
    head alone is 151,936 rows.)"""
    from concurrent.futures import ThreadPoolExecutor

    todo = {id(w): w for w in weights if w.block_type in INT8_ACTIVATION_TYPES and w.int8_packed is None}
    tasks = [(w, start) for w in todo.values() for start in range(0, max(w.shape[0], 1), rows_per_task)]
    workers = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            parts = list(pool.map(lambda t: pack_int8_activation(t[0].blocks[t[1]:t[1] + rows_per_task],
                                                                 t[0].block_type), tasks))
    finally:
        torch.set_num_threads(workers)
    chunks: dict = {}
    for (w, _), part in zip(tasks, parts):
        chunks.setdefault(id(w), []).append(part)
    packed = {key: QuantizedWeight(w.blocks, w.block_type, w.shape,
                                   chunks[key][0] if len(chunks[key]) == 1 else torch.cat(chunks[key]))
              for key, w in todo.items()}
    return [packed.get(id(w), w) for w in weights]


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [N, H] held as GGUF blocks.

    blocks: uint8 [N, row_bytes(block_type, H)], contiguous; block_type: GGML type id;
    shape: (N, H), the logical shape (GGUF files list it reversed, as [H, N]);
    int8_packed: None, or ``pack_int8_activation(blocks)``: then :meth:`linear` multiplies
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
        """This weight with its int8-activation packing attached (its ``linear`` then uses
        ``int8_activation_linear``); the weight itself when its type has no such kernel
        (the types in INT8_ACTIVATION_TYPES have one)."""
        return attach_int8_packing([self])[0]

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
