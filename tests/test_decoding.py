"""The speculative decode loop: exactness of greedy decoding for every drafter, the sampled
distribution, EOS / max_new_tokens, schedules and statistics (small random models)."""
import numpy as np
import pytest
import torch

from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule
from specdec_kernels.drafting.medusa.drafter import MedusaDrafter
from specdec_kernels.drafting.draft_model.drafter import ModelDrafter, SelfSpecDrafter
from specdec_kernels.drafting.ngram import NgramDrafter, NgramTables, NgramTreeDrafter
from specdec_kernels.decoding.cost_model import StepCost
from specdec_kernels.decoding.stats import RequestStats
from specdec_kernels.models import Llama, tiny_config
from tests.helpers import exact_joint_probs, joint_chisquare_pvalue


@pytest.fixture(scope="module")
def model():
    return Llama.random(tiny_config(num_layers=3), seed=0)


# An injected step cost (relative cost of 1, 2, ... verified rows), so that tree sizes do not
# depend on timings; tests/test_cost_model.py covers the measured curve.
STEP_COST = (1.0, 1.08, 1.14, 1.17, 1.24, 1.31, 1.36, 1.41, 1.46, 1.52, 1.56, 1.61)

DRAFTERS = {
    "ngram": lambda m: NgramDrafter(),
    "ngram-tree": lambda m: NgramTreeDrafter(step_cost=STEP_COST),
    "draft-chain": lambda m: ModelDrafter(Llama.random(tiny_config(num_layers=1), seed=5)),
    "draft-good": lambda m: ModelDrafter(m.truncated(2)),
    "draft-tree": lambda m: ModelDrafter(m.truncated(1), tree_width=3),
    "draft+ngram": lambda m: ModelDrafter(m.truncated(2), sized=True, step_cost=STEP_COST,
                                          lookup=NgramTreeDrafter(step_cost=STEP_COST)),
    "self-spec": lambda m: SelfSpecDrafter(m, 1),
    "medusa": lambda m: MedusaDrafter(m),
}


def reference_greedy(model, prompt, n):
    """Greedy decoding by recomputing the whole sequence each step (no cache reuse)."""
    ids = list(prompt)
    for _ in range(n):
        cache = model.new_cache(1, len(ids) + 1, block_size=32)
        slot = cache.add_request(len(ids))
        ids.append(int(model.logits(model.prefill(torch.tensor(ids), cache, slot))[-1].argmax()))
    return ids[len(prompt):]


def test_autoregressive_matches_reference(model, prompts):
    reqs = Generator(model).generate(prompts, 12)
    for r, p in zip(reqs, prompts):
        assert r.output == reference_greedy(model, p, 12)
        assert r.stats.steps == 12 and r.stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("schedule", ["constant", "heuristic", "adaptive"])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_speculative_equals_autoregressive(model, prompts, drafter, schedule):
    ar = [r.output for r in Generator(model).generate(prompts, 30)]
    reqs = Generator(model, DRAFTERS[drafter](model), SpecSchedule(schedule, 3)).generate(prompts, 30)
    assert [r.output for r in reqs] == ar
    for r in reqs:
        assert len(r.output) == 30
        assert r.stats.emitted == 30 and r.stats.steps <= 30
        assert r.stats.emitted == r.stats.steps + r.stats.accepted
    if drafter == "draft-good":  # the draft shares 2 of 3 layers: it must get some right
        assert sum(r.stats.accepted for r in reqs) > 0


@pytest.mark.parametrize("max_batch", [1, 2, 3])
@pytest.mark.parametrize("drafter", ["none", *sorted(DRAFTERS)])
def test_continuous_batching_equals_autoregressive(model, prompts, drafter, max_batch):
    """At most ``max_batch`` requests decode at once and waiting prompts join as slots free up
    (drafters get them through ``admit``): every greedy output equals its autoregressive one,
    the requests come back in prompt order, and no step runs more than ``max_batch``."""
    ps = prompts + [prompts[2][::-1], prompts[3][:9]]  # six prompts: more than the slots
    ar = [reference_greedy(model, p, 14) for p in ps]
    gen = Generator(model, None if drafter == "none" else DRAFTERS[drafter](model), SpecSchedule("heuristic", 3))
    widths, step = [], gen.step
    gen.step = lambda reqs, *a: (widths.append(len(reqs)), step(reqs, *a))
    reqs = gen.generate(ps, 14, max_batch=max_batch)
    assert [r.rid for r in reqs] == list(range(len(ps)))
    assert [r.output for r in reqs] == ar
    assert gen.cache.max_batch == max_batch and max(widths) == max_batch
    assert all(r.stats.prefill_tokens == len(p) - 1 for r, p in zip(reqs, ps))


