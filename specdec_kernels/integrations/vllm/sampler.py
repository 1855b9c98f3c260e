"""Our chain rejection sampling in place of vLLM v1's ``RejectionSampler`` (vLLM 0.32).

vLLM's model runner calls ``rejection_sampler(metadata, draft_probs, logits,
sampling_metadata)`` once per speculative step (``vllm/v1/worker/gpu_model_runner.py``,
``_sample``) with its flattened layout: ``logits`` [num_tokens + B, V] holding, per request in
batch order, the rows of its drafts and then its bonus row; ``metadata.draft_token_ids``
[num_tokens]; ``metadata.cu_num_draft_tokens`` [B] (inclusive prefix sums); ``draft_probs``
[num_tokens, V] or None; per-request temperature / top-k / top-p and torch generators in
``sampling_metadata``. It expects int32 [B, max_spec_len + 1] token ids, -1 padded.

:class:`SpecdecRejectionSampler` passes that layout as is to
``specdec::chain_rejection_sample_flat`` (no copy of the logits into a padded [B, K+1, V]
tensor), which accepts or rejects every draft, draws the recovered or bonus token and does
both greedy and sampled requests in one call. Top-k / top-p go through
``specdec::apply_top_k_top_p`` on the temperature-scaled rows, as vLLM defines them.
Randomness: our counter-based generator, keyed per request and step by a 64-bit seed drawn
from the request's own ``torch.Generator`` (vLLM's per-request ``seed``), or from torch's
global generator for unseeded requests, so seeded requests stay reproducible.

Batches that use what the op does not cover fall back to vLLM's own sampler for that step,
which stays exact: logprobs, penalties, bad words, allowed token ids, min-p, logit bias, min
tokens, thinking budgets, other logits processors, and vLLM's "synthetic" acceptance mode.
"""
from __future__ import annotations

import logging

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler

from ... import ops

# A child of vLLM's "vllm" logger: our messages go through vLLM's handlers and level
# (VLLM_LOGGING_LEVEL), next to its own.
logger = logging.getLogger("vllm.specdec_kernels")

# Largest 64-bit seed we draw (torch.randint's upper bound is exclusive and must fit int64).
_SEED_RANGE = (-(2**63), 2**63 - 1)


def unsupported_feature(sampling_metadata) -> str | None:
    """What in this batch the op does not implement (vLLM's sampler must run), or None."""
    sm = sampling_metadata
    if sm.max_num_logprobs is not None or sm.logprob_token_ids:
        return "logprobs"
    if not sm.no_penalties:
        return "penalties"
    if sm.bad_words_token_ids:
        return "bad words"
    if sm.allowed_token_ids_mask is not None:
        return "allowed token ids"
    holder = sm.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "thinking budget"
    for proc in sm.logitsprocs.all:
        # The built-in processors are idle unless some request uses them; anything else
        # may change the logits at any time.
        name = type(proc).__name__
        if name == "MinPLogitsProcessor":
            if proc.min_p_count:
                return "min_p"
        elif name == "LogitBiasLogitsProcessor":
            if proc.biases:
                return "logit bias"
        elif name == "MinTokensLogitsProcessor":
            if proc.min_toks:
                return "min tokens"
        else:
            return f"logits processor {name}"
    return None


def request_seeds(batch: int, generators: dict, device) -> torch.Tensor:
    """int64 [B]: one fresh key per request for this step, from the request's generator
    (seeded requests) or torch's global generator (the others)."""
    seed = torch.randint(*_SEED_RANGE, (batch,), dtype=torch.int64)
    for i, gen in generators.items():
        if i < batch:
            seed[i] = torch.randint(*_SEED_RANGE, (1,), dtype=torch.int64, generator=gen)[0]
    return seed.to(device)


