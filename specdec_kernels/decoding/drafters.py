"""Drafters: what proposes the tokens the target verifies.

A drafter implements ``propose(gen, requests, lengths) -> list[Draft]``: one tree per request,
at most ``lengths[b]`` deep (0 = the root alone). Optional hooks: ``start`` (after the
prefill), ``verified`` (after each step, with the accepted counts), ``finish``, and for
drafters that read the target's hidden states (``uses_hidden``) ``hidden_states``.
A drafter's random draws for a request come from that request's own Philox counters
(:func:`draft_uniforms`), so they do not depend on the other requests of the batch.

- :class:`NgramDrafter` — prompt lookup: the continuation of the latest earlier occurrence
  of the last n tokens (no model);
- :class:`ModelDrafter` — a separate draft model (any Llama of the package with the same
  vocabulary) with its own paged cache, as a chain or a "top-k tree" (the greedy chain plus
  the next-best tokens at the first level as extra leaves);
- :class:`SelfSpecDrafter` — self-speculation: the target's first L layers and its own LM
  head, writing into the target's cache (layers < L of the draft positions are rewritten by
  the verification forward, so no extra cache and no catch-up are needed);
- :class:`MedusaDrafter` — Medusa heads on the target's last hidden state, a static tree from
  Medusa choices, through ``MedusaHeads`` (``specdec_kernels.medusa``, fused ``medusa_topk``).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .. import ops
from ..rng import PURPOSE_DRAFT
from ..medusa import (MedusaHeads, default_medusa_checkpoint, load_medusa_heads, read_medusa_metadata,
                      read_medusa_state_dict)
from ..models.llama import Batch, Llama, dense, rms_norm
from .cost_model import best_chain_length, best_node_count, relative_cost, with_seconds


@dataclass
class Draft:
    """A draft tree: node 0 is the root (the last verified token)."""

    parents: list  # int, parents[0] = -1, parents[i] < i
    tokens: list  # int token ids, tokens[0] = root
    probs: torch.Tensor | None = None  # fp32 [n, V]: row i = q the children of node i were drawn from

    @classmethod
    def root_only(cls, root: int) -> "Draft":
        return cls([-1], [root])

    @classmethod
    def chain(cls, root: int, tokens: list, probs=None) -> "Draft":
        return cls(list(range(-1, len(tokens))), [root] + list(tokens), probs)

    def depths(self) -> list:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d


class Drafter:
    name = "drafter"
    max_nodes = 16  # most nodes (root included) a draft may have: sizes the caches
    uses_hidden = False  # whether the Generator hands it the target's hidden states (hidden_states)

    def start(self, gen, reqs) -> None:
        """A generation begins: ``reqs`` are its first requests, prefilled (``gen.cache`` is
        the target's cache, with ``gen.cache.max_batch`` slots: the most requests that decode
        at once). Default: :meth:`admit` them."""
        self.admit(gen, reqs)

    def admit(self, gen, reqs) -> None:
        """``reqs`` (prefilled) join the running batch: at ``start``, and under continuous
        batching whenever finished requests freed their slots."""

    def propose(self, gen, reqs, lengths) -> list:
        """One Draft per request. A proposal that raises must leave the drafter as it was
        (commit state only once nothing can fail): the Generator then proposes for each
        request alone to find the one that fails, and the others must see what they saw."""
        raise NotImplementedError

    def hidden_states(self, gen, req, hidden, tokens) -> None:
        """Only for a drafter with ``uses_hidden``: ``hidden`` [n, H], the target's pre-norm
        hidden states that ``req``'s last forward computed for the tokens now in its cache,
        row i the one that produced ``tokens[i]`` (so the last row produced the root). After
        the prefill (following ``start`` / ``admit``): the prompt's tokens but the last, tokens
        = prompt[1:]; after each step (before ``verified``): the root and the accepted nodes,
        tokens = the emitted ones."""

    def verified(self, gen, reqs, num_accepted) -> None:
        pass

    def finish(self, gen, req) -> None:
        pass


class SizedDrafter(Drafter):
    """A drafter that sizes its drafts by the pay-off model (``cost_model``: expected tokens
    per unit time) against a step-cost curve: its own (``step_cost``, given to it, with the
    seconds of a one-row step from ``step_seconds`` when the curve is relative), else the
    Generator's, taken at each ``start`` (``Generator.drafter_step_cost``: the Generator
    resolves, and if need be measures, the curve; a drafter never does)."""

    def _own_step_cost(self, step_cost, step_seconds: float | None = None) -> None:
        self.step_cost = None if step_cost is None else with_seconds(step_cost, step_seconds)
        self._step_seconds = step_seconds
        self._cost = self.step_cost  # what sizing uses: until ``start``, the own curve (or none)

    def _take_step_cost(self, gen) -> None:
        self._cost = gen.drafter_step_cost(self.step_cost, step_seconds=self._step_seconds)

    def cost(self, rows: int, batch: int = 1) -> float:
        """Step cost over ``rows`` verified rows in all at batch ``batch``, relative to a
        step of one row per request."""
        if self._cost is None:
            raise RuntimeError(f"{type(self).__name__} has no step cost: pass step_cost= or call start(gen, reqs) "
                               "(which takes the Generator's) first")
        return float(self._cost(rows, batch))

    def relative_cost(self, seconds: float, batch: int = 1) -> float:
        """``seconds`` (measured drafting time) relative to a one-row-per-request step of
        ``batch`` requests (``cost_model.relative_cost``)."""
        self.cost(1)  # a clear error when there is no curve yet
        return relative_cost(seconds, self._cost, batch)


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) in the request's tokens and propose what followed.

    ``min_ngram`` = 2 by default: a one-token match is mostly a coincidence (a common word or
    punctuation), and a rejected draft costs a wider verification. SmolLM2-135M, 1 thread, 4
    of the package's prompts x 2, 48 tokens, constant k = 4, same process: min 1 gave 1.09x
    our autoregressive tokens/s (mean accepted length 1.94), min 2 gave 1.28x (1.87)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, max_k: int = 16):
        self.max_ngram, self.min_ngram, self.max_nodes = max_ngram, min_ngram, max_k + 1

    def lookup(self, tokens: list, k: int) -> list:
        arr = np.asarray(tokens, dtype=np.int64)
        L = arr.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = arr[L - n:]
            # Windows starting at 0..L-n-1 (strictly before the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start: start + k].tolist()
        return []

    def propose(self, gen, reqs, lengths):
        return [Draft.chain(r.tokens[-1], self.lookup(r.tokens, k) if k > 0 else []) for r, k in zip(reqs, lengths)]


class HiddenStateRecorder(Drafter):
    """Drafts nothing (the loop decodes autoregressively) and keeps what a drafter with
    ``uses_hidden`` is handed: ``rows[rid]``, the target's pre-norm hidden states of request
    ``rid``'s tokens, [P - 1 + emitted, H] in the order they were computed (the prompt's but the
    last, then one per emitted token, the one that produced it). Training data collection."""

    name = "record-hidden"
    max_nodes = 1
    uses_hidden = True

    def __init__(self):
        self.rows: dict = {}

    def propose(self, gen, reqs, lengths):
        return [Draft.root_only(r.tokens[-1]) for r in reqs]

    def hidden_states(self, gen, req, hidden, tokens):
        self.rows[req.rid] = hidden if req.rid not in self.rows else torch.cat([self.rows[req.rid], hidden])


def draft_uniforms(reqs, num: int) -> torch.Tensor:
    """fp32 [B, num] in (0, 1]: the drafter's draws of this step for each request, from the
    request's own seed and Philox offset (``rng.PURPOSE_DRAFT``; the offset moves on every
    step), so they are the same whatever else is in the batch."""
    seed = torch.tensor([r.sampling.seed for r in reqs], dtype=torch.int64)
    offset = torch.tensor([r.offset for r in reqs], dtype=torch.int64)
    return ops.philox_uniform(seed, offset, 0, PURPOSE_DRAFT, max(1, num))


def sample_rows(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 [R, n]: draws from the rows of q fp32 [R, V] (probabilities, any positive
    total) by inverse CDF with uniforms u [R, n] in (0, 1]: the first index whose
    cumulative probability reaches u * total, so an entry of probability 0 is never drawn."""
    cdf = q.cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous()).clamp_(max=q.shape[-1] - 1)


