"""References of specdec::skinny_linear and specdec::quantized_linear (tests only).

Computed in float64 from the inputs widened to float64, one dot product at a time. The
kernels compute in fp32, so tests compare with tolerances. The GGUF blocks are decoded
here one block at a time with plain Python arithmetic, giving each weight the fp32 value
gguf-py's quants.py computes (tests check the two agree bit for bit).
"""
import struct

import torch


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, H] @ weight [N, H]^T + bias [N], one dot product at a time, in float64."""
    M, H = x.shape
    N = weight.shape[0]
    xd, wd = x.double(), weight.double()
    out = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        for n in range(N):
            out[m, n] = torch.dot(xd[m], wd[n]) + (float(bias[n]) if bias is not None else 0.0)
    return out


# GGML type id -> (name, weights per block, bytes per block), written out independently of
# specdec_kernels.ops.GGUF_BLOCK_FORMATS.
BLOCK_FORMATS = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
                 30: ("BF16", 1, 2)}


def _fp32(v: float) -> float:
    """v rounded to the nearest fp32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _fp16(b: bytes) -> float:
    return struct.unpack("<e", b)[0]


def dequantize_block(block: bytes, block_type: int) -> list[float]:
    """The fp32 values of one GGUF block (as Python floats), as gguf.dequantize computes them.

    Q4_0: 18 bytes = fp16 d, 16 bytes qs; weight j < 16 is the low nibble of qs[j], weight
    16 + j the high one; value d * (nibble - 8). Q4_1: 20 bytes = fp16 d, fp16 m, 16 bytes
    qs; value fp32(d * nibble + m) (d * nibble is exact in fp32, the sum is rounded once).
    Q8_0: 34 bytes = fp16 d, 32 int8 q; value q * d. F32 / F16 / BF16: one value.
    """
    if block_type == 0:
        return [struct.unpack("<f", block)[0]]
    if block_type == 1:
        return [_fp16(block)]
    if block_type == 30:
        return [struct.unpack("<f", b"\x00\x00" + block)[0]]
    if block_type == 2:
        d = _fp16(block[0:2])
        qs = block[2:18]
        nibbles = [b & 15 for b in qs] + [b >> 4 for b in qs]
        return [d * (q - 8) for q in nibbles]  # exact: at most 11 + 4 significant bits
    if block_type == 3:
        d, m = _fp16(block[0:2]), _fp16(block[2:4])
        qs = block[4:20]
        nibbles = [b & 15 for b in qs] + [b >> 4 for b in qs]
        return [_fp32(d * q + m) for q in nibbles]  # d * q + m is exact in float64
    if block_type == 8:
        d = _fp16(block[0:2])
        return [q * d for q in struct.unpack("<32b", block[2:34])]  # exact
    raise ValueError(f"unsupported block type {block_type}")


def dequantize(weight: torch.Tensor, block_type: int, H: int) -> torch.Tensor:
    """weight: uint8 [N, H / block_size * block_bytes] -> fp32 [N, H], block by block."""
    _, size, nbytes = BLOCK_FORMATS[block_type]
    N = weight.shape[0]
    data = weight.contiguous().numpy().tobytes()
    row_bytes = H // size * nbytes
    values = []
    for n in range(N):
        row = data[n * row_bytes:(n + 1) * row_bytes]
        for i in range(0, row_bytes, nbytes):
            values.extend(dequantize_block(row[i:i + nbytes], block_type))
    return torch.tensor(values, dtype=torch.float32).reshape(N, H)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, block_type: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, H] @ W^T + bias in float64, W [N, H] the dequantised GGUF blocks ``weight``."""
    return skinny_linear(x, dequantize(weight, block_type, x.shape[1]), bias)