def test_continuous_batching_admits_as_requests_finish(model, prompts):
    """A request that stops early (max_new_tokens reached through long accepted paths, or
    nothing to generate) gives its slot to the next prompt at once, and max_batch is checked."""
    good = ModelDrafter(model.truncated(3))  # the whole target: every draft is accepted
    gen = Generator(model, good, SpecSchedule("constant", 4))
    widths, step = [], gen.step
    gen.step = lambda reqs, *a: (widths.append(len(reqs)), step(reqs, *a))
    ps = prompts * 2
    reqs = gen.generate(ps, 10, max_batch=2)
    assert [r.output for r in reqs] == [reference_greedy(model, p, 10) for p in ps]
    assert sum(widths) == sum(r.stats.steps for r in reqs) and set(widths) == {2}
    assert [r.output for r in Generator(model).generate(ps, 0, max_batch=3)] == [[]] * len(ps)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_batch"):
            Generator(model).generate(ps, 4, max_batch=bad)
    with pytest.raises(ValueError, match="2 sampling parameters for 8 prompts"):  # not silently fewer requests
        Generator(model).generate(ps, 4, [SamplingParams()] * 2)


def test_good_draft_gives_long_accepted_lengths(model, prompts):
    """The target as its own draft model accepts everything: k + 1 tokens per step."""
    reqs = Generator(model, ModelDrafter(model), SpecSchedule("constant", 4)).generate(prompts, 20)
    for r in reqs:
        assert r.stats.mean_accepted_length == 5.0
        assert r.stats.acceptance_per_pos == [1.0] * 4


def test_eos_and_max_new_tokens_inside_accepted_paths(prompts):
    m = Llama.random(tiny_config(num_layers=3), seed=0)
    ar = Generator(m).generate(prompts, 30)
    # Make a token that greedy decoding emits mid-way an EOS token.
    eos = ar[3].output[10]
    m.config.eos_token_ids = (eos,)
    ar_eos = [r.output for r in Generator(m).generate(prompts, 30)]
    assert ar_eos[3][-1] == eos and len(ar_eos[3]) <= 11
    reqs = Generator(m, ModelDrafter(m), SpecSchedule("constant", 6)).generate(prompts, 30)
    assert [r.output for r in reqs] == ar_eos
    # max_new_tokens that is not a multiple of the accepted length.
    m.config.eos_token_ids = ()
    for n in (1, 2, 7):
        reqs = Generator(m, ModelDrafter(m), SpecSchedule("constant", 4)).generate(prompts, n)
        assert all(len(r.output) == n for r in reqs)


def test_streaming_callback(model, prompts):
    seen = {}
    reqs = Generator(model, NgramDrafter()).generate(prompts, 15, on_tokens=lambda r, t: seen.setdefault(r.rid, []).extend(t))
    assert [seen[r.rid] for r in reqs] == [r.output for r in reqs]


def _sampled_pairs(model, drafter, n, params, prompt=(3, 1, 4)):
    """(x1, x2) of n requests sampled with seeds 0..n-1, all in one batch."""
    prompt = list(prompt)
    sampling = [SamplingParams(seed=s, **params) for s in range(n)]
    reqs = Generator(model, drafter, SpecSchedule("constant", 2)).generate([prompt] * n, 2, sampling)
    return [tuple(r.output) for r in reqs]