def draw_tokens(logits: torch.Tensor, reqs, u: torch.Tensor) -> tuple[list, list]:
    """(tokens, q) from draft logits fp32 [R, V], one row per request of ``reqs``, at each
    request's temperature / top-k / top-p (``ops.apply_temperature_top_k_top_p``), drawn with
    uniforms u [R]: the argmax and None for greedy requests, else a draw from q and q [V]."""
    temperature = torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32)
    sampled = (temperature >= ops.MIN_SAMPLING_TEMPERATURE).tolist()
    tokens, qs = logits.argmax(-1).tolist(), [None] * len(reqs)
    if any(sampled):
        top_k = torch.tensor([r.sampling.top_k for r in reqs], dtype=torch.int32)
        top_p = torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32)
        filtered = any(r.sampling.top_k > 0 or r.sampling.top_p < 1 for r in reqs)
        q = ops.apply_temperature_top_k_top_p(logits.float().clone(), temperature, top_k if filtered else None,
                                              top_p if filtered else None).softmax(-1)
        drawn = sample_rows(q, u[:, None])[:, 0].tolist()
        for i, s in enumerate(sampled):
            if s:
                tokens[i], qs[i] = drawn[i], q[i]
    return tokens, qs


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


PRIOR_TOKENS = 4  # how many drafted tokens' worth of evidence a request's prior acceptance counts as
PROBE_TOKENS = 4  # drafted tokens a request probes with before its sizing may keep drafting off


