"""Triton kernel of ``specdec::compact_kv``: every layer's K and V in one launch.

Grid: (request b, kv head h, layer chunk). A program loads its request's accepted node
indices once, turns them into source and destination rows through the block table, then for
each layer of its chunk loads all accepted source rows of head h ([BLOCK_A, BLOCK_D] tile)
of K and of V before it stores any destination: gather-then-scatter inside one program,
so the overlap of sources and destinations cannot corrupt anything, and no two programs
touch the same bytes (they differ in request, head or layer).

How the list of layers reaches the kernel: the launcher passes two int64 tensors holding
the data pointers of the K and V caches of every layer (``tl.load(ptrs + layer)`` cast to
a pointer), so one launch covers all layers, whatever their number, and layer tensors need
not be slices of one allocation. The pointer tables are remembered by their content (the
tuple of pointers), so after the first call on a cache no host-to-device copy is made and
the launch is capturable in a CUDA graph. (The alternative, one launch per layer chunk with the chunk's
pointers as separate arguments, costs a launch per chunk, which is what dominates this tiny
op on a GPU.)

Data are moved as raw bits (an integer type of the element size), so every cache dtype —
fp32, bf16, fp16, fp8, uint8 — takes the same code.

Data-dependent faults are skipped, never read or written out of bounds: a move whose node
index is < 1, whose source or destination lies outside the block table capacity, or whose
block id lies outside [0, num_blocks) is not done (the other moves of the request are);
num_accepted is clamped to [0, accepted_nodes.shape[1]]. Identity moves (node i+1 at
position prefix+1+i, e.g. a fully accepted chain) are masked out, so they cost no memory
traffic. No host synchronisation: all counts are read in the kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_compact_kv

__all__ = ["compact_kv_triton"]


@triton.jit
def _compact_kv_kernel(
    k_ptrs,  # int64 [num_layers], data pointers of the K caches
    v_ptrs,  # int64 [num_layers], data pointers of the V caches
    block_table,  # int32 [B, max_blocks]
    prefix_lens,  # int32 [B]
    accepted_nodes,  # int32 [B, max_accepted]
    num_accepted,  # int32 [B]
    num_layers,
    layers_per_program,
    stride_bt_b,
    stride_bt_j,
    stride_an_b,
    stride_an_i,
    stride_block,  # cache strides in elements (identical for every layer, K and V)
    stride_pos,
    stride_head,
    num_blocks,
    block_size,
    max_blocks,
    max_accepted,
    HEAD_DIM: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    chunk = tl.program_id(2)

    if ELEM_BYTES == 1:
        elem_ty = tl.int8
    elif ELEM_BYTES == 2:
        elem_ty = tl.int16
    elif ELEM_BYTES == 4:
        elem_ty = tl.int32
    else:
        elem_ty = tl.int64

    count = tl.load(num_accepted + b)
    count = tl.minimum(tl.maximum(count, 0), max_accepted)
    prefix = tl.load(prefix_lens + b).to(tl.int64)

    i = tl.arange(0, BLOCK_A)
    in_range = i < count
    node = tl.load(accepted_nodes + b * stride_an_b + i * stride_an_i, mask=in_range, other=0).to(tl.int64)
    capacity = max_blocks * block_size
    src_pos = prefix + node
    dst_pos = prefix + 1 + i
    # prefix >= 0 is tested on a block (the interpreter mis-broadcasts a scalar bool).
    prefix_ok = (prefix + tl.zeros_like(node)) >= 0
    valid = in_range & (node >= 1) & prefix_ok & (src_pos < capacity) & (dst_pos < capacity)
    # Identity moves are no moves at all (a fully accepted chain touches no cache byte).
    valid = valid & (src_pos != dst_pos)
    src_block = tl.load(block_table + b * stride_bt_b + (src_pos // block_size) * stride_bt_j, mask=valid, other=-1).to(tl.int64)
    dst_block = tl.load(block_table + b * stride_bt_b + (dst_pos // block_size) * stride_bt_j, mask=valid, other=-1).to(tl.int64)
    valid = valid & (src_block >= 0) & (src_block < num_blocks) & (dst_block >= 0) & (dst_block < num_blocks)
    head_offset = h.to(tl.int64) * stride_head
    src_row = src_block * stride_block + (src_pos % block_size) * stride_pos + head_offset
    dst_row = dst_block * stride_block + (dst_pos % block_size) * stride_pos + head_offset

    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    src_offsets = src_row[:, None] + d[None, :]
    dst_offsets = dst_row[:, None] + d[None, :]

    layer_start = chunk * layers_per_program
    layer_end = tl.minimum(layer_start + layers_per_program, num_layers)
    for layer in range(layer_start, layer_end):
        k_cache = tl.load(k_ptrs + layer).to(tl.pointer_type(elem_ty))
        v_cache = tl.load(v_ptrs + layer).to(tl.pointer_type(elem_ty))
        # All sources of this (request, head, layer) are loaded before any store.
        k_rows = tl.load(k_cache + src_offsets, mask=mask)
        v_rows = tl.load(v_cache + src_offsets, mask=mask)
        tl.store(k_cache + dst_offsets, k_rows, mask=mask)
        tl.store(v_cache + dst_offsets, v_rows, mask=mask)


# Pointer tables by (device, K pointers, V pointers): an entry's content is its key, so a
# hit is always right, whatever happened to the tensors. A few entries cover the caches of
# one engine; the oldest is dropped beyond that.
_POINTER_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_POINTER_TABLES = 8


def _pointer_tables(k_caches, v_caches) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 tensors of the layers' data pointers, on the caches' device (made once per
    set of pointers: no host-to-device copy on later calls)."""
    device = k_caches[0].device
    key = (device, tuple(t.data_ptr() for t in k_caches), tuple(t.data_ptr() for t in v_caches))
    tables = _POINTER_TABLES.get(key)
    if tables is None:
        tables = (torch.tensor(key[1], dtype=torch.int64, device=device),
                  torch.tensor(key[2], dtype=torch.int64, device=device))
        if len(_POINTER_TABLES) >= _MAX_POINTER_TABLES:
            del _POINTER_TABLES[next(iter(_POINTER_TABLES))]
        _POINTER_TABLES[key] = tables
    return tables


