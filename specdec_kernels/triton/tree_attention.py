"""Triton kernels of ``specdec::tree_attention`` (registered for the CUDA key).

Three launches, none of which reads a device value on the host:

1. ``_attend_kernel`` with IS_TREE=False, flash-decoding style: grid
   (B * Hkv * tile_programs, num_splits). A query tile holds BLOCK_M rows of one request and
   KV head — the request's nodes x the GQA group's query heads (row r = node r // GROUP, head
   h * GROUP + r % GROUP), so a K/V tile loaded once serves every node and head of the group.
   The tile_programs programs of a (request, KV head) take its tiles i, i + tile_programs, ...
   in turn; each attends, unmasked, one split of the request's prefix (cut per request into
   at most num_splits splits of whole key tiles).
2. the same kernel with IS_TREE=True, grid (B * Hkv * tile_programs, 1): the tree part
   (cache positions prefix + j, j < n), where the bit mask (or the causal rule when there is
   none) is applied.
3. ``_merge_kernel``: per query row, combines the partial (out, lse) of the splits and the
   tree part by their log-sum-exp; writes out (dtype of q) and optionally lse.

Host-side sizes come from shapes only: tile_programs covers the mean request's rows
(ceil(T / B) * GROUP), so a uniform batch has no idle program and a larger request's
programs loop over more tiles; num_splits targets a few waves of programs, bounded by the
block table's capacity (splits past a request's prefix run no iteration). Partials of rows
that see no key are not written: the launcher fills lse = -inf. Data-dependent faults give a
defined result instead of a fault: keys whose table slot lies beyond max_blocks or whose
block id lies outside [0, num_blocks) are skipped (treated as invisible), query rows
outside [0, T) are skipped, mask words beyond W read as 0. Rows owned by no request, and
rows that see no key, get out = 0 and lse = -inf.

fp32 inputs use IEEE fp32 dots (not TF32) so that all backends agree to fp32 accuracy
(``fp32_precision="tf32x3"`` is an opt-in for benchmarks). Launch configurations per dtype
and head dim: ``GPU_CONFIGS``; the launcher's keywords override them.
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
    """Grid (B * HKV * num_q_tiles, splits): num_q_tiles tile-programs per (request, KV head),
    program i of which takes the request's query tiles i, i + num_q_tiles, ...; split_len is
    the fewest keys a split takes (a multiple of BLOCK_N)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    first_tile = pid % num_q_tiles
    bh = pid // num_q_tiles
    b = bh // HKV
    h = bh % HKV

    # In int64: qo_indptr is data (not checked on a GPU), and its differences or its sums
    # with T may not fit in int32.
    q_begin = tl.load(qo_indptr_ptr + b).to(tl.int64)
    q_end = tl.load(qo_indptr_ptr + b + 1).to(tl.int64)
    n = q_end - q_begin
    # The request's rows that lie in q: tokens tok_lo <= t < tok_hi, num_rows = their count
    # times GROUP (row r: token tok_lo + r // GROUP, head h * GROUP + r % GROUP).
    tok_lo = tl.maximum(q_begin, 0)
    tok_hi = tl.minimum(q_end, T)
    num_rows = (tl.maximum(tok_hi - tok_lo, 0) * GROUP).to(tl.int32)
    # Keys at positions >= capacity have no table slot (they are skipped), so a prefix past
    # the capacity is clamped to it: with prefix_lens near 2^31, prefix + node index would
    # wrap around int32 to a negative position, whose slot lies before block_table's start.
    capacity = max_blocks * block_size
    prefix = tl.minimum(tl.maximum(tl.load(prefix_lens_ptr + b), 0), capacity)

    # Key range of this program: a split of the request's prefix, or its tree nodes.
    if IS_TREE:
        lo = 0
        # Tree keys past the capacity are skipped anyway; stopping there bounds the loop (and
        # keeps positions from wrapping) when qo_indptr gives a huge n.
        hi = tl.maximum(tl.minimum(n, capacity - prefix), 0).to(tl.int32)
    else:
        # The prefix cut into at most num_splits splits of whole key tiles, sized per request
        # (not by the capacity: a block table sized for the longest sequence would leave all
        # splits but the first idle), each of at least split_len keys.
        per_split = tl.cdiv(tl.cdiv(prefix, tl.num_programs(1)), BLOCK_N) * BLOCK_N
        span = tl.maximum(per_split, split_len)
        lo = tl.minimum(split * span, prefix)
        hi = tl.minimum(lo + span, prefix)
    # No tile when there is no key: the partials keep the launcher's lse = -inf.
    num_tiles = tl.where(hi > lo, tl.cdiv(num_rows, BLOCK_M), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tl.static_assert(64 % BLOCK_N == 0, "a key tile's mask bits must lie in one int64 word")

    for q_tile in range(first_tile, num_tiles, num_q_tiles):
        rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        token = tok_lo + rows // GROUP
        node = token - q_begin  # the token's node index in its tree
        head = h * GROUP + rows % GROUP

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
                    # A key tile starts at a multiple of BLOCK_N, which divides 64: all its
                    # keys' bits lie in one word per row.
                    word = start // 64 + tl.zeros([BLOCK_M], tl.int32)  # as a block: a boolean mask
                    words = tl.load(mask_ptr + token * mask_words + word, mask=row_ok & (word < mask_words), other=0)
                    bits = (words[:, None] >> (idx % 64).to(tl.int64)[None, :]) & 1
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

        # Rows that saw no key keep the partial the launcher filled in (lse = -inf, which the
        # merge weighs 0 without reading out): only rows that saw a key are written.
        seen = l_i > 0
        part_out = acc / tl.where(seen, l_i, 1.0)[:, None]
        part_lse = m_i + tl.log(tl.where(seen, l_i, 1.0))
        part = (part_index0 + split).to(tl.int64)
        row_index = (part * T + token) * HQ + head
        written = row_ok & seen
        tl.store(part_out_ptr + row_index[:, None] * HEAD_DIM + offs_d[None, :], part_out,
                 mask=written[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + row_index, part_lse, mask=written)


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
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Launch configurations on a GPU by dot kind and BLOCK_D (the head dim padded to a power of
# two, 64 at least): (largest BLOCK_M, BLOCK_N, num_warps, num_stages). First chosen from
# ptxas's register and spill counts for sm_90, then the D = 128 rows by timing on an H200
# (bench/bench_gpu.py's sweep, 4 x 64-node trees over 2,048-token prefixes; bench/results/
# gpu.json). "ieee": fp32 inputs; IEEE fp32 dots run on the FMA units, and each thread holds its
# rows of both operands whole along the reduced dimension (D for q k^T, BLOCK_N for p v): small
# tiles, else they spill (BLOCK_M 64, BLOCK_N 64, 4 warps at D = 128: ~24 KB a thread); at
# D = 128, 16 x 16 tiles on 4 warps ran 0.69 ms against 0.78 for 32 x 32 on 8. "tc": bf16/fp16
# on tensor cores; BLOCK_N 64 with 8 warps uses all 255 registers at D = 128 and spills in the
# tree pass; BLOCK_N 32 on 4 warps ran 0.157 ms against 0.236 on 8 and 0.262 for BLOCK_N 64.
# "tf32x3": fp32 inputs with fp32_precision="tf32x3" (opt-in), tensor cores, twice the operand
# registers of bf16.
GPU_CONFIGS = {
    ("ieee", 64): (32, 32, 8, 2),
    ("ieee", 128): (16, 16, 4, 2),
    ("ieee", 256): (16, 16, 8, 2),
    ("tc", 64): (64, 64, 4, 2),
    ("tc", 128): (64, 32, 4, 2),
    ("tc", 256): (64, 32, 8, 2),
    ("tf32x3", 64): (64, 32, 4, 2),
    ("tf32x3", 128): (64, 32, 4, 2),
    ("tf32x3", 256): (64, 16, 8, 2),
}
# Keys a split takes at least when the launcher chooses the split count: shorter splits cost
# more in partials written and merged than they gain in parallelism.
MIN_SPLIT_KEYS = 256
FP32_PRECISIONS = ("ieee", "tf32x3")


def plan_launch(T, B, Hq, Hkv, D, capacity, dtype, device, *, num_splits=None, block_m=None, block_n=None,
                num_warps=None, num_stages=None, tile_programs=None, fp32_precision="ieee") -> dict:
    """The launch of tree_attention for these sizes (host values only), each override taken as
    given: block_m (a power of two >= 16), block_n (16, 32 or 64), num_warps, num_stages, tile_programs
    (programs per request and KV head, each looping over the request's query tiles),
    num_splits (prefix splits; with it, a split may be as short as one key tile),
    fp32_precision ("ieee", or "tf32x3": 3xTF32 tensor-core dots, close to but not IEEE fp32)."""
    if fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}, got {fp32_precision!r}")
    group = Hq // Hkv
    block_d = max(16, triton.next_power_of_2(D))
    on_gpu = device.type == "cuda"
    # The interpreter's tl.dot mishandles bfloat16 operands (Triton 3.9): there, and only
    # there, bf16 tiles are widened to fp32 before the dots.
    dot_fp32 = dtype == torch.float32 or (dtype == torch.bfloat16 and not on_gpu)
    precision = fp32_precision if (dot_fp32 and on_gpu) else ("ieee" if dot_fp32 else "tf32")
    if on_gpu:
        kind = precision if dot_fp32 else "tc"
        max_m, cfg_n, cfg_warps, cfg_stages = GPU_CONFIGS[(kind, min(max(block_d, 64), 256))]
    else:  # the interpreter: small tiles run faster in numpy
        max_m, cfg_n, cfg_warps, cfg_stages = 64, 32, 4, 2
    # Rows of a request: its tree nodes times the GQA group, packed into BLOCK_M-row tiles. The
    # tile-programs per (request, KV head) cover the mean request's rows: a uniform batch has
    # no idle program, a larger request's programs loop over more tiles.
    mean_rows = triton.cdiv(T, max(B, 1)) * group
    block_m = block_m or min(max_m, max(16, triton.next_power_of_2(mean_rows)))
    block_n = block_n or cfg_n
    tile_programs = tile_programs or max(1, triton.cdiv(mean_rows, block_m))

    split_len = MIN_SPLIT_KEYS if num_splits is None else block_n
    split_len = triton.cdiv(split_len, block_n) * block_n
    max_splits = max(1, triton.cdiv(capacity, split_len))  # bound on the prefix's splits
    if num_splits is None:
        num_splits = triton.cdiv(_target_programs(device), max(1, B * Hkv * tile_programs))
    num_splits = max(1, min(num_splits, max_splits))
    return dict(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=num_warps or cfg_warps,
                num_stages=num_stages or cfg_stages, tile_programs=tile_programs, num_splits=num_splits,
                split_len=split_len, dot_fp32=dot_fp32, precision=precision)


def tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale, out, lse,
                   *, num_splits: int | None = None, block_m: int | None = None, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, tile_programs: int | None = None,
                   fp32_precision: str = "ieee") -> None:
    """Launcher with the op's signature (see ``specdec_kernels.ops.tree_attention``).

    The keywords override the heuristics (see ``plan_launch``): tests use them to exercise the
    merge and the tile loop, bench/bench_gpu.py to sweep launch configurations.
    """
    # The op's check (specdec_kernels.checks): through torch.ops on a CUDA tensor this
    # launcher is the kernel, and it indexes with the strides and shapes it assumes (a
    # non-contiguous lse or tree_mask, a mis-shaped out would be read or written past).
    check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse)
    T, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    B, max_blocks = block_table.shape
    if T == 0:
        return
    block_table = block_table.contiguous()
    prefix_lens = prefix_lens.contiguous()
    qo_indptr = qo_indptr.contiguous()
    plan = plan_launch(T, B, Hq, Hkv, D, max_blocks * block_size, q.dtype, q.device, num_splits=num_splits,
                       block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                       tile_programs=tile_programs, fp32_precision=fp32_precision)
    num_splits = plan["num_splits"]

    num_parts = num_splits + 1  # the prefix splits, then the tree part
    # Only rows that see a key write their partial: the rest keep lse = -inf (weight 0).
    part_out = torch.empty(num_parts, T, Hq, D, dtype=torch.float32, device=q.device)
    part_lse = torch.full((num_parts, T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    has_mask = tree_mask is not None
    mask_arg = tree_mask if has_mask else qo_indptr  # never read when HAS_MASK is False
    mask_words = tree_mask.shape[1] if has_mask else 1

    common = dict(
        HQ=Hq, HKV=Hkv, GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"],
        BLOCK_D=plan["block_d"], HAS_MASK=has_mask, DOT_PRECISION=plan["precision"], DOT_FP32=plan["dot_fp32"],
        num_warps=plan["num_warps"], num_stages=plan["num_stages"],
    )
    args = (q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_arg, part_out, part_lse, float(sm_scale),
            T, num_blocks, max_blocks, block_size, mask_words, plan["split_len"])
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0))
    programs = B * Hkv * plan["tile_programs"]
    _attend_kernel[(programs, num_splits)](*args, 0, plan["tile_programs"], *strides, IS_TREE=False, **common)
    _attend_kernel[(programs, 1)](*args, num_splits, plan["tile_programs"], *strides, IS_TREE=True, **common)
    _merge_kernel[(T,)](
        part_out, part_lse, out, lse if lse is not None else part_lse, T, num_parts, out.stride(0), out.stride(1),
        HQ=Hq, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(Hq), BLOCK_D=plan["block_d"], HAS_LSE=lse is not None,
    )


torch.library.register_kernel("specdec::tree_attention", "cuda", tree_attention)
