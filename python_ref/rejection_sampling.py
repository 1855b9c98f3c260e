"""Pure-Python reference of rejection sampling (chain and tree) and of top-k/top-p/min-p.

Readable loops over requests, positions and vocabulary entries, in float64, following
docs/design.md literally (p' is an explicit list that is renormalised after every rejection).
Random numbers come from ``specdec_kernels.rng`` with the layout documented there:

- acceptance draw of chain draft k / tree node c: position k + 1 / c, PURPOSE_ACCEPT, index 0;
- the recovered or bonus token drawn at chain row k / tree node i: position k / i,
  PURPOSE_SAMPLE, index v for vocabulary entry v, through the exponential race
  ``sample_from_weights``.

A row is *invalid* (the request gets num_accepted = -1 and all -1 outputs) when any of the
request's rows in use (chain rows 0..n, tree nodes 0..num_nodes-1) holds a NaN or +inf,
or is entirely -inf: the raw logits of a greedy request, l / T as the kernels compute it
(in fp32, l times the fp32 reciprocal of T) of a sampled one, so that l / T overflowing
fp32 (e.g. l = 3e38 at T = 0.5) or a -inf logit at T = +inf (NaN) also make it invalid.
A temperature below ``MIN_SAMPLING_TEMPERATURE`` (2^-64; 0, negative and NaN ones too)
means greedy. Tests only: never imported by the package.
"""
from __future__ import annotations

import math

import torch

from specdec_kernels.ops import MIN_SAMPLING_TEMPERATURE
from specdec_kernels.rng import PURPOSE_ACCEPT, PURPOSE_SAMPLE, philox_uniform, sample_from_weights


def scaled_row(row: list[float], temperature: float) -> list[float]:
    """l / T as the kernels compute it: in fp32, l times the fp32 reciprocal of T."""
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    return (torch.tensor(row, dtype=torch.float32) * inv_t).tolist()


def is_sampled(temperature: float) -> bool:
    """T >= 2^-64 samples; smaller (0, negative, NaN) is greedy, the limit as T -> 0."""
    return temperature >= MIN_SAMPLING_TEMPERATURE


def row_is_valid(row: list[float], temperature: float) -> bool:
    """No NaN, no +inf, not all -inf: in the raw row when greedy, in l / T when sampled."""
    values = scaled_row(row, temperature) if is_sampled(temperature) else row
    if any(math.isnan(x) or x == math.inf for x in values):
        return False
    return max(values) > -math.inf


def argmax_first(row: list[float]) -> int:
    best = 0
    for i, x in enumerate(row):
        if x > row[best]:
            best = i
    return best


def softmax(row: list[float], temperature: float) -> list[float]:
    scaled = [x / temperature for x in row]
    m = max(scaled)
    e = [math.exp(x - m) for x in scaled]
    z = sum(e)
    return [x / z for x in e]


def race(weights: list[float], seed: int, offset: int, position: int) -> int:
    """Exponential race over ``weights`` with the uniforms of (position, PURPOSE_SAMPLE)."""
    # Uniforms are only needed where the weight is positive (zero weights never win).
    uniforms = [philox_uniform(seed, offset, position, PURPOSE_SAMPLE, v) if w > 0 else 1.0 for v, w in enumerate(weights)]
    return sample_from_weights(weights, uniforms)


def accept_draw(seed: int, offset: int, position: int) -> float:
    return philox_uniform(seed, offset, position, PURPOSE_ACCEPT, 0)


def accepts(u: float, p_x: float, q_x: float) -> bool:
    """Accept iff u <= p(x) / q(x); p(x) = 0 is never accepted, q(x) = 0 < p(x) always is."""
    if p_x <= 0.0:
        return False
    return q_x <= 0.0 or u <= p_x / q_x


def _rows(logits: torch.Tensor, count: int) -> list[list[float]]:
    return [logits[i].float().tolist() for i in range(count)]


