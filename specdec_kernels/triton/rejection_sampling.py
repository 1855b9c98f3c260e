"""Triton kernels of specdec::chain_rejection_sample (and its flattened layout,
chain_rejection_sample_flat), tree_rejection_sample, apply_top_k_top_p.

Rejection sampling is four launches, parallel over requests and vocabulary tiles, with no
host synchronisation (so it can be captured in a CUDA graph):

1. ``_row_stats_kernel``, grid (B * N rows, vocabulary tiles): per tile the max of l / T,
   sum exp(l / T - tile max), the first argmax and a "bad" flag (NaN or +inf);
2. ``_walk_kernel``, grid (B,): combines the tile partials of the rows it visits and walks
   the tree (a chain is the tree parents = [-1, 0, 1, ...]): ``_greedy_walk`` follows the
   child holding the row's argmax, ``_sampled_walk`` runs the acceptance tests of each
   node's children (``_sampled_step``); acceptance tests read one logit and one q entry;
   an i.i.d. rejection that is not the last sibling costs one pass over the row for the
   residual's mass. It writes the accepted path and, for a sampled request, a "race spec"
   (row, max, coefficient of q, excluded tokens) for the last token;
3. ``_race_kernel``, grid (B, vocabulary tiles): the exponential race argmax w / (-log u)
   over each tile for the residual weights and, as a fallback for a residual without
   mass, for p;
4. ``_race_reduce_kernel``, grid (B,): the winner over tiles (ties to the lower index).

Out-of-range data never reads out of bounds: counts are clamped into range, a drafted
token outside [0, V) is rejected (p(x) = 0), a node whose parent is not an earlier node
is never visited. ``apply_top_k_top_p`` finds the k-th largest value and the top-p
threshold by bisection on the ordered bits of fp32 (``_bisect_keys``: 32 steps, one pass
over the row per step) instead of sorting. The launchers are registered for the CUDA key and also run on
CPU tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import (MIN_SAMPLING_TEMPERATURE, check_apply_top_k_top_p, check_chain_rejection_sample,
                      check_chain_rejection_sample_flat, check_has_data, check_tree_rejection_sample)
from .rng import PURPOSE_ACCEPT, PURPOSE_SAMPLE, philox_uniform

BLOCK_V = 1024
# Larger than every index: the "no index" of the min-reductions that pick the lowest index
# among equal values (int32 max, as indices are int32).
NO_INDEX = tl.constexpr(2147483647)
# Requests with T below this (and 0, negative, NaN) are greedy (2^-64 is exact in fp32).
MIN_T: tl.constexpr = tl.constexpr(MIN_SAMPLING_TEMPERATURE)


@triton.jit
def _row_stats_kernel(logits_ptr, row0_ptr, temp_ptr, rows_ptr, pmax_ptr, psum_ptr, parg_ptr, pbad_ptr, R, V, T,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (request, node) of the [B, R] partials
    tile = tl.program_id(1)
    b = row // R
    k = row % R
    num_rows = tl.load(rows_ptr + b)
    if k < num_rows:
        temp = tl.load(temp_ptr + b)
        scale = 1.0 / tl.where(temp >= MIN_T, temp, 1.0)
        idx = tile * BLOCK + tl.arange(0, BLOCK)
        mask = idx < V
        logits_row = tl.load(row0_ptr + b) + k
        # Lanes past V are -inf after the scaling (-inf * scale is NaN when T = +inf).
        x = tl.where(mask, tl.load(logits_ptr + logits_row * V + idx, mask=mask, other=0.0).to(tl.float32) * scale,
                     float("-inf"))
        bad = tl.max(((x != x) | (x == float("inf"))).to(tl.int32), axis=0)
        m = tl.max(x, axis=0)
        arg = tl.min(tl.where(x == m, idx, NO_INDEX), axis=0)
        s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), axis=0)
        tl.store(pmax_ptr + row * T + tile, m)
        tl.store(psum_ptr + row * T + tile, s)
        tl.store(parg_ptr + row * T + tile, arg)
        tl.store(pbad_ptr + row * T + tile, bad)


@triton.jit
def _residual_mass(logits_ptr, q_ptr, row_off, q_off, V, inv_t, m, coef, BLOCK: tl.constexpr):
    """sum_v max(exp(l_v inv_t - m) - coef q_v, 0) over one row."""
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        mask = idx < V
        x = tl.load(logits_ptr + row_off + idx, mask=mask, other=float("-inf")).to(tl.float32)
        qv = tl.load(q_ptr + q_off + idx, mask=mask, other=0.0)
        w = tl.maximum(tl.exp(x * inv_t - m) - coef * qv, 0.0)
        acc += tl.where(mask, w, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _row_max_and_sum(pmax_ptr, psum_ptr, base, tidx, tmask):
    """A row's max of l / T and sum of exp(l / T - max), from its tiles' partials at base."""
    pm = tl.load(pmax_ptr + base + tidx, mask=tmask, other=float("-inf"))
    ps = tl.load(psum_ptr + base + tidx, mask=tmask, other=0.0)
    m = tl.max(pm, axis=0)
    z = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - m), 0.0), axis=0)
    return m, z


@triton.jit
def _greedy_walk(b, walk, n, par, tok, nidx, pmax_ptr, parg_ptr, N, T, tidx, tmask, BLOCK_N: tl.constexpr):
    """Greedy request (when walk): follow the child whose token is the row's first argmax.
    Returns (path [BLOCK_N] of accepted nodes, -1 padded; their number; the final token)."""
    path = tl.full([BLOCK_N], -1, tl.int32)
    depth = 0
    node = 0
    final = -1
    done = (walk == 0).to(tl.int32)
    while done == 0:
        base = (b * N + node) * T
        pm = tl.load(pmax_ptr + base + tidx, mask=tmask, other=float("-inf"))
        pa = tl.load(parg_ptr + base + tidx, mask=tmask, other=NO_INDEX)
        m = tl.max(pm, axis=0)
        amax = tl.min(tl.where(pm == m, pa, NO_INDEX), axis=0)
        cond = (nidx > node) & (nidx < n) & (par == node) & (tok == amax)
        c = tl.min(tl.where(cond, nidx, BLOCK_N), axis=0)
        if c < BLOCK_N:
            path = tl.where(nidx == depth, c, path)
            depth += 1
            node = c
        else:
            final = amax.to(tl.int32)
            done = 1
    return path, depth, final


@triton.jit
def _sampled_step(row0, q_row0, node, n, par, tok, nidx, logits_ptr, q_ptr, seed, offset, inv_t, m, z, V,
                  HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The acceptance tests of node's children in order, against the residual left by the
    rejected ones. Returns (the accepted child or -1, the excluded tokens [BLOCK_N] (no q:
    the rejected ones, -1 padded), the residual's coefficient of q and mass, the number of
    rejected children)."""
    row_off = (row0 + node) * V
    q_off = (q_row0 + node) * V
    next_node = -1
    # Residual p' = w / mass: i.i.d. drafts w = max(e - coef q, 0), deterministic
    # drafts w = e with the rejected tokens (excl[:num_excl]) zeroed.
    coef = 0.0
    mass = z
    excl = tl.full([BLOCK_N], -1, tl.int64)
    num_excl = 0
    num_rejected = 0
    prev = node
    searching = 1
    while searching == 1:
        c = tl.min(tl.where((nidx > prev) & (nidx < n) & (par == node), nidx, BLOCK_N), axis=0)
        if c >= BLOCK_N:
            searching = 0
        else:
            x = tl.sum(tl.where(nidx == c, tok, 0), axis=0)
            in_range = (x >= 0) & (x < V)
            xs = tl.where(in_range, x, 0)
            e_x = tl.exp(tl.load(logits_ptr + row_off + xs).to(tl.float32) * inv_t - m)
            u = philox_uniform(seed, offset + c, PURPOSE_ACCEPT, c * 0)
            dup = tl.sum(((excl == x) & (nidx < num_excl)).to(tl.int32), axis=0) > 0
            if HAS_Q:
                q_x = tl.load(q_ptr + q_off + xs)
                w_x = tl.maximum(e_x - coef * q_x, 0.0)
            else:
                q_x = e_x * 0.0 + 1.0
                w_x = tl.where(dup, 0.0, e_x)
            w_x = tl.where(in_range, w_x, 0.0)
            p_x = w_x / mass
            if (p_x > 0.0) & ((q_x <= 0.0) | (u <= p_x / q_x)):
                next_node = c
                searching = 0
            else:
                num_rejected += 1
                if dup == 0:
                    excl = tl.where(nidx == num_excl, x, excl)
                    num_excl += 1
                has_next = tl.min(tl.where((nidx > c) & (nidx < n) & (par == node), nidx, BLOCK_N),
                                  axis=0) < BLOCK_N
                if has_next:
                    if HAS_Q:
                        coef = coef + mass
                        mass = _residual_mass(logits_ptr, q_ptr, row_off, q_off, V, inv_t, m, coef, BLOCK_V)
                        if mass <= 0.0:
                            coef = 0.0
                            mass = z
                    else:
                        mass = mass - w_x
                        if mass <= 0.0:
                            excl = tl.full([BLOCK_N], -1, tl.int64)
                            num_excl = 0
                            mass = z
                prev = c
    return next_node, excl, coef, mass, num_rejected


