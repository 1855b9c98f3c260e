"""Triton kernels of specdec::skinny_linear (CUDA key), also the GEMM of medusa_topk's
ResBlocks, of specdec::quantized_linear (``_quantized_linear_kernel``: the weight as raw
GGUF blocks, decoded in registers) and of specdec::int8_activation_linear
(``_int8_activation_linear_kernel``: repacked blocks times int8 activations).

``_linear_kernel`` computes out = x W^T (+ b) for one (row block, output block, head) per
program, optionally fused into the Medusa ResBlock x_next = x + SiLU(x W^T + b)
(RESIDUAL_SILU); ``launch_linear`` launches it for one or several heads. Arithmetic is
fp32 (weights of any float dtype are widened on load; tl.dot uses input_precision="ieee",
not tf32).

Every launcher also runs on CPU tensors under TRITON_INTERPRET=1 (the tests do that).
"""
import torch
import triton
import triton.language as tl

from ..checks import (GGUF_BLOCK_FORMATS, INT8_ACTIVATION_FORMATS, INT8_ACTIVATION_GROUP_BYTES,  # noqa: F401
                      check_int8_activation_linear, check_quantized_linear, check_skinny_linear)


@triton.jit
def dot_tile(x_base, w_base, rm, rn, M, N, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 tile of x w^T: rows rm (< M) of x, fp32 rows of length H at
    x_base, times rows rn (< N) of w [N, H], any float dtype, at w_base; rows out of range
    give 0. (Also the LM-head tile of medusa_topk.)"""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_base + rm[:, None] * H + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < H), other=0.0)
        # The weight tile is loaded transposed, [BLOCK_K, BLOCK_N], straight from [N, H].
        w = tl.load(w_base + rn[None, :].to(tl.int64) * H + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < H),
                    other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, H,
    stride_xh, stride_wh, stride_bh, stride_oh,  # per-head (program_id(2)) strides
    HAS_BIAS: tl.constexpr, RESIDUAL_SILU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[h, m, n] = sum_k x[h, m, k] w[h, n, k] (+ b[h, n]); with RESIDUAL_SILU
    (requires N == H) out = x + SiLU(that). x, out: [*, M, H|N] fp32 rows of stride H|N."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_base = x_ptr + head * stride_xh
    acc = dot_tile(x_base, w_ptr + head * stride_wh, rm, rn, M, N, H, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(b_ptr + head * stride_bh + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if RESIDUAL_SILU:
        resid = tl.load(x_base + rm[:, None] * H + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = resid + acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + head * stride_oh + rm[:, None] * N + rn[None, :], acc, mask=mask)


def launch_linear(x, weight, bias, out, *, heads=1, stride_xh=0, stride_wh=0, stride_bh=0, stride_oh=0,
            residual_silu=False):
    """Runs _linear_kernel on each of ``heads`` problems out[h] = x[h] @ weight[h]^T (+ bias[h])
    (with ``residual_silu``: x[h] + SiLU(that)); x, out: fp32, rows of stride H / N; the
    stride_*h arguments step from one head's tensor to the next (0: shared)."""
    M, H = x.shape[-2], x.shape[-1]
    N = out.shape[-1]
    BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M), heads)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N, H,
        stride_xh, stride_wh, stride_bh, stride_oh,
        HAS_BIAS=bias is not None, RESIDUAL_SILU=residual_silu,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor) -> None:
    """Launcher of specdec::skinny_linear: out [M, N] = x [M, H] @ weight [N, H]^T + bias."""
    check_skinny_linear(x, weight, bias, out)  # torch.ops on CUDA reaches this launcher directly
    M, N = out.shape
    if M == 0 or N == 0:
        return
    x32 = x.to(torch.float32).contiguous()
    res = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(M, N, dtype=torch.float32,
                                                                                   device=out.device)
    launch_linear(x32, weight.contiguous(), None if bias is None else bias.contiguous(), res)
    if res is not out:
        out.copy_(res)


torch.library.register_kernel("specdec::skinny_linear", "cuda", skinny_linear)


# ---------------------------------------------------------------------------------------
# quantized_linear: the weight as raw GGUF blocks.
# ---------------------------------------------------------------------------------------

