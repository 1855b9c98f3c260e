"""The decode loop fails one request, not the batch: NaN target logits, a drafter raising, a
KV cache that cannot grow for one request end that request with ``Request.error`` while the
others finish exactly as they would alone; a prompt or ``max_new_tokens`` beyond the model's
context is a ValueError before any work (small random models)."""
import math

import pytest
import torch

from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule
from specdec_kernels.drafting.draft_model.drafter import ModelDrafter
from specdec_kernels.drafting.ngram import NgramDrafter
from specdec_kernels.drafting.eagle.drafter import EagleDrafter
from specdec_kernels.drafting.eagle.head import EagleHead
from specdec_kernels.kv_cache import OutOfBlocksError
from specdec_kernels.models import Llama, tiny_config

BAD = 1  # the request that goes wrong
N_NEW = 12


@pytest.fixture(scope="module")
def model():
    return Llama.random(tiny_config(num_layers=2), seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 9, 17)]
    ps[2] = ps[2] + ps[2][:8]  # something for prompt lookup to find
    return ps


def sampled():
    return [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i) for i in range(3)]


class NaNGenerator(Generator):
    """The target's logits for request ``BAD`` turn NaN once it has emitted 3 tokens."""

    def verify(self, reqs, drafts):
        v = super().verify(reqs, drafts)
        for b, r in enumerate(reqs):
            if r.rid == BAD and len(r.output) >= 3:
                v.logits[v.qo_indptr[b]: v.qo_indptr[b + 1]] = math.nan
        return v


class FailingDrafter(ModelDrafter):
    """Raises when asked to draft for request ``BAD`` once it has emitted 2 tokens."""

    def propose(self, gen, reqs, lengths):
        if any(r.rid == BAD and len(r.output) >= 2 for r in reqs):
            raise KeyError("no draft for this one")
        return super().propose(gen, reqs, lengths)


class FailingEagle(EagleDrafter):
    """Raises after its catch-up pass whenever that pass ran request ``BAD``'s entries once it
    has emitted 2 tokens: the error comes from that request's own data (as a NaN feature
    would), after the pass has run for every request of the batch."""

    def catch_up(self, reqs):
        bad = any(r.rid == BAD and len(r.output) >= 2 and len(self.pending[r.rid][1]) for r in reqs)
        out = super().catch_up(reqs)
        if bad:
            raise FloatingPointError("a bad feature")
        return out


def eagle(model, cls=EagleDrafter):
    """EAGLE with free verification rows and a slow step: every request's tree is its full
    beam, whatever else is in the batch (so a request's drafts are its own)."""
    torch.manual_seed(1)
    head = EagleHead.for_target(model, torch.arange(model.config.vocab_size)).eval().requires_grad_(False)
    return cls(model, head, step_cost={r: 1.0 for r in range(1, 129)}, step_seconds=1e6, top_k=3, max_depth=3,
               max_tree_nodes=8)


def cache_that_cannot_grow_for(model, monkeypatch, slot, limit):
    """Make ``model.new_cache`` give caches whose ``slot`` cannot grow past ``limit`` tokens."""
    new_cache = model.new_cache

    def limited_new_cache(*args, **kw):
        cache = new_cache(*args, **kw)
        reserve = cache.reserve

        def limited_reserve(slots, num_new):
            counts = [num_new] * len(slots) if isinstance(num_new, int) else list(num_new)
            for s, n in zip(slots, counts):
                if s == slot and cache.length(s) + n > limit:
                    raise OutOfBlocksError(f"slot {s}: no block for {cache.length(s) + n} tokens")
            reserve(slots, num_new)

        cache.reserve = limited_reserve
        return cache

    monkeypatch.setattr(model, "new_cache", limited_new_cache)


def alone(make_gen, prompts, sampling):
    return [make_gen().generate([p], N_NEW, [s])[0].output for p, s in zip(prompts, sampling)]