@triton.jit
def _sampled_walk(b, row0, q_row0, walk, n, par, tok, nidx, logits_ptr, q_ptr, pmax_ptr, psum_ptr, seed, offset,
                  inv_t, N, V, T, tidx, tmask,
                  HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sampled request (when walk): accept children by rejection sampling until a node
    accepts none. Returns (path, its length, the excluded tokens and the race spec: node,
    max, coefficient of q, from which the last token is drawn)."""
    path = tl.full([BLOCK_N], -1, tl.int32)
    excl = tl.full([BLOCK_N], -1, tl.int64)
    depth = 0
    node = 0
    spec_node = b * 0 - 1
    spec_max = 0.0
    spec_coef = 0.0
    done = (walk == 0).to(tl.int32)
    while done == 0:
        m, z = _row_max_and_sum(pmax_ptr, psum_ptr, (b * N + node) * T, tidx, tmask)
        next_node, excl, coef, mass, num_rejected = _sampled_step(
            row0, q_row0, node, n, par, tok, nidx, logits_ptr, q_ptr, seed, offset, inv_t, m, z, V,
            HAS_Q, BLOCK_N, BLOCK_V)
        if next_node >= 0:
            path = tl.where(nidx == depth, next_node, path)
            depth += 1
            node = next_node
        else:
            spec_node = node + b * 0
            spec_max = m
            if HAS_Q:
                spec_coef = tl.where(num_rejected > 0, coef + mass, 0.0)
            done = 1
    return path, depth, excl, spec_node, spec_max, spec_coef


@triton.jit
def _walk_kernel(parents_ptr, tokens_ptr, num_nodes_ptr, logits_ptr, q_ptr, row0_ptr, q_row0_ptr, temp_ptr, seed_ptr,
                 offset_ptr, pmax_ptr, psum_ptr, parg_ptr, pbad_ptr,
                 path_ptr, num_acc_ptr, final_ptr,
                 spec_node_ptr, spec_max_ptr, spec_coef_ptr, excl_ptr,
                 N, V, T,
                 HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row0 = tl.load(row0_ptr + b)
    q_row0 = tl.load(q_row0_ptr + b)
    nidx = tl.arange(0, BLOCK_N)
    tidx = tl.arange(0, BLOCK_T)
    tmask = tidx < T
    n = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b), 0), N)
    par = tl.load(parents_ptr + b * N + nidx, mask=nidx < n, other=-2)
    tok = tl.load(tokens_ptr + b * N + nidx, mask=nidx < n, other=-1)
    temp = tl.load(temp_ptr + b)
    sampled = temp >= MIN_T
    inv_t = 1.0 / tl.where(sampled, temp, 1.0)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)

    # The request is invalid when any of its rows holds NaN / +inf or is entirely -inf.
    bad = n * 0
    for r in range(0, n):
        base = (b * N + r) * T
        pb = tl.load(pbad_ptr + base + tidx, mask=tmask, other=0)
        pm = tl.load(pmax_ptr + base + tidx, mask=tmask, other=float("-inf"))
        bad = tl.maximum(bad, tl.max(pb, axis=0))
        bad = tl.maximum(bad, (tl.max(pm, axis=0) == float("-inf")).to(tl.int32))

    # One of the two walks runs (the other returns its initial values at once).
    walk = (bad == 0) & (n > 0)
    g_path, g_depth, final = _greedy_walk(b, walk & (sampled == 0), n, par, tok, nidx, pmax_ptr, parg_ptr, N, T,
                                          tidx, tmask, BLOCK_N)
    s_path, s_depth, excl, spec_node, spec_max, spec_coef = _sampled_walk(
        b, row0, q_row0, walk & sampled, n, par, tok, nidx, logits_ptr, q_ptr, pmax_ptr, psum_ptr, seed, offset,
        inv_t, N, V, T, tidx, tmask, HAS_Q, BLOCK_N, BLOCK_V)
    path = tl.where(sampled, s_path, g_path)
    depth = tl.where(sampled, s_depth, g_depth)

    tl.store(path_ptr + b * N + nidx, path, mask=nidx < N)
    tl.store(num_acc_ptr + b, tl.where(bad != 0, -1, depth))
    tl.store(final_ptr + b, final)
    tl.store(spec_node_ptr + b, spec_node)
    tl.store(spec_max_ptr + b, spec_max)
    tl.store(spec_coef_ptr + b, spec_coef)
    tl.store(excl_ptr + b * N + nidx, tl.where(nidx < N, excl, -1), mask=nidx < N)


@triton.jit
def _race_kernel(logits_ptr, q_ptr, row0_ptr, q_row0_ptr, temp_ptr, seed_ptr, offset_ptr, spec_node_ptr, spec_max_ptr,
                 spec_coef_ptr, excl_ptr, pscore_ptr, pidx_ptr, fscore_ptr, fidx_ptr, N, V, T,
                 HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    node = tl.load(spec_node_ptr + b)
    best_score = -1.0
    best_idx = -1
    fb_score = -1.0
    fb_idx = -1
    if node >= 0:
        temp = tl.load(temp_ptr + b)
        inv_t = 1.0 / temp
        m = tl.load(spec_max_ptr + b)
        idx = tile * BLOCK + tl.arange(0, BLOCK)
        mask = idx < V
        x = tl.load(logits_ptr + (tl.load(row0_ptr + b) + node) * V + idx, mask=mask,
                    other=float("-inf")).to(tl.float32)
        e = tl.where(mask, tl.exp(x * inv_t - m), 0.0)
        w = e
        if HAS_Q:
            # coef is 0 unless a draft of this node was rejected, and only then is q read: the
            # chain's bonus row (node K) has no q row, reading it would leave the tensor.
            coef = tl.load(spec_coef_ptr + b)
            q_mask = mask & (tl.zeros([BLOCK], tl.float32) + coef > 0.0)
            qv = tl.load(q_ptr + (tl.load(q_row0_ptr + b) + node) * V + idx, mask=q_mask, other=0.0)
            w = tl.maximum(e - coef * qv, 0.0)
        else:
            for j in range(0, N):
                t = tl.load(excl_ptr + b * N + j)
                w = tl.where(idx == t, 0.0, w)
        seed = tl.load(seed_ptr + b)
        offset = tl.load(offset_ptr + b)
        u = philox_uniform(seed, offset + node, PURPOSE_SAMPLE, idx)
        # 0 - log(u): u = 1 gives +0 and a positive weight wins with +inf.
        ex = 0.0 - tl.log(u)
        score = tl.where(w > 0.0, w / ex, -1.0)
        fscore = tl.where(e > 0.0, e / ex, -1.0)
        best_score = tl.max(score, axis=0)
        best_idx = tl.min(tl.where(score == best_score, idx, NO_INDEX), axis=0)
        best_idx = tl.where(best_score > -1.0, best_idx, -1)
        fb_score = tl.max(fscore, axis=0)
        fb_idx = tl.min(tl.where(fscore == fb_score, idx, NO_INDEX), axis=0)
        fb_idx = tl.where(fb_score > -1.0, fb_idx, -1)
    tl.store(pscore_ptr + b * T + tile, best_score)
    tl.store(pidx_ptr + b * T + tile, best_idx)
    tl.store(fscore_ptr + b * T + tile, fb_score)
    tl.store(fidx_ptr + b * T + tile, fb_idx)


@triton.jit
def _race_reduce_kernel(spec_node_ptr, pscore_ptr, pidx_ptr, fscore_ptr, fidx_ptr, final_ptr, T,
                        BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if tl.load(spec_node_ptr + b) >= 0:
        tidx = tl.arange(0, BLOCK_T)
        tmask = tidx < T
        s = tl.load(pscore_ptr + b * T + tidx, mask=tmask, other=-1.0)
        i = tl.load(pidx_ptr + b * T + tidx, mask=tmask, other=-1)
        fs = tl.load(fscore_ptr + b * T + tidx, mask=tmask, other=-1.0)
        fi = tl.load(fidx_ptr + b * T + tidx, mask=tmask, other=-1)
        best = tl.max(s, axis=0)
        winner = tl.min(tl.where((s == best) & (i >= 0), i, NO_INDEX), axis=0)
        fbest = tl.max(fs, axis=0)
        fwinner = tl.min(tl.where((fs == fbest) & (fi >= 0), fi, NO_INDEX), axis=0)
        # Residual without mass (only through rounding): draw from p instead.
        tl.store(final_ptr + b, tl.where(best > -1.0, winner, fwinner))


def _sample_tree(parents, tokens, num_nodes, logits, draft_probs, temperature, seed, offset, row0, q_row0):
    """Runs the four kernels; returns (path int32 [B, N], num_accepted int32 [B], final int32 [B]).

    ``row0`` / ``q_row0``: int64 [B], the row of node 0 of each request in ``logits`` /
    ``draft_probs`` viewed as [rows, V] (b * N for the padded layouts; where the request
    starts in the flattened one)."""
    batch, n_max = parents.shape
    vocab = logits.shape[-1]
    device = logits.device
    logits = logits.contiguous()
    # The kernels index every tensor as contiguous (a strided temperature read the wrong
    # requests' values; found by fuzzing).
    temperature, seed, offset = temperature.contiguous(), seed.contiguous(), offset.contiguous()
    tiles = triton.cdiv(vocab, BLOCK_V)
    rows = batch * n_max
    pmax = torch.empty(rows, tiles, dtype=torch.float32, device=device)
    psum = torch.empty_like(pmax)
    parg = torch.empty(rows, tiles, dtype=torch.int32, device=device)
    pbad = torch.empty_like(parg)
    num_rows = num_nodes.clamp(0, n_max).to(torch.int32)
    # enable_fp_fusion=False on every launch here: the C++ kernels and python_ref round each
    # product before it is added (no contraction). Fused, x * (1 / T) - m keeps the rounding
    # residue of x * (1 / T), ~1e30 for logits near 1e38, and exp of it overflows: on an H200 a
    # row at T = 2.5 sampled no token at all (its interpreter run, unfused, was right).
    if rows > 0:
        _row_stats_kernel[(rows, tiles)](logits, row0, temperature, num_rows, pmax, psum, parg, pbad, n_max, vocab,
                                         tiles, BLOCK=BLOCK_V, enable_fp_fusion=False)
    path = torch.empty(batch, n_max, dtype=torch.int32, device=device)
    num_acc = torch.empty(batch, dtype=torch.int32, device=device)
    final = torch.empty(batch, dtype=torch.int32, device=device)
    spec_node = torch.empty(batch, dtype=torch.int64, device=device)
    spec_max = torch.empty(batch, dtype=torch.float32, device=device)
    spec_coef = torch.empty(batch, dtype=torch.float32, device=device)
    excl = torch.empty(batch, n_max, dtype=torch.int64, device=device)
    has_q = draft_probs is not None
    q = draft_probs.contiguous() if has_q else pmax  # any valid pointer when unused
    block_n = max(2, triton.next_power_of_2(n_max))
    block_t = max(2, triton.next_power_of_2(tiles))
    if batch > 0:
        _walk_kernel[(batch,)](parents.contiguous(), tokens.contiguous(), num_nodes.contiguous(), logits, q, row0,
                               q_row0, temperature, seed, offset, pmax, psum, parg, pbad, path, num_acc, final,
                               spec_node, spec_max, spec_coef, excl, n_max, vocab, tiles, HAS_Q=has_q,
                               BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_V=BLOCK_V, enable_fp_fusion=False)
        pscore = torch.empty(batch, tiles, dtype=torch.float32, device=device)
        pidx = torch.empty(batch, tiles, dtype=torch.int32, device=device)
        fscore = torch.empty_like(pscore)
        fidx = torch.empty_like(pidx)
        _race_kernel[(batch, tiles)](logits, q, row0, q_row0, temperature, seed, offset, spec_node, spec_max, spec_coef,
                                     excl, pscore, pidx, fscore, fidx, n_max, vocab, tiles, HAS_Q=has_q,
                                     BLOCK=BLOCK_V, enable_fp_fusion=False)
        _race_reduce_kernel[(batch,)](spec_node, pscore, pidx, fscore, fidx, final, tiles, BLOCK_T=block_t,
                                      enable_fp_fusion=False)
    return path, num_acc, final


def _write_outputs(path, num_acc, final, node_tokens, output_token_ids, accepted_nodes=None):
    """Accepted tokens, then the final token, -1 padded (torch ops on device, no sync)."""
    batch, width = output_token_ids.shape
    pos = torch.arange(width, device=path.device).unsqueeze(0)
    n_acc = num_acc.to(torch.int64).unsqueeze(1)
    path_w = path[:, :width]
    if path_w.shape[1] < width:
        path_w = torch.cat([path_w, path.new_full((batch, width - path_w.shape[1]), -1)], dim=1)
    path_tok = torch.gather(node_tokens, 1, path_w.clamp(min=0).to(torch.int64))
    out = torch.where(pos < n_acc, path_tok, torch.full_like(path_tok, -1))
    out = torch.where(pos == n_acc, final.to(torch.int64).unsqueeze(1).expand_as(out), out)
    output_token_ids.copy_(out)
    if accepted_nodes is not None:
        cols = accepted_nodes.shape[1]
        an = torch.where(pos[:, :cols] < n_acc, path[:, :cols], torch.full_like(path[:, :cols], -1))
        accepted_nodes.copy_(an)


def chain_rejection_sample(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
                           output_token_ids, num_accepted):
    """Triton launcher of ``specdec::chain_rejection_sample`` (the chain as the tree [-1, 0, 1, ...])."""
    # The op's check runs here (specdec_kernels.checks): torch.ops on CUDA reaches this launcher directly.
    check_chain_rejection_sample(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed,
                                 offset, output_token_ids, num_accepted)
    batch, max_drafts = draft_token_ids.shape
    device = draft_token_ids.device
    parents = torch.arange(-1, max_drafts, dtype=torch.int32, device=device).unsqueeze(0).expand(batch, -1)
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=device), draft_token_ids], dim=1)
    num_nodes = (num_draft_tokens.clamp(0, max_drafts) + 1).to(torch.int32)
    rows = torch.arange(batch, dtype=torch.int64, device=device)
    path, num_acc, final = _sample_tree(parents, tokens, num_nodes, target_logits, draft_probs, temperature, seed,
                                        offset, rows * (max_drafts + 1), rows * max_drafts)
    _write_outputs(path, num_acc, final, tokens, output_token_ids)
    num_accepted.copy_(num_acc)


def chain_rejection_sample_flat(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature, seed,
                                offset, output_token_ids, num_accepted):
    """Triton launcher of ``specdec::chain_rejection_sample_flat``: the chain kernels with each
    request's rows where the flattened layout puts them (only [B, K+1] index tensors are
    built, the logits are not copied)."""
    check_chain_rejection_sample_flat(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature,
                                      seed, offset, output_token_ids, num_accepted)
    batch, width = output_token_ids.shape
    max_drafts = width - 1
    num_tokens = draft_token_ids.shape[0]
    device = draft_token_ids.device
    # Each request's range, clamped into [0, T] and to at most K drafts (no host sync).
    cu = cu_num_draft_tokens.to(torch.int64).clamp(0, num_tokens)
    start = torch.cat([cu.new_zeros(1), cu[:-1]]) if batch > 0 else cu
    count = (cu - start).clamp(0, max_drafts)
    parents = torch.arange(-1, max_drafts, dtype=torch.int32, device=device).unsqueeze(0).expand(batch, -1)
    tokens = torch.zeros(batch, width, dtype=torch.int64, device=device)
    if num_tokens > 0 and max_drafts > 0:
        k = torch.arange(max_drafts, device=device)
        index = (start.unsqueeze(1) + k).clamp(max=num_tokens - 1)
        drafts = draft_token_ids[index]
        # A negative id is padding: the request's drafts end at the first one.
        count = ((k < count.unsqueeze(1)) & (drafts >= 0)).to(torch.int64).cumprod(1).sum(1)
        tokens[:, 1:] = torch.where(k < count.unsqueeze(1), drafts, 0)
    rows = torch.arange(batch, dtype=torch.int64, device=device)
    path, num_acc, final = _sample_tree(parents, tokens, (count + 1).to(torch.int32), target_logits, draft_probs,
                                        temperature, seed, offset, start + rows, start)
    _write_outputs(path, num_acc, final, tokens, output_token_ids)
    num_accepted.copy_(num_acc)


def tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset,
                          accepted_nodes, output_token_ids, num_accepted):
    """Triton launcher of ``specdec::tree_rejection_sample`` (arguments checked as for chains)."""
    check_tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed,
                                offset, accepted_nodes, output_token_ids, num_accepted)
    batch, n_max = parents.shape
    rows = torch.arange(batch, dtype=torch.int64, device=parents.device) * n_max
    path, num_acc, final = _sample_tree(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature,
                                        seed, offset, rows, rows)
    _write_outputs(path, num_acc, final, tree_token_ids, output_token_ids, accepted_nodes)
    num_accepted.copy_(num_acc)


# ---------------------------------------------------------------------------------------
# apply_top_k_top_p.
# ---------------------------------------------------------------------------------------


# The bits of an fp32 read as int32 order non-negative floats; flipping the magnitude bits
# of the negative ones orders all of them (the "key" of a float).
MAGNITUDE_BITS = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _key_to_float(key):
    """Inverse of the order-preserving map float bits -> int (keys as int64 in int32 range)."""
    k32 = key.to(tl.int32)
    bits = tl.where(k32 >= 0, k32, k32 ^ MAGNITUDE_BITS)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _float_to_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ MAGNITUDE_BITS).to(tl.int64)


@triton.jit
def _bisect_keys(base, V, lo, hi, bound, threshold, m, TOP_P: tl.constexpr, BLOCK: tl.constexpr):
    """Bisection over the float keys in (lo, hi), one pass over the row base[0..V) per step,
    on a statistic S(t) of the row that does not increase with t: top-k (not TOP_P), the
    count of entries >= t; top-p, the mass sum exp(x - m) of the entries x > t that are
    >= threshold. Returns (lo, hi = lo + 1) with S(key lo) >= bound > S(key hi), given
    that this holds for the lo and hi passed in."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        t = _key_to_float(mid)
        if TOP_P:
            acc = tl.zeros([BLOCK], tl.float32)
        else:
            acc = tl.zeros([BLOCK], tl.int32)
        for v0 in range(0, V, BLOCK):
            idx = v0 + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            if TOP_P:
                acc += tl.where((x > t) & (x >= threshold), tl.exp(x - m), 0.0)
            else:
                acc += ((x >= t) & (idx < V)).to(tl.int32)
        if tl.sum(acc, axis=0) < bound:
            hi = mid
        else:
            lo = mid
    return lo, hi