class SpecdecRejectionSampler(RejectionSampler):
    """vLLM's ``RejectionSampler`` with ``forward`` done by ``chain_rejection_sample_flat``
    (vLLM's own ``forward`` serves the batches ``unsupported_feature`` names)."""

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        reason = "synthetic acceptance" if self.synthetic_mode else unsupported_feature(sampling_metadata)
        if reason is not None:
            _log_fallback(reason)
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        output_token_ids = sample(metadata, draft_probs, logits, sampling_metadata)
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)


def sample(metadata, draft_probs, logits, sampling_metadata) -> torch.Tensor:
    """int32 [B, max_spec_len + 1]: accepted drafts, then the recovered or bonus token, -1
    padded, for vLLM's flattened batch (see the module docstring). ``logits`` may be
    modified in place (vLLM allows it)."""
    num_draft_tokens = metadata.num_draft_tokens  # python list [B]
    batch = len(num_draft_tokens)
    device = logits.device
    sm = sampling_metadata
    if sm.all_greedy:
        temperature = torch.zeros(batch, dtype=torch.float32, device=device)
    else:
        temperature = sm.temperature[:batch].to(torch.float32)
        if sm.top_k is not None or sm.top_p is not None:
            # vLLM applies top-k / top-p to logits / T: the rows become logits / T, masked,
            # sampled at temperature 1 (greedy rows keep their values and temperature).
            rows_per_request = torch.tensor(num_draft_tokens, device=device) + 1

            def per_row(t):
                return t[:batch].repeat_interleave(rows_per_request, output_size=logits.shape[0])

            if logits.dtype != torch.float32:
                logits = logits.to(torch.float32)
            ops.apply_temperature_top_k_top_p(logits, per_row(temperature),
                                              None if sm.top_k is None else per_row(sm.top_k.to(torch.int32)),
                                              None if sm.top_p is None else per_row(sm.top_p.to(torch.float32)))
            greedy = ~(temperature >= ops.MIN_SAMPLING_TEMPERATURE)  # the op's rule (NaN too)
            temperature = torch.where(greedy, temperature, torch.ones_like(temperature))
    if draft_probs is not None and draft_probs.dtype != torch.float32:
        draft_probs = draft_probs.to(torch.float32)
    seed = request_seeds(batch, sm.generators, device)
    offset = torch.zeros(batch, dtype=torch.int64, device=device)  # a fresh key every step
    output_token_ids, num_accepted = ops.chain_rejection_sample_flat(
        metadata.draft_token_ids.to(torch.int64), metadata.cu_num_draft_tokens.to(torch.int32), logits,
        draft_probs, temperature, seed, offset, max_num_draft_tokens=metadata.max_spec_len)
    if device.type == "cpu" and bool((num_accepted < 0).any()):
        # vLLM would take an empty output as "no token this step" and retry forever.
        bad = (num_accepted < 0).nonzero().flatten().tolist()
        raise RuntimeError(f"specdec rejection sampler: the target logits of request(s) {bad} hold NaN/inf")
    return output_token_ids.to(torch.int32)


_logged_fallbacks: set[str] = set()


def _log_fallback(reason: str) -> None:
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.info("specdec: a batch uses %s; vLLM's own rejection sampler serves such batches", reason)


def install() -> None:
    """Make vLLM's v1 model runner build ``SpecdecRejectionSampler`` instead of its own
    (for every engine created afterwards in this process)."""
    import vllm.v1.worker.gpu_model_runner as runner

    if runner.RejectionSampler is not SpecdecRejectionSampler:
        runner.RejectionSampler = SpecdecRejectionSampler
        logger.info("specdec: vLLM's rejection sampler is replaced by specdec_kernels' chain_rejection_sample_flat")


def uninstall() -> None:
    """Undo ``install`` (engines created afterwards use vLLM's own sampler again)."""
    import vllm.v1.worker.gpu_model_runner as runner

    runner.RejectionSampler = RejectionSampler


def installed() -> bool:
    import vllm.v1.worker.gpu_model_runner as runner

    return runner.RejectionSampler is SpecdecRejectionSampler