@pytest.mark.parametrize("drafter,params", [
    ("ngram", dict(temperature=1.0)),
    ("ngram-tree", dict(temperature=1.0)),
    ("ngram-tree", dict(temperature=0.7, top_p=0.8)),
    ("ngram-tree+openings", dict(temperature=1.0)),
    ("draft", dict(temperature=0.8)),
    ("draft-tree", dict(temperature=1.0, top_k=5)),
    ("self-spec", dict(temperature=1.0, top_p=0.9)),
])
def test_sampling_distribution_equals_target(drafter, params):
    """Chi-square of the first two sampled tokens against the target's exact joint
    distribution (vocabulary 8; fixed seeds, so the test is deterministic)."""
    m = Llama.random(tiny_config(vocab_size=8, num_layers=2), seed=3)
    make = {"ngram": lambda: NgramDrafter(min_ngram=1),
            # Every token of the prompt recurs: the first draft is a tree with 3 children of the root.
            "ngram-tree": lambda: NgramTreeDrafter(step_cost=[1.0] * 32),  # free rows: keep every node
            # Answer openings after the prompt's last token, merged into the same trie: 2 and 5
            # join the lookup's 2, 3, 4 at the root, and their children join the lookup's.
            "ngram-tree+openings": lambda: NgramTreeDrafter(step_cost=[1.0] * 32, tables=NgramTables(
                NgramTreeDrafter.FIRST, NgramTreeDrafter.NEXT, NgramTreeDrafter.RANK,
                (((1,), (2, 3), 3), ((1,), (5, 6), 2), ((1,), (2, 7), 1)))),
            "draft": lambda: ModelDrafter(Llama.random(tiny_config(vocab_size=8, num_layers=1), seed=4)),
            "draft-tree": lambda: ModelDrafter(m.truncated(1), tree_width=2),
            "self-spec": lambda: SelfSpecDrafter(m, 1)}[drafter]
    n = 1500
    prompt = (1, 2, 1, 3, 1, 4, 1) if drafter.startswith("ngram-tree") else (3, 1, 4)
    pairs = _sampled_pairs(m, make(), n, params, prompt)
    joint = exact_joint_probs(m, params["temperature"], prompt, 2, params.get("top_k", 0), params.get("top_p", 1.0))
    pvalue = joint_chisquare_pvalue(pairs, joint)
    assert pvalue > 1e-3, (drafter, pvalue)


SEEDED = {  # drafters whose draft for a request depends on that request alone
    "none": lambda m: None,
    "ngram": DRAFTERS["ngram"],
    "draft-chain": DRAFTERS["draft-chain"],
    "draft-tree": DRAFTERS["draft-tree"],
    "self-spec": DRAFTERS["self-spec"],
    "medusa": DRAFTERS["medusa"],
}


@pytest.mark.parametrize("drafter", sorted(SEEDED))
def test_seeded_sampling_does_not_depend_on_the_batch(model, prompts, drafter):
    """Issue 24 (7b): a request with a seed gives the same tokens alone, in any batch, at any
    slot, with or without continuous batching (as vLLM's per-request seeds do). Before, the
    Philox offset moved on by the batch's widest tree and ModelDrafter drew every request's
    drafts from one shared generator, so a request's tokens depended on the others."""
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=0.7, top_k=8, seed=12),
              SamplingParams(temperature=1.1, top_p=0.8, seed=13), SamplingParams(temperature=0.8, seed=14)]
    make = SEEDED[drafter]

    def run(order, **kw):
        reqs = Generator(model, make(model), SpecSchedule("constant", 3)).generate(
            [prompts[i] for i in order], 10, [params[i] for i in order], **kw)
        return {i: r.output for i, r in zip(order, reqs)}

    alone = {i: run([i])[i] for i in range(4)}
    assert len({tuple(o) for o in alone.values()}) == 4
    for order, kw in (([0, 1, 2, 3], {}), ([3, 2, 1, 0], {}), ([2, 0, 3, 1], {"max_batch": 2}),
                      ([1, 3, 0, 2], {"max_batch": 3})):
        assert run(order, **kw) == alone, (order, kw)


def test_schedules():
    s = SpecSchedule("heuristic", 4)
    s.update(0, 4, 4)
    assert s.length(0) == 6
    s.update(0, 6, 2)
    assert s.length(0) == 5
    a = SpecSchedule("adaptive", 4)
    for _ in range(20):
        a.update(1, a.length(1), a.length(1))
    assert a.length(1) == 8
    for _ in range(40):
        a.update(1, a.length(1), 0)
    assert a.length(1) == 2
    c = SpecSchedule("constant", 3)
    c.update(2, 3, 0)
    assert c.length(2) == 3
    m = SpecSchedule("max", 3, max_k=12)
    m.update(2, 3, 0)
    assert m.length(2) == 12
    with pytest.raises(ValueError, match="schedule must be one of"):
        SpecSchedule("bogus")


