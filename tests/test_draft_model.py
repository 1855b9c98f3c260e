"""Distilled draft models and self-speculation exit heads (``drafting.draft_model.model``,
``specdec train-draft``): the trainer's forward against the decode loop's, file round trips
(bf16 and GGUF blocks), the exit head's folding, exactness (greedy equals autoregressive;
sampled output follows the target with a draft vocabulary smaller than the target's),
chain sizing by the step-cost curve, training that raises agreement, the shipped files
on the real model, and the frequency-ranked draft vocabulary of a whole model drafting by name
(FR-Spec)."""

import time

import pytest
import torch

from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule
from specdec_kernels.decoding.cost_model import StepCost
from specdec_kernels.drafting.draft_model.drafter import AcceptanceByConfidence, ModelDrafter, SelfSpecDrafter
from specdec_kernels.drafting.ngram import NgramTreeDrafter
from specdec_kernels.drafting.draft_model import model as draft_model
from specdec_kernels.drafting.draft_model.model import (corpus_files, corpus_token_counts, exit_model, fold_exit_head,
                                                        frequency_ranked_vocab, load_draft_model, save_draft_model,
                                                        save_exit_head, truncated_draft, with_draft_vocab)
from specdec_kernels.models import Llama, tiny_config
from specdec_kernels.models.llama import LlamaConfig, dense
from specdec_kernels.drafting.draft_model.training import DraftLM, ExitHead, Sequences, agreement, distill_loss, train

from tests.helpers import exact_joint_probs, joint_chisquare_pvalue, real_model, require_real_model

FREE = StepCost({1: {1: 1.0, 64: 1.0}, 4: {4: 1.0, 256: 1.0}})  # extra verified rows cost nothing
TOL = {None: 1e-4, "Q8_0": 0.05}  # logits: fp32 exact up to summation order; Q8_0 within its rounding


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return Llama.random(tiny_config(num_layers=3), seed=0)


def draft_config(model, n):
    c = model.config
    return {"num_layers": n, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "intermediate_size": c.intermediate_size, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim}


def vocab_of(model, size, seed=0):
    return torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:size]


def twin(model, n, vocab):
    d = truncated_draft(model, n, vocab)
    return DraftLM(d.config, d.layers, model.norm, dense(model.embed), dense(model.lm_head)[vocab].float())


def greedy_reference(model, prompt, n):
    return Generator(model, None).generate([prompt], n)[0].output


@pytest.mark.parametrize("vocab_size", [None, 40])
def test_training_twin_matches_the_decode_loop(model, vocab_size):
    """DraftLM (autograd, batched, causal) gives the logits the plain-tensor Llama gives."""
    vocab = vocab_of(model, vocab_size) if vocab_size else torch.arange(model.config.vocab_size)
    lm = twin(model, 2, vocab)
    d = truncated_draft(model, 2, vocab)
    toks = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = lm(toks)
    for b in range(2):
        cache = d.new_cache(1, 16, block_size=16)
        ref = d.logits(d.prefill(toks[b], cache, cache.add_request(0)))
        torch.testing.assert_close(got[b], ref, atol=TOL[None], rtol=TOL[None])


@pytest.mark.parametrize("block_type", [None, "Q8_0"])
def test_save_load_round_trip(model, tmp_path, block_type):
    vocab = vocab_of(model, 48)
    lm = twin(model, 2, vocab)
    path = tmp_path / "d.safetensors"
    save_draft_model(lm.layer_weights(), lm.norm, vocab, draft_config(model, 2), path, block_type=block_type,
                     metadata={"held_out_top1": 0.5})
    d = load_draft_model(path, model)
    assert d.config.num_layers == 2 and torch.equal(d.draft_vocab, vocab) and d.metadata["held_out_top1"] == "0.5"
    assert d.weight_format == (block_type.lower() if block_type else "fp32")
    toks = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3))
    cache = d.new_cache(1, 16, block_size=16)
    got = d.logits(d.prefill(toks, cache, cache.add_request(0)))
    with torch.no_grad():
        ref = lm(toks[None])[0]
    tol = TOL[block_type] if block_type else 0.05  # bf16 storage
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=0)
    for weights in ("fp32", "q4_0"):  # re-formatted on load
        assert load_draft_model(path, model, weights).weight_format == weights