@triton.jit
def _top_k_top_p_kernel(logits_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = logits_ptr + r * V
    k = tl.load(top_k_ptr + r)
    p = tl.load(top_p_ptr + r)
    mp_raw = tl.load(min_p_ptr + r)
    mp = tl.minimum(mp_raw, 1.0)
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    use_mp = mp_raw > 0.0  # a NaN min_p is off, as in the reference (a minimum with NaN may be either side)
    if use_k | use_p | use_mp:
        # Row max and NaN check.
        mvec = tl.full([BLOCK], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK], tl.int32)
        for v0 in range(0, V, BLOCK):
            idx = v0 + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            nan = tl.maximum(nan, (x != x).to(tl.int32))
            mvec = tl.maximum(mvec, tl.where(x != x, float("-inf"), x))
        m = tl.max(mvec, axis=0)
        has_nan = tl.max(nan, axis=0) > 0
        if (has_nan == 0) & (m > float("-inf")):
            threshold = tl.zeros_like(m) - float("inf")
            if use_k:
                # Largest key x with count(l >= x) >= k: the k-th largest value.
                lo, hi = _bisect_keys(base, V, _float_to_key(threshold), _float_to_key(m) + 1, k, threshold, m,
                                      False, BLOCK)
                threshold = _key_to_float(lo)
            if use_p:
                zvec = tl.zeros([BLOCK], tl.float32)
                for v0 in range(0, V, BLOCK):
                    idx = v0 + tl.arange(0, BLOCK)
                    x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                    zvec += tl.where(x >= threshold, tl.exp(x - m), 0.0)
                target = p * tl.sum(zvec, axis=0)
                # Smallest key x with S(x) = mass of survivors strictly above x < target;
                # the largest value is always kept.
                lo, hi = _bisect_keys(base, V, _float_to_key(threshold) - 1, _float_to_key(m), target, threshold, m,
                                      True, BLOCK)
                threshold = tl.maximum(threshold, _key_to_float(hi))
            for v0 in range(0, V, BLOCK):
                idx = v0 + tl.arange(0, BLOCK)
                mask = idx < V
                x_raw = tl.load(base + idx, mask=mask, other=0.0)
                x = x_raw.to(tl.float32)
                drop = x < threshold
                if use_mp:  # kept iff exp(x - m) >= mp: NaN (x = m = +inf) is not kept, as in the reference
                    drop = drop | ((tl.exp(x - m) >= mp) == 0)
                tl.store(base + idx, tl.where(drop, float("-inf"), x).to(x_raw.dtype), mask=mask & drop)