def compact_kv_triton(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted) -> None:
    """Launcher with the op's signature (see ``specdec_kernels.ops.compact_kv``): caches
    [num_blocks, block_size, num_kv_heads, head_dim] per layer, block_table int32 [B,
    max_blocks], prefix_lens int32 [B], accepted_nodes int32 [B, D], num_accepted int32 [B].
    Works on CUDA tensors and, under TRITON_INTERPRET=1, on CPU tensors."""
    k_caches, v_caches = list(k_caches), list(v_caches)
    check_compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
    first = k_caches[0]
    num_blocks, block_size, num_heads, head_dim = first.shape
    batch, max_accepted = accepted_nodes.shape
    num_layers = len(k_caches)
    if first.element_size() not in (1, 2, 4, 8):
        raise ValueError(f"k_caches element size must be 1, 2, 4 or 8 bytes, got {first.element_size()} ({first.dtype})")
    if batch == 0 or max_accepted == 0 or first.numel() == 0:
        return
    k_ptrs, v_ptrs = _pointer_tables(k_caches, v_caches)
    # Enough programs to fill a GPU (~1024) without making each one trivially small: split
    # the layers into chunks only as far as needed.
    programs_per_layer_chunk = batch * num_heads
    num_chunks = max(1, min(num_layers, triton.cdiv(1024, programs_per_layer_chunk)))
    layers_per_program = triton.cdiv(num_layers, num_chunks)
    num_chunks = triton.cdiv(num_layers, layers_per_program)
    _compact_kv_kernel[(batch, num_heads, num_chunks)](
        k_ptrs,
        v_ptrs,
        block_table,
        prefix_lens,
        accepted_nodes,
        num_accepted,
        num_layers,
        layers_per_program,
        block_table.stride(0),
        block_table.stride(1),
        accepted_nodes.stride(0),
        accepted_nodes.stride(1),
        first.stride(0),
        first.stride(1),
        first.stride(2),
        num_blocks,
        block_size,
        block_table.shape[1],
        max_accepted,
        HEAD_DIM=head_dim,
        ELEM_BYTES=first.element_size(),
        BLOCK_A=max(triton.next_power_of_2(max_accepted), 2),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
    )


torch.library.register_kernel("specdec::compact_kv", "cuda", compact_kv_triton)
