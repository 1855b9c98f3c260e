"""The speculative decode loop for a batch of requests with independent progress.

Each step (:meth:`Generator.step`), for every unfinished request:

1. draft (:meth:`Generator.draft`) — the drafter proposes a tree (node 0 = the root, the last
   verified token, whose K/V is not yet cached; node i has parent ``parents[i] < i``), at
   most ``k`` deep, where ``k`` comes from the speculation-length schedule and the tokens the
   request may still emit;
2. verify (:meth:`Generator.verify`) — one target forward over all nodes of all requests
   through ``tree_attention`` (node j at cache position ``prefix_len + j``, RoPE position
   ``prefix_len + depth``);
3. accept (:meth:`Generator.accept`) — ``tree_rejection_sample`` (greedy, or temperature
   with top-k/top-p applied to the target logits first) gives the accepted path and one
   recovered/bonus token;
4. commit — ``compact_kv`` (``PagedKVCache.compact``) moves the accepted nodes' K/V next to
   the root and commits them in the cache; :meth:`Generator.commit` appends the emitted
   tokens to the requests, truncated at an EOS token or at ``max_new_tokens``.

Plain autoregressive decoding is the same loop with no drafter (a tree of the root alone).

Continuous batching (``generate(..., max_batch=B)``): at most B requests decode at once; when
one finishes, its cache slot goes to the next waiting prompt, which is prefilled and joins
the running batch at the next step (``Drafter.admit``). Without it every prompt decodes from
the first step and the batch runs until its slowest request is done, so a token accepted by a
request that is not the slowest one saves no step: speculation pays at batch B > 1 only
under continuous batching, which is how serving engines batch.

A request that goes wrong fails alone (:meth:`Generator.fail`: ``Request.error`` set, ``done``,
its cache slot freed); the others go on exactly as they would alone. The failures: NaN target
logits (the samplers' ``num_accepted = -1``), its drafter raising (the batch's proposal is
retried request by request to find which — a proposal that raises leaves the drafter as it
was, ``Drafter.propose`` — and the request fails rather than going on undrafted, so that an
error in a drafter is seen), or the cache having no blocks for its tree (``OutOfBlocksError``).
A prompt plus ``max_new_tokens`` beyond the model's context is a ValueError from
:meth:`Generator.generate` before any work.

Randomness is per request: the verification's Philox draws are keyed by the request's seed
and counted from its own offset, which moves on by the request's own tree size each step
(the counters ``tree_rejection_sample`` used for it), and drafters draw from the same
request's counters (``PURPOSE_DRAFT``). So a seeded request gives the same tokens alone, in
any batch, at any slot, with or without continuous batching — whenever its drafts are its
own (drafters that size their trees from the batch or from measured times adapt the tree,
and the tokens follow it; every output stays exactly distributed).

The target's hidden states are handed only to drafters that ask for them
(``Drafter.uses_hidden``, ``Drafter.hidden_states``); the request itself keeps none.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from .. import ops
from ..kv_cache import OutOfBlocksError
from ..models.llama import Batch, Llama
from ..tree import tree_mask as build_tree_mask, tree_mask_ragged
from .cost_model import LiveCheck, RelativeStepCost, StepCost, step_cost_for, with_seconds
from .drafter import Draft, Drafter
from .schedule import SpecSchedule
from .stats import RequestStats


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0


@dataclass
class Request:
    prompt: list
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: int = 0
    # Decoding state.
    tokens: list = field(default_factory=list)  # prompt + emitted; tokens[-1] is the root
    output: list = field(default_factory=list)  # emitted tokens
    slot: int = -1
    offset: int = 0  # Philox counter base: this request's own, moved on by its own tree size
    done: bool = False
    error: str | None = None  # why the request failed (then done, with the output so far)
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)


@dataclass
class Verification:
    """The draft trees of one step, padded to N nodes, and the target's forward over them."""

    parents: torch.Tensor  # int32 [B, N], -1 padded
    tokens: torch.Tensor  # int64 [B, N], -1 padded
    num_nodes: torch.Tensor  # int32 [B]
    sizes: list  # int: num_nodes as Python ints
    depth: list  # int: each tree's depth
    hidden: torch.Tensor  # [T, H] pre-norm hidden states ([T, (k + 1) H] with the drafter's k feature_layers);
    # request b's nodes at rows qo_indptr[b]:qo_indptr[b+1]
    logits: torch.Tensor  # fp32 [T, V], the same rows
    qo_indptr: torch.Tensor  # int32 [B+1]


