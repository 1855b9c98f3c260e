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
