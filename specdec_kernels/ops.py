"""Typed wrappers of the ``torch.ops.specdec`` ops, their input validation and fakes.

Each op is called as ``torch.ops.specdec.<name>(..., out tensors)`` (destination-passing,
capturable in CUDA graphs); the wrappers here validate the inputs with errors that name
the argument, allocate the outputs for the functional form and return them. The fakes
(``register_fake``) describe the ops to ``torch.compile`` and ``opcheck``: ops that only
write into their arguments return nothing, so their fakes check nothing and return None.
"""
from __future__ import annotations

import torch

__all__ = [
    "philox_uniform",
    "medusa_topk", "skinny_linear", "linear",
]


# ---------------------------------------------------------------------------------------
# Validation helpers, shared by every wrapper.
# ---------------------------------------------------------------------------------------


def check_tensor(t, name: str, *, dtype=None, dims=None, device=None, shape=None) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` is a tensor as described.

    ``dtype`` may be one dtype or a tuple; ``shape`` entries of None are not checked.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


# ---------------------------------------------------------------------------------------
# Random numbers.
# ---------------------------------------------------------------------------------------


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, position: int, purpose: int, num: int) -> torch.Tensor:
    """The package generator's uniforms (see ``specdec_kernels.rng``).

    seed, offset: int64 [B]. Returns fp32 [B, num], the uniforms for vocabulary indices
    0..num-1 at ``position`` for ``purpose``.
    """
    check_tensor(seed, "seed", dtype=torch.int64, dims=1)
    check_tensor(offset, "offset", dtype=torch.int64, shape=(seed.shape[0],), device=seed.device)
    return torch.ops.specdec.philox_uniform(seed, offset, position, purpose, num)


@torch.library.register_fake("specdec::philox_uniform")
def _philox_uniform_fake(seed, offset, position, purpose, num):
    return seed.new_empty((seed.shape[0], num), dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Rejection sampling: chain_rejection_sample, tree_rejection_sample, apply_top_k_top_p.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Tree attention: tree_attention.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# KV-cache compaction: compact_kv.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM: medusa_topk, skinny_linear.
# ---------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Largest number of rows for which `linear` uses skinny_linear instead of F.linear on CPU.
# Measured with `python bench/bench_medusa.py --threads 1` on the 2-core dev machine (torch
# 2.13, MKL/oneDNN, a CPU with AVX-512 and AMX) over the SmolLM2 layer shapes [1536, 576],
# [576, 1536], [576, 576], [192, 576], [49152, 576], with "cold" weights (each call takes
# the next of a pool of copies larger than the 300 MB L3, as in a decode step where the
# other layers evicted this one; bench/results/medusa.json). fp32: F.linear time /
# skinny_linear time = 1.1-1.8x at M = 4 and 8 on every shape, 0.84-1.03x at M = 1-2 on
# the small shapes but 1.0-1.7x on the LM head, mixed from M = 16 (MKL's AVX-512 GEMM
# wins once the kernel is compute bound). bf16: oneDNN's bf16 GEMM (AMX) wins from M = 4
# (skinny_linear 1.1-1.5x faster at M = 1-2). With the weight hot in L2 (a microbenchmark
# calling one small layer in a loop) F.linear wins on [576, 576] and [192, 576] at every M.
# (2-thread wall-clock medians on the shared machine were dominated by preemption.)
SKINNY_LINEAR_MAX_ROWS = 8
SKINNY_LINEAR_MAX_ROWS_BF16 = 2


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out=None) -> torch.Tensor:
    """``x @ weight.T + bias`` streaming the weight once for all rows (CPU, few rows).

    x: [M, H] fp32/bf16/fp16; weight: [N, H] fp32/bf16/fp16, contiguous (bf16/fp16 weights
    are widened on the fly, so they stream half the bytes); bias: [N] or None; out: [M, N]
    of x's dtype (allocated when None). Accumulates in fp32. Designed for M <= 64; any M is
    correct (the CPU kernel just stops beating MKL). Returns out.
    """
    check_tensor(x, "x", dtype=_FLOAT_DTYPES, dims=2)
    check_tensor(weight, "weight", dtype=_FLOAT_DTYPES, dims=2, device=x.device)
    M, H = x.shape
    N = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight must have shape [N, {H}] (x is [{M}, {H}]), got {list(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if bias is not None:
        check_tensor(bias, "bias", dtype=_FLOAT_DTYPES, shape=(N,), device=x.device)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        check_tensor(out, "out", dtype=x.dtype, shape=(M, N), device=x.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    torch.ops.specdec.skinny_linear(x, weight, bias, out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that uses ``skinny_linear`` where it was measured to be faster.

    x: [..., H]; weight: [N, H]; bias: [N] or None. skinny_linear is used on CPU when the
    flattened row count is <= SKINNY_LINEAR_MAX_ROWS (fp32) or SKINNY_LINEAR_MAX_ROWS_BF16
    (bf16), x, weight (and bias) are all fp32 or all bf16, the weight is contiguous and no
    gradient is needed (skinny_linear has no autograd formula); otherwise this is exactly
    ``F.linear``. (skinny_linear accumulates
    in fp32 and rounds once, so bf16 results can differ from F.linear's in the last bit.)
    """
    rows = x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] > 0 else 0
    use_skinny = (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and 0 < rows <= (SKINNY_LINEAR_MAX_ROWS if x.dtype == torch.float32 else SKINNY_LINEAR_MAX_ROWS_BF16)
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dim() == 1 and bias.device.type == "cpu" and bias.dtype == x.dtype))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad)))
    )
    if not use_skinny:
        return torch.nn.functional.linear(x, weight, bias)
    out = skinny_linear(x.reshape(rows, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def medusa_topk(
    hidden: torch.Tensor,
    res_weight: torch.Tensor,
    res_bias: torch.Tensor,
    lm_head: torch.Tensor,
    top_k: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k candidates of K Medusa heads, fused: the [M, K, V] logits are never written.

    hidden: [M, H]; res_weight: [K, L, H, H] and res_bias: [K, L, H] (L ResBlocks per head,
    x <- x + SiLU(x W^T + b); L may be 0); lm_head: [V, H] shared by all heads or [K, V, H]
    per head; all fp32/bf16/fp16 (arithmetic in fp32), weights contiguous; 1 <= top_k <= V.
    Returns (topk_ids int64 [M, K, top_k], topk_logprobs fp32 [M, K, top_k]): per row and
    head, the top_k vocabulary ids by descending logit (ties to the lower id) and their
    log-softmax values. ``out`` = (topk_ids, topk_logprobs) to write into.
    Non-finite logits raise on CPU (RuntimeError); on GPU they give NaN log-probs.
    """
    check_tensor(hidden, "hidden", dtype=_FLOAT_DTYPES, dims=2)
    M, H = hidden.shape
    dev = hidden.device
    check_tensor(res_weight, "res_weight", dtype=_FLOAT_DTYPES, dims=4, device=dev)
    K, L = res_weight.shape[0], res_weight.shape[1]
    if K < 1:
        raise ValueError(f"res_weight must have at least one head (K >= 1), got shape {list(res_weight.shape)}")
    check_tensor(res_weight, "res_weight", shape=(K, L, H, H))
    check_tensor(res_bias, "res_bias", dtype=_FLOAT_DTYPES, shape=(K, L, H), device=dev)
    check_tensor(lm_head, "lm_head", dtype=_FLOAT_DTYPES, device=dev)
    if lm_head.dim() == 2 and lm_head.shape[1] == H:
        V = lm_head.shape[0]
    elif lm_head.dim() == 3 and lm_head.shape[0] == K and lm_head.shape[2] == H:
        V = lm_head.shape[1]
    else:
        raise ValueError(
            f"lm_head must have shape [V, {H}] (shared) or [{K}, V, {H}] (per head), got {list(lm_head.shape)}"
        )
    if V < 1:
        raise ValueError(f"lm_head must have at least one vocabulary row, got shape {list(lm_head.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"top_k must be an int in [1, V = {V}], got {top_k!r}")
    for t, name in ((res_weight, "res_weight"), (res_bias, "res_bias"), (lm_head, "lm_head")):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out is None:
        topk_ids = torch.empty((M, K, top_k), dtype=torch.int64, device=dev)
        topk_logprobs = torch.empty((M, K, top_k), dtype=torch.float32, device=dev)
    else:
        topk_ids, topk_logprobs = out
        check_tensor(topk_ids, "topk_ids", dtype=torch.int64, shape=(M, K, top_k), device=dev)
        check_tensor(topk_logprobs, "topk_logprobs", dtype=torch.float32, shape=(M, K, top_k), device=dev)
        if not (topk_ids.is_contiguous() and topk_logprobs.is_contiguous()):
            raise ValueError("topk_ids and topk_logprobs must be contiguous")
    torch.ops.specdec.medusa_topk(hidden.contiguous(), res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs)
    return topk_ids, topk_logprobs


@torch.library.register_fake("specdec::medusa_topk")
def _medusa_topk_fake(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs):
    return None


@torch.library.register_fake("specdec::skinny_linear")
def _skinny_linear_fake(x, weight, bias, out):
    return None