class Accepted(NamedTuple):
    """What ``tree_rejection_sample`` gives for one step."""

    nodes: torch.Tensor  # int32 [B, N-1]: accepted node indices, in path order, -1 padded
    tokens: torch.Tensor  # int64 [B, N]: the accepted draft tokens then the recovered/bonus token
    num_accepted: torch.Tensor  # int32 [B] (-1: a NaN row)


class Generator:
    """Speculative (or, with ``drafter=None``, autoregressive) generation with ``model``."""

    def __init__(self, model: Llama, drafter: Drafter | None = None, schedule: SpecSchedule | None = None,
                 *, block_size: int = 64, step_cost=None):
        """``step_cost``: what a verification step costs against its rows, which the
        tree-sizing drafters weigh drafts against (see :attr:`step_cost`)."""
        self.model = model
        self.drafter = drafter
        self.schedule = schedule or SpecSchedule("constant", 4)
        self.block_size = block_size
        self.eos = set(model.config.eos_token_ids)
        self.cache = None
        self.step_cost = step_cost

    @property
    def step_cost(self):
        """The step cost the drafters weigh drafts against — the one place they get it from: a
        ``cost_model.StepCost``, a callable ``rows -> cost relative to a one-row step`` or a
        sequence of such costs at 1, 2, ... rows, as given; by default (None) the target's
        measured curve, ``cost_model.step_cost_for(model)``, resolved at first use (so a
        generation whose drafter never asks measures nothing). A measured curve is checked
        against the verification steps this Generator times (``cost_model.LiveCheck``) and
        measured again, in place, when they disagree."""
        if self._step_cost is None:
            self._step_cost = step_cost_for(self.model)
        return self._step_cost

    @step_cost.setter
    def step_cost(self, value) -> None:
        self._step_cost = value
        self._live = None

    def drafter_step_cost(self, own=None, *, step_seconds: float | None = None):
        """The step cost a drafter sizes its drafts by (``cost_model``'s pay-off functions):
        ``own`` (the drafter's own ``step_cost=``, if it was given one; this Generator's
        curve is then not resolved) or else :attr:`step_cost`, as ``cost_model.with_seconds``
        makes it — a StepCost as it is; a relative curve with the seconds of a one-row step
        from ``step_seconds``, else from :attr:`step_cost` when that holds seconds, else from
        the target's measured curve (read lazily, when a drafter weighs drafting time)."""
        cost = with_seconds(self.step_cost if own is None else own, step_seconds)
        if isinstance(cost, RelativeStepCost) and cost.one_row_seconds is None:
            cost = RelativeStepCost(cost.relative, self._one_row_seconds)
        return cost

    def _one_row_seconds(self) -> float:
        """Seconds of a one-row verification step: from :attr:`step_cost` when it is a
        StepCost, else from the target's measured curve."""
        cost = self.step_cost
        return (cost if isinstance(cost, StepCost) else step_cost_for(self.model)).seconds(1)

    def _observe_step(self, rows: int, batch: int, seconds: float) -> None:
        """Report a verification step's time to the live check of a measured curve (never to
        a given table or callable, and never before a drafter asked for the curve)."""
        cost = self._step_cost
        if not (isinstance(cost, StepCost) and cost.meta.get("measured")):
            return
        if self._live is None or self._live.cost is not cost:
            self._live = LiveCheck.for_cost(cost, self.model)
        self._live.observe(rows, batch, seconds)

    def generate(self, prompts: list, max_new_tokens: int = 64, sampling: SamplingParams | list | None = None,
                 on_tokens: Callable[[Request, list], None] | None = None, *, stop_at_eos: bool = True,
                 max_batch: int | None = None) -> list[Request]:
        """Generate for every prompt (lists of token ids, at least one token each); returns the
        requests with ``.output`` (token ids) and ``.stats``, in prompt order.
        ``on_tokens(request, new_ids)`` is called after every step that emitted tokens
        (streaming). ``max_batch``: at most this many requests decode at once, the others
        wait and join as slots free up (continuous batching, module docstring); default: all
        at once."""
        if not isinstance(sampling, list):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} sampling parameters for {len(prompts)} prompts")
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        reqs = [Request(list(p), max_new_tokens, s, rid=i) for i, (p, s) in enumerate(zip(prompts, sampling))]
        if any(len(r.prompt) == 0 for r in reqs):
            raise ValueError("every prompt needs at least one token")
        context = self.model.config.max_position_embeddings
        for r in reqs:
            if len(r.prompt) + max_new_tokens > context:
                raise ValueError(f"request {r.rid}: a prompt of {len(r.prompt)} tokens + max_new_tokens = "
                                 f"{max_new_tokens} exceed the model's context of {context} positions "
                                 "(config.max_position_embeddings)")
        if not reqs:
            return reqs
        eos = self.eos if stop_at_eos else set()
        extra = (self.drafter.max_nodes if self.drafter else 1) + 2
        max_len = max(len(r.prompt) for r in reqs) + max_new_tokens + extra
        slots = min(max_batch or len(reqs), len(reqs))
        self.cache = self.model.new_cache(slots, max_len, block_size=self.block_size)
        waiting = list(reversed(reqs))  # popped from the end: prompt order
        active = self._admit(waiting, slots, max_new_tokens, first=True)
        while active:
            self.step(active, on_tokens, eos)
            for r in active:
                if r.done:
                    self.cache.free(r.slot)
                    if self.drafter:
                        self.drafter.finish(self, r)
            active = [r for r in active if not r.done]
            if waiting and len(active) < slots:
                active += self._admit(waiting, slots - len(active), max_new_tokens)
        return reqs

    def _admit(self, waiting: list, n: int, max_new_tokens: int, first: bool = False) -> list[Request]:
        """Prefill up to ``n`` requests from the end of ``waiting`` into free cache slots and
        hand them to the drafter (``start`` for a generation's first requests, ``admit`` for
        those joining a running batch); returns the ones with tokens to generate. Requests
        with nothing to generate are done at once and give their slot back."""
        admitted, hidden = [], []
        while waiting and len(admitted) < n:
            r = waiting.pop()
            t0 = time.perf_counter()
            r.tokens = list(r.prompt)
            r.slot = self.cache.add_request(len(r.prompt))
            # The prompt's last token is the first root: only the tokens before it are cached.
            h = self._prefill(r)
            r.offset = 0
            r.stats.time_prefill = time.perf_counter() - t0
            r.stats.prefill_tokens = len(r.prompt) - 1
            if max_new_tokens <= 0:
                r.done = True
                self.cache.free(r.slot)
                continue
            admitted.append(r)
            hidden.append(h)
        if self.drafter and (admitted or first):
            t0 = time.perf_counter()
            (self.drafter.start if first else self.drafter.admit)(self, admitted)
            if self.drafter.uses_hidden:
                for r, h in zip(admitted, hidden):  # row t produced prompt token t + 1
                    self.drafter.hidden_states(self, r, h, r.prompt[1:])
            # The drafter's own work on the prompts (a draft model's prefill) is prefill time,
            # shared by the requests it admitted: the decode phase is the steps alone.
            share = (time.perf_counter() - t0) / max(1, len(admitted))
            for r in admitted:
                r.stats.time_prefill += share
        return admitted

    @property
    def feature_layers(self) -> tuple:
        """The layer counts whose states the drafter reads besides the last layer's (its
        ``feature_layers``; () when it reads none or only the last)."""
        return tuple(self.drafter.feature_layers) if self.drafter and self.drafter.uses_hidden else ()

    def _prefill(self, r: Request) -> torch.Tensor:
        """The prefill of request ``r``'s prompt but its last token -> the hidden states its
        drafter is handed ([P - 1, H], or with ``feature_layers`` [P - 1, (k + 1) H])."""
        tokens = torch.tensor(r.prompt[:-1], dtype=torch.int64)
        if not self.feature_layers:
            return self.model.prefill(tokens, self.cache, r.slot)
        h, states = self.model.prefill(tokens, self.cache, r.slot, return_layers=self.feature_layers)
        return self.model.with_features(h, states)

    @torch.inference_mode()
    def step(self, reqs: list[Request], on_tokens=None, eos=frozenset()) -> None:
        """One speculative step for every request of ``reqs`` (see the module docstring)."""
        t0 = time.perf_counter()
        drafts = self.draft(reqs)
        # Reserve each tree's cache blocks alone, so that a request the cache cannot hold fails alone.
        for r, d in zip(reqs, drafts):
            if not r.done:
                try:
                    self.cache.reserve([r.slot], [len(d.tokens)])
                except OutOfBlocksError as e:
                    self.fail(r, f"the KV cache cannot grow: {e}")
        drafts = [d for r, d in zip(reqs, drafts) if not r.done]
        reqs = [r for r in reqs if not r.done]
        if not reqs:
            return
        t1 = time.perf_counter()
        verified = self.verify(reqs, drafts)
        t2 = time.perf_counter()
        accepted = self.accept(reqs, drafts, verified)
        t3 = time.perf_counter()
        self.cache.compact([r.slot for r in reqs], accepted.nodes, accepted.num_accepted)
        t4 = time.perf_counter()
        for r in reqs:
            r.stats.time_draft += t1 - t0
            r.stats.time_verify += t2 - t1
            r.stats.time_sample += t3 - t2
            r.stats.time_compact += t4 - t3
        num_accepted = self.commit(reqs, verified, accepted, on_tokens, eos)
        if self.drafter is not None:
            if self.drafter.uses_hidden:
                self.hand_hidden_states(reqs, verified, accepted)
            self.drafter.verified(self, reqs, num_accepted)

    def draft(self, reqs: list[Request]) -> list[Draft]:
        """Each request's draft tree, at most as deep as its schedule's length and the tokens
        it may still emit allow (the root alone without a drafter)."""
        ks = [max(0, min(self.schedule.length(r.rid), r.remaining - 1)) for r in reqs]
        if self.drafter is None or max(ks) == 0:
            return [Draft.root_only(r.tokens[-1]) for r in reqs]
        try:
            return self.drafter.propose(self, reqs, ks)
        except Exception as e:
            if len(reqs) == 1:
                self.fail(reqs[0], f"the drafter failed: {type(e).__name__}: {e}")
                return [Draft.root_only(reqs[0].tokens[-1])]
        # Find the request(s) it fails for: propose again one request at a time (a proposal
        # that raised left the drafter as it was, so each retry sees what the batch saw).
        return [self.draft([r])[0] for r in reqs]

    def fail(self, r: Request, error: str) -> None:
        """End request ``r`` with ``error`` (:meth:`generate` frees its cache slot); its output
        is what it emitted so far."""
        r.error = f"request {r.rid}: {error}"
        r.done = True

    def verify(self, reqs: list[Request], drafts: list[Draft]) -> Verification:
        """One target forward over every node of every request (node j of request b at cache
        position ``length + j``, RoPE position ``length + depth``; K/V written, not committed)."""
        model, cache = self.model, self.cache
        B = len(reqs)
        sizes = [len(d.tokens) for d in drafts]
        N = max(sizes)
        slots = [r.slot for r in reqs]
        if N == 1:  # roots only: the autoregressive step, its batch as the cache's host integers
            t0 = time.perf_counter()
            hidden, logits = model.decode_logits([d.tokens[0] for d in drafts], cache, slots,
                                                 feature_layers=self.feature_layers)
            self._observe_step(B, B, time.perf_counter() - t0)
            return Verification(torch.full((B, 1), -1, dtype=torch.int32),
                                torch.tensor([d.tokens for d in drafts], dtype=torch.int64),
                                torch.ones(B, dtype=torch.int32), sizes, [0] * B, hidden, logits,
                                torch.arange(B + 1, dtype=torch.int32))
        new = cache.append_slots(slots, sizes)
        block_table, prefix_lens = cache.batch_view(slots)
        depths = [d.depths() for d in drafts]
        tokens = torch.tensor([t for d in drafts for t in d.tokens], dtype=torch.int64)
        positions = torch.tensor([cache.length(s) + x for s, dep in zip(slots, depths) for x in dep], dtype=torch.int64)
        parents = torch.full((B, N), -1, dtype=torch.int32)
        tree_tokens = torch.full((B, N), -1, dtype=torch.int64)
        for b, d in enumerate(drafts):
            parents[b, : sizes[b]] = torch.tensor(d.parents, dtype=torch.int32)
            tree_tokens[b, : sizes[b]] = torch.tensor(d.tokens, dtype=torch.int64)
        num_nodes = torch.tensor(sizes, dtype=torch.int32)
        is_chain = all(p == i - 1 for d in drafts for i, p in enumerate(d.parents))
        mask = None if is_chain else tree_mask_ragged(build_tree_mask(parents, num_nodes), new.qo_indptr, tokens.shape[0])
        batch = Batch(block_table, prefix_lens, new.qo_indptr, new.slot_mapping, mask)
        t0 = time.perf_counter()
        hidden, logits = model.forward_logits(tokens, positions, cache, batch, feature_layers=self.feature_layers)
        # What the step-cost curve measures: the forward and the LM head over every row.
        self._observe_step(int(tokens.shape[0]), B, time.perf_counter() - t0)
        return Verification(parents, tree_tokens, num_nodes, sizes, [max(dep) for dep in depths], hidden,
                            logits, new.qo_indptr)

    def accept(self, reqs: list[Request], drafts: list[Draft], v: Verification) -> Accepted:
        """``tree_rejection_sample`` of every request's tree against the target logits (greedy,
        or at the request's temperature with top-k/top-p applied to the target first)."""
        B, N = v.parents.shape
        sizes = v.sizes
        if all(s == N for s in sizes):
            logits = v.logits.view(B, N, -1)
        else:
            logits = v.logits.new_zeros(B, N, v.logits.shape[-1])
            for b in range(B):
                logits[b, : sizes[b]] = v.logits[v.qo_indptr[b]: v.qo_indptr[b] + sizes[b]]
        temperature = torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32)
        sampled = [b for b, r in enumerate(reqs) if r.sampling.temperature > 0]
        draft_probs = None
        if sampled:
            filt = [b for b in sampled if reqs[b].sampling.top_k > 0 or reqs[b].sampling.top_p < 1]
            if filt:
                # These rows become logits / T with top-k / top-p applied, sampled at T = 1.
                rows = logits[filt].reshape(len(filt) * N, -1)
                temp = temperature[filt]
                top_k = torch.tensor([reqs[b].sampling.top_k for b in filt for _ in range(N)], dtype=torch.int32)
                top_p = torch.tensor([reqs[b].sampling.top_p for b in filt for _ in range(N)], dtype=torch.float32)
                ops.apply_temperature_top_k_top_p(rows, temp.repeat_interleave(N), top_k, top_p)
                logits[filt] = rows.view(len(filt), N, -1)
                temperature[filt] = torch.where(temp >= ops.MIN_SAMPLING_TEMPERATURE, 1.0, temp)
            if any(d.probs is not None for d in drafts):
                draft_probs = torch.zeros(B, N, logits.shape[-1], dtype=torch.float32)
                for b, d in enumerate(drafts):
                    if d.probs is not None:
                        draft_probs[b, : d.probs.shape[0]] = d.probs
        seed = torch.tensor([r.sampling.seed for r in reqs], dtype=torch.int64)
        offset = torch.tensor([r.offset for r in reqs], dtype=torch.int64)
        return Accepted(*ops.tree_rejection_sample(v.parents, v.tokens, v.num_nodes, logits, draft_probs, temperature,
                                                   seed, offset))

    def commit(self, reqs: list[Request], v: Verification, acc: Accepted, on_tokens=None,
               eos=frozenset()) -> list[int]:
        """After the cache compaction: append each request's emitted tokens (cut at an EOS
        token and at ``max_new_tokens``), move its root and Philox offset on, record its
        statistics and schedule, stream the new tokens. Returns the accepted counts."""
        n_acc = acc.num_accepted.tolist()
        out_rows = acc.tokens.tolist()
        for b, r in enumerate(reqs):
            if n_acc[b] < 0:
                self.fail(r, "the target logits contain NaN")
                continue
            emitted = out_rows[b][: n_acc[b] + 1]
            # tree_rejection_sample drew this request's numbers at positions 0..sizes[b]-1
            # (not up to the batch's widest tree N): its next step starts after them.
            r.offset += v.sizes[b]
            keep = emitted[: r.remaining]
            for i, t in enumerate(keep):
                if t in eos:
                    keep = keep[: i + 1]
                    break
            r.tokens.extend(emitted)  # all emitted tokens: the cache now holds them
            r.output.extend(keep)
            if len(keep) < len(emitted) or r.remaining <= 0 or (keep and keep[-1] in eos):
                r.done = True
            r.stats.record(v.depth[b], v.sizes[b] - 1, n_acc[b], len(keep))
            self.schedule.update(r.rid, v.depth[b], n_acc[b])
            if on_tokens is not None and keep:
                on_tokens(r, keep)
        return n_acc

    def hand_hidden_states(self, reqs: list[Request], v: Verification, acc: Accepted) -> None:
        """Give the drafter (``uses_hidden``) each request's hidden states of the root and the
        accepted nodes [n_accepted + 1, H], row i the one that produced emitted token i (the
        last row produced the new root); requests whose step failed get none."""
        n_acc = acc.num_accepted.tolist()
        indptr = v.qo_indptr.tolist()
        for b, r in enumerate(reqs):
            if n_acc[b] < 0:
                continue
            path = torch.cat([torch.zeros(1, dtype=torch.int64), acc.nodes[b, : n_acc[b]].to(torch.int64)])
            emitted = r.tokens[len(r.tokens) - (n_acc[b] + 1):]
            self.drafter.hidden_states(self, r, v.hidden[indptr[b] + path], emitted)
