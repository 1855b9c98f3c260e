"""References of specdec::skinny_linear, specdec::quantized_linear and
specdec::int8_activation_linear (tests only).

Computed in float64 from the inputs widened to float64, one dot product at a time. The
kernels compute in fp32, so tests compare with tolerances. The GGUF blocks are decoded
here one block at a time with plain Python arithmetic, giving each weight the fp32 value
gguf-py's quants.py computes (tests check the two agree bit for bit).
"""
import struct

import numpy as np
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
BLOCK_FORMATS = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
                 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


def _fp32(v: float) -> float:
    """v rounded to the nearest fp32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _fp16(b: bytes) -> float:
    return struct.unpack("<e", b)[0]


def _k_scale_min(scales: bytes, s: int) -> tuple[int, int]:
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block s < 8 from the 12 scale bytes."""
    if s < 4:
        return scales[s] & 63, scales[s + 4] & 63
    return (scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4), (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4)


def _dequantize_k_block(block: bytes, block_type: int) -> list[float]:
    """The 256 fp32 values of one Q4_K / Q5_K / Q6_K super-block (see dequantize_block)."""
    values = []
    if block_type == 14:
        ql, qh, scales, d = block[0:128], block[128:192], struct.unpack("<16b", block[192:208]), _fp16(block[208:210])
        for e in range(256):
            i, t, l = e // 128, (e % 128) // 32, e % 32
            low = (ql[64 * i + 32 * (t % 2) + l] >> (4 * (t // 2))) & 15
            high = (qh[32 * i + l] >> (2 * t)) & 3
            values.append((d * scales[e // 16]) * ((low | high << 4) - 32))  # exact: 11 + 8 + 6 bits
        return values
    d, dmin = _fp16(block[0:2]), _fp16(block[2:4])
    qh, qs = (None, block[16:144]) if block_type == 12 else (block[16:48], block[48:176])
    for s in range(8):
        sc, m = _k_scale_min(block[4:16], s)
        for l in range(32):
            q = (qs[32 * (s // 2) + l] >> (4 * (s % 2))) & 15
            if qh is not None:
                q |= ((qh[l] >> s) & 1) << 4
            # Both products are exact in fp32; their fp32 difference is rounded once (a float64
            # difference could round too, before the rounding to fp32).
            values.append(float(np.float32((d * sc) * q) - np.float32(dmin * m)))
    return values


def dequantize_block(block: bytes, block_type: int) -> list[float]:
    """The fp32 values of one GGUF block (as Python floats), as gguf.dequantize computes them.

    Q4_0: 18 bytes = fp16 d, 16 bytes qs; weight j < 16 is the low nibble of qs[j], weight
    16 + j the high one; value d * (nibble - 8). Q4_1: 20 bytes = fp16 d, fp16 m, 16 bytes
    qs; value fp32(d * nibble + m) (d * nibble is exact in fp32, the sum is rounded once).
    Q5_0: 22 bytes = fp16 d, uint32 qh, 16 bytes qs; q = nibble | (bit j of qh) << 4, value
    d * (q - 16). Q5_1: 24 bytes = fp16 d, fp16 m, uint32 qh, 16 bytes qs; value fp32(d * q + m).
    Q8_0: 34 bytes = fp16 d, 32 int8 q; value q * d. F32 / F16 / BF16: one value.
    Q4_K: 144 bytes = fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (_k_scale_min),
    128 bytes qs; weight l of sub-block s: nibble (s % 2) of qs[32 (s // 2) + l], value
    fp32((d * sc) * q - dmin * m). Q5_K: 176 bytes, as Q4_K with 32 bytes qh after the scales
    (bit s of qh[l] is the fifth bit). Q6_K: 210 bytes = 128 bytes ql, 64 bytes qh, 16 int8
    scales, fp16 d; value (d * scale[e // 16]) * (q - 32).
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
    if block_type in (6, 7):
        d, m = _fp16(block[0:2]), (_fp16(block[2:4]) if block_type == 7 else 0.0)
        start = 2 if block_type == 6 else 4
        qh = struct.unpack("<I", block[start:start + 4])[0]
        qs = block[start + 4:start + 20]
        q = [(b & 15) for b in qs] + [b >> 4 for b in qs]
        q = [q[j] | ((qh >> j) & 1) << 4 for j in range(32)]
        if block_type == 6:
            return [d * (v - 16) for v in q]  # exact
        return [float(np.float32(d * v) + np.float32(m)) for v in q]  # exact products, one fp32 rounding
    if block_type == 8:
        d = _fp16(block[0:2])
        return [q * d for q in struct.unpack("<32b", block[2:34])]  # exact
    if block_type in (12, 13, 14):
        return _dequantize_k_block(block, block_type)
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


# The block types of int8_activation_linear: GGML type id -> (weights per block, bytes per block).
INT8_BLOCK_FORMATS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144),
                      13: (256, 176), 14: (256, 210)}


def _k_scales(s: bytes) -> tuple[list[int], list[int]]:
    """Q4_K / Q5_K: the 8 6-bit scales and 8 6-bit mins packed in 12 bytes (llama.cpp's
    get_scale_min_k4): j < 4: s[j] & 63, s[j + 4] & 63; j >= 4: the low / high nibble of
    s[j + 4] plus the top 2 bits of s[j - 4] / s[j] as bits 4, 5."""
    sc, mn = [], []
    for j in range(8):
        if j < 4:
            sc.append(s[j] & 63)
            mn.append(s[j + 4] & 63)
        else:
            sc.append((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4))
            mn.append((s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    return sc, mn


def _record_terms(block: bytes, block_type: int) -> tuple[float, float, list[tuple[list[int], int, int]]]:
    """One GGUF block as (d, m_w, subs), subs one (c, sc, mn) per sub-block of 32 weights, such
    that the block's integer sum with activation integers q is I = sum_s sc * (c . q_s), and for
    the K-quants with mins Mn = sum_s mn * sum(q_s):
      Q4_0: c = nibble - 8; Q4_1: c = nibble, m_w = m; Q8_0: c = q; Q5_0: c = q5 - 16;
      Q5_1: c = q5, m_w = m (sc = 1, mn = 0 for these); Q4_K / Q5_K (8 sub-blocks): c = q, the
      6-bit sc and mn, m_w = dmin; Q6_K (8 sub-blocks of two 16-weight halves with int8 scales
      sc0, sc1): c = sc_half * (q6 - 32), sc = 1."""
    f16 = lambda at: _fp16(block[at:at + 2])  # noqa: E731
    if block_type == 8:
        return f16(0), 0.0, [(list(struct.unpack("<32b", block[2:34])), 1, 0)]
    if block_type in (2, 3, 6, 7):
        at = 4 if block_type in (3, 7) else 2
        high = [0] * 32
        if block_type in (6, 7):
            qh = int.from_bytes(block[at:at + 4], "little")
            high, at = [(qh >> j) & 1 for j in range(32)], at + 4
        qs = block[at:at + 16]
        q = [(b & 15) for b in qs] + [(b >> 4) for b in qs]
        q = [v | (h << 4) for v, h in zip(q, high)]
        offset = {2: 8, 3: 0, 6: 16, 7: 0}[block_type]
        m = f16(2) if block_type in (3, 7) else 0.0
        return f16(0), m, [([v - offset for v in q], 1, 0)]
    if block_type in (12, 13):
        sc, mn = _k_scales(block[4:16])
        qh, qs = (block[16:48], block[48:176]) if block_type == 13 else (bytes(32), block[16:144])
        subs = []
        for s in range(8):
            pair = qs[32 * (s // 2):32 * (s // 2) + 32]
            low = [(b >> (4 * (s % 2))) & 15 for b in pair]
            subs.append(([v | (((qh[i] >> s) & 1) << 4) for i, v in enumerate(low)], sc[s], mn[s]))
        return f16(0), f16(2), subs
    if block_type == 14:
        ql, qh = block[0:128], block[128:192]
        scales = struct.unpack("<16b", block[192:208])
        q = []
        for i in range(256):  # weight i: low bits from ql, high bits from qh
            h, r = divmod(i, 128)
            low = (ql[64 * h + r % 64] >> (4 * (r // 64))) & 15
            high = (qh[32 * h + r % 32] >> (2 * (r // 32))) & 3
            q.append(low | (high << 4))
        return f16(208), 0.0, [([scales[(32 * s + j) // 16] * (q[32 * s + j] - 32) for j in range(32)], 1, 0)
                               for s in range(8)]
    raise ValueError(f"unsupported block type {block_type}")


def activation_block(block_type: int) -> int:
    """Activations per int8 scale: 256 (one GGUF block) for the K-quants, 32 otherwise."""
    return INT8_BLOCK_FORMATS[block_type][0]


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, H] (H a multiple of ``block``) -> (q int64 [M, H / 32, 32], d fp32 [M, H / block]):
    per scale block of ``block`` values, d = max|x| / 127 and q = round_half_even(x * (1 / d))
    clamped to +-127, all in fp32 (a scale block with max|x| < 2^-96 is zero: d = 0, q = 0; one
    holding NaN or inf has q = 0, d = NaN)."""
    M, H = x.shape
    xb = x.float().reshape(M, H // block, block)
    finite = torch.isfinite(xb).all(-1)
    amax = xb.abs().amax(-1).where(finite, torch.zeros(()))
    d = torch.where(amax < 2.0 ** -96, torch.zeros(()), amax / 127)
    inv = torch.where(d == 0, torch.zeros(()), 1 / d)
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int64)
    q = q.where(finite[..., None], torch.zeros((), dtype=torch.int64))
    return q.reshape(M, H // 32, 32), d.where(finite, torch.full((), float("nan")))


def int8_activation_linear(x: torch.Tensor, weight: torch.Tensor, block_type: int,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The result of specdec::int8_activation_linear from the weight's plain GGUF blocks
    (uint8 [N, H / block size * block bytes], not the packed form), in float64: x quantised per
    GGUF block (``activation_block``: scale d_x); per GGUF block, the exact integer sums I and Mn
    (``_record_terms``), then I * fp32(d * d_x), plus m * fp32(d_x * sum q) (Q4_1 / Q5_1) or
    minus Mn * fp32(dmin * d_x) (Q4_K / Q5_K); summed over blocks, plus bias."""
    M, H = x.shape
    size, nbytes = INT8_BLOCK_FORMATS[block_type]
    q, d = quantize_activations(x, size)  # q [M, H / 32, 32], d [M, H / size]
    sq = q.sum(-1)  # [M, H / 32]
    data = weight.contiguous().numpy().tobytes()
    N = weight.shape[0]
    out = torch.zeros(M, N, dtype=torch.float64)
    fp32 = lambda v: v.float().double()  # noqa: E731  (a product rounded to fp32, as the kernel does)
    for n in range(N):
        for r, off in enumerate(range(n * H // size * nbytes, (n + 1) * H // size * nbytes, nbytes)):
            dw, mw, subs = _record_terms(data[off:off + nbytes], block_type)
            isum = torch.zeros(M, dtype=torch.int64)
            mins = torch.zeros(M, dtype=torch.int64)
            for s, (coef, sc, mn) in enumerate(subs):
                b = r * len(subs) + s
                isum += sc * (q[:, b] @ torch.tensor(coef, dtype=torch.int64))  # exact
                mins += mn * sq[:, b]
            dx = d[:, r]
            out[:, n] += isum.double() * fp32(torch.tensor(dw, dtype=torch.float32) * dx)
            if block_type in (3, 7):
                out[:, n] += mw * fp32(dx * sq[:, r].float())
            if block_type in (12, 13):
                out[:, n] -= mins.double() * fp32(torch.tensor(mw, dtype=torch.float32) * dx)
    if bias is not None:
        out += bias.double()[None]
    return out
