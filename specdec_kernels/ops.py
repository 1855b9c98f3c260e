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
    "tree_attention",
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


_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse):
    """Shape/dtype/device checks of tree_attention (no data-dependent checks: no host sync)."""
    check_tensor(q, "q", dtype=_ATTENTION_DTYPES, dims=3)
    T, Hq, D = q.shape
    dev = q.device
    check_tensor(k_cache, "k_cache", dtype=q.dtype, dims=4, device=dev)
    num_blocks, block_size, Hkv, _ = k_cache.shape
    check_tensor(k_cache, "k_cache", shape=(None, None, None, D))
    check_tensor(v_cache, "v_cache", dtype=q.dtype, shape=tuple(k_cache.shape), device=dev)
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"q's number of heads ({Hq}) must be a multiple of k_cache's ({Hkv})")
    if block_size < 1:
        raise ValueError(f"k_cache must have block_size >= 1, got shape {list(k_cache.shape)}")
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_tensor(block_table, "block_table", dtype=torch.int32, dims=2, device=dev)
    B = block_table.shape[0]
    check_tensor(prefix_lens, "prefix_lens", dtype=torch.int32, shape=(B,), device=dev)
    check_tensor(qo_indptr, "qo_indptr", dtype=torch.int32, shape=(B + 1,), device=dev)
    if tree_mask is not None:
        check_tensor(tree_mask, "tree_mask", dtype=torch.int64, shape=(T, None), device=dev)
        if tree_mask.shape[1] < 1:
            raise ValueError(f"tree_mask must have at least one word per row, got shape {list(tree_mask.shape)}")
        if not tree_mask.is_contiguous():
            raise ValueError("tree_mask must be contiguous")
    if out is not None:
        check_tensor(out, "out", dtype=q.dtype, shape=tuple(q.shape), device=dev)
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    if lse is not None:
        check_tensor(lse, "lse", dtype=torch.float32, shape=(T, Hq), device=dev)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Attention of all tree nodes of a batch over their prefix and their tree ancestors.

    q: [T, Hq, D] fp32/bf16/fp16; request b owns rows qo_indptr[b]:qo_indptr[b+1] in node
    order. k_cache, v_cache: [num_blocks, block_size, Hkv, D] (paged; a contiguous cache is
    one block of max_len per request), Hq a multiple of Hkv. block_table: int32
    [B, max_blocks]. prefix_lens: int32 [B]; node j of request b has its K/V at cache
    position prefix_lens[b] + j (written before the call). qo_indptr: int32 [B + 1].
    tree_mask: int64 [T, W] or None; bit j (word j // 64, little-endian) of row t set iff
    node j is visible to the node of row t (its own bit set); None = causal among the new
    tokens (plain decoding, chains). sm_scale: default 1 / sqrt(D).

    Returns out [T, Hq, D] (dtype of q), or (out, lse) with ``return_lse``: lse fp32
    [T, Hq], natural log-sum-exp of the scaled scores. ``out``/``lse`` may be given to
    write into (``lse`` given is always filled). Rows owned by no request, and rows that
    see no key, get out = 0 and lse = -inf.

    Data-dependent faults: on CPU, block ids out of range, a non-monotone qo_indptr, a
    prefix_lens + n beyond the block table, or more nodes than 64 * W raise RuntimeError;
    the Triton kernel skips the keys whose block id or table slot is out of range.

    The checks here cost some microseconds of Python per call; a hot loop on CPU may call
    ``torch.ops.specdec.tree_attention(..., sm_scale, out, lse)`` directly, whose C++
    kernel checks every argument too (RuntimeError).
    """
    _check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse)
    if sm_scale is None:
        sm_scale = float(q.shape[-1]) ** -0.5
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    torch.ops.specdec.tree_attention(
        q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, float(sm_scale), out, lse
    )
    return (out, lse) if return_lse else out


@torch.library.register_fake("specdec::tree_attention")
def _tree_attention_fake(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale, out, lse):
    return None



# ---------------------------------------------------------------------------------------
# KV-cache compaction: compact_kv.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM: medusa_topk, skinny_linear.
# ---------------------------------------------------------------------------------------