def test_stats():
    st = RequestStats()
    st.record(depth=3, nodes=3, accepted=2, emitted=3)
    st.record(depth=2, nodes=4, accepted=0, emitted=1)
    assert st.drafted_per_pos == [2, 2, 1] and st.accepted_per_pos == [1, 1]
    assert st.acceptance_per_pos == [0.5, 0.5, 0.0]
    assert st.mean_accepted_length == 2.0
    assert "mean accepted length 2.00" in st.format()


def test_a_drafters_prompt_work_is_prefill_time(model, prompts):
    """What a drafter does on admitting requests (a draft model's prefill of the prompt) is
    counted as prefill, shared by the requests admitted, not as a decode step's time."""
    import time

    class SlowAdmit(NgramDrafter):
        def admit(self, gen, reqs):
            time.sleep(1.0)

    reqs = Generator(model, SlowAdmit()).generate(prompts[:2], 4)
    for r in reqs:  # half the sleep each; the steps of a random tiny model take milliseconds
        assert r.stats.time_prefill >= 0.5 and r.stats.total_time < 0.5, r.stats.summary()


def test_cli_drafters_by_name(model, prompts):
    from specdec_kernels.cli import main
    from specdec_kernels.decoding import DRAFTERS as NAMES, make_drafter

    from specdec_kernels.decoding.registry import TRAINED

    ar = [r.output for r in Generator(model).generate(prompts[:2], 6)]
    for name in NAMES:
        if name.split("+")[0].removesuffix("-tree") in TRAINED:  # no trained file ships for a random model
            with pytest.raises(ValueError, match="no trained .* ships for model 'random'"):
                make_drafter(name, model, self_spec_layers=1)
            continue
        d = make_drafter(name, model, self_spec_layers=1)
        assert (d is None) == (name == "none")
        assert [r.output for r in Generator(model, d).generate(prompts[:2], 6)] == ar
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("bogus", model)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])


def test_medusa_checkpoint_through_cli(model, prompts, tmp_path):
    """Random heads saved with safetensors under the Medusa keys load through the CLI's
    make_drafter path, propose what the heads predict, and keep greedy decoding exact."""
    from safetensors.torch import save_file

    from specdec_kernels.decoding import make_drafter
    from specdec_kernels.drafting.medusa.heads import MedusaHeads

    c = model.config
    g = torch.Generator().manual_seed(3)
    heads = MedusaHeads(c.hidden_size, c.vocab_size, num_heads=3, num_layers=1, lm_head_weight=model.lm_head)
    sd = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in heads.state_dict().items()}
    path = tmp_path / "medusa_lm_head.safetensors"
    save_file(sd, str(path))

    drafter = make_drafter("medusa", model, medusa_checkpoint=str(path))
    assert isinstance(drafter, MedusaDrafter) and drafter.heads.num_heads == 3
    assert drafter.heads.lm_head_weight.data_ptr() == model.lm_head.data_ptr()  # shared, not copied
    torch.testing.assert_close(drafter.heads.medusa_head[2][0].linear.weight, sd["medusa_head.2.0.linear.weight"])
    # The proposal is the heads' top-1 chain along the tree's first branch.
    req = Generator(model, None).generate([prompts[1]], 1)[0]
    hidden = torch.randn(c.hidden_size, generator=g)
    req.tokens = list(prompts[1])
    drafter.hidden_states(None, req, hidden[None], req.tokens[-1:])  # the state that produced the root
    (draft,) = drafter.propose(None, [req], [3])
    from specdec_kernels.models.llama import rms_norm

    ref = MedusaHeads(c.hidden_size, c.vocab_size, 3, 1, lm_head_weight=model.lm_head)
    ref.load_state_dict(sd)
    heads_logits = ref.logits(rms_norm(hidden, model.norm, c.rms_norm_eps))  # [K, V]
    expect = heads_logits.argmax(-1).tolist()
    node, path = 0, []
    for i in range(1, len(draft.tokens)):  # follow first children: the top-1 of each head
        if draft.parents[i] == node:
            path.append(draft.tokens[i])
            node = i
    assert path == expect
    ar = Generator(model, None).generate(prompts, 12)
    spec = Generator(model, drafter, SpecSchedule("constant", 3)).generate(prompts, 12)
    assert [r.output for r in spec] == [r.output for r in ar]


def _paths(parents, tokens):
    """Root-to-node token paths (root excluded) of a draft tree."""
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return paths