class ModelDrafter(SizedDrafter):
    """Draft with a (smaller) Llama of the same vocabulary, chain or top-k tree.

    ``tree_width`` > 1 adds the next ``tree_width - 1`` best first tokens as extra children
    of the root (deterministic drafts, verified without draft probabilities). With a chain
    and sampling, drafts are drawn from the draft model's q and verified with it.
    ``share_target_cache`` (self-speculation): ``model`` is the target truncated to its first
    layers and writes into the target's cache. A model with a ``draft_vocab`` (a distilled
    draft or an exit head, ``specdec_kernels.draft_model``) drafts ids of that vocabulary,
    mapped to the target's; its q is zero outside it, which rejection sampling handles exactly.
    """

    name = "draft"

    def __init__(self, model: Llama, *, tree_width: int = 1, max_k: int = 16, share_target_cache: bool = False,
                 name: str | None = None, sized: bool = False, step_cost=None, acceptance: float | None = None):
        """``sized``: the schedule's length is a cap and each step drafts the chain length
        that maximises expected tokens per unit time (:meth:`chain_length`), from the
        target's step-cost curve (``step_cost``, default the Generator's ``step_cost``:
        the target's measured curve unless it was given one), the draft's measured time per token and the request's
        running acceptance rate (each request starts from ``acceptance``, default the
        held-out agreement the draft's file records, else 0.5: how predictable a request is
        varies a lot — code and arithmetic accept several times more than open writing — so
        one request's rejections do not switch drafting off for the next); the drafters by
        name (``make_drafter``) run this way with the ``max`` schedule. ``sized=False``:
        exactly the schedule's length."""
        self.model, self.tree_width, self.share = model, tree_width, share_target_cache
        self.vocab_size = model.config.vocab_size
        self.max_nodes = max_k + tree_width
        self.name = name or ("draft-tree" if tree_width > 1 else "draft")
        self.sized = sized
        self._own_step_cost(step_cost)
        measured = acceptance if acceptance is not None else getattr(model, "metadata", {}).get("held_out_top1")
        self.prior = 0.5 if measured is None else float(measured)
        # A measured prior counts as PRIOR_TOKENS drafted tokens of evidence; 0.5 for want of one
        # (a whole model by name) as one, so a request's own acceptance soon decides.
        self.prior_tokens = PRIOR_TOKENS if measured is not None else 1
        # Per request: [accepted draft tokens, rejections] seen, seeded with the prior.
        self._seen: dict = {}
        self._token_s = None  # measured seconds of one draft depth (batch of this step), EMA
        self._drafted: dict = {}

    # ---- sizing ---------------------------------------------------------------------------
    def acceptance(self, rid=None) -> float:
        """Request ``rid``'s running estimate of P(a draft token is accepted | the ones before
        it were); the prior for an unknown request."""
        acc, rej = self._seen.get(rid, (self.prior_tokens * self.prior, self.prior_tokens * (1 - self.prior)))
        return acc / max(1e-9, acc + rej)

    def chain_length(self, batch: int, cap: int, acceptance: float | None = None) -> int:
        """The chain length (0..cap) maximising expected tokens per unit time at this batch:
        ``B * sum_{i<=k} a^i / (cost(B (k + w)) + k * t_draft / t_step)`` with ``a`` the running
        acceptance, ``cost`` the target's step-cost curve (relative to a one-row-per-request
        step), ``w`` the tree width (the root's extra children count as cost only) and
        ``t_draft / t_step`` the measured draft-depth time over a target step
        (``cost_model.best_chain_length``; ``acceptance``: default the prior)."""
        a = self.prior if acceptance is None else acceptance
        k, _ = best_chain_length(a, cap, self._cost, batch=batch, width=self.tree_width,
                                 draft_cost=self.relative_cost(self._token_s, batch))
        return k

    def _sized_length(self, rid, cap: int, batch: int) -> int:
        """Request ``rid``'s chain length this step: :meth:`chain_length` at its running
        acceptance, or a one-token probe while it has fewer than PROBE_TOKENS drafted tokens of
        its own seen and a chain would pay at full acceptance — so a prior that is too low
        (a whole model by name has no recorded agreement: 0.5) cannot keep a draft that agrees
        97% of the time off for good, and one that does not pay stops after a few probes."""
        k = self.chain_length(batch, cap, self.acceptance(rid))
        acc, rej = self._seen.get(rid, (self.prior_tokens, 0.0))
        if k == 0 and cap > 0 and acc + rej < self.prior_tokens + PROBE_TOKENS and self.chain_length(batch, cap, 1.0) > 0:
            return 1
        return k

    def start(self, gen, reqs):
        if self.sized:
            self._take_step_cost(gen)
            if self._token_s is None:
                from .cost_model import draft_token_seconds

                self._token_s = draft_token_seconds(self.model)
        if self.share:
            self.cache = gen.cache
        else:
            self.cache = self.model.new_cache(gen.cache.max_batch, gen.cache.max_len, block_size=gen.cache.block_size)
            self.slot, self.fed = {}, {}
        self.admit(gen, reqs)

    def admit(self, gen, reqs):
        for r in reqs:
            self._seen[r.rid] = [self.prior_tokens * self.prior, self.prior_tokens * (1 - self.prior)]
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
        model, cache = self.model, self.cache
        drafts = [Draft.root_only(r.tokens[-1]) for r in reqs]
        if self.sized and self._token_s is not None:
            lengths = [self._sized_length(r.rid, n, len(reqs)) for r, n in zip(reqs, lengths)]
        runs = []
        for b, (r, k) in enumerate(zip(reqs, lengths)):
            if k <= 0:
                continue
            # Step 0 feeds what the draft cache lacks (the root, plus any tokens accepted last
            # step that the draft never saw); later steps feed one drafted token each.
            slot = self._slot(r)
            committed = cache.length(slot)
            pending = r.tokens[committed:]
            cache.reserve([slot], [len(pending) + k])
            runs.append(ChainRun(b, r, slot, k, committed, pending, feed=pending, pos=committed))
        if not runs:
            return drafts
        uniforms = draft_uniforms([run.request for run in runs], max(run.length for run in runs))
        for step in range(max(run.length for run in runs)):
            t_step = time.perf_counter()
            live = [i for i, run in enumerate(runs) if step < run.length]
            rows = [runs[i] for i in live]
            row_positions = [torch.arange(run.pos, run.pos + len(run.feed)) for run in rows]
            indptr = torch.tensor([0] + list(np.cumsum([len(run.feed) for run in rows])), dtype=torch.int32)
            block_table, _ = cache.batch_view([run.slot for run in rows])
            slot_mapping = torch.cat([cache.slot_mapping(run.slot, pos) for run, pos in zip(rows, row_positions)])
            batch = Batch(block_table, torch.tensor([run.pos for run in rows], dtype=torch.int32), indptr, slot_mapping)
            tokens = torch.tensor([t for run in rows for t in run.feed], dtype=torch.int64)
            h = model.forward(tokens, torch.cat(row_positions), cache, batch)
            logits = model.logits(h[indptr[1:].long() - 1])
            vocab = model.draft_vocab  # None, or the target ids of a draft-vocabulary head's rows
            drawn, drawn_q = draw_tokens(logits, [run.request for run in rows], uniforms[live, step])
            for i, run in enumerate(rows):
                tok, q = drawn[i], drawn_q[i]
                if step == 0 and self.tree_width > 1:
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
            if step > 0 and self._token_s is not None:  # step 0 also feeds the catch-up tokens
                self._token_s = 0.8 * self._token_s + 0.2 * (time.perf_counter() - t_step)
        for run in runs:
            r = run.request
            self._drafted[r.rid] = len(run.chain)
            if self.tree_width > 1:
                k = len(run.chain)
                drafts[run.index] = Draft(list(range(-1, k)) + [0] * len(run.alts), [r.tokens[-1]] + run.chain + run.alts)
            else:
                q = None
                if run.probs[0] is not None:
                    q = torch.stack(run.probs + [torch.zeros_like(run.probs[0])])
                drafts[run.index] = Draft.chain(r.tokens[-1], run.chain, q)
            if not self.share:
                # What the draft cache holds after this step (committed + written, in order).
                self.fed[r.rid] = r.tokens[:run.committed] + run.pending + run.chain[:-1]
        return drafts

    def verified(self, gen, reqs, num_accepted):
        for r, n in zip(reqs, num_accepted):  # the running acceptance rate (chain_length)
            k = self._drafted.pop(r.rid, 0)
            if k > 0 and r.rid in self._seen:
                n = max(0, min(int(n), k))  # -1: the step failed (NaN logits)
                self._seen[r.rid][0] += n
                self._seen[r.rid][1] += n < k
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
        self._seen.pop(req.rid, None)
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


