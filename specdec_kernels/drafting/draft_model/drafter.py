"""Drafting with a smaller Llama of the target's vocabulary.

- :class:`ModelDrafter` — a separate draft model (any Llama of the package with the same
  vocabulary) with its own paged cache, as a chain or a "top-k tree" (the greedy chain plus
  the next-best tokens at the first level as extra leaves), optionally with prompt lookup
  (``draft+ngram``: a request whose lookup tries promise more than the draft's chain runs no
  draft forward that step; the tries are merged into every greedy request's draft, and a
  sampled request drafts the lookup's best chain instead of its drawn one where it promises more);
- :class:`SelfSpecDrafter` — self-speculation: the target's first L layers and its own LM
  head (or a trained exit head), writing into the target's cache (layers < L of the draft
  positions are rewritten by the verification forward, so no extra cache and no catch-up
  are needed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ...decoding.cost_model import best_chain_length, best_node_count, payoff
from ...decoding.drafter import Draft, SizedDrafter, draft_uniforms, draw_tokens
from ...models.llama import Batch, Llama
from ..ngram import NgramTreeDrafter, accepted_on_tree


@dataclass
class ChainRun:
    """One request's draft chain while :meth:`ModelDrafter.propose` extends it."""

    index: int  # the request's position in the batch
    request: object  # the Request
    slot: int  # its slot in the draft cache
    length: int  # tokens to draft
    committed: int  # tokens the draft cache held at the start of the step
    pending: list  # tokens the draft cache lacked at the start (fed by the first forward)
    feed: list  # tokens the next forward feeds
    pos: int  # cache position of feed[0]
    chain: list = field(default_factory=list)  # drafted tokens
    probs: list = field(default_factory=list)  # q each drafted token was drawn from (None: greedy)
    alts: list = field(default_factory=list)  # tree_width > 1: the root's other children
    confidence: list = field(default_factory=list)  # the draft's probability of each drafted token
    forwards: int = 0  # draft forwards run (a stopped chain's last one may have drawn a token it left out)
    expected: float = 1.0  # expected tokens of the step with the chain so far (the target's own included)
    path: float = 1.0  # the estimated probability that the whole chain so far is accepted
    stops: bool = False  # whether it stops on the draft's confidence (else it drafts ``length``)


PRIOR_TOKENS = 4  # how many drafted tokens' worth of evidence a request's prior acceptance counts as
PROBE_TOKENS = 4  # drafted tokens a request probes with before its sizing may keep drafting off
REPROBE_AFTER = 8  # steps without a drafted token before a request past its probes probes again (_probe)
REPROBE_MAX_WAIT = 64  # the longest such wait (it doubles after each rejected re-probe)


class AcceptanceByConfidence:
    """P(a drafted token is accepted | the ones before it were) as a function of the draft's
    own probability of the token, learnt online over every request in ``bins`` equal bins of
    that probability. A bin's estimate starts, with ``prior_tokens`` tokens of weight, halfway
    between its midpoint (what a calibrated draft would accept) and the request's running
    acceptance: a draft less sure of itself than it is right still drafts, and so gets
    measured, where the midpoint alone would keep it off for good."""

    def __init__(self, bins: int = 10, prior_tokens: float = 2.0):
        self.bins, self.prior_tokens = bins, prior_tokens
        self.accepted = [0.0] * bins
        self.seen = [0.0] * bins

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def __call__(self, confidence: float, acceptance: float) -> float:
        """The estimate for a token the draft gave probability ``confidence``, in a request
        whose running acceptance is ``acceptance``."""
        i = self._bin(confidence)
        prior = 0.5 * ((i + 0.5) / self.bins + acceptance)
        return (self.accepted[i] + self.prior_tokens * prior) / (self.seen[i] + self.prior_tokens)

    def observe(self, confidence: float, accepted: bool) -> None:
        i = self._bin(confidence)
        self.accepted[i] += bool(accepted)
        self.seen[i] += 1