def apply_top_k_top_p(logits, top_k, top_p, min_p):
    """Triton launcher of ``specdec::apply_top_k_top_p`` (in place on logits [R, V])."""
    # The op's check (the kernel indexes row r at r * V and reads one parameter per row);
    # a meta tensor (no data) would fail inside Triton with a message naming no argument.
    check_apply_top_k_top_p(logits, top_k, top_p, min_p)
    check_has_data(logits, "logits")
    rows, vocab = logits.shape
    if rows == 0:
        return
    device = logits.device
    # Absent parameters are "off" rows (no host sync, just small device tensors).
    if top_k is None:
        top_k = torch.zeros(rows, dtype=torch.int32, device=device)
    if top_p is None:
        top_p = torch.ones(rows, dtype=torch.float32, device=device)
    if min_p is None:
        min_p = torch.zeros(rows, dtype=torch.float32, device=device)
    _top_k_top_p_kernel[(rows,)](logits, top_k.contiguous(), top_p.contiguous(), min_p.contiguous(), vocab,
                                 BLOCK=BLOCK_V, enable_fp_fusion=False)


torch.library.register_kernel("specdec::chain_rejection_sample", "cuda", chain_rejection_sample)
torch.library.register_kernel("specdec::chain_rejection_sample_flat", "cuda", chain_rejection_sample_flat)
torch.library.register_kernel("specdec::tree_rejection_sample", "cuda", tree_rejection_sample)
torch.library.register_kernel("specdec::apply_top_k_top_p", "cuda", apply_top_k_top_p)
