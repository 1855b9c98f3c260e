"""Triton kernels of ``specdec::tree_attention`` (registered for the CUDA key).

Three launches, none of which reads a device value on the host:

1. ``_attend_kernel`` with IS_TREE=False, flash-decoding style: grid
   (B * Hkv * q_tiles, num_splits). Each program takes one query tile of one request and
   KV head — the request's nodes x the GQA group's query heads packed into BLOCK_M rows
   (row r = node r // GROUP, head h * GROUP + r % GROUP), so a K/V tile loaded once serves
   every node and head of the group — and one split of the prefix, unmasked.
2. the same kernel with IS_TREE=True: the tree part (cache positions prefix + j, j < n),
   where the bit mask (or the causal rule when there is none) is applied.
3. ``_merge_kernel``: per query row, combines the partial (out, lse) of the splits and the
   tree part by their log-sum-exp; writes out (dtype of q) and optionally lse.

Host-side sizes come from shapes only: the number of query tiles per request is bounded by
T * GROUP (tiles past a request's rows run zero iterations), the number of splits by the
block table's capacity (splits past a request's prefix run zero iterations and contribute
lse = -inf). Data-dependent faults give a defined result instead of a fault: keys whose
table slot lies beyond max_blocks or whose block id lies outside [0, num_blocks) are skipped
(treated as invisible), query rows outside [0, T) are skipped, mask words beyond W read as 0.
Rows owned by no request, and rows that see no key, get out = 0 and lse = -inf.

fp32 inputs use IEEE fp32 dots (not TF32) so that all backends agree to fp32 accuracy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tree_attention


# The token-count-dependent arguments (T, num_q_tiles) are runtime values and not
# specialised (Triton would otherwise compile a variant for T == 1 and for T % 16 == 0):
# a decode loop whose batch of tree tokens changes size every step reuses one binary.
# Left whole though long: split into @triton.jit helpers, its loop state (accumulators, running
# max / sum, masks) would pass through many arguments, which reads worse and can cost registers.
@triton.jit(do_not_specialize=["T", "num_q_tiles"])
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, prefix_lens_ptr, qo_indptr_ptr, mask_ptr,
    part_out_ptr, part_lse_ptr,
    sm_scale, T, num_blocks, max_blocks, block_size, mask_words, split_len, part_index0, num_q_tiles,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_TREE: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    q_tile = pid % num_q_tiles
    bh = pid // num_q_tiles
    b = bh // HKV
    h = bh % HKV

    q_begin = tl.load(qo_indptr_ptr + b)
    n = tl.load(qo_indptr_ptr + b + 1) - q_begin
    # Keys at positions >= capacity have no table slot (they are skipped), so a prefix past
    # the capacity is clamped to it: with prefix_lens near 2^31, prefix + node index would
    # wrap around int32 to a negative position, whose slot lies before block_table's start.
    capacity = max_blocks * block_size
    prefix = tl.minimum(tl.maximum(tl.load(prefix_lens_ptr + b), 0), capacity)

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    node = rows // GROUP
    head = h * GROUP + rows % GROUP
    token = (q_begin + node).to(tl.int64)
    row_ok = (rows < n * GROUP) & (token >= 0) & (token < T)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # Key range of this program: a split of the prefix, or the n tree nodes. A tile with
    # no rows of its request runs no iteration.
    tile_busy = q_tile * BLOCK_M < n * GROUP
    if IS_TREE:
        lo = 0
        # Tree keys past the capacity are skipped anyway; stopping there bounds the loop (and
        # keeps positions from wrapping) when qo_indptr gives a huge n.
        hi = tl.where(tile_busy, tl.minimum(n, capacity - prefix), 0)
    else:
        lo = split * split_len
        hi = tl.where(tile_busy, tl.minimum(lo + split_len, prefix), lo)

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)  # prefix position, or node index in the tree pass
        if IS_TREE:
            pos = prefix + idx
        else:
            pos = idx
        slot = pos // block_size
        key_ok = (idx < hi) & (slot < max_blocks)
        blk = tl.load(block_table_ptr + b * stride_bt + slot, mask=key_ok, other=0)
        key_ok = key_ok & (blk >= 0) & (blk < num_blocks)
        blk = tl.where(key_ok, blk, 0).to(tl.int64)
        offset = (pos % block_size).to(tl.int64)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + blk[:, None] * stride_kb + offset[:, None] * stride_ks + h * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        visible = row_ok[:, None] & key_ok[None, :]
        if IS_TREE:
            if HAS_MASK:
                word_idx = idx // 64
                words = tl.load(
                    mask_ptr + token[:, None] * mask_words + word_idx[None, :],
                    mask=visible & (word_idx < mask_words)[None, :], other=0,
                )
                bits = (words >> (idx % 64).to(tl.int64)[None, :]) & 1
                visible = visible & (bits != 0)
            else:
                visible = visible & (idx[None, :] <= node[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + blk[:, None] * stride_vb + offset[:, None] * stride_vs + h * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    part_out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    part_lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = (part_index0 + split).to(tl.int64)
    row_index = (part * T + token) * HQ + head
    tl.store(part_out_ptr + row_index[:, None] * HEAD_DIM + offs_d[None, :], part_out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(part_lse_ptr + row_index, part_lse, mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, T, num_parts, stride_ot, stride_oh,
    HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = heads < HQ
    io_mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for part in range(num_parts):
        row_index = (part * T + t) * HQ + heads
        lse_part = tl.load(part_lse_ptr + row_index, mask=h_ok, other=float("-inf"))
        m_new = tl.maximum(m, lse_part)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_part - m_safe)
        o = tl.load(part_out_ptr + row_index[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask & (w > 0)[:, None],
                    other=0.0)
        acc = acc * alpha[:, None] + o * w[:, None]
        l = l * alpha + w
        m = m_new
    seen = l > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)
    if HAS_LSE:
        lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * HQ + heads, lse, mask=h_ok)


def _target_programs(device: torch.device) -> int:
    """Programs worth launching for the prefix pass: a few waves on a GPU; few under the
    interpreter, where every program runs serially."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale, out, lse,
                   *, num_splits: int | None = None, block_n: int | None = None) -> None:
    """Launcher with the op's signature (see ``specdec_kernels.ops.tree_attention``).

    ``num_splits``/``block_n`` override the heuristics (tests use them to exercise the
    merge with several splits).
    """
    # The op's check (specdec_kernels.checks): through torch.ops on a CUDA tensor this
    # launcher is the kernel, and it indexes with the strides and shapes it assumes (a
    # non-contiguous lse or tree_mask, a mis-shaped out would be read or written past).
    check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse)
    T, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    B, max_blocks = block_table.shape
    group = Hq // Hkv
    if T == 0:
        return
    block_table = block_table.contiguous()
    prefix_lens = prefix_lens.contiguous()
    qo_indptr = qo_indptr.contiguous()

    block_d = max(16, triton.next_power_of_2(D))
    mean_rows = triton.cdiv(T, max(B, 1)) * group
    block_m = min(64, max(16, triton.next_power_of_2(mean_rows)))
    if block_n is None:
        block_n = 64 if (q.device.type == "cuda" and block_d <= 128) else 32
    num_q_tiles = triton.cdiv(T * group, block_m)

    capacity = max_blocks * block_size  # bound on prefix_lens[b] + n
    max_splits = max(1, triton.cdiv(capacity, block_n))
    if num_splits is None:
        num_splits = triton.cdiv(_target_programs(q.device), max(1, B * Hkv * min(num_q_tiles, 4)))
    num_splits = max(1, min(num_splits, max_splits))
    split_len = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(capacity, split_len))

    num_parts = num_splits + 1  # the prefix splits, then the tree part
    part_out = torch.empty(num_parts, T, Hq, D, dtype=torch.float32, device=q.device)
    part_lse = torch.full((num_parts, T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    has_mask = tree_mask is not None
    mask_arg = tree_mask if has_mask else qo_indptr  # never read when HAS_MASK is False
    mask_words = tree_mask.shape[1] if has_mask else 1
    # The interpreter's tl.dot mishandles bfloat16 operands (Triton 3.9): there, and only
    # there, bf16 tiles are widened to fp32 before the dots.
    dot_fp32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type != "cuda")
    precision = "ieee" if dot_fp32 else "tf32"

    common = dict(
        HQ=Hq, HKV=Hkv, GROUP=group, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, HAS_MASK=has_mask, DOT_PRECISION=precision, DOT_FP32=dot_fp32,
    )
    args = (q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_arg, part_out, part_lse, float(sm_scale),
            T, num_blocks, max_blocks, block_size, mask_words)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0))
    _attend_kernel[(B * Hkv * num_q_tiles, num_splits)](*args, split_len, 0, num_q_tiles, *strides, IS_TREE=False,
                                                        **common)
    _attend_kernel[(B * Hkv * num_q_tiles, 1)](*args, split_len, num_splits, num_q_tiles, *strides, IS_TREE=True,
                                               **common)
    _merge_kernel[(T,)](
        part_out, part_lse, out, lse if lse is not None else part_lse, T, num_parts, out.stride(0), out.stride(1),
        HQ=Hq, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(Hq), BLOCK_D=block_d, HAS_LSE=lse is not None,
    )


torch.library.register_kernel("specdec::tree_attention", "cuda", tree_attention)