def test_block_draft_follows_an_int8_activation_target(model, tmp_path):
    """A draft stored as blocks, loaded for a target on int8 activations, runs its block
    products on int8 activations too (its LM head rows included); a dense draft stays dense."""
    from specdec_kernels.models.llama import Llama

    vocab = vocab_of(model, 48)
    lm = twin(model, 2, vocab)
    path = tmp_path / "d.safetensors"
    save_draft_model(lm.layer_weights(), lm.norm, vocab, draft_config(model, 2), path, block_type="Q8_0")
    target = model.quantized("Q8_0").with_int8_activations()
    d = load_draft_model(path, target)
    assert d.int8_activations and d.weight_format == "q8_0-int8act"
    assert all(L[k].int8_packed is not None for L in d.layers for k in Llama.LINEAR_KEYS)
    assert not load_draft_model(path, target, "fp32").int8_activations


def test_load_rejects_bad_files(model, tmp_path):
    vocab = vocab_of(model, 8)
    lm = twin(model, 1, vocab)
    path = tmp_path / "d.safetensors"
    save_draft_model(lm.layer_weights(), lm.norm, vocab, draft_config(model, 1), path, block_type=None)
    other = Llama.random(tiny_config(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1), seed=1)
    with pytest.raises(ValueError, match="hidden size"):
        load_draft_model(path, other)
    with pytest.raises(ValueError, match="weights must be one of"):
        load_draft_model(path, model, "int3")
    with pytest.raises(ValueError, match="not an exit head"):
        exit_model(model, path)
    bad = tmp_path / "bad.safetensors"
    save_draft_model(lm.layer_weights(), lm.norm, torch.tensor([1, 1, 2]), draft_config(model, 1), bad, block_type=None)
    with pytest.raises(ValueError, match="repeated"):
        load_draft_model(bad, model)


def test_exit_head_folds_into_one_product(model, tmp_path):
    """The trained exit head (norm + adapter before the LM head rows) and its folded form
    on the truncated target give the same logits."""
    vocab = vocab_of(model, 50)
    head = ExitHead(model.norm, dense(model.lm_head)[vocab].float(), rank=8, eps=model.config.rms_norm_eps)
    with torch.no_grad():
        head.up.normal_(0, 0.1)
    path = tmp_path / "e.safetensors"
    save_exit_head(head.norm, head.down, head.up, vocab, 2, path, metadata={"top1": 0.25})
    d = exit_model(model, path)
    assert d.config.num_layers == 2 and torch.equal(d.draft_vocab, vocab)
    assert ModelDrafter(d, share_target_cache=True, sized=True).prior == 0.25  # an exit file's agreement: its prior
    toks = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(4))
    cache = d.new_cache(1, 16, block_size=16)
    h = d.prefill(toks, cache, cache.add_request(0))
    with torch.no_grad():
        ref = head(h)
    torch.testing.assert_close(d.logits(h), ref, atol=1e-4, rtol=1e-4)
    E, D, U = torch.randn(5, 6), torch.randn(2, 6), torch.randn(6, 2)
    x = torch.randn(6)
    torch.testing.assert_close(fold_exit_head(E, D, U) @ x, E @ (x + U @ (D @ x)))


@pytest.mark.parametrize("variant", ["draft", "draft-tree", "draft-unsized", "self-spec-exit", "draft-q8_0",
                                     "whole-model-vocab", "draft+ngram"])
def test_greedy_equals_autoregressive(model, prompts, tmp_path, variant):
    vocab = vocab_of(model, 40)
    if variant == "whole-model-vocab":  # another model of the vocabulary, restricted to 40 of its tokens
        other = Llama.random(tiny_config(num_layers=2), seed=7).quantized("Q8_0").with_int8_activations()
        drafter = ModelDrafter(with_draft_vocab(other, vocab), step_cost=FREE, acceptance=0.9, sized=True)
    elif variant == "self-spec-exit":
        head = ExitHead(model.norm, dense(model.lm_head)[vocab].float(), rank=4, eps=model.config.rms_norm_eps)
        save_exit_head(head.norm, head.down, head.up, vocab, 2, tmp_path / "e.safetensors")
        drafter = SelfSpecDrafter(model, exit_model=exit_model(model, tmp_path / "e.safetensors"), step_cost=FREE,
                                  acceptance=0.9, sized=True)
    else:
        lm = twin(model, 2, vocab)
        path = tmp_path / "d.safetensors"
        save_draft_model(lm.layer_weights(), lm.norm, vocab, draft_config(model, 2), path,
                         block_type="Q8_0" if variant == "draft-q8_0" else None)
        d = load_draft_model(path, model)
        lookup = NgramTreeDrafter(step_cost=FREE) if variant == "draft+ngram" else None
        drafter = ModelDrafter(d, tree_width=3 if variant == "draft-tree" else 1, step_cost=FREE, acceptance=0.9,
                               sized=variant != "draft-unsized", lookup=lookup)
    reqs = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate(prompts, 20)
    for p, r in zip(prompts, reqs):
        assert r.output == greedy_reference(model, p, 20)
    assert sum(r.stats.drafted for r in reqs) > 0