class ModelDrafter(SizedDrafter):
    """Draft with a (smaller) Llama of the same vocabulary, chain or top-k tree.

    ``tree_width`` > 1 adds the next ``tree_width - 1`` best first tokens as extra children
    of the root (deterministic drafts, verified without draft probabilities). With a chain
    and sampling, drafts are drawn from the draft model's q and verified with it.
    ``share_target_cache`` (self-speculation): ``model`` is the target truncated to its first
    layers and writes into the target's cache. A sized chain stops where the draft's
    confidence says the next token no longer pays (:meth:`_keep_drafting`). A model with a
    ``draft_vocab`` (a distilled draft or an exit head, ``drafting.draft_model.model``) drafts
    ids of that vocabulary, mapped to the target's; its q is zero outside it, which rejection
    sampling handles exactly.
    """

    name = "draft"

    def __init__(self, model: Llama, *, tree_width: int = 1, max_k: int = 16, share_target_cache: bool = False,
                 name: str | None = None, sized: bool = False, step_cost=None, acceptance: float | None = None,
                 lookup: NgramTreeDrafter | None = None):
        """``sized``: the schedule's length is a cap and each step drafts the chain length
        that maximises expected tokens per unit time (:meth:`chain_length`), from the
        target's step-cost curve (``step_cost``, default the Generator's ``step_cost``:
        the target's measured curve unless it was given one), the draft's measured time per token and the request's
        running acceptance rate (each request starts from ``acceptance``, default the
        held-out agreement the draft's file records, else 0.5: how predictable a request is
        varies a lot — code and arithmetic accept several times more than open writing — so
        one request's rejections do not switch drafting off for the next); the drafters by
        name (``make_drafter``) run this way with the ``max`` schedule. ``sized=False``:
        exactly the schedule's length.

        A sized chain (``tree_width`` 1, no ``lookup``) drafts up to the schedule's length
        wherever its sizing drafts at all, token by token, and stops where the next token does
        not pay (:meth:`_keep_drafting`): a token's chance of acceptance is estimated from the
        draft's own probability of it (:class:`AcceptanceByConfidence`, learnt from the
        verified tokens), so chains run long through text the draft is sure of and stop at the
        first guess. The stopping depends on the draft's side alone, so sampled output stays
        exact.

        ``lookup`` (``draft+ngram``, sized drafters): prompt-lookup tries for greedy requests;
        a sampled request drafts either its drawn chain or the lookup's best chain (one-hot q
        rows, ``NgramTreeDrafter.sampled_chains``), whichever promises more.
        Each step a request's tries (the lookup's trie, sized by its own tables and the cost
        curve) are weighed against its draft chain, both as expected tokens per unit time at
        batch 1 (the chain's drafting time included); where the tries promise at least as
        much, the request drafts no chain that step, so the draft's forwards are paid only
        where lookup has little to copy. The kept tries are merged into the request's draft
        (paths shared where they agree)."""
        self.model, self.tree_width, self.share = model, tree_width, share_target_cache
        self.lookup = lookup
        self.vocab_size = model.config.vocab_size
        self.max_nodes = max_k + tree_width + (lookup.max_nodes - 1 if lookup is not None else 0)
        self.name = name or ("draft-tree" if tree_width > 1 else "draft") + ("+ngram" if lookup is not None else "")
        self.sized = sized
        self._own_step_cost(step_cost)
        measured = acceptance if acceptance is not None else getattr(model, "metadata", {}).get("held_out_top1")
        self.prior = 0.5 if measured is None else float(measured)
        # A measured prior counts as PRIOR_TOKENS drafted tokens of evidence; 0.5 for want of one
        # (a whole model by name) as one, so a request's own acceptance soon decides.
        self.prior_tokens = PRIOR_TOKENS if measured is not None else 1
        # Per request: [accepted draft tokens, rejections] seen, seeded with the prior.
        self._seen: dict = {}
        self._token_s = None  # measured seconds of one draft forward and its drawing (batch of this step), EMA
        self._call_s = None  # measured seconds a drafting call takes outside its forwards, EMA
        self._price_samples = 0  # forwards timed into _token_s so far
        self._admitted_at: dict = {}  # request -> _price_samples when it was admitted
        self._drafted: dict = {}  # request -> (its last chain, the draft's probability of each of its tokens)
        self._verified: dict = {}  # request -> its drafted tokens verified (the accepted ones and each first rejected)
        self._idle: dict = {}  # request -> steps in a row it drafted no token (verified)
        self._reprobe_wait: dict = {}  # request -> the idle steps before its next re-probe (_probe)
        self._reprobing: dict = {}  # request -> its chain this step is a re-probe (True: after an idle stretch)
        # Only chains drafted alone stop on confidence: beside lookup tries (draft+ngram), long
        # confident chains spend draft forwards on tokens the tries give for free (slower on code).
        self.by_confidence = AcceptanceByConfidence() if sized and tree_width == 1 and lookup is None else None

    # ---- sizing ---------------------------------------------------------------------------
    def acceptance(self, rid=None) -> float:
        """Request ``rid``'s running estimate of P(a draft token is accepted | the ones before
        it were); the prior for an unknown request."""
        acc, rej = self._seen.get(rid, (self.prior_tokens * self.prior, self.prior_tokens * (1 - self.prior)))
        return acc / max(1e-9, acc + rej)

    def chain_length(self, batch: int, cap: int, acceptance: float | None = None, priced: bool = True) -> int:
        """The chain length (0..cap) maximising expected tokens per unit time at this batch:
        ``B * sum_{i<=k} a^i / (cost(B (k + w)) + d(k))`` with ``a`` the running acceptance,
        ``cost`` the target's step-cost curve (relative to a one-row-per-request step), ``w``
        the tree width (the root's extra children count as cost only) and ``d(k)`` the
        measured time of drafting k tokens over a target step (:meth:`drafting_cost`;
        ``cost_model.best_chain_length``; ``acceptance``: default the prior; ``priced=False``:
        drafting taken as free, d = 0)."""
        a = self.prior if acceptance is None else acceptance
        k, _ = best_chain_length(a, cap, self._cost, batch=batch, width=self.tree_width,
                                 draft_cost=(lambda forwards: self.drafting_cost(forwards, batch)) if priced else 0.0)
        return k

    def drafting_cost(self, forwards: int, batch: int) -> float:
        """A drafting call of ``forwards`` draft forwards relative to a one-row-per-request step
        of ``batch`` requests (0 for none): the call's measured fixed part plus a forward's
        time each, both measured in the drafting calls (:meth:`_draft_chains`). A forward's
        time includes feeding it and drawing its token, which on a small draft cost more than
        the forward itself; the fixed part (the batch's setup, the chains' bookkeeping) is
        priced once a call, not once a token, so it does not cut long chains that pay."""
        if forwards <= 0 or self._token_s is None:
            return 0.0
        return self.relative_cost((self._call_s or 0.0) + forwards * self._token_s, batch)

    def _sized_length(self, rid, cap: int, batch: int) -> tuple[int, bool]:
        """(request ``rid``'s chain length this step, whether it is a probe: one token, drafted
        whatever the draft's confidence): :meth:`chain_length` at its running acceptance, or a
        probe where :meth:`_probe` says so."""
        if cap <= 0:
            return 0, False
        k = self.chain_length(batch, cap, self.acceptance(rid))
        return (1, True) if self._probe(rid, k, cap, batch) else (k, False)

    def _probe(self, rid, k: int, cap: int, batch: int) -> bool:
        """Whether request ``rid``, sized to ``k`` tokens, drafts a one-token probe instead:
        - while its running acceptance keeps every chain off (``k`` 0), it has fewer than
          PROBE_TOKENS drafted tokens of its own verified, and a chain would pay at full
          acceptance — so a prior that is too low (a whole model by name has no recorded
          agreement: 0.5) cannot keep a draft that agrees 97% of the time off for good, and
          one that does not pay stops after a few probes;
        - once it has, after REPROBE_AFTER steps in which it drafted nothing, whether its
          acceptance kept chains off or its chains stopped before their first token on the
          draft's confidence. Both are measured only by drafting, and an answer's opening (a
          greeting, a restated question) agrees less than what follows it, so a few early
          misses would otherwise keep drafting off for the rest of a long answer. The evidence
          from before the idle stretch then counts half (``verified``: the text has moved on);
          an accepted re-probe is followed by another the next step that drafts nothing, until
          chains draft again or one is rejected, which doubles the wait (up to REPROBE_MAX_WAIT);
        - where only the price of drafting keeps every chain off (one would pay at full
          acceptance if drafting were free), once while no draft forward has been timed since
          the request was admitted — a price is measured only by drafting, so one inflated by
          a busy moment would otherwise keep drafting off for every later request, with
          nothing left to measure it again."""
        idle, wait = self._idle.get(rid, 0), self._reprobe_wait.get(rid, REPROBE_AFTER)
        probing = self._verified.get(rid, 0) < PROBE_TOKENS
        if k > 0:  # chains pay; only chains that stop on confidence can draft nothing
            due = self.by_confidence is not None and idle >= max(1, wait)
        elif self.chain_length(batch, cap, 1.0) > 0:
            if probing:
                return True
            due = idle >= wait
        else:
            stale = self._price_samples == self._admitted_at.get(rid)
            return probing and stale and self.chain_length(batch, cap, 1.0, priced=False) > 0
        if due:
            self._reprobing[rid] = idle > 0  # whether it follows an idle stretch
        return due

    def start(self, gen, reqs):
        if self.lookup is not None:
            self.lookup.start(gen, [])  # its tables and step cost; requests are admitted below
        if self.sized:
            self._take_step_cost(gen)
            if self._token_s is None:
                from ...decoding.cost_model import draft_token_seconds

                self._token_s = draft_token_seconds(self.model)
        if self.share:
            self.cache = gen.cache
        else:
            self.cache = self.model.new_cache(gen.cache.max_batch, gen.cache.max_len, block_size=gen.cache.block_size)
            self.slot, self.fed = {}, {}
        self.admit(gen, reqs)

    def admit(self, gen, reqs):
        if self.lookup is not None:
            self.lookup.admit(gen, reqs)
        for r in reqs:
            self._seen[r.rid] = [self.prior_tokens * self.prior, self.prior_tokens * (1 - self.prior)]
            self._admitted_at[r.rid] = self._price_samples
            for per_request in (self._verified, self._idle, self._reprobe_wait):
                per_request.pop(r.rid, None)
        if self.share:
            return
        for r in reqs:
            self.slot[r.rid] = self.cache.add_request(len(r.prompt))
            self.model.prefill(torch.tensor(r.prompt[:-1], dtype=torch.int64), self.cache, self.slot[r.rid])
            self.fed[r.rid] = list(r.prompt[:-1])

    def _slot(self, r):
        return r.slot if self.share else self.slot[r.rid]

    @torch.inference_mode()
    def propose(self, gen, reqs, lengths):
        drafts = [Draft.root_only(r.tokens[-1]) for r in reqs]
        caps = list(lengths)
        stops = [False] * len(reqs)  # chains that stop on the draft's confidence, drafted up to the cap
        if self.sized and self._token_s is not None:
            sized = [self._sized_length(r.rid, n, len(reqs)) for r, n in zip(reqs, lengths)]
            lengths = [k for k, _ in sized]
            if self.by_confidence is not None:  # where the sizing drafts a chain, not a one-token probe
                stops = [k > 0 and not probe for k, probe in sized]
        if self.lookup is None:
            return self._draft_chains(reqs, [cap if stop else k for stop, k, cap in zip(stops, lengths, caps)],
                                      stops, drafts)
        lookups = self.lookup.greedy_candidates(reqs, caps)
        # Sampled requests: the lookup's chain (one-hot q rows) or the draft's drawn chain, never both.
        chains = self.lookup.sampled_chains(
            reqs, caps, lambda b, c, n: lengths[b] <= 0 or self._lookup_wins(reqs[b].rid, c, lengths[b]),
            self.vocab_size)
        lengths = [0 if b in chains or (c is not None and self._lookup_wins(r.rid, c, k)) else k
                   for b, (r, c, k) in enumerate(zip(reqs, lookups, lengths))]
        drafts = self._draft_chains(reqs, lengths, stops, drafts)  # (no stops beside lookup: by_confidence None)
        keep = self.lookup.select([c.ranked if c is not None else [] for c in lookups])  # the batch's tries that pay
        drafts = self.lookup.merge_into(reqs, drafts, lookups, keep)
        for b, chain in chains.items():
            drafts[b] = chain
        return drafts

    def _keep_drafting(self, run: ChainRun, confidence: float, batch: int, sampled: bool) -> tuple:
        """(p, run another forward) for the token just drawn in a confidence-stopped chain:
        p the estimated probability that the chain up to it is accepted, None to leave it out.
        A greedy token is kept if its expected tokens (the chain's path probability times its
        own estimated acceptance) raise the step's expected tokens per unit time, with the
        forwards already run counted as spent. A sampled token is kept whatever it is: leaving
        a drawn token out because of its own probability would make the proposals follow
        another distribution than the q they are verified against, while stopping on the
        tokens drawn before it keeps rejection sampling exact. Drafting goes on if some
        further m tokens, at the request's running acceptance, would raise the pay-off again
        (their forwards counted)."""
        a = self.acceptance(run.request.rid)
        p = run.path * self.by_confidence(confidence, a)
        k = len(run.chain)

        def value(expected, tokens, forwards):
            return payoff(expected, batch * (tokens + 1), self.cost, batch=batch,
                          draft_cost=self.drafting_cost(forwards, batch))

        now = value(run.expected + p, k + 1, run.forwards)
        if not sampled and now < value(run.expected, k, run.forwards):
            return None, False
        more, expected = p, run.expected + p
        for m in range(1, run.length - k):
            more *= a
            expected += more
            if value(expected, k + 1 + m, run.forwards + m) > now:
                return p, True
        return p, False

    def _draft_chains(self, reqs, lengths, stops, drafts) -> list:
        """The draft model's chains (or top-k trees) of ``lengths[b]`` tokens into ``drafts``;
        where ``stops[b]``, at most ``lengths[b]``, stopped by :meth:`_keep_drafting`."""
        t_start = time.perf_counter()
        runs = self._start_runs(reqs, lengths, stops)
        if not runs:
            return drafts
        uniforms = draft_uniforms([run.request for run in runs], max(run.length for run in runs))
        in_forwards = 0.0
        for step in range(max(run.length for run in runs)):
            t_step = time.perf_counter()
            live = [i for i, run in enumerate(runs) if step < run.length]
            if not live:  # every chain stopped on confidence
                break
            rows = [runs[i] for i in live]
            # A forward that also catches up a draft cache lagging by more than the one or two
            # tokens a verification leaves (steps this request did not draft, lookup tokens
            # accepted) costs that lag once; it is not the price of a drafted token.
            priced = all(len(run.feed) <= 2 for run in rows)
            self._extend_chains(rows, self._forward_rows(rows), uniforms[live, step], len(runs))
            # Every forward is timed (the call's fixed part is what lies outside them). Those
            # that fed one or two tokens a row are price samples, the first included. One sample
            # moves the price by at most 40% (a sample at most 3x the price): a stall of the
            # machine is not the draft's cost, and a lasting change still shows within a few
            # forwards.
            dt = time.perf_counter() - t_step
            in_forwards += dt
            if self._token_s is not None and priced:
                self._token_s = 0.8 * self._token_s + 0.2 * min(dt, 3 * self._token_s)
                self._price_samples += 1
        drafts = self._chains_into(runs, drafts)
        if self._token_s is not None:  # the call's fixed part (drafting_cost)
            rest = time.perf_counter() - t_start - in_forwards
            self._call_s = rest if self._call_s is None else 0.8 * self._call_s + 0.2 * rest
        return drafts

    def _start_runs(self, reqs, lengths, stops) -> list:
        """A :class:`ChainRun` for each request with a chain to draft (``lengths[b]`` > 0),
        its draft cache reserved for what it feeds."""
        runs = []
        for b, (r, k) in enumerate(zip(reqs, lengths)):
            if k <= 0:
                continue
            # Step 0 feeds what the draft cache lacks (the root, plus any tokens accepted last
            # step that the draft never saw); later steps feed one drafted token each.
            slot = self._slot(r)
            committed = self.cache.length(slot)
            pending = r.tokens[committed:]
            self.cache.reserve([slot], [len(pending) + k])
            runs.append(ChainRun(b, r, slot, k, committed, pending, feed=pending, pos=committed, stops=stops[b]))
        return runs

    def _forward_rows(self, rows: list) -> torch.Tensor:
        """One draft forward of every run's ``feed`` at its cache positions -> the logits
        [len(rows), Vd] of each run's last fed token."""
        model, cache = self.model, self.cache
        row_positions = [torch.arange(run.pos, run.pos + len(run.feed)) for run in rows]
        indptr = torch.tensor([0] + list(np.cumsum([len(run.feed) for run in rows])), dtype=torch.int32)
        block_table, _ = cache.batch_view([run.slot for run in rows])
        slot_mapping = torch.cat([cache.slot_mapping(run.slot, pos) for run, pos in zip(rows, row_positions)])
        batch = Batch(block_table, torch.tensor([run.pos for run in rows], dtype=torch.int32), indptr, slot_mapping)
        tokens = torch.tensor([t for run in rows for t in run.feed], dtype=torch.int64)
        h = model.forward(tokens, torch.cat(row_positions), cache, batch)
        return model.logits(h[indptr[1:].long() - 1])

    def _extend_chains(self, rows: list, logits: torch.Tensor, uniforms: torch.Tensor, batch: int) -> None:
        """Each run's next token from its row of ``logits`` [len(rows), Vd] (drawn with
        ``uniforms``; a sized chain may stop instead, :meth:`_keep_drafting`), appended to its
        chain with the q it was drawn from (over the target's vocabulary) and fed next."""
        vocab = self.model.draft_vocab  # None, or the target ids of a draft-vocabulary head's rows
        drawn, drawn_q = draw_tokens(logits, [run.request for run in rows], uniforms)
        if self.by_confidence is not None:  # the draft's probability of each drawn token (q of a sampled one)
            greedy = logits.softmax(-1).amax(-1).tolist()
            conf = [float(q[t]) if q is not None else g for t, q, g in zip(drawn, drawn_q, greedy)]
        for i, run in enumerate(rows):
            tok, q = drawn[i], drawn_q[i]
            run.forwards += 1
            if run.stops:
                p, more = self._keep_drafting(run, conf[i], batch, q is not None)
                if p is None:
                    run.length = len(run.chain)
                    continue
                run.path, run.expected = p, run.expected + p
                if not more:
                    run.length = len(run.chain) + 1
            if self.by_confidence is not None:  # probes too: what they find calibrates the estimates
                run.confidence.append(conf[i])
            if not run.chain and self.tree_width > 1:  # the root's children: the best first tokens
                best = logits[i].topk(self.tree_width).indices.tolist()
                tok, q = best[0], None
                run.alts = best[1:] if vocab is None else vocab[best[1:]].tolist()
            elif self.tree_width > 1:
                tok, q = int(logits[i].argmax()), None
            if vocab is not None:
                tok = int(vocab[tok])
                if q is not None:  # q over the target's vocabulary: zero outside the draft's
                    q = torch.zeros(self.vocab_size, dtype=q.dtype).index_copy_(0, vocab, q)
            run.chain.append(tok)
            run.probs.append(q)
            run.pos += len(run.feed)
            run.feed = [tok]

    def _chains_into(self, runs: list, drafts: list) -> list:
        """The finished runs' chains (or top-k trees) into ``drafts``, with what verification
        and the draft cache's bookkeeping need of them."""
        for run in runs:
            r = run.request
            self._drafted[r.rid] = (run.chain, run.confidence)
            if self.tree_width > 1:
                k = len(run.chain)
                drafts[run.index] = Draft(list(range(-1, k)) + [0] * len(run.alts), [r.tokens[-1]] + run.chain + run.alts)
            elif run.chain:  # (a chain stopped before its first token leaves the root alone)
                q = None
                if run.probs[0] is not None:
                    q = torch.stack(run.probs + [torch.zeros_like(run.probs[0])])
                drafts[run.index] = Draft.chain(r.tokens[-1], run.chain, q)
            if not self.share:
                # What the draft cache holds after this step (committed + written, in order): the
                # chain's tokens that a forward fed (a stopped chain's last forward fed its last token).
                self.fed[r.rid] = r.tokens[:run.committed] + run.pending + run.chain[:run.forwards - 1]
        return drafts

    # ---- prompt lookup (draft+ngram) ---------------------------------------------------------
    def _lookup_wins(self, rid, c, k: int) -> bool:
        """Whether request ``rid``'s lookup tries alone promise at least what its ``k``-token
        draft chain would (expected tokens per unit time at batch 1, drafting time included)."""
        if k <= 0 or not c.ranked:
            return False
        _, tries = best_node_count([p for p, _ in c.ranked], self.cost)
        a = self.acceptance(rid)
        _, chain = best_chain_length(a, k, self._cost, width=self.tree_width,
                                     draft_cost=lambda forwards: self.drafting_cost(forwards, 1))
        return tries >= chain

    def verified(self, gen, reqs, num_accepted):
        if self.lookup is not None:
            self.lookup.verified_merged(gen, reqs, num_accepted)
        for r, n in zip(reqs, num_accepted):  # the running acceptance rate (chain_length)
            chain, confidence = self._drafted.pop(r.rid, ([], []))
            k = len(chain)
            reprobe = self._reprobing.pop(r.rid, None)
            if r.rid in self._seen:  # (_probe) steps in a row it drafted nothing
                self._idle[r.rid] = 0 if k > 0 else self._idle.get(r.rid, 0) + 1
            if k > 0 and reprobe is None:  # it drafts again: a later idle stretch waits REPROBE_AFTER
                self._reprobe_wait.pop(r.rid, None)
            if k > 0 and r.rid in self._seen:
                total = int(n)
                n = max(0, min(total, k))  # -1: the step failed (NaN logits)
                if self.lookup is not None and total > 0:  # the accepted tokens may be the lookup's
                    n = accepted_on_tree(list(range(-1, k)), [r.tokens[-1]] + chain,
                                         r.tokens[len(r.tokens) - (total + 1): len(r.tokens) - 1])
                seen = self._seen[r.rid]
                if reprobe is not None:  # (_probe)
                    if reprobe:  # the evidence from before the idle stretch counts half
                        seen[0], seen[1] = 0.5 * seen[0], 0.5 * seen[1]
                    wait = self._reprobe_wait.get(r.rid, REPROBE_AFTER)
                    self._reprobe_wait[r.rid] = 0 if n > 0 else min(max(REPROBE_AFTER, 2 * wait), REPROBE_MAX_WAIT)
                seen[0] += n
                seen[1] += n < k
                self._verified[r.rid] = self._verified.get(r.rid, 0) + n + (n < k)
                # The verified tokens (the accepted ones, then the first rejected) calibrate the estimates.
                for i, c in enumerate(confidence[:n + 1] if total >= 0 else []):
                    self.by_confidence.observe(c, i < n)
        if self.share:
            return
        for r in reqs:
            if r.done:
                continue
            slot = self.slot[r.rid]
            fed, toks = self.fed[r.rid], r.tokens
            n = cache_len = self.cache.length(slot)
            while n < len(fed) and n < len(toks) - 1 and fed[n] == toks[n]:
                n += 1
            self.cache.commit([slot], [n - cache_len])

    def finish(self, gen, req):
        if self.lookup is not None:
            self.lookup.finish(gen, req)
        for per_request in (self._seen, self._admitted_at, self._verified, self._idle, self._reprobe_wait,
                            self._reprobing):
            per_request.pop(req.rid, None)
        if not self.share:
            self.cache.free(self.slot[req.rid])


class SelfSpecDrafter(ModelDrafter):
    """Self-speculation: the target's first layers draft, writing into the target's cache
    (``ModelDrafter`` options in ``kw``). With ``exit_model`` (``draft_model.exit_model``: the
    target's first L layers with a trained exit head — norm + low-rank adapter folded into a
    draft-vocabulary LM head) the exit is trained; else plain early exit after
    ``num_layers`` layers through the target's own final norm and LM head."""

    def __init__(self, target: Llama, num_layers: int | None = None, *, exit_model: Llama | None = None, **kw):
        if exit_model is None and num_layers is None:
            raise ValueError("SelfSpecDrafter needs num_layers or an exit_model")
        model = exit_model if exit_model is not None else target.truncated(num_layers)
        name = f"self-spec-{model.config.num_layers}" + ("-exit" if exit_model is not None else "")
        super().__init__(model, share_target_cache=True, name=kw.pop("name", name), **kw)
