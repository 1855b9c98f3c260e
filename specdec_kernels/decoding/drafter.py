"""The interface between the Generator and the drafting methods (``specdec_kernels.drafting``).

A drafter implements ``propose(gen, requests, lengths) -> list[Draft]``: one tree per request,
at most ``lengths[b]`` deep (0 = the root alone). Optional hooks: ``start`` (after the
prefill), ``verified`` (after each step, with the accepted counts), ``finish``, and for
drafters that read the target's hidden states (``uses_hidden``) ``hidden_states``.
A drafter's random draws for a request come from that request's own Philox counters
(:func:`draft_uniforms`), so they do not depend on the other requests of the batch.
:class:`SizedDrafter` is the base of the drafters that size their drafts by the pay-off
model (``cost_model``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..rng import PURPOSE_DRAFT
from .cost_model import relative_cost, with_seconds


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
    # With uses_hidden: the layer counts whose states come before the last layer's in each
    # row of ``hidden_states`` (EAGLE-3's fused features: [n, (len + 1) H]); () = the last alone.
    feature_layers: tuple = ()

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
        hidden states that ``req``'s last forward computed for the tokens now in its cache
        ([n, (k + 1) H] with k ``feature_layers``: the states after those layers, then the last),
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