@pytest.mark.parametrize("source", ["file", "whole-model-vocab"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_distribution_equals_target(tmp_path, temperature, source):
    """Chi-square of the first two sampled tokens against the target's exact joint
    distribution (vocabulary 8, fixed seeds), drafting from 5 of the 8 tokens with the
    draft's q (zero outside its vocabulary): a draft file, or another whole model restricted
    to those tokens (``with_draft_vocab``, as ``--draft-model NAME --draft-vocab`` does)."""
    m = Llama.random(tiny_config(vocab_size=8, num_layers=2), seed=3)
    vocab = torch.tensor([0, 2, 3, 5, 7])
    if source == "file":
        lm = twin(m, 1, vocab)
        save_draft_model(lm.layer_weights(), lm.norm, vocab, draft_config(m, 1), tmp_path / "d.safetensors",
                         block_type=None)
        drafter = ModelDrafter(load_draft_model(tmp_path / "d.safetensors", m))
    else:
        drafter = ModelDrafter(with_draft_vocab(Llama.random(tiny_config(vocab_size=8, num_layers=1), seed=5), vocab))
    n, prompt = 1500, (3, 1, 4)
    sampling = [SamplingParams(seed=s, temperature=temperature) for s in range(n)]
    reqs = Generator(m, drafter, SpecSchedule("constant", 2)).generate([list(prompt)] * n, 2, sampling)
    assert sum(r.stats.drafted for r in reqs) > 0
    pvalue = joint_chisquare_pvalue([tuple(r.output) for r in reqs], exact_joint_probs(m, temperature, prompt, 2))
    assert pvalue > 1e-3, pvalue


def test_draft_plus_ngram_sampled_lookup_chains_keep_the_distribution(tmp_path):
    """``draft+ngram`` at T = 1: requests whose prompt repeats draft the lookup's chain
    (one-hot q rows) where it promises more than the draft's drawn chain, in the same batch
    as requests drafting drawn chains; the first two tokens of each prompt still follow the
    target's exact joint distribution (chi-square, fixed seeds)."""
    m = Llama.random(tiny_config(vocab_size=8, num_layers=2), seed=3)
    lookup = NgramTreeDrafter(step_cost=FREE)
    chains = []
    sampled_chains = lookup.sampled_chains
    lookup.sampled_chains = lambda *a: chains.append(sampled_chains(*a)) or chains[-1]
    drafter = ModelDrafter(with_draft_vocab(Llama.random(tiny_config(vocab_size=8, num_layers=1), seed=5),
                                            torch.tensor([0, 2, 3, 5, 7])),
                           step_cost=FREE, acceptance=0.5, sized=True, lookup=lookup)
    copying, fresh, n = (3, 1, 4, 5, 2) * 3, (3, 1, 4), 1200
    prompts = [list(copying if i % 2 else fresh) for i in range(2 * n)]
    sampling = [SamplingParams(seed=s, temperature=1.0) for s in range(2 * n)]
    reqs = Generator(m, drafter, SpecSchedule("max", 2, max_k=2)).generate(prompts, 2, sampling)
    used = sum(len(c) for c in chains)
    assert n <= used < 2 * n  # the copying prompts' first steps, not the fresh ones'
    assert sum(r.stats.drafted for i, r in enumerate(reqs) if i % 2 == 0) > 0  # drawn chains beside them
    for parity, prompt in ((1, copying), (0, fresh)):
        pairs = [tuple(r.output) for i, r in enumerate(reqs) if i % 2 == parity]
        pvalue = joint_chisquare_pvalue(pairs, exact_joint_probs(m, 1.0, prompt, 2))
        assert pvalue > 1e-3, (prompt, pvalue)


def test_draft_plus_ngram_weighs_the_lookup_against_the_chain(model):
    """``draft+ngram``: a request's lookup tries are weighed against its draft chain (expected
    tokens per unit time, the chain's drafting time included)."""
    from specdec_kernels.drafting.ngram import Candidates

    drafter = ModelDrafter(model.truncated(2), step_cost=StepCost({1: {1: 1.0, 64: 2.0}}), acceptance=0.5, sized=True,
                           lookup=NgramTreeDrafter())
    drafter._cost, drafter._token_s = drafter.step_cost, None
    sure = Candidates([1, 2, 3, 4], [-1, 0, 1, 2], [0, 1, 2, 3], [(0.95, 1), (0.9, 2), (0.85, 3)])
    weak = Candidates([1, 2], [-1, 0], [0, 1], [(0.05, 1)])
    none = Candidates([1], [-1], [0], [])
    drafter._seen["low"], drafter._seen["high"] = [0.5, 9.5], [9.5, 0.5]  # acceptance 0.05 / 0.95
    assert drafter._lookup_wins("low", sure, 4)
    assert not drafter._lookup_wins("high", weak, 4)
    assert not drafter._lookup_wins("high", none, 4) and not drafter._lookup_wins("low", sure, 0)


@pytest.mark.parametrize("lookup_wins", [True, False])
def test_draft_plus_ngram_runs_no_draft_forward_where_the_lookup_wins(model, prompts, lookup_wins):
    """Where the lookup wins the draft model runs no forward that step, and what is drafted
    (the tries alone, or the chain merged with them) is verified exactly: greedy output is the
    model's own either way."""
    forwards = []

    class Counting(ModelDrafter):
        def _lookup_wins(self, rid, c, k):
            return lookup_wins

        def _draft_chains(self, reqs, lengths, stops, drafts):
            forwards.extend(k for k in lengths if k > 0)
            return super()._draft_chains(reqs, lengths, stops, drafts)

    drafter = Counting(model.truncated(2), step_cost=FREE, acceptance=0.9, sized=True,
                       lookup=NgramTreeDrafter(step_cost=FREE))
    assert drafter.name == "draft+ngram"
    copying = [p * 3 for p in prompts]  # something to look up
    reqs = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate(copying, 16)
    for p, r in zip(copying, reqs):
        assert r.output == greedy_reference(model, p, 16)
    assert bool(forwards) != lookup_wins
    assert sum(r.stats.drafted for r in reqs) > 0


def test_chain_length_follows_the_step_cost(model, prompts):
    """Free verification rows and a good acceptance: the longest chain; rows that cost 100
    steps: no draft at all (plain autoregressive steps). (The trainer's predicted chain
    speedup is the same pay-off model: tests/test_cost_model.py.)"""
    d = truncated_draft(model, 1)
    free = ModelDrafter(d, step_cost=FREE, acceptance=0.9, sized=True)
    Generator(model, free, SpecSchedule("max", 4, max_k=6)).generate(prompts[1:2], 4)
    assert free.chain_length(1, 6) == 6
    costly = ModelDrafter(d, step_cost=StepCost({1: {1: 1.0, 2: 100.0}}), acceptance=0.9, sized=True)
    (r,) = Generator(model, costly, SpecSchedule("max", 4, max_k=6)).generate(prompts[1:2], 6)
    assert r.stats.drafted == 0 and r.stats.steps == 6


def test_drafting_is_priced_at_what_a_call_takes(model, prompts):
    """A drafting call's time beyond its forwards (here 30 ms of bookkeeping a call) is
    measured and priced once a call: one-token chains come to cost it, and a longer chain
    pays it once, not once a token."""
    class SlowBookkeeping(ModelDrafter):
        def _chains_into(self, runs, drafts):
            time.sleep(0.03)
            return super()._chains_into(runs, drafts)

    d = SlowBookkeeping(truncated_draft(model, 1), step_cost=FREE, acceptance=0.9, sized=True)
    Generator(model, d, SpecSchedule("max", 1, max_k=1)).generate(prompts[1:2], 12)
    assert d._call_s > 0.015 and d._token_s < 0.01
    one, four = d.drafting_cost(1, 1), d.drafting_cost(4, 1)
    assert four - one == pytest.approx(3 * (d.drafting_cost(2, 1) - one)) and four < 2 * one


def test_catching_up_a_lagging_draft_is_not_priced(model, prompts):
    """A drafting call whose first forward also feeds the tokens the draft missed while it did
    not draft (here it drafts every third step, and such forwards are slowed by 50 ms) does not
    price that catch-up as a drafted token: the price stays what a one- or two-token forward
    costs. (Priced, each catch-up would raise it by 40%: a dozen of them, 5x or more.)"""
    class EveryThirdStep(ModelDrafter):
        calls = 0

        def propose(self, gen, reqs, lengths):
            self.calls += 1
            return super().propose(gen, reqs, lengths if self.calls % 3 == 0 else [0] * len(lengths))

    draft = model.truncated(model.config.num_layers)
    forward = draft.forward
    catch_up_delay = [0.0]

    def slow_forward(tokens, *a, **kw):
        # Every forward takes at least 3 ms, so that the machine's noise does not move the price.
        time.sleep(0.003 + (catch_up_delay[0] if tokens.numel() > 2 else 0.0))
        return forward(tokens, *a, **kw)

    draft.forward = slow_forward
    d = EveryThirdStep(draft, step_cost=FREE, sized=True, acceptance=0.9)
    d._token_s = 0.004  # about a one- or two-token forward's (start() times it only when unset)
    gen = Generator(model, d, SpecSchedule("max", 2, max_k=2))
    gen.generate(prompts[1:2], 8)  # the price of a one- or two-token forward, measured
    price = d._token_s
    catch_up_delay[0] = 0.05
    (r,) = gen.generate(prompts[1:2], 48)
    assert r.output == greedy_reference(model, prompts[1], 48)
    assert d.calls >= 30 and r.stats.drafted >= 10  # it drafted after lagging, a dozen times
    assert d._token_s < 3 * price


def test_an_inflated_price_is_measured_again(model, prompts):
    """A price that says no chain pays even if every token were accepted (here five steps a
    drafted token, as a busy moment of the machine can leave it) does not keep drafting off
    for good: each new request probes once, which times a forward and brings the price
    down, until chains pay again. Greedy output stays the target's throughout."""
    d = ModelDrafter(model.truncated(model.config.num_layers), step_cost=FREE, sized=True)
    Generator(model, d, SpecSchedule("max", 4, max_k=4)).generate(prompts[1:2], 4)
    assert d.chain_length(1, 4, 1.0) > 0
    d._token_s = 5.0  # seconds; a step is one second (FREE)
    assert d.chain_length(1, 4, 1.0) == 0
    ar = greedy_reference(model, prompts[1], 8)
    prices, drafted = [d._token_s], []
    for _ in range(40):
        (r,) = Generator(model, d, SpecSchedule("max", 4, max_k=4)).generate(prompts[1:2], 8)
        assert r.output == ar
        prices.append(d._token_s)
        drafted.append(r.stats.drafted)
        if r.stats.drafted > 2:
            break
    assert all(n >= 1 for n in drafted) and all(b < a for a, b in zip(prices, prices[1:]))
    assert drafted[-1] > 2 and d._token_s < 1.0


ROWS_PAY_AT_HIGH_ACCEPTANCE = StepCost({1: {1: 1.0, 2: 1.5, 8: 1.8}})  # seconds: drafting is nearly free


def test_a_too_low_prior_is_probed_not_kept(model, prompts):
    """A draft that equals the target, sized from a prior of 0.05 and verification rows that
    pay only at high acceptance: it probes one token a step, finds it accepted and drafts
    chains; an unrelated draft stops after its few probes (PROBE_TOKENS) and decodes
    autoregressive steps from then on, but for a re-probe after REPROBE_AFTER idle steps and
    another after twice that (each rejected). Greedy output stays the target's either way."""
    from specdec_kernels.drafting.draft_model.drafter import PROBE_TOKENS, REPROBE_AFTER

    cost = ROWS_PAY_AT_HIGH_ACCEPTANCE
    ar = greedy_reference(model, prompts[1], 24)
    same = ModelDrafter(model.truncated(model.config.num_layers), step_cost=cost, acceptance=0.05, sized=True)
    (r,) = Generator(model, same, SpecSchedule("max", 6, max_k=6)).generate(prompts[1:2], 24)
    assert r.output == ar and r.stats.drafted > 2 * PROBE_TOKENS and r.stats.steps < 12
    other = ModelDrafter(Llama.random(tiny_config(num_layers=1), seed=11), step_cost=cost, acceptance=0.05, sized=True)
    # One token a step: the probes, a re-probe after REPROBE_AFTER idle steps, another after twice
    # that, and two tokens to spare; a third would come 4 * REPROBE_AFTER idle steps later.
    n = PROBE_TOKENS + (REPROBE_AFTER + 1) + (2 * REPROBE_AFTER + 1) + 2
    (r,) = Generator(model, other, SpecSchedule("max", 6, max_k=6)).generate(prompts[1:2], n)
    assert r.output == greedy_reference(model, prompts[1], n)
    assert r.stats.accepted == 0 and r.stats.drafted == PROBE_TOKENS + 2


def test_a_request_kept_off_by_its_opening_drafts_again(model, prompts):
    """A draft that disagrees with the target over the answer's first 8 tokens (its logits
    negated) and equals it after: its probes are rejected and its acceptance keeps chains off;
    REPROBE_AFTER steps later it probes again, finds the draft agreeing, probes on while it
    agrees and then drafts chains for the rest of the answer. Before re-probes it decoded the
    rest one token a step."""
    from specdec_kernels.drafting.draft_model.drafter import PROBE_TOKENS

    draft = model.truncated(model.config.num_layers)
    switch = len(prompts[1]) + 8  # the position of the answer's 9th token
    last_fed = [0]
    forward, logits = draft.forward, draft.logits

    def tracking_forward(tokens, positions, *a, **kw):
        last_fed[0] = int(positions.max())
        return forward(tokens, positions, *a, **kw)

    def opening_wrong(h):  # the token drawn from these logits goes at last_fed + 1
        return -logits(h) if last_fed[0] + 1 < switch else logits(h)

    draft.forward, draft.logits = tracking_forward, opening_wrong
    d = ModelDrafter(draft, step_cost=ROWS_PAY_AT_HIGH_ACCEPTANCE, acceptance=0.05, sized=True)
    (r,) = Generator(model, d, SpecSchedule("max", 6, max_k=6)).generate(prompts[1:2], 48)
    assert r.output == greedy_reference(model, prompts[1], 48)
    assert r.stats.drafted > PROBE_TOKENS + 16 and r.stats.accepted >= 16 and r.stats.steps <= 28


def sharpened(model, num_layers: int, factor: float) -> Llama:
    """The target's first layers with its logits scaled by ``factor`` (its final norm's
    weight): the same greedy tokens as ``model.truncated``, more sure of them."""
    cfg = LlamaConfig(**{**model.config.__dict__, "num_layers": num_layers})
    return Llama(cfg, dict(embed=model.embed, norm=model.norm * factor, lm_head=model.lm_head, draft_vocab=None,
                           layers=model.layers[:num_layers]))


class RecordingStops(ModelDrafter):
    """A draft drafter whose drafting time is a fixed tenth of a step (so that the test does
    not depend on this machine's timing) and that records each confidence-stopping decision:
    (chain length before the token, the chain's limit, the token's probability under the
    draft, p, go on)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.decisions = []

    def drafting_cost(self, forwards, batch):
        return 0.1 * forwards

    def _keep_drafting(self, run, confidence, batch, sampled):
        p, more = super()._keep_drafting(run, confidence, batch, sampled)
        self.decisions.append((len(run.chain), run.length, confidence, p, more))
        return p, more


ROW_PRICED = StepCost({1: {1: 1.0, 2: 1.25, 16: 4.0}})  # a verified row past the first costs a quarter step


def test_acceptance_by_confidence_starts_halfway_and_learns():
    """A bin's estimate starts halfway between its midpoint and the request's running
    acceptance, with two tokens of weight, and moves to what the bin's tokens showed."""
    est = AcceptanceByConfidence(bins=10, prior_tokens=2.0)
    assert est(0.93, 0.5) == pytest.approx(0.5 * (0.95 + 0.5))
    assert est(0.0, 1.0) == pytest.approx(0.5 * (0.05 + 1.0)) and est(1.0, 0.0) == pytest.approx(0.475)
    for i in range(98):
        est.observe(0.31, i % 4 != 0)
    assert est(0.35, 0.2) == pytest.approx((73 + 2 * 0.5 * (0.35 + 0.2)) / 100)  # 73 of 98 accepted
    assert est(0.55, 0.2) == pytest.approx(0.5 * (0.55 + 0.2))  # other bins untouched


def test_confidence_stopped_chains_equal_autoregressive(model, prompts):
    """Sized chains stop where the draft's confidence says the next token does not pay:
    chains of several lengths, some ended before the schedule's cap by a token left out and
    some after a kept one, and greedy output is the target's."""
    drafter = RecordingStops(sharpened(model, 2, 8.0), step_cost=ROW_PRICED, acceptance=0.8, sized=True)
    reqs = Generator(model, drafter, SpecSchedule("max", 6, max_k=6)).generate(prompts, 24)
    for p, r in zip(prompts, reqs):
        assert r.output == greedy_reference(model, p, 24)
    d = drafter.decisions
    assert any(p is None for _, _, _, p, _ in d)  # a greedy token left out
    assert any(p is not None and not more and k + 1 < cap for k, cap, _, p, more in d)  # stopped after a kept one
    assert any(more for *_, more in d) and sum(r.stats.drafted for r in reqs) > 0
    left_out = [c for _, _, c, p, _ in d if p is None]
    kept_first = [c for k, _, c, p, _ in d if p is not None and k == 0]
    assert min(kept_first) > min(left_out)  # the sure tokens are the ones kept
    assert sum(drafter.by_confidence.seen) > 0  # the verified tokens calibrate the estimates
    with_lookup = ModelDrafter(sharpened(model, 2, 8.0), step_cost=ROW_PRICED, sized=True, lookup=NgramTreeDrafter())
    assert with_lookup.by_confidence is None  # draft+ngram keeps its sized length (benchmarks.md)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_confidence_stopped_sampled_chains_keep_the_distribution(temperature):
    """Sampled chains keep every token they draw and stop on the confidence of the ones drawn
    so far: the first three sampled tokens follow the target's exact joint distribution
    (chi-square, fixed seeds), with chains that went on after their first token and chains
    that stopped there (before the schedule's cap), which decides whether the third token is
    a draft's or the target's own."""
    m = Llama.random(tiny_config(vocab_size=8, num_layers=2), seed=3)
    rows_priced = StepCost({8: {8: 1.0, 16: 1.25, 32: 2.0}})  # 8 requests: a row past each one's first costs 1/32 step
    drafter = RecordingStops(sharpened(m, 1, 2.0), step_cost=rows_priced, acceptance=0.6, sized=True)
    n, prompt = 3000, (3, 1, 4)
    sampling = [SamplingParams(seed=s, temperature=temperature) for s in range(n)]
    reqs = Generator(m, drafter, SpecSchedule("max", 3, max_k=3)).generate([list(prompt)] * n, 5, sampling,
                                                                           max_batch=8)
    d = drafter.decisions
    assert all(p is not None for *_, p, _ in d)  # a drawn token is never left out
    assert any(more and k == 0 for k, *_, more in d) and any(not more and k == 0 and cap > 1 for k, cap, *_, more in d)
    pvalue = joint_chisquare_pvalue([tuple(r.output[:3]) for r in reqs], exact_joint_probs(m, temperature, prompt, 3))
    assert pvalue > 1e-3, pvalue


def _distill_data(target, n_seqs=24, length=24, seed=0, layers=None):
    """Teacher-forced top-k targets of ``target`` on random token sequences (the data dict of
    ``training.distill_data``)."""
    from specdec_kernels.training.distill_data import teacher_forced

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, target.config.vocab_size, (length,), generator=g).tolist() for _ in range(n_seqs)]
    layers = layers or (target.config.num_layers,)
    data = teacher_forced(target, seqs, layers, topk=8)
    data.update(tokens=torch.tensor([t for s in seqs for t in s]),
                seq_start=torch.arange(0, (n_seqs + 1) * length, length),
                prompt_len=torch.full((n_seqs,), 4), layers=torch.tensor(layers))
    return data