def medusa_heads_for(target: Llama, checkpoint=None, *, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
    """MedusaHeads for ``target``.

    ``checkpoint``: a Medusa checkpoint (``.safetensors``/``.pt`` or a state dict with
    Medusa keys, see ``specdec_kernels.medusa``); None = the trained heads the package ships
    for this model (``default_medusa_checkpoint``: SmolLM2-135M-Instruct, trained by
    ``specdec train-medusa``) if there are any, else untrained heads; ``"untrained"`` =
    ``num_heads`` untrained heads (zero ResBlocks = identity: every head predicts what the
    LM head predicts, so acceptance is low). The target's LM head is shared unless the
    checkpoint has per-head LM heads."""
    if checkpoint is None:
        checkpoint = default_medusa_checkpoint(target.name) or "untrained"
    if isinstance(checkpoint, str) and checkpoint == "untrained":
        heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads, num_layers,
                            lm_head_weight=dense(target.lm_head), dtype=target.dtype, device=target.device)
    else:
        state = read_medusa_state_dict(checkpoint)
        own_lm_heads = any(k.endswith(".weight") and not k.endswith(("linear.weight", "root_proj.weight"))
                           for k in state)
        heads = load_medusa_heads(state, lm_head_weight=None if own_lm_heads else dense(target.lm_head),
                                  dtype=target.dtype, device=target.device,
                                  metadata=read_medusa_metadata(checkpoint), embed_weight=dense(target.embed))
        if heads.hidden_size != target.config.hidden_size or heads.vocab_size != target.config.vocab_size:
            raise ValueError(f"Medusa heads have H={heads.hidden_size}, V={heads.vocab_size}; the target has "
                             f"H={target.config.hidden_size}, V={target.config.vocab_size}")
    return heads.requires_grad_(False).eval()


