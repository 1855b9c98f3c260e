"""Triton kernels of specdec::medusa_topk (CUDA key).

medusa_topk runs in three steps, none of which writes the [M, K, V] logits:
  1. ResBlocks: per layer one launch over (row block, output block, head) of a fused
     x_next = x + SiLU(x W^T + b) (``_linear_kernel`` of linear.py with RESIDUAL_SILU).
  2. ``_lm_head_topk_kernel``: one program per (vocabulary tile, row block, head) computes
     the tile's logits, its max and sum of exp (log-sum-exp partials), and its top_k
     candidates by iterative max extraction (ties to the lower id); at most 64.
     top_k is a runtime argument of both kernels (the merge sizes its running list with a
     power-of-two bound): a new top_k compiles nothing, or one merge variant per power of
     two, instead of a fully unrolled kernel pair per top_k.
  3. ``_merge_kernel``: one program per (row, head) merges the partials: log-sum-exp,
     then the best top_k of all tiles' candidates, merged chunk by chunk with a running
     top-k list in registers.
Arithmetic is fp32 (weights of any float dtype are widened on load; tl.dot uses
input_precision="ieee", not tf32). Non-finite logits give NaN log-probs (ids are then
unspecified, -1 or in range): the GPU path never raises.

Every launcher also runs on CPU tensors under TRITON_INTERPRET=1 (the tests do that).
"""
import torch
import triton
import triton.language as tl

from ..checks import check_medusa_topk
from .linear import dot_tile, launch_linear

# Candidates per tile are extracted one by one; beyond this the fallback below is used.
MAX_FUSED_TOP_K = 64


