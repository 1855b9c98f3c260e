"""EAGLE drafting with dynamic trees (EAGLE-2) over the trained feature-level draft head.

Per request the drafter keeps the head's own paged KV cache (one layer, ``PagedKVCache``):
entry t holds the head's K/V for (target feature f_t, token t+1). Each step:

1. **Catch up** — the entries the target's last verification made known (root and accepted
   nodes: their features, handed over by the Generator's ``hidden_states`` hook, and the
   emitted tokens; after the prefill, the prompt's) go through the head in one causal
   ``tree_attention`` pass; they are committed once the step's trees are drafted (a
   proposal that raises leaves them pending, for the Generator's retry). The last one's
   output ``g`` is the depth-1 draft state: its logits rank the root's children.
2. **Expand** (EAGLE-2) — depth 1: the root's top-k children with their log-probabilities.
   Depth d > 1: the ``top_k`` candidates of depth d-1 with the highest *cumulative* draft
   log-probability (the beam) are fed back as (their parent's ``g``, their token); each
   attends to the committed entries, its ancestors' entries and itself (scratch K/V that is
   never committed) and yields ``top_k`` children. Expansion stops at the speculation
   length, ``max_depth``, or when one more depth is not expected to pay for its measured
   cost (below).
3. **Select** — the verified tree is the root plus the candidates with the highest cumulative
   log-probability over all depths (``tree.eagle_tree_from_expansions``: closed under
   parents). How many: the number of verified rows ``R`` (B roots + kept nodes over the
   batch) that maximises expected tokens per unit time, ``(B + sum p) / (cost(R) +
   draft time)``, with p = exp(cumulative log-prob) and ``cost`` the *measured* verification
   cost curve at the batch's size (``step_cost``; by default the Generator's, the target's
   step-cost curve measured once per machine) and the draft time measured while drafting
   (``cost_model.best_node_count``).
4. **Verify** — the generator's one ``tree_attention`` forward and ``tree_rejection_sample``.

When a step's trees are not expected to pay for the drafting itself (their expected tokens
per unit time, drafting included, no better than a step that drafts nothing: typical at
batch 4, where the batch already fills the step), the catch-up pass and expansions were
spent for nothing, so the drafter backs off: after m such steps in a row it skips the next
2^m - 1 steps (m <= 5), and their entries wait for the next catch-up pass (one batched
forward).

The draft cache needs no ``compact_kv``: only entries built from the *target's* features
are committed (step 1); the tree's entries were built from the head's own estimates g and
are dropped after each step — EAGLE recomputes accepted tokens' entries from the true
features, which costs one row per accepted token in the next step's catch-up pass, and
keeps drafts as good as the head was trained for.

Sampling (temperature > 0): children are drawn i.i.d. from the head's q (softmax of the
draft logits / T; uniforms from the request's own Philox counters, ``draft_uniforms``) instead
of taken as the top-k, every drawn child is kept (a node's
children never depend on their own values, which keeps the acceptance exact), and the
draft's q rows go to ``tree_rejection_sample``. Greedy requests use deterministic top-k
children (exact: greedy verification follows the target's argmax).

``ngram``: a prompt-lookup chain merged into the tree as one more branch (``eagle+ngram``,
as ``MedusaDrafter`` does), cut to the tokens whose estimated hit probability pays for a
verified row (``_with_ngram``).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .cost_model import best_node_count, payoff, row_price
from ..eagle import EagleHead, eagle_head_for
from ..kv_cache import PagedKVCache
from ..tree import eagle_tree_from_expansions
from .drafters import Draft, MedusaDrafter, SizedDrafter, draft_uniforms, sample_rows


class EagleDrafter(SizedDrafter):
    """EAGLE-2 dynamic trees from an :class:`~specdec_kernels.eagle.EagleHead` (module
    docstring). ``head``: default ``eagle_head_for(target)`` (the trained head the package
    ships for the model). ``top_k``: children per expanded node and beam width.
    ``max_tree_nodes``: most draft nodes per request (root excluded). ``step_cost``: a
    ``cost_model.StepCost``, {rows: cost relative to a one-row step}, a callable rows -> that,
    or a sequence of relative costs at 1, 2, ... rows; ``step_seconds``: a one-row step in
    seconds (to weigh the measured draft time against a relative curve); by default both
    come from the Generator's step cost (``Generator.drafter_step_cost``: the target's curve,
    measured once per machine, batch-aware).
    ``sample_width``: children drawn per expanded node (and beam width) for sampled requests.
    """

    name = "eagle"
    uses_hidden = True  # the head's entries are built from the target's features
    CHAIN_PRIOR = 0.5  # a request's prompt-lookup hit rate before any observation (_with_ngram)

    def __init__(self, target, head: EagleHead | None = None, *, top_k: int = 8, max_depth: int = 8,
                 max_tree_nodes: int = 48, ngram=None, step_cost=None, step_seconds: float | None = None,
                 sample_width: int = 2, name: str | None = None):
        self.target = target
        self.head = head if head is not None else eagle_head_for(target)
        self.top_k, self.max_depth, self.max_tree_nodes = top_k, max_depth, max_tree_nodes
        self.sample_width = sample_width
        self.ngram = ngram
        sampled_nodes = sample_width + sample_width * sample_width * (max_depth - 1)
        self.max_nodes = max(max_tree_nodes, sampled_nodes) + 1 + (ngram.max_nodes - 1 if ngram is not None else 0)
        self.name = name or ("eagle+ngram" if ngram is not None else "eagle")
        # A StepCost holds seconds (measured or given); anything else holds relative costs
        # (a dict: a one-batch table), weighed against drafting time with ``step_seconds``.
        self._own_step_cost(step_cost, step_seconds)
        self._depth_seconds = None  # measured: moving average of one expansion depth
        # Drafting statistics: tree sizes and depths, accepted lengths (see ``summary``).
        self.stats = {"steps": 0, "nodes": 0, "depth_hist": {}, "accepted_hist": {}, "skipped_steps": 0}
        self._empty_run, self._skip = 0, 0  # back-off after empty trees (propose)
        # Prepare the head's decode weights now too (its GGUF blocks are quantised from the
        # stored bf16 on first use, ~30 ms for SmolLM2's head): a drafter is built once and
        # serves many requests, so that cost belongs to construction, not to the first step.
        self.head.decode_weights(target.dtype)

    # ---- costs ------------------------------------------------------------------------
    def _draft_cost(self, depths: int, batch: int = 1) -> float:
        """Relative cost of ``depths`` expansion depths (measured; 0 until measured) against a
        one-row-per-request step of ``batch`` requests."""
        if self._depth_seconds is None:
            return 0.0
        return self.relative_cost(depths * self._depth_seconds, batch)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, gen, reqs):
        self._take_step_cost(gen)  # its own curve, else the Generator's (which resolves it)
        h = self.head
        bs = gen.cache.block_size
        blocks = -(-gen.cache.max_len // bs)
        slots = gen.cache.max_batch
        self.cache = PagedKVCache(1, h.num_kv_heads, h.head_dim, num_blocks=slots * blocks, block_size=bs,
                                  max_batch=slots, max_blocks_per_seq=blocks, dtype=self.target.dtype,
                                  device=self.target.device)
        self.slot, self.pending = {}, {}
        self._empty_run, self._skip = 0, 0
        self._chains, self._chain_rate = {}, {}  # prompt-lookup chains and their hit rates (_with_ngram)
        self.admit(gen, reqs)

    def admit(self, gen, reqs):
        for r in reqs:
            self.slot[r.rid] = self.cache.add_request(0)
            self.pending[r.rid] = (None, [])  # filled by hidden_states

    def hidden_states(self, gen, req, hidden, tokens):
        """Entries (f_t, the token f_t produced) to catch up: after the prefill the prompt's
        (entry t = (f_t, token t+1) for t < P-1), after a step the root's and each accepted
        node's, after any a skipped step left (see ``propose``)."""
        if req.done:
            return
        left_f, left_t = self.pending.get(req.rid, (None, []))
        if left_f is not None and len(left_t):
            hidden, tokens = torch.cat([left_f, hidden]), list(left_t) + list(tokens)
        self.pending[req.rid] = (hidden, list(tokens))

    def verified(self, gen, reqs, num_accepted):
        for r, n in zip(reqs, num_accepted):
            self.stats["accepted_hist"][n] = self.stats["accepted_hist"].get(n, 0) + 1
            self._score_chain(r, n)

    def finish(self, gen, req):
        self.cache.free(self.slot.pop(req.rid))
        self.pending.pop(req.rid, None)
        self._chains.pop(req.rid, None)
        self._chain_rate.pop(req.rid, None)

    def summary(self) -> dict:
        s = self.stats
        return {"steps": s["steps"], "skipped_steps": s["skipped_steps"], "mean_tree_nodes": s["nodes"] / max(1, s["steps"]),
                "tree_depth_hist": dict(sorted(s["depth_hist"].items())),
                "accepted_length_hist": dict(sorted(s["accepted_hist"].items()))}

    # ---- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, reqs: list) -> tuple[dict, dict]:
        """Step 1: run the pending entries and write their K/V after each slot's committed
        ones, without committing them (``commit_caught_up`` does, once the step's trees are
        drafted). Returns ({b: (g [H], draft log-probs [Vd]) of the last entry}, {b: entries
        run})."""
        head, cache = self.head, self.cache
        rows = [b for b, r in enumerate(reqs) if self.pending[r.rid][0] is not None and len(self.pending[r.rid][1])]
        if not rows:
            return {}, {}
        feats, toks, counts = [], [], []
        for b in rows:
            f, t = self.pending[reqs[b].rid]
            feats.append(f.to(self.target.dtype))
            toks.extend(t)
            counts.append(len(t))
        slots = [self.slot[reqs[b].rid] for b in rows]
        starts = [cache.length(s) for s in slots]
        new = cache.append_slots(slots, counts)
        block_table, prefix = cache.batch_view(slots)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        x = head.decode_inputs(torch.cat(feats), torch.tensor(toks, dtype=torch.int64))
        q, k, v = head.decode_qkv(x, positions)
        cache.write(0, new.slot_mapping, k, v)
        attn = torch.empty_like(q)
        torch.ops.specdec.tree_attention(q, cache.k_caches[0], cache.v_caches[0], block_table, prefix,
                                         new.qo_indptr, None, head.head_dim ** -0.5, attn, None)
        last = new.qo_indptr[1:].long() - 1
        g, logp = head.decode_output(x[last], attn.reshape(attn.shape[0], -1)[last])
        return {b: (g[i], logp[i]) for i, b in enumerate(rows)}, dict(zip(rows, counts))

    def commit_caught_up(self, reqs: list, caught: dict) -> None:
        """Commit the entries ``catch_up`` ran ({b: count}); they are no longer pending."""
        self.cache.commit([self.slot[reqs[b].rid] for b in caught], list(caught.values()))
        for b in caught:
            self.pending[reqs[b].rid] = (None, [])

    def _committed_kv(self, slots: list, caught: list):
        """K/V of each slot's committed entries and the ``caught[i]`` entries written after
        them, padded: k, v [B, Lmax, Hkv, D], valid bool [B, Lmax], lengths [B]."""
        cache, h = self.cache, self.head
        lens = [cache.length(s) + n for s, n in zip(slots, caught)]
        Lmax = max(lens)
        B = len(slots)
        k = torch.zeros(B, Lmax, h.num_kv_heads, h.head_dim, dtype=self.target.dtype)
        v = torch.zeros_like(k)
        kc = cache.k_caches[0].view(-1, h.num_kv_heads, h.head_dim)
        vc = cache.v_caches[0].view(-1, h.num_kv_heads, h.head_dim)
        for i, (s, n) in enumerate(zip(slots, lens)):
            idx = cache.slot_mapping(s, torch.arange(n))
            k[i, :n] = kc[idx]
            v[i, :n] = vc[idx]
        valid = torch.arange(Lmax)[None, :] < torch.tensor(lens)[:, None]
        return k, v, valid, torch.tensor(lens)

    def _children(self, logp: torch.Tensor, sampled: torch.Tensor, temps: torch.Tensor, width: int,
                  u: torch.Tensor | None = None):
        """logp [B, M, Vd] -> (child draft ids [B, M, width], child log-prob [B, M, width],
        q [B, M, Vd] or None): top-``width`` for greedy rows, i.i.d. draws from
        softmax(logits / T) for sampled rows (their scores are log q), with the uniforms u
        [B, M * width] (the requests' own, ``draft_uniforms``)."""
        ids = logp.topk(width, dim=-1)
        cid, clp = ids.indices, ids.values
        q = None
        if bool(sampled.any()):
            B, M, Vd = logp.shape
            q = (logp / temps.clamp(min=1e-6)[:, None, None]).softmax(-1)
            draws = sample_rows(q[sampled].reshape(-1, Vd), u[sampled].reshape(-1, width)).view(-1, M, width)
            cid = cid.clone()
            clp = clp.clone()
            cid[sampled] = draws
            clp[sampled] = torch.gather(q[sampled], -1, draws).clamp(min=1e-30).log()
        return cid, clp, q

    @torch.inference_mode()
    def propose(self, gen, reqs, lengths):
        t_start = time.perf_counter()
        drafts = [Draft.root_only(r.tokens[-1]) for r in reqs]
        if self._skip > 0:  # back-off after empty trees: no head forward this step
            self._skip -= 1
            self.stats["skipped_steps"] += 1
            return self._with_ngram(reqs, lengths, drafts)
        roots_g, caught = self.catch_up(reqs)
        drafts = self._trees(reqs, lengths, drafts, roots_g, caught, t_start)
        self.commit_caught_up(reqs, caught)  # only now: nothing after this can fail
        return drafts

    def _trees(self, reqs, lengths, drafts, roots_g, caught, t_start):
        """Steps 2-3 (module docstring) for the requests ``catch_up`` gave a draft state,
        then the prompt-lookup merge; returns every request's draft."""
        active = [b for b, k in enumerate(lengths) if k > 0 and b in roots_g]
        if not active:
            return self._with_ngram(reqs, lengths, drafts)
        B = len(active)
        sub = [reqs[b] for b in active]
        depth_cap = torch.tensor([min(lengths[b], self.max_depth) for b in active])
        sampled = torch.tensor([r.sampling.temperature > 0 for r in sub])
        any_sampled = bool(sampled.any())
        expansions = self._expand(sub, active, roots_g, caught, depth_cap, sampled)
        scores = expansions[0]
        # Beyond a request's own cap the candidates are not eligible.
        for j in range(len(scores)):
            scores[j] = scores[j].masked_fill((depth_cap < j + 1)[:, None], float("-inf"))
        draft_rel = self.relative_cost(time.perf_counter() - t_start, B)
        keep, value = self._select(scores, B, draft_rel)
        for i, b in enumerate(active):
            drafts[b] = self._request_draft(sub[i], i, bool(sampled[i]), keep[i], *expansions)
        self.stats["steps"] += 1
        self._back_off(active, drafts, value, any_sampled, B)
        for b in active:
            dd = drafts[b]
            self.stats["nodes"] += len(dd.tokens) - 1
            depth = max(dd.depths())
            self.stats["depth_hist"][depth] = self.stats["depth_hist"].get(depth, 0) + 1
        worth = value if not any_sampled and B == len(reqs) else None
        return self._with_ngram(reqs, lengths, drafts, worth)

    def _expand(self, sub: list, active: list, roots_g: dict, caught: dict, depth_cap: torch.Tensor,
                sampled: torch.Tensor):
        """Step 2 for the B requests ``sub`` (batch rows ``active``): the root's children, then
        beam expansions while a depth is expected to pay (``_expansion_threshold``), at most
        ``depth_cap`` [B] deep. Returns per depth d (0-based) lists of: cumulative log-probs
        ``scores`` [B, C_d] of its candidates, ``parents`` (None at depth 0, else the beam
        [B, G_d] of indices into depth d-1's candidates), draft-vocabulary->target ``tokens``
        [B, C_d], ``qs`` (the root's q [B, Vd], or [None] when no request samples) and
        ``beam_q`` (per expansion: q of the beam nodes [B, G, Vd], or None)."""
        head = self.head
        B = len(sub)
        temps = torch.tensor([max(r.sampling.temperature, 0.0) for r in sub], dtype=torch.float32)
        any_sampled = bool(sampled.any())
        # Children per expanded node and beam width (a batch with sampled requests uses the
        # sampled width for all: every drawn child is kept, so it sizes the tree).
        width = self.sample_width if any_sampled else self.top_k
        vocab = head.draft_vocab
        # Per request: width draws at depth 1, then at most width x width per deeper depth.
        u = draft_uniforms(sub, width + (self.max_depth - 1) * width * width) if any_sampled else None

        def u_at(depth: int, parents: int):  # the uniforms of the children drawn at ``depth``
            start = 0 if depth == 1 else width + (depth - 2) * width * width
            return None if u is None else u[:, start: start + parents * width]

        # Depth 1: the root's children.
        g0 = torch.stack([roots_g[b][0] for b in active])  # [B, H]
        logp0 = torch.stack([roots_g[b][1] for b in active])  # [B, Vd]
        cid, clp, q0 = self._children(logp0[:, None], sampled, temps, width, u_at(1, 1))
        scores = [clp[:, 0]]  # [B, C_0]
        parents = [None]
        tokens = [vocab[cid[:, 0]]]
        qs = [q0[:, 0] if q0 is not None else None]  # q of the root, per request
        cand_g = g0[:, None].expand(B, width, -1)  # the g each candidate's entry is fed with
        slots = [self.slot[r.rid] for r in sub]
        committed = self._committed_kv(slots, [caught.get(b, 0) for b in active])
        clen = committed[3]
        sk = torch.zeros(B, 0, head.num_kv_heads, head.head_dim, dtype=committed[0].dtype)
        sv = torch.zeros_like(sk)
        cand_anc = torch.zeros(B, width, 0, dtype=torch.bool)
        beam_q = []  # per depth: q rows of the beam nodes [B, G, Vd] (sampled requests)
        t_depth = time.perf_counter()
        d = 1
        while d < int(depth_cap.max()):
            s_prev = scores[-1].masked_fill((depth_cap < d)[:, None], float("-inf"))
            threshold = self._expansion_threshold(scores, d)
            if threshold is None:
                break
            top = s_prev.topk(min(width, s_prev.shape[1]), dim=-1)
            # The beam: the best candidates whose children can still pay (see
            # _expansion_threshold), as many as the request that has most of them needs.
            G = int((top.values.exp() > threshold).sum(1).max()) if not any_sampled else top.values.shape[1]
            if G == 0:
                break
            beam = top.indices[:, :G]  # [B, G], indices into step d-1's candidates
            bsel = beam[..., None]
            feat = torch.gather(cand_g, 1, bsel.expand(B, G, cand_g.shape[-1]))
            tok = torch.gather(tokens[-1], 1, beam)
            pos = (clen + d - 1)[:, None].expand(B, G).reshape(-1)
            anc = torch.gather(cand_anc, 1, bsel.expand(B, G, cand_anc.shape[-1]))
            g, logp, sk, sv, anc = self._beam_forward(feat, tok, pos, anc, sk, sv, committed)
            cid, clp, qd = self._children(logp, sampled, temps, width, u_at(d + 1, G))
            beam_score = torch.gather(s_prev, 1, beam)
            scores.append((beam_score[..., None] + clp).reshape(B, G * width))
            parents.append(beam)
            tokens.append(vocab[cid].reshape(B, G * width))
            beam_q.append(qd)
            cand_g = g.repeat_interleave(width, 1)
            cand_anc = anc.repeat_interleave(width, 1)
            d += 1
            now = time.perf_counter()
            dt = now - t_depth
            t_depth = now
            self._depth_seconds = dt if self._depth_seconds is None else 0.8 * self._depth_seconds + 0.2 * dt
        return scores, parents, tokens, qs, beam_q

    def _beam_forward(self, feat, tok, pos, anc, sk, sv, committed):
        """One head forward of the G beam nodes of each of B requests: feat [B, G, H] (the g
        they are fed with), tok [B, G] (their tokens), pos [B * G] (their positions), anc
        [B, G, S] (which of the S tree entries sk / sv [B, S, Hkv, D] so far each attends to),
        ``committed`` = ``_committed_kv``'s (k, v, valid, lengths). Returns (g [B, G, H],
        logp [B, G, Vd], sk and sv with the beam's entries appended [B, S + G, Hkv, D], anc
        with itself appended [B, G, S + G])."""
        head = self.head
        ck, cv, cvalid, _ = committed
        B, G = tok.shape
        rep = head.num_heads // head.num_kv_heads
        Hkv, D = head.num_kv_heads, head.head_dim
        x = head.decode_inputs(feat.reshape(B * G, -1), tok.reshape(-1))
        q, k, v = head.decode_qkv(x, pos)
        sk = torch.cat([sk, k.view(B, G, Hkv, D)], 1)
        sv = torch.cat([sv, v.view(B, G, Hkv, D)], 1)
        anc = torch.cat([anc, torch.eye(G, dtype=torch.bool)[None].expand(B, G, G)], -1)  # + itself
        mask = torch.cat([cvalid[:, None].expand(B, G, -1), anc], -1)[:, None]  # [B, 1, G, L+S]
        keys = torch.cat([ck, sk], 1).repeat_interleave(rep, 2).transpose(1, 2)
        vals = torch.cat([cv, sv], 1).repeat_interleave(rep, 2).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q.view(B, G, -1, D).transpose(1, 2), keys, vals, attn_mask=mask)
        g, logp = head.decode_output(x, attn.transpose(1, 2).reshape(B * G, -1))
        return g.view(B, G, -1), logp.view(B, G, -1), sk, sv, anc

    def _request_draft(self, r, i: int, sampled: bool, keep: int, scores, parents, tokens, qs, beam_q) -> Draft:
        """Step 3 for request ``r`` (row ``i`` of the expansions): a sampled request keeps every
        drawn child (``_sampled_draft``), a greedy one its ``keep`` best nodes."""
        if sampled:
            return self._sampled_draft(r, i, scores, parents, tokens, qs, beam_q)
        n = min(keep, self.max_tree_nodes)
        tree = eagle_tree_from_expansions([s[i: i + 1] for s in scores],
                                          [None] + [p[i: i + 1] for p in parents[1:]], n,
                                          [t[i: i + 1] for t in tokens],
                                          torch.tensor([r.tokens[-1]]))
        return Draft(tree.parents[0].tolist(), tree.token_ids[0].tolist())

    def _back_off(self, active: list, drafts: list, value: float, any_sampled: bool, B: int) -> None:
        """Back-off: a step that is not expected to have paid for its drafting — its expected
        tokens per unit time (``_select``'s value: drafting time included) no better than
        a step that drafts nothing, B / cost(B) — cost a catch-up
        pass and the expansions for nothing (typical at batch 4, where the batch already
        fills the step and extra rows rarely pay). After m such steps in a row the next
        2^m - 1 steps draft nothing (m <= 5) and their entries wait for the next catch-up
        pass, one batched forward. A step that paid resets it. (Sampled requests keep every
        drawn child: there, any node counts as paying.)"""
        if any_sampled:
            paid = any(len(drafts[b].tokens) > 1 for b in active)
        else:
            paid = value > payoff(B, B, self.cost, batch=B)
        if paid:
            self._empty_run = 0
        else:
            self._empty_run = min(self._empty_run + 1, 5)
            self._skip = 2 ** self._empty_run - 1

    def _expansion_threshold(self, scores: list, d: int) -> float | None:
        """None when one more expansion depth is not expected to pay for its measured cost,
        else the least cumulative probability a beam node needs to be expanded.

        Whether a depth pays: the best nodes it can add are the beam's best children,
        estimated as the beam's probability times the last depth's best-child/parent
        probability ratio. The threshold (a change from EAGLE-2's fixed top-k beam): a node
        with probability p raises expected tokens per unit cost, e / c, only if p > (e / c) *
        (cost of one more verified row); a child's probability is at most its parent's, so a
        parent below that bound cannot have a child worth verifying and expanding it would
        only add draft rows (each depth's head forward costs about in proportion to its rows
        on GGUF-block weights). With free verification rows the bound is 0: the full beam."""
        if d >= self.max_depth:
            return None
        if self._depth_seconds is None:
            return 0.0  # not measured yet: expand (the first steps measure it)
        p_all = torch.cat([s.exp() for s in scores], 1)  # [B, C]
        B = p_all.shape[0]
        top = p_all.sort(dim=1, descending=True).values[:, : self.max_tree_nodes]
        # Current expected tokens per step and cost at the best size.
        best = None
        draft = self._draft_cost(d, B)
        for n in range(0, top.shape[1] + 1, max(1, top.shape[1] // 16)):
            e = B + float(top[:, :n].sum())
            value = payoff(e, B * (n + 1), self.cost, batch=B, draft_cost=draft)
            if best is None or value > best[0]:
                best = (value, e, self.cost(B * (n + 1), B) + draft, B * (n + 1))
        last = scores[-1].exp()
        prev = scores[-2].exp() if len(scores) > 1 else torch.ones(B, 1)
        ratio = float(last.max(1).values.sum() / prev.max(1).values.sum().clamp(min=1e-9))
        G = min(self.top_k, last.shape[1])
        gain = ratio * float(last.topk(G, dim=1).values.sum())
        value, e, c, rows = best
        if (e + gain) / (c + self._draft_cost(1, B)) <= value:
            return None
        return max(0.0, row_price(value, rows, self.cost, B))

    def _select(self, scores: list, B: int, draft_rel: float) -> tuple[list, float]:
        """(nodes to keep per request, the expected tokens per unit time they give): the
        batch's most probable candidates, as many as maximise (B + sum p) / (cost(B + kept)
        + draft cost) (``cost_model.best_node_count``)."""
        p_all = torch.cat([s.exp() for s in scores], 1)
        top = p_all.sort(dim=1, descending=True).values[:, : self.max_tree_nodes]
        pool = sorted(((-float(p), b) for b in range(B) for p in top[b] if p > 0), key=lambda t: t[0])
        best_n, best = best_node_count([-neg_p for neg_p, _ in pool], self.cost, batch=B, draft_cost=draft_rel)
        keep = [0] * B
        for _, b in pool[:best_n]:
            keep[b] += 1
        return keep, best

    def _sampled_draft(self, r, i: int, scores, parents, tokens, qs, beam_q) -> Draft:
        """The tree of a sampled request: every drawn child of every expanded node (i.i.d.
        from q), with q rows (over the target vocabulary) for ``tree_rejection_sample``."""
        V = self.target.config.vocab_size
        vocab = self.head.draft_vocab
        width = scores[0].shape[1]
        node_of = {}  # (step, candidate index) -> node
        par, tok = [-1], [r.tokens[-1]]
        rows = [qs[0][i]]  # node 0's children were drawn from the root's q
        for c in range(width):
            node_of[(0, c)] = len(tok)
            par.append(0)
            tok.append(int(tokens[0][i, c]))
            rows.append(None)
        for d in range(1, len(scores)):
            beam = parents[d][i].tolist()
            w = scores[d].shape[1] // len(beam)
            for gi, pc in enumerate(beam):
                pnode = node_of.get((d - 1, pc))
                if pnode is None or not torch.isfinite(scores[d][i, gi * w]):
                    continue
                rows[pnode] = beam_q[d - 1][i, gi]
                for c in range(w):
                    node_of[(d, gi * w + c)] = len(tok)
                    par.append(pnode)
                    tok.append(int(tokens[d][i, gi * w + c]))
                    rows.append(None)
        probs = torch.zeros(len(tok), V, dtype=torch.float32)
        for n, q in enumerate(rows):
            if q is not None:
                probs[n, vocab] = q.float()
        return Draft(par, tok, probs)

    def _with_ngram(self, reqs, lengths, drafts, worth: float | None = None):
        """Merge each request's prompt-lookup chain into its tree, cut to the tokens that
        pay: chain token j is right with probability ~ a^j (a: the request's running rate
        at which looked-up tokens matched what the target emitted), and it is kept while
        a^j exceeds the cost of one more verified row times ``worth``, the expected tokens
        per unit cost of the step as drafted (``_select``'s value; by default B tokens for
        the cost of the drafts' rows, costs relative to a one-row-per-request step of the B
        requests). At batch 1 with nothing drafted that is the row's cost itself; at batch 4
        a row must be worth about four times its share of the step, since the step already
        yields four tokens. With free rows the whole chain is kept. Every looked-up chain is
        scored against the emitted tokens in ``verified``, kept or not, so the rate recovers
        when copying starts to pay."""
        if self.ngram is None:
            return drafts
        out, B = [], len(reqs)
        rows = sum(len(d.tokens) for d in drafts)
        if worth is None:
            worth = payoff(B, rows, self.cost, batch=B)
        for r, k, d in zip(reqs, lengths, drafts):
            if k > 0 and d.probs is None:
                chain = self.ngram.lookup(r.tokens, min(k, self.ngram.max_nodes - 1))
                self._chains[r.rid] = chain
                rate, keep = self._chain_rate.get(r.rid, self.CHAIN_PRIOR), 0
                while keep < len(chain) and rate ** (keep + 1) > row_price(worth, rows, self.cost, B):
                    keep, rows = keep + 1, rows + 1
                if keep:
                    par, tok = MedusaDrafter.merge_chain(d.parents, d.tokens, chain[:keep])
                    d = Draft(par, tok)
            out.append(d)
        return out

    def _score_chain(self, r, n: int) -> None:
        """Update the request's chain rate from this step's looked-up chain against the
        n + 1 tokens the target emitted: each chain token up to the first mismatch is one
        observation (a moving average)."""
        chain = self._chains.pop(r.rid, None)
        if not chain:
            return
        emitted = r.tokens[len(r.tokens) - (n + 1):]
        rate = self._chain_rate.get(r.rid, self.CHAIN_PRIOR)
        for want, got in zip(chain, emitted):
            rate = 0.9 * rate + 0.1 * float(want == got)
            if want != got:
                break
        self._chain_rate[r.rid] = rate
