"""The ops the model and decode loop call, with plain-torch stand-ins.

Each function calls the ``specdec`` op (through ``specdec_kernels.ops``) when a kernel for the
tensor's device is registered, and otherwise a short torch implementation with the same
semantics, so that the model runs on a build without that area's kernel. ``USING`` records
which path each op took (the benchmark prints it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops as _specdec_ops

USING: dict[str, str] = {}
LINEAR = "auto"  # "auto" | "torch" | "specdec": see linear()


def has_kernel(op: str, device: torch.device) -> bool:
    key = "CUDA" if device.type == "cuda" else "CPU"
    try:
        return hasattr(_specdec_ops, op) and torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", key)
    except RuntimeError:
        return False


def _note(op: str, path: str) -> None:
    USING[op] = path


# ---- linear -------------------------------------------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., H] @ weight[N, H].T; the medusa area's ``linear`` helper picks skinny_linear
    for the few-row shapes of decoding where it beats F.linear.

    With one torch thread F.linear (MKL) was faster here on SmolLM2's shapes (32 vs 26
    tokens/s for the whole autoregressive loop; the helper's threshold was measured with 2
    threads), so the helper is used only with several threads; ``LINEAR = "torch"`` forces
    F.linear, ``"specdec"`` forces the helper."""
    helper = getattr(_specdec_ops, "linear", None)
    use = LINEAR == "specdec" or (LINEAR == "auto" and torch.get_num_threads() > 1)
    if helper is not None and use and has_kernel("skinny_linear", x.device):
        _note("linear", "specdec")
        return helper(x, weight)
    _note("linear", "torch")
    return F.linear(x, weight)


# ---- tree attention -----------------------------------------------------------------------
def tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale):
    """q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] -> out [T, Hq, D] (DESIGN.md)."""
    if has_kernel("tree_attention", q.device):
        _note("tree_attention", "specdec")
        return _specdec_ops.tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr,
                                           tree_mask=tree_mask, sm_scale=sm_scale)
    _note("tree_attention", "torch")
    return torch_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale)


def unpack_tree_mask(tree_mask: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """bool [n, n] visibility among nodes start..start+n-1 (rows of their request)."""
    j = torch.arange(n, device=tree_mask.device)
    words = tree_mask[start:start + n][:, j // 64]
    return ((words >> (j % 64)) & 1).bool()


def torch_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale):
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    indptr = qo_indptr.tolist()
    for b, prefix in enumerate(prefix_lens.tolist()):
        s, e = indptr[b], indptr[b + 1]
        n = e - s
        if n == 0:
            continue
        L = prefix + n
        blocks = block_table[b, : -(-L // bs)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L]
        v = v_cache[blocks].reshape(-1, Hkv, D)[:L]
        if tree_mask is None:
            local = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            local = unpack_tree_mask(tree_mask, s, n)
        mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=q.device), local], dim=1)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=sm_scale,
                                           enable_gqa=Hq != Hkv)
        out[s:e] = o[0].transpose(0, 1)
    return out