def test_distillation_raises_agreement(model):
    """A 1-layer draft distilled from the 3-layer target agrees with it clearly more than the
    truncated target did (held-out sequences)."""
    data = _distill_data(model)
    vocab = torch.arange(model.config.vocab_size)
    lm = twin(model, 1, vocab)
    tr, held = Sequences(data, range(20), vocab, 64), Sequences(data, range(20, 24), vocab, 64)
    b = tr.batch([0, 1])
    loss, hits, count = distill_loss(lm(b["tokens"]), b)
    assert loss.item() > 0 and count == 2 * (24 - 4)
    result = train(lm, tr, held, epochs=25, batch_seqs=4, lr=3e-3, seed=0, progress=False, log=lambda s: None)
    assert result["best"] >= result["before"] + 0.15, result
    assert agreement(lm, held) == pytest.approx(result["best"])


def test_exit_head_training_raises_agreement(model):
    """An exit head on the tiny target's features after 1 of 3 layers agrees with the full
    model more than plain early exit does (held-out sequences)."""
    data = _distill_data(model, seed=1, layers=(1, 3))
    feats = data["features"][0]
    vocab = torch.arange(model.config.vocab_size)
    tr = Sequences(data, range(20), vocab, 64, features=feats)
    held = Sequences(data, range(20, 24), vocab, 64, features=feats)
    head = ExitHead(model.norm, dense(model.lm_head).float(), rank=16, eps=model.config.rms_norm_eps)
    result = train(head, tr, held, epochs=20, batch_seqs=4, lr=3e-3, seed=0, progress=False, log=lambda s: None)
    assert result["best"] >= result["before"] + 0.1, result