# A small tree for 4 heads (depth <= 4, 24 nodes + root).
MEDUSA_SMALL_CHOICES = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0),
                        (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
                        (2, 1), (3, 0), (0, 3), (1, 2), (0, 0, 2), (0, 0, 0, 2)]


class MedusaDrafter(Drafter):
    """Medusa: head k on the hidden state of the node that produced the root predicts the
    token k+1 after the root; the static tree comes from Medusa choices (truncated to the
    speculation length), filled from each head's top-k (``medusa_topk``).

    ``heads``: default ``medusa_heads_for(target)`` (the package's trained heads for the
    model if it ships them). ``choices``: default the tree tuned for the heads (their file's
    ``medusa_choices`` metadata, a JSON list of lists) or ``MEDUSA_SMALL_CHOICES``.

    ``ngram``: an :class:`NgramDrafter` whose prompt-lookup chain (up to the speculation
    length) is merged into the tree as one more branch, sharing the nodes it agrees with.
    The two are complementary: the heads guess fluent continuations, the lookup copies
    spans of the context (summaries, extraction, code edits, repetitive output), and one
    verification forward checks both (the chain adds at most k nodes, none when nothing
    matches)."""

    name = "medusa"
    uses_hidden = True  # the heads read the hidden state that produced the root

    def __init__(self, target: Llama, heads: MedusaHeads | None = None, choices=None, *,
                 ngram: "NgramDrafter | None" = None):
        import json

        from ..tree import medusa_tree

        self.target = target
        self.heads = heads if heads is not None else medusa_heads_for(target)
        if choices is None and "medusa_choices" in getattr(self.heads, "metadata", {}):
            choices = [tuple(c) for c in json.loads(self.heads.metadata["medusa_choices"])]
        choices = [c for c in (choices or MEDUSA_SMALL_CHOICES) if len(c) <= self.heads.num_heads]
        self.tree = medusa_tree(choices)
        self.ngram = ngram
        self.max_nodes = self.tree.num_nodes + (ngram.max_nodes - 1 if ngram is not None else 0)
        self.parents = self.tree.parents.tolist()
        self.depth = self.tree.depth.tolist()
        self.root_hidden: dict = {}  # rid -> [H], the target's hidden state that produced the root
        if ngram is not None:
            self.name = "medusa+ngram"

    def hidden_states(self, gen, req, hidden, tokens):
        # A one-token prompt has no state before its root: zeros (the heads still draft).
        self.root_hidden[req.rid] = hidden[-1] if hidden.shape[0] else hidden.new_zeros(hidden.shape[1])

    def finish(self, gen, req):
        self.root_hidden.pop(req.rid, None)

    @staticmethod
    def merge_chain(parents: list, tokens: list, chain: list) -> tuple[list, list]:
        """Add the path root -> chain[0] -> chain[1] ... to a tree (parents, tokens; node 0
        = root), reusing the nodes already there; new nodes are appended (parents stay
        before children)."""
        parents, tokens = list(parents), list(tokens)
        child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
        node = 0
        for t in chain:
            nxt = child.get((node, t))
            if nxt is None:
                parents.append(node)
                tokens.append(t)
                nxt = child[(node, t)] = len(tokens) - 1
            node = nxt
        return parents, tokens

    @torch.inference_mode()
    def propose(self, gen, reqs, lengths):
        hidden = torch.stack([self.root_hidden[r.rid] for r in reqs])
        hidden = rms_norm(hidden, self.target.norm, self.target.config.rms_norm_eps)
        roots = torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.int64)
        ids, _ = self.heads(hidden, self.tree.top_k, root_ids=roots)  # fused specdec::medusa_topk
        tokens = self.tree.token_ids(roots, ids).tolist()
        drafts = []
        for b, k in enumerate(lengths):
            n = sum(1 for d in self.depth if d <= k)  # nodes are ordered by depth
            parents, toks = self.parents[:n], tokens[b][:n]
            if self.ngram is not None and k > 0:
                chain = self.ngram.lookup(reqs[b].tokens, min(k, self.ngram.max_nodes - 1))
                if chain:
                    parents, toks = self.merge_chain(parents, toks, chain)
            drafts.append(Draft(parents, toks))
        return drafts


class Candidates(NamedTuple):
    """A request's trie of prompt-lookup continuations (node 0 = the root; every node's
    parent precedes it), as :meth:`NgramTreeDrafter.candidates` builds it."""

    tokens: list  # int token ids
    parents: list  # int, parents[0] = -1
    depths: list  # int, root 0
    ranked: list  # [(p, node)] over the non-root nodes, most probable first (ties: shallower, earlier), at most max_nodes - 1

    def tree(self, n: int) -> tuple[list, list]:
        """(parents, token ids) of the tree of the root and the ``n`` best-ranked nodes (a
        tree: a node never ranks above its parent), ordered by depth."""
        keep = sorted((i for _, i in self.ranked[:n]), key=lambda i: (self.depths[i], i))  # parents before children
        new = {0: 0}
        parents, ids = [-1], [self.tokens[0]]
        for i in keep:
            new[i] = len(ids)
            parents.append(new[self.parents[i]])
            ids.append(self.tokens[i])
        return parents, ids