# ---- KV compaction ------------------------------------------------------------------------
def compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted) -> None:
    """Position prefix+1+i <- prefix+accepted_nodes[i] in every layer (DESIGN.md)."""
    if has_kernel("compact_kv", k_caches[0].device):
        _note("compact_kv", "specdec")
        _specdec_ops.compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
        return
    _note("compact_kv", "torch")
    bs = k_caches[0].shape[1]
    src, dst = [], []
    for b, (prefix, n) in enumerate(zip(prefix_lens.tolist(), num_accepted.tolist())):
        for i in range(max(n, 0)):
            node = int(accepted_nodes[b, i])
            if node != i + 1:
                for pos, lst in ((prefix + node, src), (prefix + 1 + i, dst)):
                    lst.append(int(block_table[b, pos // bs]) * bs + pos % bs)
    if not src:
        return
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    for cache in list(k_caches) + list(v_caches):
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst_t] = flat[src_t]  # gathers every source before writing


# ---- sampling -----------------------------------------------------------------------------
def apply_top_k_top_p(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Mask logits [R, V] outside each row's top-k / top-p set to -inf (in place, returned).
    top_k int32 [R] (0 = off) or None; top_p fp32 [R] (1 = off) or None."""
    if top_k is None and top_p is None:
        return logits
    if has_kernel("apply_top_k_top_p", logits.device):
        _note("apply_top_k_top_p", "specdec")
        return _specdec_ops.apply_top_k_top_p(logits, top_k, top_p)
    _note("apply_top_k_top_p", "torch")
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long().clamp(min=0)
        k = torch.where(k == 0, torch.full_like(k, logits.shape[-1]), k)
        remove |= torch.arange(logits.shape[-1], device=logits.device)[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        remove |= before >= top_p[:, None]
    logits.scatter_(-1, idx, sorted_logits.masked_fill(remove, float("-inf")))
    return logits


def tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset):
    """-> accepted_nodes int32 [B, N-1], output_token_ids int64 [B, N], num_accepted int32 [B]."""
    if has_kernel("tree_rejection_sample", target_logits.device):
        _note("tree_rejection_sample", "specdec")
        return _specdec_ops.tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs,
                                                  temperature, seed, offset)
    _note("tree_rejection_sample", "torch")
    return torch_tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs,
                                       temperature, seed, offset)


def torch_tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset):
    """The DESIGN.md semantics with torch's generator (seeded from seed+offset per request)."""
    B, N = parents.shape
    accepted = torch.full((B, max(N - 1, 0)), -1, dtype=torch.int32)
    out = torch.full((B, N), -1, dtype=torch.int64)
    num_acc = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = int(num_nodes[b])
        par = parents[b, :n].tolist()
        toks = tree_token_ids[b, :n].tolist()
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[par[i]].append(i)
        T = float(temperature[b])
        gen = torch.Generator().manual_seed(int(seed[b]) * 1_000_003 + int(offset[b]))
        node, path = 0, []
        while True:
            logits = target_logits[b, node].float()
            if T == 0:
                best = int(logits.argmax())
                nxt = next((c for c in children[node] if toks[c] == best), None)
                if nxt is None:
                    last = best
                    break
                node = nxt
                path.append(nxt)
                continue
            p = torch.softmax(logits / T, -1)
            nxt = None
            for c in children[node]:
                x = toks[c]
                u = float(torch.rand((), generator=gen))
                if draft_probs is not None:
                    q = draft_probs[b, node].float()
                    if q[x] > 0 and u < min(1.0, float(p[x] / q[x])):
                        nxt = c
                        break
                    r = (p - q).clamp(min=0)
                    p = r / r.sum() if r.sum() > 0 else p
                else:
                    if u < float(p[x]):
                        nxt = c
                        break
                    p = p.clone()
                    p[x] = 0
                    p = p / p.sum() if p.sum() > 0 else torch.softmax(logits / T, -1)
            if nxt is None:
                last = int(torch.multinomial(p, 1, generator=gen))
                break
            node = nxt
            path.append(nxt)
        num_acc[b] = len(path)
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        out[b, : len(path)] = torch.tensor([toks[i] for i in path], dtype=torch.int64)
        out[b, len(path)] = last
    return accepted, out, num_acc


# ---- Medusa -------------------------------------------------------------------------------
def medusa_topk(hidden, res_weight, res_bias, lm_head, top_k):
    """-> topk_ids int64 [M, K, top_k], topk_logprobs fp32 [M, K, top_k]."""
    if has_kernel("medusa_topk", hidden.device):
        _note("medusa_topk", "specdec")
        return _specdec_ops.medusa_topk(hidden, res_weight, res_bias, lm_head, top_k)
    _note("medusa_topk", "torch")
    K, L = res_weight.shape[0], res_weight.shape[1]
    x = hidden[:, None, :].expand(-1, K, -1).clone()
    for l in range(L):
        x = x + F.silu(torch.einsum("mkh,kgh->mkg", x, res_weight[:, l]) + res_bias[:, l])
    if lm_head.dim() == 2:
        logits = x @ lm_head.T
    else:
        logits = torch.einsum("mkh,kvh->mkv", x, lm_head)
    logp = logits.float().log_softmax(-1)
    vals, ids = logp.topk(top_k, dim=-1)
    return ids, vals
