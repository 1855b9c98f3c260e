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
   attends to the committed entries, its ancestors' entries and itself through
   ``tree_attention`` over the head's paged cache (each beam node's path is copied into
   scratch blocks that continue its request's block table, never committed) and yields
   ``top_k`` children. Expansion stops at the speculation
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
per unit time, drafting included, no better than a step without the head's forwards: one
that drafts nothing, or for ``eagle+ngram`` the lookup tries alone; typical at batch 4,
where the batch already fills the step, and on code, where the lookup drafts what the head
would), the catch-up pass and expansions were spent for nothing, so the drafter backs off: after m such steps in a row it skips the next
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

``lookup`` (``eagle+ngram``): prompt-lookup tries (``NgramTreeDrafter``: the continuations
of several earlier occurrences of the request's last tokens, each node with an acceptance
probability from tables measured for the model) chosen *together* with the head's
candidates: the most probable nodes of both kinds, while they pay for their rows
(``_select``), the lookup's merged into the tree where the paths agree
(``NgramTreeDrafter.merge_into``). The lookup's probabilities follow the request's evidence
(``NgramTreeDrafter.verified_merged``), fed only the accepted tokens on its own nodes. Where
the head has no tree (a backed-off step) the tries alone are drafted, sized the same way.
A sampled request drafts the head's tree or, when it promises a token, the lookup's best chain
with one-hot q rows (``_lookup_chains``): a node's q row covers all its children, so drawn and
deterministic children cannot share a node.
"""
from __future__ import annotations

import time

import torch

from ...decoding.cost_model import best_node_count, best_size, chain_tokens, payoff, row_price
from .head import EagleHead, eagle_head_for
from ...kv_cache import PagedKVCache
from ...tree import eagle_tree_from_expansions
from ...decoding.drafter import Draft, SizedDrafter, draft_uniforms, sample_rows


class EagleDrafter(SizedDrafter):
    """EAGLE-2 dynamic trees from an :class:`~specdec_kernels.drafting.eagle.head.EagleHead` (module
    docstring). ``head``: default ``eagle_head_for(target)`` (the trained head the package
    ships for the model). ``top_k``: children per expanded node and beam width.
    ``max_tree_nodes``: most draft nodes per request (root excluded). ``step_cost``: a
    ``cost_model.StepCost``, {rows: cost relative to a one-row step}, a callable rows -> that,
    or a sequence of relative costs at 1, 2, ... rows; ``step_seconds``: a one-row step in
    seconds (to weigh the measured draft time against a relative curve); by default both
    come from the Generator's step cost (``Generator.drafter_step_cost``: the target's curve,
    measured once per machine, batch-aware).
    ``sample_width``: children drawn per expanded node (and beam width) for sampled requests.

    A sampled request keeps every child it draws (choosing among draws by their values would
    bias them), so its tree cannot be pruned after drawing: its depth is chosen before, from
    the acceptance sampled requests have realised so far (``_sampled_plan``), and where no
    depth pays the head backs off as it does for greedy requests, probing again after each
    back-off. The choice depends only on past steps, so sampling stays exact.
    """

    # Sampled acceptance per depth: a prior of SAMPLED_PRIOR over SAMPLED_PRIOR_WEIGHT
    # pseudo-trials, then each observation weighs 1 and older ones fade by SAMPLED_DECAY
    # (about the last 20 steps count), so a request that stops paying is noticed quickly.
    SAMPLED_PRIOR, SAMPLED_PRIOR_WEIGHT, SAMPLED_DECAY = 0.5, 2.0, 0.95
    # eagle+ngram, sampled requests: the lookup's chain replaces the head's tree for a step when
    # it is expected to be accepted for at least this many tokens. The head's sampled trees
    # accept fewer than one token a step on the 1.5B (mean accepted length 1.4-1.6 at T = 0.7).
    SAMPLED_CHAIN_MIN_ACCEPTED = 1.0

    name = "eagle"
    uses_hidden = True  # the head's entries are built from the target's features

    def __init__(self, target, head: EagleHead | None = None, *, top_k: int = 8, max_depth: int = 8,
                 max_tree_nodes: int = 48, lookup=None, step_cost=None, step_seconds: float | None = None,
                 sample_width: int = 2, name: str | None = None):
        self.target = target
        self.head = head if head is not None else eagle_head_for(target)
        self.top_k, self.max_depth, self.max_tree_nodes = top_k, max_depth, max_tree_nodes
        self.sample_width = sample_width
        self.lookup = lookup  # an NgramTreeDrafter, or None
        self.max_nodes = (max(max_tree_nodes, self._sampled_nodes(max_depth)) + 1
                          + (lookup.max_nodes - 1 if lookup is not None else 0))
        self.name = name or ("eagle+ngram" if lookup is not None else "eagle")
        # A StepCost holds seconds (measured or given); anything else holds relative costs
        # (a dict: a one-batch table), weighed against drafting time with ``step_seconds``.
        self._own_step_cost(step_cost, step_seconds)
        self._depth_seconds = None  # measured: moving average of one expansion depth
        # Drafting statistics: tree sizes and depths, accepted lengths (see ``summary``).
        self.stats = {"steps": 0, "nodes": 0, "depth_hist": {}, "accepted_hist": {}, "skipped_steps": 0,
                      "sampled_lookup_chains": 0}
        self._empty_run, self._skip = 0, 0  # back-off after empty trees (propose)
        self._probe = False  # the next head step after a sampled back-off draws at least one depth
        # Sampled requests: realised acceptance per depth (decayed counts: accepted, trials)
        # and the depth each request's last tree was drawn to (``verified`` scores it).
        self._sampled_counts = [[0.0, 0.0] for _ in range(max_depth)]
        self._sampled_depth = {}
        # Prepare the head's decode weights now too (its GGUF blocks are quantised from the
        # stored bf16 on first use, ~30 ms for SmolLM2's head): a drafter is built once and
        # serves many requests, so that cost belongs to construction, not to the first step.
        self.head.decode_weights(target.dtype)

    @property
    def feature_layers(self) -> tuple:
        """The target layers whose states the head fuses besides the last (``EagleHead.fuse_with``)."""
        return self.head.feature_layers

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
        # Scratch blocks for the beam's paths (_beam_forward): two depths' worth of rows, each
        # row the committed part of its request's last block plus its path.
        width = max(self.top_k, self.sample_width)
        path_blocks = -(-(bs - 1 + self.max_depth) // bs)
        scratch = 2 * slots * width * path_blocks
        self.cache = PagedKVCache(1, h.num_kv_heads, h.head_dim, num_blocks=slots * blocks + scratch, block_size=bs,
                                  max_batch=slots, max_blocks_per_seq=blocks, dtype=self.target.dtype,
                                  device=self.target.device)
        self._scratch = self.cache.take_blocks(scratch).view(2, slots * width, path_blocks)
        self.slot, self.pending = {}, {}
        self._empty_run, self._skip = 0, 0
        if self.lookup is not None:
            self.lookup.start(gen, [])  # its tables for the target; the requests come through admit
        self.admit(gen, reqs)

    def admit(self, gen, reqs):
        for r in reqs:
            self.slot[r.rid] = self.cache.add_request(0)
            self.pending[r.rid] = (None, [])  # filled by hidden_states
        if self.lookup is not None:
            self.lookup.admit(gen, reqs)

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
            self._observe_sampled(self._sampled_depth.pop(r.rid, 0), n)
        if self.lookup is not None:
            self.lookup.verified_merged(gen, reqs, num_accepted)

    def finish(self, gen, req):
        self.cache.free(self.slot.pop(req.rid))
        self.pending.pop(req.rid, None)
        self._sampled_depth.pop(req.rid, None)
        if self.lookup is not None:
            self.lookup.finish(gen, req)

    def summary(self) -> dict:
        s = self.stats
        return {"steps": s["steps"], "skipped_steps": s["skipped_steps"], "mean_tree_nodes": s["nodes"] / max(1, s["steps"]),
                "tree_depth_hist": dict(sorted(s["depth_hist"].items())),
                "sampled_lookup_chains": s["sampled_lookup_chains"],
                "sampled_acceptance_per_depth": [round(a, 3) for a in self._sampled_rates()],
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
        x = head.decode_inputs(head.decode_features(torch.cat(feats)), torch.tensor(toks, dtype=torch.int64))
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

    def _request_paths(self, slots: list, caught: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(entries of each slot: committed + the ``caught[i]`` written after them, int64 [B];
        the slots' block tables with room for a path's blocks after them, int32 [B, W])."""
        lengths = torch.tensor([self.cache.length(s) + n for s, n in zip(slots, caught)], dtype=torch.int64)
        tables = self.cache.batch_view(slots)[0]
        pad = torch.zeros(len(slots), self._scratch.shape[-1], dtype=tables.dtype)
        return lengths, torch.cat([tables, pad], 1)

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
        # Sampled requests whose output is copying draft the lookup's chain instead of a
        # head tree this step (no head forward for them; the head catches up next step).
        chains = self._lookup_chains(reqs, lengths)
        if not chains:
            return self._propose(reqs, lengths)
        drafts = self._propose(reqs, [0 if b in chains else k for b, k in enumerate(lengths)])
        for b, draft in chains.items():
            drafts[b] = draft
        return drafts

    def _propose(self, reqs, lengths):
        t_start = time.perf_counter()
        drafts = [Draft.root_only(r.tokens[-1]) for r in reqs]
        if self._skip > 0:  # back-off after empty trees: no head forward this step
            self._skip -= 1
            self.stats["skipped_steps"] += 1
            return self._lookup_only(reqs, lengths, drafts)
        drafting = [r for r, k in zip(reqs, lengths) if k > 0]
        if drafting and all(r.sampling.temperature > 0 for r in drafting) and not self._probe:
            if self._sampled_plan(len(reqs), max(lengths))[0] == 0:  # no depth pays: no head forward
                self._back_off_one(probe=True)
                self.stats["skipped_steps"] += 1
                return self._lookup_only(reqs, lengths, drafts)
        roots_g, caught = self.catch_up(reqs)
        drafts = self._trees(reqs, lengths, drafts, roots_g, caught, t_start)
        self.commit_caught_up(reqs, caught)  # only now: nothing after this can fail
        return drafts

    def _trees(self, reqs, lengths, drafts, roots_g, caught, t_start):
        """Steps 2-3 (module docstring) for the requests ``catch_up`` gave a draft state, the
        prompt-lookup tries chosen with them; returns every request's draft."""
        active = [b for b, k in enumerate(lengths) if k > 0 and b in roots_g]
        if not active:
            return self._lookup_only(reqs, lengths, drafts)
        B = len(active)
        sub = [reqs[b] for b in active]
        depth_cap = torch.tensor([min(lengths[b], self.max_depth) for b in active])
        sampled = torch.tensor([r.sampling.temperature > 0 for r in sub])
        any_sampled = bool(sampled.any())
        sampled_pays = False
        if any_sampled:  # their depth is chosen now, before anything is drawn
            planned = self._sampled_plan(B, int(depth_cap[sampled].max()))[0]
            sampled_pays = planned > 0  # (a probe's forced depth is not evidence that drafting pays)
            if self._probe:
                planned, self._probe = max(planned, 1), False
            depth_cap = torch.where(sampled, depth_cap.clamp(max=planned), depth_cap)
        expansions = self._expand(sub, active, roots_g, caught, depth_cap, sampled)
        scores = expansions[0]
        # Beyond a request's own cap the candidates are not eligible.
        for j in range(len(scores)):
            scores[j] = scores[j].masked_fill((depth_cap < j + 1)[:, None], float("-inf"))
        draft_rel = self.relative_cost(time.perf_counter() - t_start, B)
        probs = self._candidate_probs(scores)
        keep, _, value = self._select(probs, [None] * B, B, draft_rel)
        without_head = payoff(B, B, self.cost, batch=B)  # a step that drafts nothing
        lookups = self._lookup_candidates(reqs, lengths)
        keep_lookup = [0] * len(reqs)
        if any(c is not None for c in lookups):
            per_request = [[] for _ in reqs]
            for i, b in enumerate(active):
                per_request[b] = probs[i]
            keep_all, keep_lookup, value = self._select(per_request, lookups, len(reqs), draft_rel)
            keep = [keep_all[b] for b in active]
            without_head = self._select([[] for _ in reqs], lookups, len(reqs), 0.0)[2]  # the tries alone
        for i, b in enumerate(active):
            if bool(sampled[i]) and int(depth_cap[i]) == 0:
                continue  # no depth pays for it: the root alone
            drafts[b] = self._request_draft(sub[i], i, bool(sampled[i]), keep[i], *expansions)
        self.stats["steps"] += 1
        self._back_off(value, without_head, sampled_pays, all_sampled=bool(sampled.all()))
        for i, b in enumerate(active):
            dd = drafts[b]
            if bool(sampled[i]):
                self._sampled_depth[reqs[b].rid] = max(dd.depths())
            self.stats["nodes"] += len(dd.tokens) - 1
            depth = max(dd.depths())
            self.stats["depth_hist"][depth] = self.stats["depth_hist"].get(depth, 0) + 1
        return drafts if self.lookup is None else self.lookup.merge_into(reqs, drafts, lookups, keep_lookup)

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
        paths = self._request_paths([self.slot[r.rid] for r in sub], [caught.get(b, 0) for b in active])
        rows = None  # the beam's scratch rows at the last depth [B, G, P] (_beam_forward)
        beam_q = []  # per depth: q rows of the beam nodes [B, G, Vd] (sampled requests)
        t_depth = time.perf_counter()
        d = 1
        while d < int(depth_cap.max()):
            s_prev = scores[-1].masked_fill((depth_cap < d)[:, None], float("-inf"))
            # (sampled requests alone: their depth was chosen before drawing, _sampled_plan)
            threshold = 0.0 if bool(sampled.all()) else self._expansion_threshold(scores, d)
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
            # Each beam node's path continues its parent's: candidate c of depth d-1 is a
            # child of that depth's beam row c // width (depth 1: of the root, no row).
            parents_rows = None if rows is None else torch.gather(rows, 1, (beam // width)[..., None].expand(
                B, G, rows.shape[-1]))
            g, logp, rows = self._beam_forward(feat, tok, d, parents_rows, paths)
            cid, clp, qd = self._children(logp, sampled, temps, width, u_at(d + 1, G))
            beam_score = torch.gather(s_prev, 1, beam)
            scores.append((beam_score[..., None] + clp).reshape(B, G * width))
            parents.append(beam)
            tokens.append(vocab[cid].reshape(B, G * width))
            beam_q.append(qd)
            cand_g = g.repeat_interleave(width, 1)
            d += 1
            now = time.perf_counter()
            dt = now - t_depth
            t_depth = now
            self._depth_seconds = dt if self._depth_seconds is None else 0.8 * self._depth_seconds + 0.2 * dt
        return scores, parents, tokens, qs, beam_q

    def _beam_forward(self, feat, tok, d: int, parent_rows, paths):
        """One head forward of the G beam nodes (depth ``d``) of each of B requests: feat
        [B, G, H] (the g they are fed with), tok [B, G] (their tokens), ``parent_rows`` [B, G,
        P] (the scratch blocks of each node's parent's path; None at depth 1: the root),
        ``paths`` (``_request_paths``). Each node gets scratch blocks that continue its
        request's block table: a copy of the committed part of the request's last block and
        of its parent's path, then its own K/V at position L + d - 1; it attends through
        ``tree_attention`` to the request's entries, its ancestors and itself, as one query
        of its own (so it sees no other branch). Returns (g [B, G, H], logp [B, G, Vd], its
        scratch blocks [B, G, P])."""
        head, cache = self.head, self.cache
        lengths, tables = paths
        B, G = tok.shape
        bs, P = cache.block_size, self._scratch.shape[-1]
        rows = self._scratch[d % 2, : B * G].view(B, G, P)  # the parent's depth used the other half
        if parent_rows is not None:
            src, dst = parent_rows.reshape(-1), rows.reshape(-1)
        else:  # the committed part of the last block, where there is one
            full = lengths // bs
            has = (lengths % bs) > 0
            src = tables[has].gather(1, full[has, None]).long().expand(-1, G).reshape(-1)
            dst = rows[has, :, 0].reshape(-1)
        for c in (cache.k_caches[0], cache.v_caches[0]):
            c.index_copy_(0, dst, c.index_select(0, src))
        pos = (lengths + d - 1).repeat_interleave(G)  # [B * G]
        offset = (lengths % bs).repeat_interleave(G) + d - 1  # the node's position within its path
        own = rows.reshape(B * G, P).gather(1, (offset // bs)[:, None])[:, 0] * bs + offset % bs
        row_tables = tables.repeat_interleave(G, 0)
        row_tables.scatter_(1, (lengths // bs).repeat_interleave(G)[:, None] + torch.arange(P),
                            rows.reshape(B * G, P).to(row_tables.dtype))
        x = head.decode_inputs(feat.reshape(B * G, -1), tok.reshape(-1))
        g, logp = head.decode_layer(x, pos, cache, row_tables,
                                    pos.to(torch.int32),  # the entries before each node's own
                                    torch.arange(B * G + 1, dtype=torch.int32), own)
        return g.view(B, G, -1), logp.view(B, G, -1), rows

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

    def _back_off(self, value: float, without_head: float, sampled_pays: bool, all_sampled: bool = False) -> None:
        """Back-off: a step whose drafting is not expected to have paid — its expected tokens
        per unit time (``_select``'s ``value``, drafting time included) no better than
        ``without_head``'s, a step without the head's forwards (one that drafts nothing, or
        the prompt-lookup tries alone for ``eagle+ngram``) — cost a catch-up pass and the
        expansions for nothing (typical at batch 4, where the batch already fills the step
        and extra rows rarely pay, and on code, where the lookup already drafts what the head
        would). After m such steps in a row the next 2^m - 1 steps run no head forward (m <=
        5) and their entries wait for the next catch-up pass, one batched forward. A step
        that paid resets it. Sampled requests pay when ``_sampled_plan`` chose a depth for
        them: from the acceptance they realised, so a head that stops being accepted backs
        off (``propose`` backs off before the catch-up pass when no depth pays)."""
        paid = sampled_pays or (not all_sampled and value > without_head)
        if paid:
            self._empty_run = 0
        else:
            self._back_off_one(probe=all_sampled)

    def _back_off_one(self, probe: bool = False) -> None:
        """One more step in a row that did not pay: skip the next 2^m - 1 (``_back_off``);
        ``probe``: the first step after them draws at least one depth for sampled requests
        (their realised acceptance only changes when something is drawn)."""
        self._empty_run = min(self._empty_run + 1, 5)
        self._skip = 2 ** self._empty_run - 1
        self._probe = self._probe or probe

    # ---- sampled requests: the depth chosen before drawing ------------------------------
    def _sampled_rates(self) -> list:
        """The probability that a sampled tree's depth d (1-based, list index d - 1) is
        accepted given depth d - 1 was, as realised so far (``SAMPLED_PRIOR`` before any)."""
        p, w = self.SAMPLED_PRIOR, self.SAMPLED_PRIOR_WEIGHT
        return [(a + p * w) / (t + w) for a, t in self._sampled_counts]

    def _observe_sampled(self, depth: int, accepted: int) -> None:
        """A sampled tree drawn ``depth`` deep had ``accepted`` nodes accepted: depths 1 ..
        min(accepted + 1, depth) were tried, the first ``accepted`` of them accepted."""
        for d in range(min(accepted + 1, depth)):
            counts = self._sampled_counts[d]
            counts[0] = self.SAMPLED_DECAY * counts[0] + (1.0 if d < accepted else 0.0)
            counts[1] = self.SAMPLED_DECAY * counts[1] + 1.0

    def _sampled_nodes(self, depth: int) -> int:
        """Draft nodes of a sampled tree ``depth`` deep: ``sample_width`` children of the root,
        then ``sample_width`` beam nodes with ``sample_width`` children each per depth."""
        w = self.sample_width
        return 0 if depth == 0 else w + (depth - 1) * w * w

    def _sampled_plan(self, batch: int, cap: int) -> tuple[int, float]:
        """(depth 0..``cap``, its pay-off): the depth of a sampled tree with the best expected
        tokens per unit time at batch ``batch`` (every request drafting alike), from the
        realised acceptance per depth (``_sampled_rates``), the step-cost curve and the
        measured drafting time of that many depths (the catch-up pass counted as one).
        0: drafting does not pay."""
        rates = self._sampled_rates()
        values = [payoff(batch, batch, self.cost, batch=batch)]
        for depth in range(1, min(cap, self.max_depth) + 1):
            tokens = batch * chain_tokens(rates, depth)
            rows = batch * (1 + self._sampled_nodes(depth))
            values.append(payoff(tokens, rows, self.cost, batch=batch, draft_cost=self._draft_cost(depth, batch)))
        return best_size(values)

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

    def _candidate_probs(self, scores: list) -> list:
        """Each request's candidate probabilities (exp of the cumulative log-probs, all
        depths), most probable first, at most ``max_tree_nodes``."""
        p_all = torch.cat([s.exp() for s in scores], 1)
        top = p_all.sort(dim=1, descending=True).values[:, : self.max_tree_nodes]
        return [[float(p) for p in row if p > 0] for row in top]

    def _select(self, probs: list, lookups: list, batch: int, draft_rel: float) -> tuple[list, list, float]:
        """(head candidates to keep per request, lookup nodes to keep per request, the
        expected tokens per unit time they give): the batch's most probable nodes of both
        kinds (``probs``: each request's head candidate probabilities, most probable first;
        ``lookups``: its lookup trie or None), as many as maximise (batch + sum p) /
        (cost(batch + kept) + draft cost) (``cost_model.best_node_count``). Each kind's picks
        are a prefix of its ranking, so each forms a tree."""
        pool = [(p, b, 0) for b, ps in enumerate(probs) for p in ps]
        pool += [(p, b, 1) for b, c in enumerate(lookups) if c is not None for p, _ in c.ranked]
        pool.sort(key=lambda entry: -entry[0])
        n, value = best_node_count([p for p, _, _ in pool], self.cost, batch=batch, draft_cost=draft_rel)
        keep = [[0, 0] for _ in probs]
        for _, b, kind in pool[:n]:
            keep[b][kind] += 1
        return [k[0] for k in keep], [k[1] for k in keep], value

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

    # ---- prompt lookup (eagle+ngram) ---------------------------------------------------
    def _lookup_candidates(self, reqs, lengths) -> list:
        """Each greedy request's prompt-lookup trie (``NgramTreeDrafter.request_candidates``),
        or None: no lookup, nothing to draft, or a sampled request (its tree keeps every
        drawn child, with the q rows a looked-up node does not have)."""
        if self.lookup is None:
            return [None] * len(reqs)
        return self.lookup.greedy_candidates(reqs, lengths)

    def _lookup_chains(self, reqs, lengths) -> dict:
        """{batch row: Draft}: the sampled requests whose prompt-lookup chain is expected to be
        accepted for at least SAMPLED_CHAIN_MIN_ACCEPTED tokens draft it (one-hot q rows,
        ``NgramTreeDrafter.sampled_chains``) instead of a head tree this step."""
        if self.lookup is None:
            return {}
        out = self.lookup.sampled_chains(
            reqs, lengths, lambda b, c, n: sum(p for p, _ in c.ranked[:n]) >= self.SAMPLED_CHAIN_MIN_ACCEPTED,
            self.target.config.vocab_size)
        self.stats["sampled_lookup_chains"] += len(out)
        return out

    def _lookup_only(self, reqs, lengths, drafts) -> list:
        """A step without head trees (backed off, or no request with a draft state): the
        prompt-lookup tries alone, sized the same way."""
        lookups = self._lookup_candidates(reqs, lengths)
        if all(c is None for c in lookups):
            return drafts
        _, keep, _ = self._select([[] for _ in reqs], lookups, len(reqs), 0.0)
        return self.lookup.merge_into(reqs, drafts, lookups, keep)