class NgramTables(NamedTuple):
    """:class:`NgramTreeDrafter`'s acceptance model: a lookup continuation's i-th token is
    accepted with probability ``first[m - 1] * rank[r] * next[m - 1] ** (i - 1)`` for a match
    of m tokens (past the tables' end: their last entry) at rank r among the matches of that
    length (0 = the most recent)."""

    first: tuple
    next: tuple
    rank: tuple


# Tables measured per model by bench/fit_ngram_tables.py (its greedy outputs, the counts and
# the simulation that fitted them are recorded with each entry).
NGRAM_TABLES_PATH = Path(__file__).resolve().parent.parent / "data" / "ngram_tables.json"


def ngram_tables_for(model_name: str) -> NgramTables | None:
    """The acceptance tables measured for ``model_name`` (a registered name or a model's
    ``name``, e.g. "Qwen2.5 Coder 1.5B Instruct GGUF"): the entry of NGRAM_TABLES_PATH whose
    key the name contains (letters and digits only), or None if none was measured for it."""
    def squash(text):
        return re.sub(r"[^a-z0-9]", "", str(text).lower())

    try:
        entries = json.loads(NGRAM_TABLES_PATH.read_text())
    except FileNotFoundError:
        return None
    name = squash(model_name)
    entry = next((e for key, e in entries.items() if squash(key) in name), None)
    if entry is None:
        return None
    tables = NgramTables(tuple(entry["first"]), tuple(entry["next"]), tuple(entry["rank"]))
    if not (tables.first and len(tables.first) == len(tables.next) and tables.rank and tables.rank[0] == 1.0
            and all(0.0 < p < 1.0 for p in tables.first + tables.next) and all(0.0 < p <= 1.0 for p in tables.rank)):
        raise ValueError(f"{NGRAM_TABLES_PATH}: the tables of {model_name!r} must be probabilities in (0, 1), "
                         "first and next of one length, rank starting at 1.0")
    return tables