class _TreeDrafter(NgramTreeDrafter):
    """Fixed acceptance tables, so that the expectations below do not move when the package's
    tables are retuned."""
    FIRST = (0.21, 0.46, 0.64, 0.70, 0.70, 0.85)
    NEXT = (0.60, 0.68, 0.72, 0.75, 0.78, 0.86)
    RANK = (1.0, 0.85, 0.75, 0.55)
    STEP_COST = (1.0, 1.08, 1.14, 1.17, 1.24, 1.31, 1.36, 1.41, 1.46, 1.52, 1.56, 1.61)

    def __init__(self, **kw):  # an injected cost table, not the target's measured curve
        kw.setdefault("step_cost", self.STEP_COST)
        super().__init__(**kw)


def test_ngram_tree_merges_matches_into_a_trie():
    d = _TreeDrafter(max_nodes=32, step_cost=[1.0] * 64)  # free rows: keep every node
    # The last tokens (2, 3) occur three times before: [1 2 3] once (match length 3), [2 3] twice.
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 8, 2, 3, 4, 9, 1, 2, 3]
    ends, lengths = d.matches(np.asarray(toks))
    assert ends.tolist() == [2, 12, 7] and lengths.tolist() == [3, 2, 2]  # longest, then most recent
    parents, tokens = d.build(toks, 3)
    assert tokens[0] == 3 and parents[0] == -1
    assert all(p < i for i, p in enumerate(parents[1:], 1))
    paths = _paths(parents, tokens)
    assert len(set(paths)) == len(paths)  # a trie: distinct siblings
    assert set(paths) == {(), (4,), (4, 5), (4, 5, 9), (4, 9), (4, 9, 1), (6,), (6, 7), (6, 7, 8)}
    # Node probabilities (noisy-or of FIRST[m] * RANK[rank] * NEXT[m]^(i-1) over its matches):
    # (4,) 0.81, (4, 5) 0.46, (6,) 0.39, (4, 5, 9) 0.33, (4, 9) 0.31, ...
    ranked = d.candidates(toks, 3).ranked
    assert [round(p, 2) for p, _ in ranked[:5]] == [0.81, 0.46, 0.39, 0.33, 0.31]
    # Budget per request: the most probable nodes, still a tree, and no deeper than k.
    parents, tokens = _TreeDrafter(max_nodes=4, step_cost=[1.0] * 64).build(toks, 3)
    assert set(_paths(parents, tokens)) == {(), (4,), (4, 5), (6,)}
    parents, tokens = _TreeDrafter(max_nodes=5, step_cost=[1.0] * 64).build(toks, 3)
    assert set(_paths(parents, tokens)) == {(), (4,), (4, 5), (6,), (4, 5, 9)}
    assert max(len(p) for p in _paths(*d.build(toks, 2))) == 2


def test_ngram_tree_size_follows_the_verification_cost():
    d = _TreeDrafter()
    assert d.build([5, 6, 7], 4) == ([-1], [7])  # 7 never occurred before
    assert d.build([5], 4) == ([-1], [5])
    assert d.build([5, 6, 5], 0) == ([-1], [5])  # k = 0
    # A lone one-token match (p = 0.21, then 0.13): worth two extra rows at the default cost...
    assert d.build([5, 6, 5], 4) == ([-1, 0, 1], [5, 6, 5])
    # ... not at 50% more per row: a plain autoregressive step.
    assert _TreeDrafter(step_cost=[1.0, 1.5, 2.0, 2.5]).build([5, 6, 5], 4) == ([-1], [5])
    # Batch: the rows go to the most probable nodes of the batch, while they pay for themselves
    # (B = 2 rows cost 1.08; + 0.9 -> 1.14, + 0.8 -> 1.17, + 0.05 -> 1.24 does not pay).
    assert d.select([[(0.9, 1), (0.8, 2)], [(0.05, 1)]]) == [2, 0]
    assert d.select([[], []]) == [0, 0]
    # Many requests: one more row still pays when its node is likely enough.
    assert _TreeDrafter().select([[(0.95, 1)]] * 4) == [1, 1, 1, 1]


def test_ngram_tree_accepts_repeated_text(model, prompts):
    """A prompt the model continues by repeating itself: the tree drafts get accepted."""
    ar = Generator(model).generate([prompts[2]], 40)[0].output
    prompt = prompts[2] + ar  # the greedy continuation of this text tends to repeat ar's patterns
    base = Generator(model).generate([prompt], 30)[0].output
    spec = Generator(model, NgramTreeDrafter(step_cost=STEP_COST), SpecSchedule("max")).generate([prompt], 30)[0]
    assert spec.output == base
    assert spec.stats.drafted > 0


