"""Triton kernel of specdec::skinny_linear (CUDA key), also the GEMM of medusa_topk's ResBlocks.

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
    rk = tl.arange(0, BLOCK_K)
    x_base = x_ptr + head * stride_xh
    w_base = w_ptr + head * stride_wh
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_base + rm[:, None] * H + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < H), other=0.0)
        # The weight tile is loaded transposed, [BLOCK_K, BLOCK_N], straight from [N, H].
        w = tl.load(w_base + rn[None, :].to(tl.int64) * H + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < H),
                    other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if HAS_BIAS:
        bias = tl.load(b_ptr + head * stride_bh + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if RESIDUAL_SILU:
        resid = tl.load(x_base + rm[:, None] * H + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = resid + acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + head * stride_oh + rm[:, None] * N + rn[None, :], acc, mask=mask)


def _check(condition, message):
    if not condition:
        raise ValueError(message)


def _check_skinny_linear(x, weight, bias, out):
    """The shapes the launcher indexes with (through torch.ops on a CUDA tensor no wrapper has
    checked them): a mismatch would read or write past a tensor."""
    _check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1],
           f"weight must have shape [N, {x.shape[-1]}] (x is {list(x.shape)}), got {list(weight.shape)}")
    M, N = x.shape[0], weight.shape[0]
    if bias is not None:
        _check(tuple(bias.shape) == (N,), f"bias must have shape [{N}], got {list(bias.shape)}")
    _check(out.dim() == 2 and tuple(out.shape) == (M, N), f"out must have shape [{M}, {N}], got {list(out.shape)}")


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
    _check_skinny_linear(x, weight, bias, out)
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