class NgramTreeDrafter(SizedDrafter):
    """Prompt lookup as a token tree: the continuations of *several* earlier occurrences of the
    request's last tokens, merged into one trie, sized by an estimate of each node's
    acceptance probability against the measured cost of verifying more rows, and verified in
    one target forward (``tree_attention`` + ``tree_rejection_sample``).

    Matches: every position ``j < L-1`` whose token equals the last token, with its match
    length ``m`` (how many tokens agree backwards from there, at most ``max_ngram``) and its
    rank among the matches of the same length (0 = the most recent); the ``max_matches``
    longest (then most recent) put their next ``k`` tokens into a trie.

    Acceptance model: the i-th token (i = 1, 2, ...) of a match's continuation is accepted
    with probability ``FIRST[m] * RANK[rank] * NEXT[m] ** (i - 1)``; a trie node's probability
    is the noisy-or over the matches through it, so a child never scores above its parent and
    the most probable nodes always form a tree. The tables depend on the model (how much it
    copies, how it loops): a model with tables measured for it (:func:`ngram_tables_for`,
    bench/fit_ngram_tables.py) uses those; any other uses the class's, measured on greedy
    SmolLM2-135M outputs (64 tokens) of the Spec-Bench dev prompts: the most recent match of
    one token predicts the next token 21% of the time, of two tokens 46%, three 64%, six or
    more 85%; once a continuation is being accepted, its next token follows with ~70% (short
    matches) to 86% (m >= 6) — copying and the small model's loops make long matches common.

    Size: over the whole batch, the most probable nodes are kept while they pay for
    themselves: the number of verified rows ``R`` (B roots + the kept nodes) maximises
    expected tokens per step over step cost, ``(B + sum p) / cost(R, B)``, where ``cost`` is
    the step-cost curve of the target (``decoding.cost_model``: seconds per verification step
    against rows and batch size, measured for the loaded model, weight format, thread count
    and CPU at first use and cached per machine; or the ``step_cost`` given here or to the
    Generator). On fp32 weights an extra row costs ~5% of a one-row step up to ~12 rows; on
    GGUF block weights the quantised GEMM streams the blocks once for all rows, so extra rows
    are cheaper still — the curve, not a table, says how many pay. When no node pays for itself the step is a
    plain autoregressive one (no extra rows); at batch B > 1 the few nodes that still pay go
    to the requests with the most probable drafts.

    Per request, the tables are checked against what the target emits (:meth:`verified`):
    every step, drafted or not, the probability the trie gave its most probable node (a
    first-level one) is compared with whether the emitted token was that node's, and the
    request's probabilities
    are scaled by (hits + PRIOR) / (expected hits + PRIOR) over a decaying window (DECAY); a
    step that drafted adds its accepted count to the hits and its drafted nodes' summed
    probability to the expected hits (remembered over ~30 steps, DRAFT_DECAY), so drafts that are accepted less often than the tables
    say (the 1.5B writing new code: 35% against a promised 50%+, where a row costs half a
    step) lower the scale until they stop. On a
    prompt with nothing to copy (open questions: the matches are common words and
    punctuation) the tables promise hits that never come, the scale falls within a few steps,
    no node pays for its row, and the steps are plain autoregressive ones — so the default
    drafter costs nothing measurable where it cannot help; when the output starts copying,
    the hits raise the scale again.

    Deterministic drafts (no ``probs``): greedy decoding is exact, and sampling stays exact
    because ``tree_rejection_sample`` treats deterministic siblings as one-hot proposals
    (the trie has distinct sibling tokens).
    """

    name = "ngram-tree"
    # Indexed by min(m, len) - 1 / min(rank, len - 1). FIRST: the measured rates above for m
    # >= 6, shrunk for short matches (0.21, 0.46, 0.64, 0.70, 0.70 measured): weak drafts are
    # worth fewer rows than their marginal rate says (several one-token matches agreeing are
    # one piece of evidence, not independent ones); the shrink maximised the simulated speedup
    # (greedy outputs + the fp32 verify-cost table measured then) over the 120 dev prompts: 1.43x -> 1.48x.
    FIRST = (0.10, 0.23, 0.45, 0.49, 0.49, 0.85)
    NEXT = (0.60, 0.68, 0.72, 0.75, 0.78, 0.86)
    RANK = (1.0, 0.85, 0.75, 0.55)
    DECAY = 0.85  # per step: the scale follows about the last 7 steps
    DRAFT_DECAY = 0.97  # per step, for the drafted steps' evidence: about the last 30 steps
    PRIOR = 0.5  # expected hits the tables are trusted for before any evidence (small: a wrong draft costs a row)
    MAX_SCALE = 1.25  # the tables were fitted to this model family: evidence may raise them a little

    def __init__(self, max_ngram: int | None = None, max_k: int = 16, *, max_nodes: int = 16, max_matches: int = 8,
                 step_cost=None, tables: NgramTables | str | None = None):
        """``step_cost``: a ``cost_model.StepCost``, a callable ``rows -> cost relative to a
        one-row step``, or a sequence of those relative costs at 1, 2, ... rows; default: the
        Generator's ``step_cost`` (the target's measured curve unless it was given one),
        taken at ``start``.
        ``tables``: the acceptance tables (:class:`NgramTables`), or a model name whose
        measured ones to use; default: those measured for the Generator's target, found by
        its name at ``start`` (the class's, SmolLM2-135M's, where none were). ``max_ngram``:
        the longest match length told apart; default: the tables' length."""
        self._given_max_ngram = max_ngram
        self.max_ngram, self.max_k, self.max_matches = max_ngram or len(self.FIRST), max_k, max_matches
        self._tables_given = tables is not None
        if isinstance(tables, str):
            name, tables = tables, ngram_tables_for(tables)
            if tables is None:
                raise ValueError(f"no prompt-lookup tables were measured for {name!r} (bench/fit_ngram_tables.py "
                                 f"measures them into {NGRAM_TABLES_PATH.name})")
        self.use_tables(tables)
        self._own_step_cost(step_cost)
        self.max_nodes = max_nodes  # per request, root included
        self._seen: dict = {}  # rid -> [hits, expected hits] of first-level tokens, decayed
        self._guess: dict = {}  # rid -> (root's position + 1, {most probable token: its raw probability})
        self._promised: dict = {}  # rid -> the raw probabilities of this step's drafted nodes, summed
        self._paid: dict = {}  # rid -> [accepted drafted tokens, their promised count], decayed

    def use_tables(self, tables: NgramTables | None) -> None:
        """Rate matches with ``tables`` (None: keep the current ones)."""
        if tables is None:
            return
        self.FIRST, self.NEXT, self.RANK = tables.first, tables.next, tables.rank
        self.max_ngram = self._given_max_ngram or len(self.FIRST)

    def start(self, gen, reqs):
        self._take_step_cost(gen)
        if not self._tables_given:
            self.use_tables(ngram_tables_for(gen.model.name))
        self.admit(gen, reqs)

    def admit(self, gen, reqs):
        for r in reqs:
            self._seen[r.rid] = [0.0, 0.0]
            self._paid[r.rid] = [0.0, 0.0]
            self._guess.pop(r.rid, None)
            self._promised.pop(r.rid, None)

    def scale(self, rid) -> float:
        """Request ``rid``'s factor on the tables' probabilities: (hits + PRIOR) / (expected + PRIOR)."""
        hits, expected = self._seen.get(rid, (0.0, 0.0))
        accepted, promised = self._paid.get(rid, (0.0, 0.0))
        return min(self.MAX_SCALE, (hits + accepted + self.PRIOR) / (expected + promised + self.PRIOR))

    def verified(self, gen, reqs, num_accepted):
        for r, accepted in zip(reqs, num_accepted):
            guess = self._guess.pop(r.rid, None)
            promised = self._promised.pop(r.rid, None)
            seen = self._seen.get(r.rid)
            if seen is None:
                continue
            if guess is not None and len(r.tokens) > guess[0]:
                pos, first = guess
                seen[0] = self.DECAY * seen[0] + (1.0 if r.tokens[pos] in first else 0.0)
                seen[1] = self.DECAY * seen[1] + sum(first.values())
            # The drafted nodes' expected accepted count (sum of their probabilities) against the
            # accepted count: the evidence of the steps that paid for rows, remembered longer
            # (DRAFT_DECAY): a loss comes back every few steps when its memory is short.
            paid = self._paid[r.rid]
            paid[0] *= self.DRAFT_DECAY
            paid[1] *= self.DRAFT_DECAY
            if promised is not None and accepted >= 0:
                paid[0] += accepted
                paid[1] += promised

    def finish(self, gen, req):
        self._seen.pop(req.rid, None)
        self._guess.pop(req.rid, None)
        self._promised.pop(req.rid, None)
        self._paid.pop(req.rid, None)

    def matches(self, arr: np.ndarray) -> tuple:
        """(end, length): every earlier occurrence of the last token (``arr[end] == arr[-1]``,
        end < L-1) with how many tokens agree backwards from it (1..max_ngram), longest first,
        then most recent, at most ``max_matches``."""
        L = arr.shape[0]
        end = np.flatnonzero(arr[: L - 1] == arr[L - 1])
        if end.size == 0:
            return end, end
        length = np.ones(end.size, dtype=np.int64)
        alive = np.ones(end.size, dtype=bool)
        for n in range(1, min(self.max_ngram, L - 1)):
            prev = end - n
            alive &= prev >= 0
            alive[alive] &= arr[prev[alive]] == arr[L - 1 - n]
            if not alive.any():
                break
            length += alive
        order = np.lexsort((-end, -length))[: self.max_matches]
        return end[order], length[order]

    def candidates(self, tokens: list, k: int, scale: float = 1.0) -> Candidates:
        """The trie of a request's matches, at most ``k`` deep, its nodes ranked by
        probability (see :class:`Candidates`), each probability times ``scale`` (the
        request's, :meth:`scale`; at most 0.99)."""
        root = tokens[-1]
        if k <= 0 or len(tokens) < 2 or self.max_nodes < 2:
            return Candidates([root], [-1], [0], [])
        arr = np.asarray(tokens, dtype=np.int64)
        ends, lengths = self.matches(arr)
        # Trie: children[node] = {token: child}; miss[node] = prod over matches of (1 - p).
        children, tok, par, miss = [{}], [root], [-1], [1.0]
        prev_m, rank = 0, 0
        for e, m in zip(ends.tolist(), lengths.tolist()):
            rank = rank + 1 if m == prev_m else 0
            prev_m = m
            mi = min(m, len(self.FIRST)) - 1
            p = self.FIRST[mi] * self.RANK[min(rank, len(self.RANK) - 1)]
            node = 0
            for t in arr[e + 1: e + 1 + k].tolist():
                child = children[node].get(t)
                if child is None:
                    child = len(tok)
                    children[node][t] = child
                    children.append({})
                    tok.append(t)
                    par.append(node)
                    miss.append(1.0)
                miss[child] *= 1.0 - p
                p *= self.NEXT[mi]
                node = child
        depth = Draft(par, tok).depths()
        order = sorted(range(1, len(tok)), key=lambda i: (miss[i], depth[i], i))[: self.max_nodes - 1]
        return Candidates(tok, par, depth, [(min(0.99, (1.0 - miss[i]) * scale), i) for i in order])

    def select(self, ranked: list) -> list:
        """How many of each request's ranked nodes to keep: the most probable nodes of the
        batch, as many as maximise (B + sum p) / cost(B + kept) (``cost_model.best_node_count``)."""
        B = len(ranked)
        pool = sorted(((-p, b, j) for b, r in enumerate(ranked) for j, (p, _) in enumerate(r)))
        best_n, _ = best_node_count([-neg_p for neg_p, _, _ in pool], self.cost, batch=B)
        keep = [0] * B
        for _, b, j in pool[:best_n]:
            keep[b] = max(keep[b], j + 1)  # a request's picks are a prefix of its ranking
        return keep

    def build(self, tokens: list, k: int) -> tuple:
        """(parents, token ids) of the draft tree of one request alone (batch 1)."""
        cand = self.candidates(tokens, k)
        return cand.tree(self.select([cand.ranked])[0])

    def propose(self, gen, reqs, lengths):
        cands = []
        for r, k in zip(reqs, lengths):
            scale = self.scale(r.rid)
            c = self.candidates(r.tokens, min(k, self.max_k), scale)
            # The most probable node (always first-level) and its unscaled probability, scored
            # against the emitted token in verified(): what decides whether a step drafts at all.
            self._guess[r.rid] = (len(r.tokens), {c.tokens[i]: p / scale for p, i in c.ranked[:1]})
            cands.append(c)
        keep = self.select([c.ranked for c in cands])
        for r, c, n in zip(reqs, cands, keep):  # what the kept nodes promise, scored in verified()
            if n > 0:
                scale = self.scale(r.rid)
                self._promised[r.rid] = sum(p for p, _ in c.ranked[:n]) / scale
        return [Draft(*c.tree(n)) for c, n in zip(cands, keep)]