def check_one_failed(gen, reqs, expected, error):
    for r, out in zip(reqs, expected):
        if r.rid == BAD:
            assert r.done and r.error is not None and error in r.error and f"request {BAD}" in r.error
            assert r.output == out[: len(r.output)] and len(r.output) < N_NEW
        else:
            assert r.error is None
            assert r.output == out
    # Every slot (the failed request's too) and every block went back to the cache.
    assert gen.cache.active_slots == [] and gen.cache.num_free_blocks == gen.cache.num_blocks


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_nan_logits_fail_one_request(model, prompts, sampling):
    params = sampled() if sampling == "sampled" else [SamplingParams()] * 3
    expected = alone(lambda: Generator(model), prompts, params)
    gen = NaNGenerator(model)
    reqs = gen.generate(prompts, N_NEW, params)
    check_one_failed(gen, reqs, expected, "NaN")
    assert len(reqs[BAD].output) == 3


def test_nan_logits_fail_one_request_speculative(model, prompts):
    greedy = [SamplingParams()] * 3
    expected = alone(lambda: Generator(model), prompts, greedy)
    gen = NaNGenerator(model, NgramDrafter())
    check_one_failed(gen, gen.generate(prompts, N_NEW, greedy), expected, "NaN")


def test_drafter_error_fails_one_request(model, prompts):
    greedy = [SamplingParams()] * 3
    expected = alone(lambda: Generator(model), prompts, greedy)
    gen = Generator(model, FailingDrafter(model.truncated(1)))
    reqs = gen.generate(prompts, N_NEW, greedy)
    check_one_failed(gen, reqs, expected, "the drafter failed: KeyError")
    assert len(reqs[BAD].output) >= 2
    assert gen.drafter.cache.active_slots == []  # the drafter's own cache was released too


def test_drafter_error_after_its_batch_pass_fails_one_request(model, prompts):
    """Issue 24 (7a): at batch > 1 a proposal that raises after EagleDrafter's catch-up pass
    had committed every request's entries was retried request by request; the retries found
    nothing to catch up, drafted the root alone, and the failing request went on undrafted
    with no error. Now a proposal that raises leaves the drafter as it was: the retry of the
    failing request raises again and fails it, and every other request drafts exactly the
    trees it drafts in a healthy run."""
    greedy = [SamplingParams()] * 3
    schedule = lambda: SpecSchedule("max", 3, max_k=3)  # noqa: E731
    expected = alone(lambda: Generator(model), prompts, greedy)
    healthy = Generator(model, eagle(model), schedule()).generate(prompts, N_NEW, greedy)
    gen = Generator(model, eagle(model, FailingEagle), schedule())
    reqs = gen.generate(prompts, N_NEW, greedy)
    check_one_failed(gen, reqs, expected, "the drafter failed: FloatingPointError: a bad feature")
    assert len(reqs[BAD].output) >= 2
    for r, h in zip(reqs, healthy):
        if r.rid != BAD:
            assert (r.stats.drafted, r.stats.accepted, r.stats.steps) == (h.stats.drafted, h.stats.accepted,
                                                                           h.stats.steps), r.rid
    assert gen.drafter.cache.active_slots == []


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_cache_that_cannot_grow_fails_one_request(model, prompts, monkeypatch, sampling):
    params = sampled() if sampling == "sampled" else [SamplingParams()] * 3
    expected = alone(lambda: Generator(model), prompts, params)
    limit = len(prompts[BAD]) + 4
    cache_that_cannot_grow_for(model, monkeypatch, slot=BAD, limit=limit)
    gen = Generator(model)
    reqs = gen.generate(prompts, N_NEW, params)
    check_one_failed(gen, reqs, expected, "the KV cache cannot grow")
    assert reqs[BAD].slot == BAD and len(reqs[BAD].output) == limit - len(prompts[BAD]) + 1


def test_context_overflow_is_a_value_error_before_any_work():
    small = Llama.random(tiny_config(num_layers=1, max_position_embeddings=32), seed=0)
    gen = Generator(small)
    with pytest.raises(ValueError, match=r"request 1: a prompt of 40 tokens .* context of 32 positions"):
        gen.generate([[1, 2, 3], [5] * 40], 4)
    with pytest.raises(ValueError, match=r"request 0: .*max_new_tokens = 30 exceed the model's context of 32"):
        gen.generate([[1, 2, 3]], 30)
    assert gen.cache is None  # nothing was allocated or run
    assert len(gen.generate([[1, 2, 3]], 29)[0].output) == 29  # exactly the context is fine