# GGML type ids (gguf.GGMLQuantizationType), as in ops.GGUF_BLOCK_FORMATS.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30


@triton.jit
def _fp16_at(ptr):
    """The little-endian fp16 at uint8 pointers ``ptr`` (any shape), as fp32 (exact)."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_quant_weights(block, s, rk, BLOCK_TYPE: tl.constexpr):
    """fp32 [BLOCK_N, 32]: sub-block s (a scalar < 8) of the Q4_K / Q5_K / Q6_K super-blocks at
    uint8 pointers ``block`` [BLOCK_N], exactly as gguf.dequantize (every product is exact in
    fp32, so only Q4_K / Q5_K's final difference rounds, once)."""
    if BLOCK_TYPE == 14:  # Q6_K: weight 128 i + 32 t + l; (d * scale) * (q - 32)
        i = s // 4
        t = s % 4
        low = (tl.load(block[:, None] + 64 * i + 32 * (t % 2) + rk[None, :]).to(tl.int32) >> (4 * (t // 2))) & 15
        high = (tl.load(block[:, None] + 128 + 32 * i + rk[None, :]).to(tl.int32) >> (2 * t)) & 3
        scale = tl.load(block[:, None] + 192 + 2 * s + (rk // 16)[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        return (_fp16_at(block + 208)[:, None] * scale) * ((low | (high << 4)) - 32).to(tl.float32)
    # Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 scale bytes at block + 4
    # (bytes s % 4, s % 4 + 4, s % 4 + 8 are the ones that hold them).
    a = tl.load(block + 4 + s % 4).to(tl.int32)
    b = tl.load(block + 8 + s % 4).to(tl.int32)
    c = tl.load(block + 12 + s % 4).to(tl.int32)
    sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
    QS: tl.constexpr = 16 if BLOCK_TYPE == 12 else 48  # Q5_K: 32 bytes of fifth bits before the nibbles
    q = (tl.load(block[:, None] + QS + 32 * (s // 2) + rk[None, :]).to(tl.int32) >> (4 * (s % 2))) & 15
    if BLOCK_TYPE == 13:
        q = q | (((tl.load(block[:, None] + 16 + rk[None, :]).to(tl.int32) >> s) & 1) << 4)
    scale = _fp16_at(block) * sc.to(tl.float32)
    offset = _fp16_at(block + 2) * m.to(tl.float32)
    return scale[:, None] * q.to(tl.float32) - offset[:, None]


@triton.jit(do_not_specialize=["M"])
def _quantized_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, H, row_bytes,
    BLOCK_TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out [M, N] = x [M, H] (fp32) @ W^T (+ b), W [N, H] decoded from GGUF blocks 32 weights
    at a time (one block, or one sub-block of a K-quant super-block of 256), exactly as
    gguf.dequantize (w_ptr: uint8 [N, row_bytes] for the block formats, or the float32 /
    float16 / bfloat16 [N, H] view of the bytes for F32 / F16 / BF16; layouts in gguf_blocks.py).

    Each step adds sum_k x[m, k] * w[n, k] over 32 weights (a tree sum, the same for every
    (m, n)) to the fp32 accumulator: the order depends on H only, never on M or on the
    other rows (batch invariance)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    n_ok = rn < N
    rn_safe = tl.where(n_ok, rn, 0).to(tl.int64)  # rows past N read row 0 (dropped)
    nibble_byte = rk % 16  # weight j of a 4-bit block: byte j % 16, high nibble for j >= 16
    nibble_shift = (rk // 16) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, 32):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * H + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < H),
                    other=0.0)
        if BLOCK_TYPE == 0 or BLOCK_TYPE == 1 or BLOCK_TYPE == 30:  # F32 / F16 / BF16: one value per weight
            w = tl.load(w_ptr + rn_safe[:, None] * H + kk[None, :], mask=kk[None, :] < H, other=0.0).to(tl.float32)
        elif BLOCK_TYPE == 12 or BLOCK_TYPE == 13 or BLOCK_TYPE == 14:  # K-quants: sub-block s of a super-block
            w = _k_quant_weights(w_ptr + rn_safe * row_bytes + (k0 // 256) * BLOCK_BYTES, (k0 // 32) % 8, rk,
                                 BLOCK_TYPE)
        elif BLOCK_TYPE == 6 or BLOCK_TYPE == 7:  # Q5_0: d * (q - 16); Q5_1: d * q + m (d * q exact)
            block = w_ptr + rn_safe * row_bytes + (k0 // 32) * BLOCK_BYTES
            d = _fp16_at(block)
            QH: tl.constexpr = 2 if BLOCK_TYPE == 6 else 4  # the uint32 of fifth bits, then 16 bytes of nibbles
            qb = tl.load(block[:, None] + QH + 4 + nibble_byte[None, :]).to(tl.int32)
            hb = tl.load(block[:, None] + QH + (rk // 8)[None, :]).to(tl.int32)
            q = ((qb >> nibble_shift[None, :]) & 15) | (((hb >> (rk % 8)[None, :]) & 1) << 4)
            if BLOCK_TYPE == 6:
                w = d[:, None] * (q - 16).to(tl.float32)
            else:
                w = d[:, None] * q.to(tl.float32) + _fp16_at(block + 2)[:, None]
        else:
            block = w_ptr + rn_safe * row_bytes + (k0 // 32) * BLOCK_BYTES
            d = _fp16_at(block)
            if BLOCK_TYPE == 8:  # Q8_0: q * d
                q = tl.load(block[:, None] + 2 + rk[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
                w = q * d[:, None]
            elif BLOCK_TYPE == 2:  # Q4_0: d * (nibble - 8)
                qb = tl.load(block[:, None] + 2 + nibble_byte[None, :]).to(tl.int32)
                w = d[:, None] * (((qb >> nibble_shift[None, :]) & 15) - 8).to(tl.float32)
            else:  # Q4_1: d * nibble + m (d * nibble is exact: fused or not, one rounding)
                m = _fp16_at(block + 2)
                qb = tl.load(block[:, None] + 4 + nibble_byte[None, :]).to(tl.int32)
                w = d[:, None] * ((qb >> nibble_shift[None, :]) & 15).to(tl.float32) + m[:, None]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=(rm[:, None] < M) & n_ok[None, :])


# The element dtypes of the views the kernel reads for the float types.
_FLOAT_VIEWS = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}
QUANTIZED_BLOCK_M, QUANTIZED_BLOCK_N = 16, 16


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, block_type: int, bias, out: torch.Tensor) -> None:
    """Launcher of specdec::quantized_linear: out [M, N] fp32 = x [M, H] @ W^T + bias, W the
    GGUF blocks uint8 [N, row_bytes] of type block_type (see ops.quantized_linear)."""
    check_quantized_linear(x, weight, block_type, bias, out)  # torch.ops on CUDA reaches this launcher directly
    M, N = out.shape
    H = x.shape[1]
    if M == 0 or N == 0:
        return
    x32 = x.to(torch.float32).contiguous()
    w = weight.view(_FLOAT_VIEWS[block_type]) if block_type in _FLOAT_VIEWS else weight
    b32 = None if bias is None else bias.to(torch.float32).contiguous()
    grid = (triton.cdiv(N, QUANTIZED_BLOCK_N), triton.cdiv(M, QUANTIZED_BLOCK_M))
    _quantized_linear_kernel[grid](
        x32, w, b32 if b32 is not None else x32, out, M, N, H, weight.shape[1],
        BLOCK_TYPE=block_type, BLOCK_BYTES=GGUF_BLOCK_FORMATS[block_type][2], HAS_BIAS=b32 is not None,
        BLOCK_M=QUANTIZED_BLOCK_M, BLOCK_N=QUANTIZED_BLOCK_N,
    )


torch.library.register_kernel("specdec::quantized_linear", "cuda", quantized_linear)


# ---------------------------------------------------------------------------------------
# int8_activation_linear: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks repacked 16 rows at a time
# (gguf_blocks.pack_int8_activation), activations quantised to int8 with one scale per GGUF block.
# ---------------------------------------------------------------------------------------


def quantize_activations(x: torch.Tensor, block: int):
    """x [M, H] -> (q int8 [M, H], d fp32 [M, H / block], s fp32 [M, H / 32]) by the op's rule
    (ops.int8_activation_linear), one scale per ``block`` values (the GGUF block: 256 for the
    K-quants, 32 otherwise): d = max|x| / 127, q = round_half_even(x * (1 / d)) clamped to +-127,
    s = d * sum(q) per 32, all rounded to fp32 as the CPU kernel does; a scale block with max|x| <
    2^-96 counts as zero (d = 0, q = 0); one holding NaN or inf gets q = 0, d = s = NaN."""
    M, H = x.shape
    xb = x.to(torch.float32).reshape(M, H // block, block)
    finite = torch.isfinite(xb).all(-1)
    zero = torch.zeros((), device=x.device)
    amax = xb.abs().amax(-1).where(finite, zero)
    d = torch.where(amax < 2.0 ** -96, zero, amax / 127)
    inv = torch.where(d == 0, zero, 1 / d)
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).where(finite[..., None], zero)
    nan = torch.full((), float("nan"), device=x.device)
    d = d.where(finite, nan)
    sq = q.reshape(M, H // 32, 32).sum(-1)  # |sum q| <= 32 * 127: exact in fp32
    s = d.repeat_interleave(block // 32, dim=1) * sq
    return q.to(torch.int8).reshape(M, H), d, s


@triton.jit
def _int8_block_weights(rec, sub, rl, rj, BLOCK_TYPE: tl.constexpr):
    """The weight integers c [16, 32] of sub-block ``sub`` of the record at ``rec`` (16 rows,
    one per lane; the layout of gguf_blocks.pack_int8_activation): the block's integer dot
    product with activation integers q is sum_j c[l, j] * q[j] (Q6_K: the int8 scales folded in)."""
    IS_K: tl.constexpr = BLOCK_TYPE == 12 or BLOCK_TYPE == 13 or BLOCK_TYPE == 14
    FIVE_BIT: tl.constexpr = BLOCK_TYPE == 6 or BLOCK_TYPE == 7 or BLOCK_TYPE == 13
    WO: tl.constexpr = 320 if (BLOCK_TYPE == 12 or BLOCK_TYPE == 13) else (
        288 if BLOCK_TYPE == 14 else (64 if (BLOCK_TYPE == 3 or BLOCK_TYPE == 7) else 32))
    SUB_BYTES: tl.constexpr = 512 if BLOCK_TYPE == 8 else (320 if FIVE_BIT else (384 if BLOCK_TYPE == 14 else 256))
    wp = rec + WO + sub * SUB_BYTES
    lane_byte = 4 * rl[:, None] + (rj % 4)[None, :]  # byte 4l + t of a 64-byte step
    if BLOCK_TYPE == 8:  # Q8_0: step j // 4 holds q + 128
        c = tl.load(wp + 64 * (rj // 4)[None, :] + lane_byte).to(tl.int32) - 128
    else:  # chunk (j % 16) // 4; the high nibble for j >= 16
        byte = tl.load(wp + 64 * ((rj % 16) // 4)[None, :] + lane_byte).to(tl.int32)
        c = (byte >> ((rj // 16) * 4)[None, :]) & 15
        if FIVE_BIT:  # bit j // 4 of byte 4l + j % 4
            c = c | (((tl.load(wp + 256 + lane_byte).to(tl.int32) >> (rj // 4)[None, :]) & 1) << 4)
        if BLOCK_TYPE == 14:  # bits 2k, 2k + 1 (k = (j % 16) // 4) of the half's vector
            h = tl.load(wp + 256 + 64 * (rj // 16)[None, :] + lane_byte).to(tl.int32)
            c = c | (((h >> (2 * ((rj % 16) // 4))[None, :]) & 3) << 4)
            sc = tl.load(rec + 32 + 16 * (2 * sub + rj // 16)[None, :] + rl[:, None]).to(tl.int8, bitcast=True)
            c = (c - 32) * sc.to(tl.int32)
        if BLOCK_TYPE == 2:
            c = c - 8
        if BLOCK_TYPE == 6:
            c = c - 16
    return c


@triton.jit(do_not_specialize=["M"])
def _int8_activation_linear_kernel(
    q_ptr, d_ptr, s_ptr, w_ptr, b_ptr, out_ptr,
    M, N, NB,
    BLOCK_TYPE: tl.constexpr, GROUP_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """out [M, N] for one group of 16 weight rows (program_id(0)) and BLOCK_M activation rows:
    per GGUF block (record; NB blocks of 32 in all), the exact integer sums I [BLOCK_M, 16] (and
    Q4_K / Q5_K's Mn), then acc = fma(float(I), d_w * d_x, acc) (+ fma(m, s_x, acc) for Q4_1 /
    Q5_1, fma(-float(Mn), dmin * d_x, acc) for Q4_K / Q5_K), in record order as on the CPU."""
    pid_g = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rl = tl.arange(0, 16)  # the group's rows: one output lane each
    rj = tl.arange(0, 32)  # weight j of a block
    m_ok = rm < M
    rm_safe = tl.where(m_ok, rm, 0).to(tl.int64)
    PER: tl.constexpr = 8 if (BLOCK_TYPE == 12 or BLOCK_TYPE == 13 or BLOCK_TYPE == 14) else 1  # blocks per record
    K_MIN: tl.constexpr = BLOCK_TYPE == 12 or BLOCK_TYPE == 13
    NR = NB // PER
    acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    for r in range(0, NR):
        rec = w_ptr + (pid_g.to(tl.int64) * NR + r) * GROUP_BYTES
        isum = tl.zeros((BLOCK_M, 16), dtype=tl.int32)
        mins = tl.zeros((BLOCK_M, 16), dtype=tl.int32)
        for sub in tl.static_range(PER):
            b = r * PER + sub
            c = _int8_block_weights(rec, sub, rl, rj, BLOCK_TYPE)  # [16, 32]
            xq = tl.load(q_ptr + rm_safe[:, None] * NB * 32 + b * 32 + rj[None, :]).to(tl.int32)  # [BLOCK_M, 32]
            dot = tl.sum(xq[:, None, :] * c[None, :, :], axis=2)  # exact
            if K_MIN:
                isum += dot * tl.load(rec + 64 + 16 * sub + rl).to(tl.int32)[None, :]
                mins += tl.sum(xq, axis=1)[:, None] * tl.load(rec + 192 + 16 * sub + rl).to(tl.int32)[None, :]
            else:
                isum += dot
        dx = tl.load(d_ptr + rm_safe * NR + r)
        dw = _fp16_at(rec + 2 * rl)
        acc = tl.fma(isum.to(tl.float32), dw[None, :] * dx[:, None], acc)
        if BLOCK_TYPE == 3 or BLOCK_TYPE == 7:
            acc = tl.fma(_fp16_at(rec + 32 + 2 * rl)[None, :], tl.load(s_ptr + rm_safe * NB + r)[:, None], acc)
        if K_MIN:
            acc = tl.fma(-mins.to(tl.float32), _fp16_at(rec + 32 + 2 * rl)[None, :] * dx[:, None], acc)
    rn = pid_g * 16 + rl
    n_ok = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


INT8_ACTIVATION_BLOCK_M = 16


def int8_activation_linear(x: torch.Tensor, packed_weight: torch.Tensor, block_type: int, bias,
                           out: torch.Tensor) -> None:
    """Launcher of specdec::int8_activation_linear: out [M, N] fp32 = int8(x) [M, H] @ W^T +
    bias, W the packed blocks uint8 [ceil(N / 16), H / 32, group bytes] (see
    ops.int8_activation_linear)."""
    check_int8_activation_linear(x, packed_weight, block_type, bias, out)  # torch.ops on CUDA reaches it directly
    M, N = out.shape
    if M == 0 or N == 0:
        return
    q, d, s = quantize_activations(x, 256 if block_type in (12, 13, 14) else 32)
    b32 = None if bias is None else bias.to(torch.float32).contiguous()
    grid = (packed_weight.shape[0], triton.cdiv(M, INT8_ACTIVATION_BLOCK_M))
    _int8_activation_linear_kernel[grid](
        q, d, s, packed_weight, b32 if b32 is not None else d, out, M, N, x.shape[1] // 32,
        BLOCK_TYPE=block_type, GROUP_BYTES=INT8_ACTIVATION_GROUP_BYTES[block_type], HAS_BIAS=b32 is not None,
        BLOCK_M=INT8_ACTIVATION_BLOCK_M,
    )


torch.library.register_kernel("specdec::int8_activation_linear", "cuda", int8_activation_linear)
