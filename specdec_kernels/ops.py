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
    "compact_kv",
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


import weakref  # noqa: E402  (kept inside this section: it is only used here)


class _CacheLists:
    """K/V cache lists that passed the layer checks, remembered while all their tensors
    live (a weakref callback forgets the entry when any of them is freed, so a remembered
    id always names the tensor that was checked). With 30-60 layers the full check costs
    ~0.1-0.4 ms of Python per call, more than the kernel itself; a hit costs one tuple of
    ids. ``pointer_tables`` is where the Triton launcher keeps the layers' data pointers."""

    __slots__ = ("refs", "signature", "pointer_tables")

    def __init__(self, refs, signature):
        self.refs = refs
        self.signature = signature
        self.pointer_tables = None


_CHECKED_CACHE_LISTS: dict[tuple, _CacheLists] = {}


def _check_cache_lists(k_caches, v_caches) -> _CacheLists | None:
    """Raise a ValueError unless k_caches/v_caches are equal-length, non-empty lists of
    4-d tensors of one shape, dtype, device and strides, contiguous in the last dim.
    (Resizing a layer tensor in place between calls is not noticed on a remembered list;
    the C++ kernel checks every layer on each call anyway.)"""
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        if not isinstance(caches, (list, tuple)):
            raise ValueError(f"{name} must be a list of tensors (one per layer), got {type(caches).__name__}")
    compiling = torch.compiler.is_compiling()  # under torch.compile: plain checks, no memo
    key = None if compiling else (tuple(map(id, k_caches)), tuple(map(id, v_caches)))
    entry = None if compiling else _CHECKED_CACHE_LISTS.get(key)
    if entry is not None:
        first = k_caches[0]
        if (first.shape, first.dtype, first.device, first.stride()) == entry.signature:
            return entry
    if len(k_caches) == 0:
        raise ValueError("k_caches must hold at least one layer tensor, got an empty list")
    if len(k_caches) != len(v_caches):
        raise ValueError(f"k_caches and v_caches must have the same length, got {len(k_caches)} and {len(v_caches)}")
    first = k_caches[0]
    check_tensor(first, "k_caches[0]", dims=4)
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        for layer, t in enumerate(caches):
            check_tensor(t, f"{name}[{layer}]", dtype=first.dtype, shape=tuple(first.shape), device=first.device)
            if t.stride() != first.stride():
                raise ValueError(
                    f"{name}[{layer}] must have the strides of k_caches[0] {first.stride()}, got {t.stride()}"
                )
    if first.stride(3) != 1:
        raise ValueError(f"k_caches/v_caches must be contiguous in head_dim (stride 1), got strides {first.stride()}")

    if compiling:
        return None

    def forget(_ref, key=key):
        _CHECKED_CACHE_LISTS.pop(key, None)

    refs = tuple(weakref.ref(t, forget) for t in (*k_caches, *v_caches))
    entry = _CacheLists(refs, (first.shape, first.dtype, first.device, first.stride()))
    _CHECKED_CACHE_LISTS[key] = entry
    return entry


def _check_compact_kv_args(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
    """Shape/dtype/device checks of compact_kv (ValueError naming the argument); the
    data-dependent checks (node order, positions, block ids) are the kernels' job."""
    entry = _check_cache_lists(k_caches, v_caches)
    device = k_caches[0].device
    check_tensor(block_table, "block_table", dtype=torch.int32, dims=2, device=device)
    batch = block_table.shape[0]
    check_tensor(prefix_lens, "prefix_lens", dtype=torch.int32, shape=(batch,), device=device)
    check_tensor(accepted_nodes, "accepted_nodes", dtype=torch.int32, shape=(batch, None), device=device)
    check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    return entry


def compact_kv(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move the accepted tree nodes' K/V next to the root, in place, for every layer.

    k_caches, v_caches: one tensor per layer, each [num_blocks, block_size, num_kv_heads,
        head_dim], all of one shape, dtype (any, uint8 included) and device, contiguous in
        head_dim; a contiguous cache is block_size = max_len with one block per request.
    block_table: int32 [B, max_blocks] (cache position p of request b is in block
        block_table[b, p // block_size] at offset p % block_size; -1 padded).
    prefix_lens: int32 [B], cache position of tree node 0 (the root).
    accepted_nodes: int32 [B, D], accepted node indices, strictly increasing, >= 1,
        -1 padded (``tree_rejection_sample``'s output).
    num_accepted: int32 [B]; a negative count (a NaN row) moves nothing.

    For i < num_accepted[b]: position prefix_lens[b] + 1 + i <- position prefix_lens[b] +
    accepted_nodes[b, i] (K and V, every layer and head). Sources are read before
    destinations are written; identity moves (a chain) are skipped. Entries at other
    positions are unchanged. Data-dependent faults (node order, positions outside the block
    table, block ids out of range) raise on CPU; the Triton kernel skips such moves.

    The op only mutates the caches, so this wrapper returns None (a functional form that
    copied every layer's cache would defeat the purpose).
    """
    _check_compact_kv_args(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
    torch.ops.specdec.compact_kv(list(k_caches), list(v_caches), block_table, prefix_lens, accepted_nodes, num_accepted)


@torch.library.register_fake("specdec::compact_kv")
def _compact_kv_fake(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
    return None



# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM: medusa_topk, skinny_linear.
# ---------------------------------------------------------------------------------------