@real_model
@pytest.mark.parametrize("drafter_name, floor", [("draft", 1.2), ("self-spec", 1.1)])
def test_shipped_drafts_on_the_real_model(drafter_name, floor):
    """The shipped distilled draft and exit head on SmolLM2-135M: greedy output equals
    autoregressive, and the trained draft accepts clearly more than the same draft before
    training (a fixed chain of 4, so the machine's cost curve does not decide the length).
    Measured when shipped, two prompts x 48 tokens: mean accepted length 1.29 draft (1.03
    before distillation), 1.14 self-spec (1.03 plain early exit)."""
    from specdec_kernels.decoding.registry import make_drafter
    from specdec_kernels.drafting.draft_model.model import default_draft_checkpoint, default_exit_checkpoint
    from specdec_kernels.models import load_model

    require_real_model()
    shipped = default_draft_checkpoint if drafter_name == "draft" else default_exit_checkpoint
    if shipped("smollm2-135m") is None:
        pytest.fail(f"no {drafter_name} file ships for smollm2-135m")
    model, tok = load_model("smollm2-135m")
    trained = make_drafter(drafter_name, model)
    # Its sizing starts from the held-out agreement its file records, whichever key holds it.
    recorded = trained.model.metadata.get("held_out_top1", trained.model.metadata.get("top1"))
    assert trained.prior == pytest.approx(float(recorded)) and trained.prior_tokens > 1
    untrained = (make_drafter("draft-untrained", model) if drafter_name == "draft"
                 else SelfSpecDrafter(model, trained.model.config.num_layers))  # plain early exit, same L
    mal = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        drafter.sized = False
        emitted = steps = 0
        for text in ("Explain why the sky is blue in two short paragraphs.", "Write a short poem about the sea."):
            ids = tok.chat_prompt(text)
            (r,) = Generator(model, drafter, SpecSchedule("constant", 4)).generate([ids], 48)
            assert r.output == Generator(model, None).generate([ids], 48)[0].output, name
            emitted, steps = emitted + r.stats.emitted, steps + r.stats.steps
        mal[name] = emitted / steps
    assert mal["trained"] >= floor and mal["trained"] > mal["untrained"] + 0.05, mal