def test_ngram_tree_scale_counts_what_drafted_steps_delivered():
    """Each step's most probable node is right (the first-level evidence alone would raise the
    tables' scale to its cap, 1.25), but of the several nodes drafted only that one is
    accepted: the drafted nodes' promised count against the accepted count lowers the scale,
    and the drafts shrink."""
    from types import SimpleNamespace

    curve = StepCost({1: {1: 1.0, 2: 1.3, 4: 1.9, 8: 3.1, 16: 5.5}})  # a row costs ~30% of a step
    d = NgramTreeDrafter(step_cost=curve)
    r = SimpleNamespace(rid=0, tokens=[1, 2, 3, 4, 5, 6] * 6 + [1])
    d.admit(None, [r])
    sizes = []
    for _ in range(12):
        draft = d.propose(None, [r], [8])[0]
        sizes.append(len(draft.tokens) - 1)
        r.tokens.append(draft.tokens[1] if sizes[-1] else r.tokens[-6])  # the first node is right...
        d.verified(None, [r], [min(1, sizes[-1])])  # ... and nothing after it
    assert sizes[0] >= 5 and max(sizes[-4:]) < sizes[0], sizes
    assert d.scale(0) < 0.7


def permutation_model(perm: list) -> Llama:
    """A Llama whose greedy next token after x is ``perm[x]``, whatever came before: one-hot
    embeddings, layers that add nothing (zero output projections), an LM head that maps
    x's embedding to perm[x]'s logit."""
    V = len(perm)
    model = Llama.random(tiny_config(vocab_size=V, hidden_size=V, num_layers=1), seed=0)
    model.embed.copy_(torch.eye(V))
    for layer in model.layers:
        layer["wo"].zero_()
        layer["w_down"].zero_()
    lm_head = torch.zeros(V, V)
    lm_head[torch.tensor(perm), torch.arange(V)] = 10.0
    model.lm_head.copy_(lm_head)
    return model


def test_ngram_tree_stops_drafting_where_nothing_is_copied():
    """A prompt whose n-grams all continue differently from the model (each pair (x, perm[x])
    is followed by a token other than perm[perm[x]]): at every step the trie has a two-token
    match the tables rate at ~0.23, enough for a row that costs 16% of a step (the measured
    native-weights curve), and every such draft is rejected. The per-request scale switches
    drafting off after the first rejections, so the run costs what autoregressive decoding
    costs, step for step; with the tables trusted as they are it drafts at every step."""
    V = 64
    perm = [(5 * x + 3) % V for x in range(V)]  # one cycle of length 64 (Hull-Dobell): 48 new tokens never repeat
    model = permutation_model(perm)
    start = 5
    prompt = []
    for x in np.random.default_rng(0).permutation(V).tolist():
        junk = (perm[perm[x]] + 1 + x) % V
        prompt += [x, perm[x], junk if junk != perm[perm[x]] else (junk + 1) % V]
    prompt.append(start)
    native_curve = StepCost({1: {1: 1.0, 2: 1.16, 4: 1.39, 8: 2.2, 16: 3.7}})
    ar = Generator(model).generate([prompt], 48)[0]
    assert ar.output[:3] == [perm[start], perm[perm[start]], perm[perm[perm[start]]]]

    def run(drafter):
        drafted = []
        propose = drafter.propose
        drafter.propose = lambda gen, reqs, lengths: [drafted.append(len(d.tokens) - 1) or d
                                                      for d in propose(gen, reqs, lengths)]
        req = Generator(model, drafter, SpecSchedule("max")).generate([prompt], 48)[0]
        assert req.output == ar.output
        return req, drafted

    trusting = NgramTreeDrafter(step_cost=native_curve)
    trusting.scale = lambda rid: 1.0  # the tables as they are, for comparison
    req, drafted = run(trusting)
    assert sum(n > 0 for n in drafted) >= 40 and req.stats.accepted == 0  # a draft every step, all rejected

    req, drafted = run(NgramTreeDrafter(step_cost=native_curve))
    assert req.stats.steps == ar.stats.steps == 48 and req.stats.accepted == 0
    assert all(n == 0 for n in drafted[3:]), drafted  # off within three steps, and it stays off
    assert req.stats.drafted <= 3