def chain_rejection_sample(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed, offset):
    """Returns (output_token_ids int64 [B, K+1], num_accepted int32 [B]); see docs/design.md."""
    batch, max_drafts = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    out = torch.full((batch, max_drafts + 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        n = int(num_draft_tokens[b])
        drafts = [int(x) for x in draft_token_ids[b, :n]]
        if any(not 0 <= x < vocab for x in drafts):
            raise ValueError(f"draft_token_ids[{b}] holds an id outside [0, {vocab}): {drafts}")
        rows = _rows(target_logits[b], n + 1)
        t, s, o = float(temperature[b]), int(seed[b]), int(offset[b])
        if not all(row_is_valid(r, t) for r in rows):
            num_accepted[b] = -1
            continue
        emitted = []
        if not is_sampled(t):  # greedy
            for k in range(n + 1):
                best = argmax_first(rows[k])
                emitted.append(best)
                if k == n or drafts[k] != best:
                    break
        else:
            for k in range(n + 1):
                p = softmax(rows[k], t)
                if k == n:  # every draft accepted: the bonus token
                    emitted.append(race(p, s, o, k))
                    break
                x = drafts[k]
                if draft_probs is not None:
                    q = draft_probs[b, k].double().tolist()
                else:
                    q = [0.0] * vocab
                    q[x] = 1.0
                if accepts(accept_draw(s, o, k + 1), p[x], q[x]):
                    emitted.append(x)
                    continue
                residual = [max(pv - qv, 0.0) for pv, qv in zip(p, q)]
                if sum(residual) <= 0.0:
                    residual = p
                emitted.append(race(residual, s, o, k))
                break
        num_accepted[b] = len(emitted) - 1
        out[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
    return out, num_accepted


def chain_rejection_sample_flat(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature, seed,
                                offset, max_num_draft_tokens):
    """The flattened ragged layout of engines (vLLM): request b owns drafts
    start_b .. start_b + n_b - 1 of ``draft_token_ids`` [T] and of ``draft_probs`` [T, V]
    (start_b = cu[b-1], 0 for b = 0, n_b = cu[b] - start_b) and logits rows start_b + b ..
    start_b + b + n_b of ``target_logits`` [T + B, V] (its drafts' rows, then its bonus row).

    A negative draft id is padding (engines pad some requests' drafts with -1): the request's
    drafts end at the first one. Defined as ``chain_rejection_sample`` on the same requests
    padded to K = ``max_num_draft_tokens`` drafts: same tokens, same randomness. Returns
    (output_token_ids int64 [B, K+1], num_accepted int32 [B])."""
    batch = cu_num_draft_tokens.shape[0]
    vocab = target_logits.shape[-1]
    k_max = max_num_draft_tokens
    cu = [0] + [int(c) for c in cu_num_draft_tokens]
    if cu[-1] != draft_token_ids.shape[0] or target_logits.shape[0] != cu[-1] + batch:
        raise ValueError(f"cu_num_draft_tokens {cu[1:]} does not describe {draft_token_ids.shape[0]} drafts and "
                         f"{target_logits.shape[0]} logits rows")
    drafts = torch.zeros(batch, k_max, dtype=torch.int64)
    num_drafts = torch.zeros(batch, dtype=torch.int32)
    logits = torch.zeros(batch, k_max + 1, vocab, dtype=target_logits.dtype)
    q = None if draft_probs is None else torch.zeros(batch, k_max, vocab, dtype=torch.float32)
    for b in range(batch):
        start, n = cu[b], cu[b + 1] - cu[b]
        if not 0 <= n <= k_max:
            raise ValueError(f"request {b} has {n} drafts, outside [0, {k_max}]")
        n = next((k for k in range(n) if int(draft_token_ids[start + k]) < 0), n)  # padding ends the drafts
        num_drafts[b] = n
        for k in range(n):
            drafts[b, k] = draft_token_ids[start + k]
            if q is not None:
                q[b, k] = draft_probs[start + k]
        for k in range(n + 1):
            logits[b, k] = target_logits[start + b + k]
    return chain_rejection_sample(drafts, num_drafts, logits, q, temperature, seed, offset)


def tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset):
    """Returns (accepted_nodes int32 [B, N-1], output_token_ids int64 [B, N], num_accepted int32 [B])."""
    batch, n_max = parents.shape
    vocab = target_logits.shape[-1]
    accepted_nodes = torch.full((batch, max(n_max - 1, 0)), -1, dtype=torch.int32)
    out = torch.full((batch, n_max), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        n = int(num_nodes[b])
        if n == 0:
            continue
        par = [int(x) for x in parents[b, :n]]
        tokens = [int(x) for x in tree_token_ids[b, :n]]
        if par[0] != -1 or any(not 0 <= par[i] < i for i in range(1, n)):
            raise ValueError(f"parents[{b}] is not a tree in topological order: {par}")
        if any(not 0 <= tokens[i] < vocab for i in range(1, n)):
            raise ValueError(f"tree_token_ids[{b}] holds an id outside [0, {vocab}): {tokens}")
        rows = _rows(target_logits[b], n)
        t, s, o = float(temperature[b]), int(seed[b]), int(offset[b])
        if not all(row_is_valid(r, t) for r in rows):
            num_accepted[b] = -1
            continue
        path, node = [], 0
        while True:
            children = [j for j in range(1, n) if par[j] == node]
            if not is_sampled(t):
                best = argmax_first(rows[node])
                nxt = next((c for c in children if tokens[c] == best), None)
                if nxt is None:
                    final = best
                    break
                path.append(nxt)
                node = nxt
                continue
            p = softmax(rows[node], t)
            residual = list(p)
            nxt = None
            for c in children:
                x = tokens[c]
                u = accept_draw(s, o, c)
                if draft_probs is not None:
                    q = draft_probs[b, node].double().tolist()
                    if accepts(u, residual[x], q[x]):
                        nxt = c
                        break
                    new = [max(rv - qv, 0.0) for rv, qv in zip(residual, q)]
                else:
                    if accepts(u, residual[x], 1.0):
                        nxt = c
                        break
                    new = list(residual)
                    new[x] = 0.0
                mass = sum(new)
                # No mass left (only reachable through rounding): fall back to the row's p.
                residual = [v / mass for v in new] if mass > 0.0 else list(p)
            if nxt is None:
                final = race(residual, s, o, node)
                break
            path.append(nxt)
            node = nxt
        num_accepted[b] = len(path)
        for i, c in enumerate(path):
            accepted_nodes[b, i] = c
            out[b, i] = tokens[c]
        out[b, len(path)] = final
    return accepted_nodes, out, num_accepted


def apply_top_k_top_p(logits, top_k=None, top_p=None, min_p=None):
    """Returns a masked copy of ``logits`` [R, V] (the op works in place).

    Per row r, on the values l = logits[r] (as float, temperature 1), in this order:
    - top-k (k = top_k[r], off when k <= 0 or k >= V): keep l_v >= the k-th largest value
      (ties at the k-th value are all kept);
    - top-p (P = top_p[r], off when P >= 1): with p = softmax over the top-k survivors, keep
      v iff the mass of survivors with a strictly larger value is < P (the largest value is
      always kept, ties at the threshold are all kept);
    - min-p (off when min_p[r] <= 0): keep v iff exp(l_v - max l) >= min(min_p[r], 1).
    Everything else becomes -inf. Rows holding a NaN are left unchanged.
    """
    out = logits.clone()
    rows, vocab = logits.shape
    for r in range(rows):
        row = logits[r].float().tolist()
        if any(math.isnan(x) for x in row):
            continue
        m = max(row)
        keep = [True] * vocab
        k = int(top_k[r]) if top_k is not None else 0
        if 0 < k < vocab:
            kth = sorted(row, reverse=True)[k - 1]
            keep = [x >= kth for x in row]
        p_top = float(top_p[r]) if top_p is not None else 1.0
        if p_top < 1.0 and m > -math.inf:
            kept = sorted((x for x, kp in zip(row, keep) if kp), reverse=True)
            e = [math.exp(x - m) for x in kept]
            z = sum(e)
            threshold, above, i = m, 0.0, 0
            while i < len(kept):
                j = i
                group_mass = 0.0
                while j < len(kept) and kept[j] == kept[i]:
                    group_mass += e[j]
                    j += 1
                if i > 0 and not above / z < p_top:
                    break
                threshold = kept[i]
                above += group_mass
                i = j
            keep = [kp and x >= threshold for x, kp in zip(row, keep)]
        mp = float(min_p[r]) if min_p is not None else 0.0
        if mp > 0.0 and m > -math.inf:
            mp = min(mp, 1.0)
            keep = [kp and math.exp(x - m) >= mp for x, kp in zip(row, keep)]
        for v in range(vocab):
            if not keep[v]:
                out[r, v] = -math.inf
    return out