# ---- frequency-ranked draft vocabulary (FR-Spec) ------------------------------------------
def test_frequency_ranked_vocab():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 2])
    assert frequency_ranked_vocab(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    assert frequency_ranked_vocab(counts, 3, always=[6]).tolist() == [2, 5, 6]  # an end-of-turn id never seen
    assert frequency_ranked_vocab(counts, 3, always=[6, 6, 2]).tolist() == [2, 5, 6]
    assert frequency_ranked_vocab(counts, 8).tolist() == list(range(8))
    for size, always in [(0, ()), (9, ()), (1, (6, 7)), (2, (8,)), (2, (-1,))]:
        with pytest.raises(ValueError, match="draft vocabulary of"):
            frequency_ranked_vocab(counts, size, always)


class CharTokenizer:
    """One token per character (its code point mod 8): what corpus_token_counts needs."""

    def __init__(self):
        self.calls = 0

    def vocab_digest(self):
        return "c" * 64

    def encode(self, text):
        self.calls += 1
        return [ord(c) % 8 for c in text]


def test_corpus_token_counts_are_counted_once_and_cached(tmp_path, monkeypatch):
    texts = ["abcab", "hhh\n"]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.py").write_text(t)
    monkeypatch.setattr(draft_model, "corpus_files", lambda: [str(tmp_path / f"{i}.py") for i in range(2)])
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    tok = CharTokenizer()
    want = torch.bincount(torch.tensor([ord(c) % 8 for c in "".join(texts)]), minlength=8)
    assert torch.equal(corpus_token_counts(tok, 8), want) and tok.calls == 2
    assert torch.equal(corpus_token_counts(tok, 8), want) and tok.calls == 2  # from the cache
    assert not [p for p in (tmp_path / "cache" / "vocab").iterdir() if p.name.endswith(".tmp")]
    prefix = torch.bincount(torch.tensor([ord(c) % 8 for c in "abc"]), minlength=8)
    assert torch.equal(corpus_token_counts(tok, 8, max_bytes=3), prefix)  # its own cache entry
    assert corpus_token_counts(tok, 9).shape == (9,)
    for entry in (tmp_path / "cache" / "vocab").iterdir():  # a corrupt cache entry is counted again
        entry.write_bytes(b"not a tensor")
    calls = tok.calls
    assert torch.equal(corpus_token_counts(tok, 8), want) and tok.calls == calls + 2


def test_the_corpus_is_the_standard_librarys_sources():
    files = corpus_files()
    assert files == corpus_files() and any(f.endswith("/textwrap.py") for f in files)
    assert not any("/test/" in f or "/site-packages/" in f for f in files)


def test_a_draft_vocab_head_gives_the_full_heads_rows(model):
    """with_draft_vocab: the LM head's rows ``vocab`` (blocks keep their int8 packing, so a
    row's logit is bit-identical to the full head's), the other weights shared."""
    vocab = vocab_of(model, 40)
    h = torch.randn(3, model.config.hidden_size)
    d = with_draft_vocab(model, vocab)
    assert torch.equal(d.draft_vocab, vocab) and d.layers[0]["wqkv"] is model.layers[0]["wqkv"]
    torch.testing.assert_close(d.logits(h), model.logits(h)[:, vocab], atol=1e-5, rtol=1e-5)
    packed = model.quantized("Q8_0").with_int8_activations()
    d = with_draft_vocab(packed, vocab)
    assert d.int8_activations and d.weight_format == packed.weight_format
    assert torch.equal(d.logits(h), packed.logits(h)[:, vocab])