@triton.jit(do_not_specialize=["M", "top_k"])
def _lm_head_topk_kernel(
    x_ptr, w_ptr, part_val_ptr, part_id_ptr, part_max_ptr, part_sum_ptr,
    M, V, H, num_tiles, stride_wh, top_k,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (tile t, row block, head k): logits of rows k*M + m (x [K*M, H] fp32) for
    vocabulary ids t*BLOCK_V..; writes per row: tile max, sum of exp(logit - max), and the
    tile's top_k best (logit, id) pairs into part_* [K*M, num_tiles(, top_k)]. top_k is a
    runtime loop bound: one binary serves every top_k."""
    pid_t = tl.program_id(0)
    pid_m = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rv = pid_t * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = head * M + rm  # global row index in [K*M]
    acc = dot_tile(x_ptr + head * M * H, w_ptr + head * stride_wh, rm, rv, M, V, H, BLOCK_M, BLOCK_V, BLOCK_K)
    neg_inf = float("-inf")
    logits = tl.where(rv[None, :] < V, acc, neg_inf)
    row_ok = rm < M
    tile_max = tl.max(logits, axis=1)
    safe_max = tl.where(tile_max == neg_inf, 0.0, tile_max)
    tile_sum = tl.sum(tl.exp(logits - safe_max[:, None]), axis=1)
    part = rows * num_tiles + pid_t
    tl.store(part_max_ptr + part, tile_max, mask=row_ok)
    tl.store(part_sum_ptr + part, tile_sum, mask=row_ok)
    # Iterative extraction: the best remaining logit, the lowest id among equal ones.
    ids = rv[None, :] + tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.int32)
    for i in range(top_k):
        best = tl.max(logits, axis=1)
        best_id = tl.min(tl.where(logits == best[:, None], ids, V), axis=1)
        tl.store(part_val_ptr + part * top_k + i, best, mask=row_ok)
        tl.store(part_id_ptr + part * top_k + i, best_id, mask=row_ok)
        logits = tl.where(ids == best_id[:, None], neg_inf, logits)
        ids = tl.where(ids == best_id[:, None], V, ids)


@triton.jit(do_not_specialize=["M", "top_k"])
def _merge_kernel(
    part_val_ptr, part_id_ptr, part_max_ptr, part_sum_ptr, ids_ptr, logprobs_ptr,
    M, K, V, num_tiles, top_k,
    TOP_K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program r = k*M + m: log-sum-exp of the tiles' partials and the best top_k of the
    num_tiles*top_k candidates; writes ids [M, K, top_k] (int64) and log-probs. top_k is a
    runtime value; TOP_K_P2 >= top_k (a power of two) sizes the running list, so one binary
    serves every top_k up to it."""
    r = tl.program_id(0).to(tl.int64)
    k = r // M
    m = r % M
    neg_inf = float("-inf")
    # Log-sum-exp: global max, then the rescaled sums.
    rt = tl.arange(0, BLOCK_T)
    gmax = tl.full((BLOCK_T,), neg_inf, tl.float32)
    for t0 in range(0, num_tiles, BLOCK_T):
        gmax = tl.maximum(gmax, tl.load(part_max_ptr + r * num_tiles + t0 + rt, mask=t0 + rt < num_tiles, other=neg_inf))
    mx = tl.max(gmax, axis=0)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for t0 in range(0, num_tiles, BLOCK_T):
        pm = tl.load(part_max_ptr + r * num_tiles + t0 + rt, mask=t0 + rt < num_tiles, other=neg_inf)
        ps = tl.load(part_sum_ptr + r * num_tiles + t0 + rt, mask=t0 + rt < num_tiles, other=0.0)
        total += tl.where(pm == neg_inf, 0.0, ps * tl.exp(pm - mx))
    lse = mx + tl.log(tl.sum(total, axis=0))
    # Top-k: a running list (best first) merged with each chunk of candidates.
    rk = tl.arange(0, TOP_K_P2)
    run_val = tl.full((TOP_K_P2,), neg_inf, tl.float32)
    run_id = tl.full((TOP_K_P2,), V, tl.int32)
    rc = tl.arange(0, BLOCK_C)
    num_cand = num_tiles * top_k
    for c0 in range(0, num_cand, BLOCK_C):
        cmask = c0 + rc < num_cand
        c_val = tl.load(part_val_ptr + r * num_cand + c0 + rc, mask=cmask, other=neg_inf)
        c_id = tl.load(part_id_ptr + r * num_cand + c0 + rc, mask=cmask, other=V)
        old_val = run_val
        old_id = run_id
        new_val = tl.full((TOP_K_P2,), neg_inf, tl.float32)
        new_id = tl.full((TOP_K_P2,), V, tl.int32)
        for i in range(top_k):
            b1 = tl.max(old_val, axis=0)
            i1 = tl.min(tl.where(old_val == b1, old_id, V), axis=0)
            b2 = tl.max(c_val, axis=0)
            i2 = tl.min(tl.where(c_val == b2, c_id, V), axis=0)
            take_old = (b1 > b2) | ((b1 == b2) & (i1 < i2))
            bv = tl.where(take_old, b1, b2)
            bi = tl.where(take_old, i1, i2)
            new_val = tl.where(rk == i, bv, new_val)
            new_id = tl.where(rk == i, bi, new_id)
            # Ids are unique across both lists (except the sentinel V, only on -inf).
            hit_old = old_id == bi
            old_val = tl.where(hit_old, neg_inf, old_val)
            old_id = tl.where(hit_old, V, old_id)
            hit_c = c_id == bi
            c_val = tl.where(hit_c, neg_inf, c_val)
            c_id = tl.where(hit_c, V, c_id)
        run_val = new_val
        run_id = new_id
    out = (m * K + k) * top_k + rk
    kmask = rk < top_k
    tl.store(ids_ptr + out, tl.where(run_id < V, run_id, -1).to(tl.int64), mask=kmask)
    tl.store(logprobs_ptr + out, run_val - lse, mask=kmask)




def _head_states(hidden, res_weight, res_bias):
    """[K*M, H] fp32: each head's input to its LM head (ResBlocks applied)."""
    M, H = hidden.shape
    K, L = res_weight.shape[:2]
    xs = hidden.to(torch.float32).unsqueeze(0).expand(K, M, H).contiguous()
    if L > 0:
        ys = torch.empty_like(xs)
        for layer in range(L):
            launch_linear(
                xs, res_weight[:, layer], res_bias[:, layer], ys, heads=K,
                stride_xh=M * H, stride_wh=L * H * H, stride_bh=L * H, stride_oh=M * H, residual_silu=True,
            )
            xs, ys = ys, xs
    return xs.view(K * M, H)


def medusa_topk(hidden, res_weight, res_bias, lm_head, top_k: int, topk_ids, topk_logprobs, *,
                block_v: int = 128, block_t: int = 128, block_c: int = 512) -> None:
    """Launcher of specdec::medusa_topk (argument meaning: ops.medusa_topk). block_v: vocabulary
    tile; block_t, block_c: tiles / candidates per merge step (small values let the tests
    exercise multi-step merges on small vocabularies)."""
    check_medusa_topk(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs)  # as skinny_linear
    M, H = hidden.shape
    K = res_weight.shape[0]
    shared = lm_head.dim() == 2
    V = lm_head.shape[-2]
    if M == 0:
        return
    xs = _head_states(hidden, res_weight.contiguous(), res_bias.contiguous())
    lm_head = lm_head.contiguous()
    if top_k > MAX_FUSED_TOP_K:
        # Beyond 64 candidates per tile the extraction loop is too long: materialise the
        # logits (one launch per head) and sort stably (descending logit, lower id first).
        logits = torch.empty(K, M, V, dtype=torch.float32, device=hidden.device)
        for k in range(K):
            launch_linear(xs[k * M:(k + 1) * M], lm_head if shared else lm_head[k], None, logits[k])
        logprobs = torch.log_softmax(logits, dim=-1)
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :top_k]
        topk_ids.copy_(order.transpose(0, 1))
        topk_logprobs.copy_(torch.gather(logprobs, -1, order).transpose(0, 1))
        return
    BLOCK_M, BLOCK_V, BLOCK_K = 16, block_v, 32
    num_tiles = triton.cdiv(V, BLOCK_V)
    R = K * M
    dev = hidden.device
    part_val = torch.empty(R, num_tiles, top_k, dtype=torch.float32, device=dev)
    part_id = torch.empty(R, num_tiles, top_k, dtype=torch.int32, device=dev)
    part_max = torch.empty(R, num_tiles, dtype=torch.float32, device=dev)
    part_sum = torch.empty(R, num_tiles, dtype=torch.float32, device=dev)
    grid = (num_tiles, triton.cdiv(M, BLOCK_M), K)
    _lm_head_topk_kernel[grid](
        xs, lm_head, part_val, part_id, part_max, part_sum,
        M, V, H, num_tiles, 0 if shared else V * H, top_k,
        BLOCK_M=BLOCK_M, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K,
    )
    _merge_kernel[(R,)](
        part_val, part_id, part_max, part_sum, topk_ids, topk_logprobs,
        M, K, V, num_tiles, top_k,
        TOP_K_P2=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_C=block_c,
    )


torch.library.register_kernel("specdec::medusa_topk", "cuda", medusa_topk)
