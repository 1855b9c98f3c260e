"""EAGLE drafting: exactness (greedy equals autoregressive, sampled output follows the target),
the dynamic tree against a brute-force reference, the head's file round trip, the trainer's
unrolled forward against step-by-step drafting, and the shipped head's acceptance."""

import json

import pytest
import torch

from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule
from specdec_kernels.drafting.ngram import Candidates, NgramTreeDrafter
from specdec_kernels.drafting.eagle.drafter import EagleDrafter
from specdec_kernels.drafting.eagle.head import EagleHead, attention_reference, load_eagle_head, save_eagle_head
from specdec_kernels.models import Llama, tiny_config

from tests.helpers import exact_joint_probs, joint_chisquare_pvalue, real_model, require_real_model

FREE = {r: 1.0 for r in range(1, 129)}  # verification cost table: every row free (keep all nodes)
SLOW_STEP = 1e6  # seconds of a one-row verification: drafting is free next to it (expand every depth)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return Llama.random(tiny_config(num_layers=3), seed=0)


def make_head(model, seed=1, vocab=None, feature_layers=()):
    """A random head whose drafts agree with the target often enough to build deep trees; with
    ``feature_layers`` it fuses those layers' states with the last one's through a random
    projection near the last layer alone."""
    torch.manual_seed(seed)
    V = model.config.vocab_size
    head = EagleHead.for_target(model, torch.randperm(V)[: (vocab or V)] if vocab else torch.arange(V))
    if feature_layers:
        head.fuse_with(feature_layers)
        with torch.no_grad():
            head.fuse.add_(torch.randn_like(head.fuse) * 0.05)
    return head.eval().requires_grad_(False)


def greedy_reference(model, prompt, n):
    return Generator(model, None).generate([prompt], n)[0].output


@pytest.mark.parametrize("variant", ["eagle", "eagle+ngram", "eagle-small-vocab", "eagle-measured-cost"])
def test_greedy_equals_autoregressive(model, prompts, variant):
    head = make_head(model, vocab=24 if variant == "eagle-small-vocab" else None)
    measured = variant == "eagle-measured-cost"
    kw = dict(step_cost=None if measured else FREE, step_seconds=None if measured else SLOW_STEP, top_k=3,
              max_depth=4, max_tree_nodes=12)
    drafter = EagleDrafter(model, head, lookup=NgramTreeDrafter() if variant == "eagle+ngram" else None, **kw)
    gen = Generator(model, drafter, SpecSchedule("max", 4, max_k=5))
    reqs = gen.generate(prompts, 20)
    for p, r in zip(prompts, reqs):
        assert r.output == greedy_reference(model, p, 20)
    assert drafter.stats["nodes"] > 0
    if variant != "eagle-measured-cost":  # free rows: every step drafts a full tree
        assert max(drafter.stats["depth_hist"]) >= 3


@pytest.mark.parametrize("variant", ["eagle", "eagle+ngram"])
def test_continuous_batching_equals_autoregressive(model, prompts, variant):
    """Requests that join a running batch (``admit``) get their own head cache entries from
    their prompt's features: outputs equal autoregressive decoding, and the head's cache
    has one slot per running request."""
    drafter = EagleDrafter(model, make_head(model), lookup=NgramTreeDrafter() if variant == "eagle+ngram" else None,
                           step_cost=FREE, step_seconds=SLOW_STEP, top_k=3, max_depth=4, max_tree_nodes=12)
    ps = prompts + [prompts[3][::-1], prompts[2][:5]]
    reqs = Generator(model, drafter, SpecSchedule("max", 4, max_k=5)).generate(ps, 16, max_batch=2)
    assert [r.output for r in reqs] == [greedy_reference(model, p, 16) for p in ps]
    assert drafter.cache.max_batch == 2 and drafter.stats["nodes"] > 0 and not drafter.slot


def _paths(parents, tokens):
    out = set()
    for i in range(1, len(parents)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


def brute_force_tree(model, head, tokens, top_k, depth, n):
    """EAGLE-2 from first principles: every node's draft distribution recomputed from scratch
    (the target's features of the verified tokens, then the head on the node's whole path
    with plain causal attention), the beam/top-k expansion in plain Python, the best n
    candidates by cumulative log-prob."""
    cache = model.new_cache(1, len(tokens) + 1)
    slot = cache.add_request(0)
    f = model.prefill(torch.tensor(tokens[:-1]), cache, slot)  # f_t for t < len-1

    def logp_after(path):
        feats = [f[t] for t in range(f.shape[0])]
        toks = list(tokens[1:])
        g_prev = None
        # True entries then one entry per drafted token, fed with the previous entry's g.
        xs = []
        for t in range(len(feats)):
            xs.append(head.inputs(feats[t][None], torch.tensor([toks[t]]))[0])
        g = _run_layer(head, torch.stack(xs))
        g_prev = g[-1]
        for j, tok in enumerate(path):
            xs.append(head.inputs(g_prev[None], torch.tensor([tok]))[0])
            g = _run_layer(head, torch.stack(xs))
            g_prev = g[-1]
        return head.logits(g_prev).log_softmax(-1)

    vocab = head.draft_vocab
    cands = []  # (score, path)
    lp = logp_after([])
    level = [(float(lp[i]), (int(vocab[i]),)) for i in lp.topk(top_k).indices]
    cands += level
    for _ in range(1, depth):
        beam = sorted(level, key=lambda c: -c[0])[:top_k]
        level = []
        for s, path in beam:
            lp = logp_after(list(path))
            level += [(s + float(lp[i]), path + (int(vocab[i]),)) for i in lp.topk(top_k).indices]
        cands += level
    cands.sort(key=lambda c: -c[0])
    return cands[:n]


def _run_layer(head, x):
    """The head's layer over a causal sequence x [S, H] (positions 0..S-1)."""
    S = x.shape[0]
    q, k, v = head.qkv(x, torch.arange(S))
    attn = attention_reference(q, k, v, torch.ones(S, S, dtype=torch.bool).tril())
    return head.output(x, attn)


# Prompt lengths: the head's entries (one per prompt token but the last) end inside a block,
# on a block boundary, and just before one (the paths cross into a second scratch block).
@pytest.mark.parametrize("prompt_len", [9, 65, 64])
def test_tree_matches_brute_force(model, prompt_len):
    head = make_head(model, seed=3)
    prompt = torch.randint(0, 64, (prompt_len,), generator=torch.Generator().manual_seed(4)).tolist()
    top_k, depth, n = 3, 3, 9
    class Capture(EagleDrafter):
        def propose(self, gen, reqs, lengths):
            drafts = super().propose(gen, reqs, lengths)
            got.setdefault("draft", drafts[0])
            return drafts

    got = {}
    drafter = Capture(model, head, top_k=top_k, max_depth=depth, max_tree_nodes=n, step_cost=FREE, step_seconds=SLOW_STEP)
    Generator(model, drafter, SpecSchedule("max", depth, max_k=depth)).generate([prompt], depth + 2, stop_at_eos=False)
    d = got["draft"]
    ref = brute_force_tree(model, head, prompt, top_k, depth, n)
    assert _paths(d.parents, d.tokens) == {p for _, p in ref}
    assert max(d.depths()) == max(len(p) for _, p in ref) >= 2


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_quantized_decode_weights(model, prompts, fmt):
    """The head's products as GGUF blocks: draft log-probs close to the dense head's (the
    weights are rounded to the block format), the draft LM head rows of a block target are the
    target's own blocks, and greedy output on a block target still equals autoregressive."""
    head = make_head(model)
    x, attn = torch.randn(5, 128), torch.randn(5, 4 * 64)
    _, dense_logp = head.decode_output(x, attn)
    head.set_decode_format(fmt)
    assert not isinstance(head.decode_weights(torch.float32)["wqkv"], torch.Tensor)
    _, q_logp = head.decode_output(x, attn)
    tol = {"Q8_0": 0.05, "Q4_0": 0.5}[fmt]
    assert (q_logp.exp() - dense_logp.exp()).abs().max() < tol
    assert not torch.equal(q_logp, dense_logp)

    target = model.quantized(fmt)
    from specdec_kernels.drafting.eagle.head import decode_format_for, eagle_head_for

    assert decode_format_for(target) == "Q4_0" and decode_format_for(model) is None
    assert decode_format_for(target, "fp32") is None and decode_format_for(model, "q4_0") == "Q4_0"
    with pytest.raises(ValueError, match="must be one of"):
        decode_format_for(model, "q5_k")
    qhead = make_head(target).attach(target).set_decode_format("Q8_0")
    # The draft LM head is the target's own blocks, whatever their type against the head's
    # format (a Q4_0 target's rows under a Q8_0 head), not a requantised copy.
    own = qhead.decode_weights(torch.float32)["lm_head_draft"]
    assert own.block_type == target.lm_head.block_type
    assert torch.equal(own.blocks, target.lm_head.rows(qhead.draft_vocab).blocks)
    # The dense draft rows (training, the dense path) are the target's dequantised rows, in
    # draft-vocabulary order: a reduced, shuffled vocabulary picks each row once.
    small = make_head(target, vocab=40).attach(target)
    assert torch.equal(small.lm_head_draft, target.lm_head.dequantize()[small.draft_vocab])
    qhead._decode_weights = None
    drafter = EagleDrafter(target, qhead, step_cost=FREE, step_seconds=SLOW_STEP, top_k=3, max_depth=4,
                           max_tree_nodes=12)
    # The blocks are made when the drafter is built (once), not inside its first step.
    assert qhead._decode_weights is not None and qhead._decode_key == (target.dtype, "Q8_0", False)
    reqs = Generator(target, drafter, SpecSchedule("max", 4, max_k=5)).generate(prompts, 16)
    for p, r in zip(prompts, reqs):
        assert r.output == greedy_reference(target, p, 16)
    assert drafter.stats["nodes"] > 0
    assert eagle_head_for(target, "untrained").decode_format == "Q4_0"


def test_int8_activation_decode_weights(model, prompts):
    """On a target with int8 activations the head's block products use them too: its decode
    weights carry the int8 packing, its draft log-probs stay close to the Q8_0 head's, and
    greedy output still equals the target's own autoregressive output."""
    from specdec_kernels.drafting.eagle.head import eagle_head_for

    target = model.quantized("Q8_0").with_int8_activations()
    head = make_head(target).attach(target)
    x, attn = torch.randn(5, 128), torch.randn(5, 4 * 64)
    _, q8_logp = head.set_decode_format("Q8_0").decode_output(x, attn)
    _, i8_logp = head.set_decode_format("Q8_0", int8_activations=True).decode_output(x, attn)
    assert all(w.int8_packed is not None for n, w in head.decode_weights(torch.float32).items()
               if n in ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head_draft"))
    assert (i8_logp.exp() - q8_logp.exp()).abs().max() < 0.05 and not torch.equal(i8_logp, q8_logp)
    with pytest.raises(ValueError, match="int8 activations need a block decode format"):
        head.set_decode_format(None, int8_activations=True)
    assert eagle_head_for(target, "untrained").int8_activations
    assert not eagle_head_for(model.quantized("Q8_0"), "untrained").int8_activations
    drafter = EagleDrafter(target, head, step_cost=FREE, step_seconds=SLOW_STEP, top_k=3, max_depth=4,
                           max_tree_nodes=12)
    reqs = Generator(target, drafter, SpecSchedule("max", 4, max_k=5)).generate(prompts, 16)
    for p, r in zip(prompts, reqs):
        assert r.output == greedy_reference(target, p, 16)
    assert drafter.stats["nodes"] > 0


def test_tree_size_follows_verification_cost(model, prompts):
    head = make_head(model)
    expensive = {1: 1.0, 2: 100.0}  # any extra row costs 100 steps: nothing pays
    drafter = EagleDrafter(model, head, top_k=3, step_cost=expensive, step_seconds=1.0)
    reqs = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate(prompts[1:2], 6)
    assert drafter.stats["nodes"] == 0 and reqs[0].stats.steps == 6


def test_tree_size_follows_the_batch_cost(model, prompts):
    """The measured curve is per batch size: rows free at batch 1 and costly at batch 4 give
    trees at batch 1 and none at batch 4 (where the batch already fills the step)."""
    from specdec_kernels.decoding.cost_model import StepCost

    curve = StepCost({1: {1: 1.0, 128: 1.0}, 4: {4: 1.0, 5: 50.0, 512: 5000.0}})
    for batch, drafts in ((1, True), (4, False)):
        drafter = EagleDrafter(model, make_head(model), top_k=3, max_depth=3, step_cost=curve)
        Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate((prompts * 4)[:batch], 6)
        assert (drafter.stats["nodes"] > 0) == drafts, batch


def test_back_off_after_empty_trees_keeps_the_head_cache_whole(model, prompts):
    """Costly rows: every tree is empty, so the drafter skips 1, 3, 7, ... steps; the entries
    of skipped steps wait and go through the next catch-up pass, so the head's cache still
    holds one entry per position. Greedy output stays equal to autoregressive."""
    expensive = {1: 1.0, 2: 100.0}
    drafter = EagleDrafter(model, make_head(model), top_k=3, step_cost=expensive, step_seconds=1.0)
    gen = Generator(model, drafter, SpecSchedule("max", 4, max_k=4))
    seen = {}
    original = drafter.catch_up

    def spy(reqs):
        out = original(reqs)
        caught = out[1]  # entries the pass ran, committed once the step's trees are drafted
        for b, r in enumerate(reqs):  # committed + caught up: entries t = 0..len(tokens)-2 of the sequence
            seen.setdefault(r.rid, []).append(
                drafter.cache.length(drafter.slot[r.rid]) + caught.get(b, 0) == len(r.tokens) - 1)
        return out

    drafter.catch_up = spy
    (r,) = gen.generate(prompts[1:2], 20)
    assert r.output == greedy_reference(model, prompts[1], 20)
    assert drafter.stats["nodes"] == 0 and drafter.stats["skipped_steps"] >= 10
    # (the last step, with one token left to emit, drafts nothing and skips nothing)
    assert r.stats.steps - 1 <= drafter.stats["steps"] + drafter.stats["skipped_steps"] <= r.stats.steps
    assert all(ok for oks in seen.values() for ok in oks) and len(seen[r.rid]) >= 3


@pytest.mark.parametrize("step_seconds, backs_off", [(1e-9, True), (SLOW_STEP, False)])
def test_back_off_when_trees_do_not_pay_for_drafting(model, prompts, step_seconds, backs_off):
    """Free rows keep trees non-empty, but when the drafting time dwarfs a step (a 1 ns step)
    no tree pays for it — the drafter backs off all the same; when a step takes 10^6 s it
    never does. Greedy output stays equal to autoregressive either way."""
    drafter = EagleDrafter(model, make_head(model), top_k=3, step_cost=FREE, step_seconds=step_seconds)
    (r,) = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate(prompts[1:2], 20)
    assert r.output == greedy_reference(model, prompts[1], 20)
    assert drafter.stats["nodes"] > 0
    assert (drafter.stats["skipped_steps"] > 0) == backs_off


def test_head_backs_off_where_the_lookup_drafts_alone(model):
    """eagle+ngram on a prompt that repeats itself, drafting time dwarfing a step: the head's
    forwards do not pay next to the lookup tries alone, so it backs off, and its skipped
    steps still draft the tries (accepted: more than one token a step). Output stays equal
    to autoregressive."""
    base = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    prompt = base * 4
    drafter = EagleDrafter(model, make_head(model), top_k=3, lookup=NgramTreeDrafter(), step_cost=FREE,
                           step_seconds=1e-9)
    (r,) = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate([prompt], 24, stop_at_eos=False)
    assert r.output == greedy_reference(model, prompt, 24)
    assert drafter.stats["skipped_steps"] > 0
    assert r.stats.emitted / r.stats.steps > 1.5
    # The criterion: a step whose value (drafting included) does not beat the tries alone
    # backs off, even when it beats a step that drafts nothing (value 1 here).
    drafter._empty_run = drafter._skip = 0
    drafter._back_off(2.0, 2.5, sampled_pays=False)
    assert (drafter._empty_run, drafter._skip) == (1, 1)
    drafter._back_off(3.0, 2.5, sampled_pays=False)
    assert drafter._empty_run == 0


def test_lookup_nodes_are_chosen_with_the_head_candidates(model):
    """eagle+ngram: the head's candidates and the lookup trie's nodes form one pool, the most
    probable kept while they pay for their rows (a row costs 0.3 of a step here); the lookup
    nodes merge into the head's tree where the paths agree; only the accepted tokens on the
    lookup's own nodes are its evidence."""
    from specdec_kernels.decoding.drafter import Draft

    drafter = EagleDrafter(model, make_head(model), lookup=NgramTreeDrafter(), step_cost={1: 1.0, 2: 1.3, 128: 39.1},
                           step_seconds=1.0)
    trie = Candidates(tokens=[2, 3, 4], parents=[-1, 0, 1], depths=[0, 1, 2], ranked=[(0.9, 1), (0.8, 2)])
    # Pool 0.9 (lookup), 0.8 (lookup), 0.5, 0.2 (head): 1/1, 1.9/1.3, 2.7/1.6 = 1.69, 3.2/1.9 = 1.68.
    assert drafter._select([[0.5, 0.2]], [trie], 1, 0.0)[:2] == ([0], [2])
    assert drafter._select([[0.95, 0.2]], [trie], 1, 0.0)[:2] == ([1], [2])  # 3.65 / 1.9 beats 2.7 / 1.6 ... and 4.45 / 2.2
    assert drafter._select([[0.5, 0.2]], [None], 1, 0.0)[:2] == ([1], [0])  # the head alone: 1.5 / 1.3
    free = EagleDrafter(model, make_head(model), lookup=NgramTreeDrafter(), step_cost=FREE, step_seconds=SLOW_STEP)
    assert free._select([[0.5, 0.2]], [trie], 1, 0.0)[:2] == ([2], [2])  # free rows: everything

    class Req:
        rid, tokens = 7, [1, 2]

    drafter.lookup._promised = {}
    head_tree = Draft([-1, 0, 0], [2, 3, 9])  # the head drafted 3 and 9 after the root 2
    (merged,) = drafter.lookup.merge_into([Req], [head_tree], [trie], [2])
    assert (merged.parents, merged.tokens) == ([-1, 0, 0, 1], [2, 3, 9, 4])  # 3 shared, 4 added under it
    Req.tokens = [1, 2, 3, 4, 5]  # 3 and 4 accepted (the lookup's path), 5 the target's own
    assert drafter.lookup.merged_accepted(Req, 2) == 2
    drafter.lookup._merged[7] = ([-1, 0], [2, 8])  # a lookup branch the target did not follow
    assert drafter.lookup.merged_accepted(Req, 2) == 0


def test_beam_keeps_only_nodes_whose_children_can_pay(model):
    """A parent whose cumulative probability is below (tokens per unit cost) x (cost of one
    more row) has no child worth verifying, so it is not expanded; free rows keep the beam."""
    costly = EagleDrafter(model, make_head(model), top_k=4, step_cost={1: 1.0, 2: 1.25, 128: 32.75},
                          step_seconds=1.0)
    costly._depth_seconds = 1e-6  # drafting is nearly free: the depth pays, the rows decide
    scores = [torch.tensor([[0.9, 0.05, 0.03, 0.02]]).log()]
    threshold = costly._expansion_threshold(scores, 1)
    assert 0.05 < threshold < 0.9  # only the 0.9 node can have children worth a 0.25-step row
    free = EagleDrafter(model, make_head(model), top_k=4, step_cost=FREE, step_seconds=SLOW_STEP)
    free._depth_seconds = 1e-6
    assert free._expansion_threshold(scores, 1) == 0.0


def test_sampled_depth_follows_realised_acceptance(model):
    """A sampled tree's depth is chosen before drawing, from the acceptance sampled trees
    realised: deep while depths are accepted, none once they are not (rows cost 0.1 of a
    step each, drafting is free), and back when they are again."""
    rows = {r: 1.0 + 0.1 * (r - 1) for r in range(1, 129)}
    drafter = EagleDrafter(model, make_head(model), sample_width=2, max_depth=4, step_cost=rows, step_seconds=SLOW_STEP)
    drafter._depth_seconds = 1e-9
    assert drafter._sampled_rates() == [0.5] * 4  # the prior
    for _ in range(60):
        drafter._observe_sampled(4, 4)  # every depth accepted
    assert drafter._sampled_plan(1, 4)[0] == 4
    for _ in range(60):
        drafter._observe_sampled(4, 0)  # nothing accepted
    assert drafter._sampled_rates()[0] < 0.1 and drafter._sampled_plan(1, 4) == (0, 1.0)
    # A tree drawn 2 deep with 1 accepted: depths 1 and 2 tried, only depth 1 accepted.
    before = [list(c) for c in drafter._sampled_counts]
    drafter._observe_sampled(2, 1)
    after = drafter._sampled_counts
    assert after[0][0] > before[0][0] * drafter.SAMPLED_DECAY and after[1][0] == before[1][0] * drafter.SAMPLED_DECAY
    assert after[1][1] > before[1][1] * drafter.SAMPLED_DECAY and after[2] == before[2]
    for _ in range(60):
        drafter._observe_sampled(1, 1)
    assert drafter._sampled_plan(1, 4)[0] >= 1


def test_sampled_head_backs_off_when_it_is_not_accepted(prompts):
    """A head whose draft vocabulary holds none of the tokens the target samples (its draws
    are never accepted) and rows that cost: sampled requests stop drafting after a few steps
    (skipped steps, probing again after each back-off) instead of drawing a full tree every
    step; with free rows and free drafting the same head keeps drafting every step."""
    m = Llama.random(tiny_config(num_layers=2), seed=4)
    V = m.config.vocab_size
    head = EagleHead.for_target(m, torch.arange(V - 4, V)).eval().requires_grad_(False)
    bias = torch.zeros(V)
    bias[V - 4:] = -1e4  # the target never samples the head's four tokens
    original = m.forward_logits

    def never_the_heads_tokens(*args, **kw):
        hidden, logits = original(*args, **kw)
        return hidden, logits + bias

    m.forward_logits = never_the_heads_tokens
    rows = {r: 1.0 + 0.1 * (r - 1) for r in range(1, 129)}
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(2)]
    costly = EagleDrafter(m, head, sample_width=2, max_depth=3, step_cost=rows, step_seconds=1.0)
    reqs = Generator(m, costly, SpecSchedule("max", 3, max_k=3)).generate(prompts[:2], 40, sampling, stop_at_eos=False)
    assert all(r.stats.emitted == 40 for r in reqs)
    # Back-offs of 1, 3, 7, ... steps, each followed by a one-depth probe: a probe that is
    # not accepted is no evidence that drafting pays, so the back-offs keep growing.
    assert costly.stats["skipped_steps"] >= 4 * costly.stats["steps"], costly.stats
    assert costly.stats["accepted_hist"] == {0: sum(costly.stats["accepted_hist"].values())}
    free = EagleDrafter(m, head, sample_width=2, max_depth=3, step_cost=FREE, step_seconds=SLOW_STEP)
    Generator(m, free, SpecSchedule("max", 3, max_k=3)).generate(prompts[:2], 40, sampling, stop_at_eos=False)
    assert free.stats["skipped_steps"] == 0 and free.stats["nodes"] > 0


def _sampled_pairs(model, drafter, n, params, prompt):
    sampling = [SamplingParams(seed=s, **params) for s in range(n)]
    reqs = Generator(model, drafter, SpecSchedule("max", 3, max_k=3)).generate([list(prompt)] * n, 2, sampling)
    return [tuple(r.output) for r in reqs]


@pytest.mark.parametrize("temperature,fmt,fused", [(1.0, None, False), (0.7, None, False), (1.0, "Q4_0", False),
                                                  (1.0, "Q4_0", True)])
def test_sampling_distribution_equals_target(temperature, fmt, fused):
    """Chi-square of the first two sampled tokens against the target's exact joint
    distribution (vocabulary 8, fixed seeds); also with the head's products as Q4_0 blocks,
    its format on a GGUF target (its q changes, the target's distribution must not), and with
    a head of fused features."""
    m = Llama.random(tiny_config(vocab_size=8, num_layers=2), seed=3)
    head = make_head(m, seed=5, vocab=6, feature_layers=(1,) if fused else ())  # a smaller draft vocabulary
    head.set_decode_format(fmt)
    drafter = EagleDrafter(m, head, sample_width=2, max_depth=3, step_cost=FREE, step_seconds=SLOW_STEP)
    n, prompt = 1500, (3, 1, 4)
    pairs = _sampled_pairs(m, drafter, n, dict(temperature=temperature), prompt)
    assert drafter.stats["nodes"] > 0
    pvalue = joint_chisquare_pvalue(pairs, exact_joint_probs(m, temperature, prompt, 2))
    assert pvalue > 1e-3, pvalue


def test_sampled_lookup_chains_keep_the_distribution():
    """eagle+ngram at T = 1: requests whose prompt repeats draft the lookup's chain (one-hot q
    rows), in the same batch as requests drafting head trees; the first two tokens of each
    prompt still follow the target's exact joint distribution (chi-square, fixed seeds)."""
    m = Llama.random(tiny_config(vocab_size=8, num_layers=2), seed=3)
    drafter = EagleDrafter(m, make_head(m, seed=5, vocab=6), sample_width=2, max_depth=3, step_cost=FREE,
                           step_seconds=SLOW_STEP, lookup=NgramTreeDrafter(step_cost=FREE))
    drafter.SAMPLED_CHAIN_MIN_ACCEPTED = 0.5  # two new tokens: a chain of one node (p ~0.9) at most
    copying, fresh, n = (3, 1, 4, 5, 2) * 3, (3, 1, 4), 1200
    prompts = [list(copying if i % 2 else fresh) for i in range(2 * n)]
    sampling = [SamplingParams(seed=s, temperature=1.0) for s in range(2 * n)]
    reqs = Generator(m, drafter, SpecSchedule("max", 3, max_k=3)).generate(prompts, 2, sampling)
    assert drafter.stats["sampled_lookup_chains"] >= n and drafter.stats["nodes"] > 0  # both kinds drafted
    for parity, prompt in ((1, copying), (0, fresh)):
        pairs = [tuple(r.output) for i, r in enumerate(reqs) if i % 2 == parity]
        pvalue = joint_chisquare_pvalue(pairs, exact_joint_probs(m, 1.0, prompt, 2))
        assert pvalue > 1e-3, (prompt, pvalue)


def test_save_load_round_trip(model, tmp_path):
    head = make_head(model, vocab=32)
    path = tmp_path / "h.safetensors"
    save_eagle_head(head, path, metadata={"note": "x"})
    back = load_eagle_head(path, model)
    assert torch.equal(back.draft_vocab, head.draft_vocab)
    assert back.metadata["note"] == "x"
    for (n, a), (_, b) in zip(head.named_parameters(), back.named_parameters()):
        assert torch.allclose(a.to(torch.bfloat16).float(), b.float()), n


def _continued_training_run(model, monkeypatch, tmp_path, *flags, layers=None):
    """``specdec train-eagle`` on the tiny model over seeded random sequences (the data
    loading patched out: the trainer's own flow, no generation; features of ``layers``, the
    last alone by default); -> the written head."""
    from specdec_kernels.drafting.eagle import training
    from specdec_kernels.training import distill_data

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (20,), generator=g).tolist() for _ in range(12)]
    data = distill_data.corpus_shard(model, seqs, layers=layers or (model.config.num_layers,), topk=4)
    monkeypatch.setattr(training, "_load_data", lambda args: (model, None, data))
    out = tmp_path / f"head{len(list(tmp_path.iterdir()))}.safetensors"
    training.main(["--model", "tiny", "--out", str(out), "--draft-vocab-size", "24", "--epochs", "1",
                   "--batch-seqs", "4", "--held-out", "0.25", "--unroll", "2", "--eval-prompts", "0",
                   "--precision", "fp32", *flags])
    return out


def test_training_continues_from_a_head_and_keeps_it_unless_beaten(model, monkeypatch, tmp_path):
    """``--init-from``: the head's draft vocabulary and width are kept, it is scored before
    training and an epoch replaces it only by beating it on the held-out data (with a zero
    learning rate none can: the file's weights come back unchanged); its origin is recorded."""
    first = _continued_training_run(model, monkeypatch, tmp_path, "--head-intermediate", "32")
    start = load_eagle_head(first, model)
    kept = _continued_training_run(model, monkeypatch, tmp_path, "--init-from", str(first), "--lr", "0",
                                   "--draft-vocab-size", "8")
    back = load_eagle_head(kept, model)
    assert torch.equal(back.draft_vocab, start.draft_vocab) and back.intermediate_size == 32
    assert back.metadata["draft_vocab_size"] == "24"  # the head's vocabulary, not the flag's 8
    assert back.metadata["epoch"] == "-1"
    for (n, a), (_, b) in zip(start.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), n
    assert json.loads(back.metadata["continued_from"])["file"] == first.name
    moved = load_eagle_head(_continued_training_run(model, monkeypatch, tmp_path, "--init-from", str(first),
                                                    "--lr", "3e-3", "--epochs", "2"), model)
    before = float(back.metadata["held_out_expected_chain_length"])  # the starting head's score on the same split
    assert float(moved.metadata["held_out_expected_chain_length"]) >= before
    assert torch.equal(moved.draft_vocab, start.draft_vocab)


def test_continued_training_can_choose_its_vocabulary_again(model, monkeypatch, tmp_path):
    """``--new-vocab``: the continued head drafts from the run's most frequent target tokens
    (``--draft-vocab-size`` of them) with the target's LM-head rows of that vocabulary; its
    layer starts from the file's (a zero learning rate keeps it)."""
    from specdec_kernels.models.llama import dense

    first = _continued_training_run(model, monkeypatch, tmp_path, "--head-intermediate", "32")
    start = load_eagle_head(first, model)
    again = load_eagle_head(_continued_training_run(model, monkeypatch, tmp_path, "--init-from", str(first),
                                                    "--new-vocab", "--draft-vocab-size", "8", "--lr", "0"), model)
    assert again.draft_vocab.shape == (8,) and again.metadata["draft_vocab_size"] == "8"
    assert torch.equal(again.lm_head_draft, dense(model.lm_head)[again.draft_vocab].to(again.lm_head_draft.dtype))
    for name in ("fc", "wqkv", "w_down"):
        assert torch.equal(getattr(again, name), getattr(start, name)), name


def test_held_out_last_holds_out_the_newest_sequences(model, monkeypatch, tmp_path):
    """``--held-out-last N`` scores on the data's last N sequences (the trainer's split, not a
    random one); N must leave training data."""
    from specdec_kernels.drafting.eagle import training

    seen = {}
    real = training.Examples

    def spy(data, seqs, *a):
        seen.setdefault("splits", []).append(list(seqs))
        return real(data, seqs, *a)

    monkeypatch.setattr(training, "Examples", spy)
    out = _continued_training_run(model, monkeypatch, tmp_path, "--held-out-last", "3")
    assert seen["splits"] == [list(range(9)), [9, 10, 11]]
    assert load_eagle_head(out, model).metadata["held_out_split"] == "the last 3 sequences"
    with pytest.raises(SystemExit, match="12 sequences"):
        _continued_training_run(model, monkeypatch, tmp_path, "--held-out-last", "12")
    with pytest.raises(SystemExit):  # argparse: --new-vocab without a head to continue
        _continued_training_run(model, monkeypatch, tmp_path, "--new-vocab")


@pytest.mark.parametrize("flags, message", [(("--model", "other"), "trained for 'tiny'"),
                                            (("--head-intermediate", "16"), "MLP width 32"),
                                            (("--features", "fused"), "several layers ending with the last"),
                                            (("--init-from", "missing.safetensors"), "no such file")])
def test_continued_training_refuses_a_head_that_does_not_fit(model, monkeypatch, tmp_path, flags, message):
    """Checked before any data is made: the head's model, MLP width and features must fit the run."""
    first = _continued_training_run(model, monkeypatch, tmp_path, "--head-intermediate", "32")
    with pytest.raises(SystemExit, match=message):
        _continued_training_run(model, monkeypatch, tmp_path, "--init-from", str(first), *flags)


def test_a_narrow_head_slices_the_target_layer_and_round_trips(model, prompts, tmp_path):
    """``intermediate_size`` below the target's: the MLP starts as the first I gate / up rows
    and down columns of the copied layer, loads back at its width, and drafts losslessly."""
    from specdec_kernels.models.llama import dense

    I_t = model.config.intermediate_size
    head = EagleHead.for_target(model, torch.arange(model.config.vocab_size), intermediate_size=I_t // 2)
    L = model.layers[-1]
    gate_up, down = dense(L["w_gate_up"]).float(), dense(L["w_down"]).float()
    assert torch.equal(head.w_gate_up, torch.cat([gate_up[: I_t // 2], gate_up[I_t: I_t + I_t // 2]]))
    assert torch.equal(head.w_down, down[:, : I_t // 2])
    full = EagleHead.for_target(model, torch.arange(8))
    assert torch.equal(full.w_gate_up, gate_up) and full.intermediate_size == I_t
    path = tmp_path / "narrow.safetensors"
    save_eagle_head(head, path)
    back = load_eagle_head(path, model)
    assert back.intermediate_size == I_t // 2 and back.w_down.shape == (model.config.hidden_size, I_t // 2)
    sched = SpecSchedule("max", 4, max_k=4)
    out = Generator(model, EagleDrafter(model, back, step_cost=FREE, step_seconds=SLOW_STEP, top_k=3, max_depth=4), sched).generate([prompts[0]], 12)[0].output
    assert out == greedy_reference(model, prompts[0], 12)
    for bad in (0, I_t + 1):
        with pytest.raises(ValueError, match="intermediate_size"):
            EagleHead.for_target(model, torch.arange(8), intermediate_size=bad)


def test_bf16_training_loss_follows_fp32(model):
    """``precision="bf16"`` (autocast products, fp32 master weights) gives the fp32 loss within
    bf16 rounding, and gradients reach every trained parameter in fp32."""
    from specdec_kernels.drafting.eagle.training import losses

    head = make_head(model, seed=3).train().requires_grad_(True)
    B, T, H, k = 2, 9, model.config.hidden_size, 4
    g = torch.Generator().manual_seed(0)
    batch = {"feats": torch.randn(B, T, H, generator=g), "next": torch.randn(B, T, H, generator=g),
             "tokens": torch.randint(0, 64, (B, T), generator=g),
             "target_ids": torch.randint(0, model.config.vocab_size, (B, T, k), generator=g),
             "target_logits": torch.randn(B, T, k, generator=g), "lens": torch.tensor([T, T - 3]),
             "answer_from": torch.zeros(B, dtype=torch.int64)}
    ref, _, _ = losses(head, batch, 2, feat_scale=1.0)
    low, _, counts = losses(head, batch, 2, feat_scale=1.0, precision="bf16")
    assert low.dtype == torch.float32 and counts == [T + T - 3, T - 1 + T - 4]
    lo, hi = float(low.detach()), float(ref.detach())
    assert abs(lo - hi) <= 0.02 * abs(hi), (lo, hi)
    low.backward()
    for n, p in head.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), n
    with pytest.raises(ValueError, match="precision"):
        losses(head, batch, 1, feat_scale=1.0, precision="fp16")


def test_training_precision_follows_the_cpu(tmp_path, capsys):
    """``--precision auto`` trains in bf16 only where the CPU multiplies bf16 in hardware (torch
    widens bf16 products in software elsewhere, ~100x slower than fp32); an explicit bf16 there
    is kept and warned about."""
    from specdec_kernels._platform import has_bf16_products
    from specdec_kernels.drafting.eagle.training import build_parser, training_precision

    cpuinfo = tmp_path / "cpuinfo"
    for flags, has in (("flags\t\t: fpu avx2 fma f16c avx512f avx512_vnni", False),
                       ("flags\t\t: fpu avx2 avx512f avx512_bf16", True),
                       ("flags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8", True),
                       ("Features\t: fp asimd bf16 i8mm", True), ("Features\t: fp asimd", False)):
        cpuinfo.write_text(f"processor\t: 0\n{flags}\n")
        assert has_bf16_products(str(cpuinfo)) is has, flags
    assert has_bf16_products(str(tmp_path / "absent")) is False
    assert build_parser().parse_args([]).precision == "auto"
    assert training_precision("auto", bf16_in_hardware=False) == "fp32"
    assert training_precision("auto", bf16_in_hardware=True) == "bf16"
    assert training_precision("fp32", bf16_in_hardware=True) == "fp32"
    capsys.readouterr()
    assert training_precision("bf16", bf16_in_hardware=False) == "bf16"
    assert "no bf16 products" in capsys.readouterr().err
    assert training_precision("auto") == ("bf16" if has_bf16_products() else "fp32")


def test_shipped_heads_fit_the_package_and_name_their_data():
    """Every head the package ships exists, is at most 40 MB, and records its training data
    (a corpus of real text names its licence)."""
    import os

    from specdec_kernels.drafting.eagle.head import SHIPPED_HEADS, default_eagle_checkpoint
    from specdec_kernels.models.registry import read_metadata

    for name in SHIPPED_HEADS:
        path = default_eagle_checkpoint(name)
        assert path is not None and os.path.getsize(path) <= 40e6, (name, path)
        meta = read_metadata(path)
        assert "trained_by" in meta and int(meta["intermediate_size"]) > 0, name
        if meta.get("corpus", "none") != "none":
            assert meta["corpus_licence"] and int(meta["corpus_tokens"]) > 0, name


def test_unrolled_training_forward_matches_drafting(model):
    """The trainer's step-j output at position t equals drafting j-1 tokens after the true
    entries 0..t-j+1 with the head fed its own outputs (the training-time-test pattern)."""
    from specdec_kernels.drafting.eagle.training import unrolled

    head = make_head(model, seed=7)
    T, H = 7, model.config.hidden_size
    feats = torch.randn(1, T, H)
    toks = torch.randint(0, 64, (1, T))
    with torch.no_grad():
        outs = unrolled(head, feats, toks, 3)
        for j in (2, 3):
            for t in range(j - 1, T):
                last_true = t - (j - 1)  # entries 0..last_true use true features
                xs = [head.inputs(feats[0, s][None], toks[0, s][None])[0] for s in range(last_true + 1)]
                g = _run_layer(head, torch.stack(xs))[-1]
                for s in range(last_true + 1, t + 1):
                    xs.append(head.inputs(g[None], toks[0, s][None])[0])
                    g = _run_layer(head, torch.stack(xs))[-1]
                assert torch.allclose(outs[j - 1][0, t], g, atol=1e-4), (j, t)


@real_model
def test_shipped_head_accepts_on_the_real_model():
    """The shipped head on SmolLM2-135M with the same fixed-size trees for both heads (16
    nodes, depth <= 4; free verification rows, so the machine's cost curve does not decide
    the size): greedy output equals autoregressive, and the trained head accepts clearly
    more than an untrained one. Measured when shipped: mean accepted length 1.45 trained
    (1.39 for the first head), 1.00 untrained (which accepted nothing in 484 drafted nodes)."""
    from specdec_kernels.drafting.eagle.head import default_eagle_checkpoint, eagle_head_for

    require_real_model()
    if default_eagle_checkpoint("smollm2-135m") is None:
        pytest.fail("no EAGLE head ships for smollm2-135m")
    from specdec_kernels.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = tok.chat_prompt("Explain why the sky is blue in two short paragraphs.")
    ar = Generator(model, None).generate([ids], 32)[0].output
    results = {}
    for name, head in (("trained", eagle_head_for(model)), ("untrained", eagle_head_for(model, "untrained"))):
        drafter = EagleDrafter(model, head, step_cost=FREE, step_seconds=SLOW_STEP, top_k=4, max_depth=4,
                               max_tree_nodes=16)
        (r,) = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate([ids], 32)
        assert r.output == ar, name
        results[name] = r.stats.mean_accepted_length
    assert results["trained"] >= 1.25 and results["untrained"] <= 1.1, results


def test_cli_drafters_by_name(model, prompts, tmp_path):
    """``make_drafter`` builds the eagle drafters (a model without a shipped head needs one
    given, and says so) and they decode exactly."""
    from specdec_kernels.cli import make_drafter

    path = tmp_path / "head.safetensors"
    save_eagle_head(make_head(model), path)
    ar = Generator(model, None).generate(prompts[1:3], 8)
    for name in ("eagle", "eagle+ngram"):
        with pytest.raises(ValueError, match=f"ships for model '{model.name}'"):
            make_drafter(name, model)
    for name, kw in (("eagle", {"eagle_checkpoint": str(path)}), ("eagle+ngram", {"eagle_checkpoint": str(path)}),
                     ("eagle-untrained", {})):
        drafter = make_drafter(name, model, **kw)
        assert drafter.name == name
        reqs = Generator(model, drafter, SpecSchedule("max", 4, max_k=4)).generate(prompts[1:3], 8)
        assert [r.output for r in reqs] == [r.output for r in ar], name


@pytest.mark.parametrize("path", ["fused", "python"])
def test_fused_features_greedy_equals_autoregressive(prompts, path):
    """A head of fused features (EAGLE-3: the target's states after layers 1 and 2 and its
    last, through ``fuse``): the Generator hands it those rows on either step path, greedy
    output equals autoregressive decoding, and a projection of the last layer alone drafts
    exactly what the last-layer head drafts."""
    model = Llama.random(tiny_config(num_layers=3), seed=0)
    model.step_path = path
    kw = dict(step_cost=FREE, step_seconds=SLOW_STEP, top_k=3, max_depth=4, max_tree_nodes=12)
    sched = SpecSchedule("max", 4, max_k=5)
    fused = EagleDrafter(model, make_head(model, feature_layers=(1, 2)), **kw)
    assert fused.feature_layers == (1, 2)
    seen = []
    real = fused.hidden_states
    fused.hidden_states = lambda gen, req, hidden, tokens: (seen.append(hidden.shape), real(gen, req, hidden, tokens))
    reqs = Generator(model, fused, sched).generate(prompts, 20)
    assert [r.output for r in reqs] == [greedy_reference(model, p, 20) for p in prompts]
    assert fused.stats["nodes"] > 0 and seen and all(s[1] == 3 * model.config.hidden_size for s in seen)
    top, alone = make_head(model), make_head(model).fuse_with((1, 2))  # fuse = [0 | 0 | I]
    runs = []
    for head in (top, alone):
        drafter = EagleDrafter(model, head.eval().requires_grad_(False), **kw)
        runs.append((Generator(model, drafter, sched).generate(prompts, 20), drafter.stats))
    assert [r.output for r in runs[0][0]] == [r.output for r in runs[1][0]]
    assert runs[0][1]["nodes"] == runs[1][1]["nodes"] and runs[0][1]["accepted_hist"] == runs[1][1]["accepted_hist"]


def test_fused_head_round_trip_and_checks(model, tmp_path):
    """A fused head's file keeps its feature layers and projection; a file whose projection
    does not fit its layers, a head whose layers are not increasing counts below the
    target's, and features of the wrong width are clear errors."""
    from safetensors.torch import load_file, save_file

    head = make_head(model, vocab=32, feature_layers=(1, 2))
    path = tmp_path / "fused.safetensors"
    save_eagle_head(head, path)
    back = load_eagle_head(path, model)
    assert back.feature_layers == (1, 2) and back.metadata["feature_layers"] == "1,2"
    assert torch.allclose(back.fuse.float(), head.fuse.to(torch.bfloat16).float())
    state = load_file(path)
    save_file({**state, "fuse": state["fuse"][:, :64].contiguous()}, tmp_path / "bad.safetensors",
              metadata={"feature_layers": "1,2"})
    with pytest.raises(ValueError, match="does not fit its feature layers"):
        load_eagle_head(tmp_path / "bad.safetensors", model)
    for bad in ((2, 1), (0,), (3,), (1, 1)):
        with pytest.raises(ValueError, match="increasing layer counts"):
            make_head(model).fuse_with(bad)
    with pytest.raises(ValueError, match="width"):
        back.fuse_features(torch.zeros(2, model.config.hidden_size))
    with pytest.raises(ValueError, match="width"):
        make_head(model).decode_features(torch.zeros(2, 2 * model.config.hidden_size))


def test_training_fused_features_writes_a_fused_head(model, monkeypatch, tmp_path):
    """``--features fused`` on data of layers (1, 2, 3) writes a head that fuses (1, 2) with the
    last and decodes losslessly; ``--init-from`` a last-layer head with ``--features fused``
    starts the projection at the last layer alone (a zero learning rate keeps exactly that);
    a fused head is refused for a last-layer run."""
    layers = (1, 2, model.config.num_layers)
    fused_file = _continued_training_run(model, monkeypatch, tmp_path, "--features", "fused", layers=layers)
    fused = load_eagle_head(fused_file, model)
    assert fused.feature_layers == (1, 2) and fused.metadata["features"] == "fused"
    out = Generator(model, EagleDrafter(model, fused, step_cost=FREE, step_seconds=SLOW_STEP, top_k=3, max_depth=4),
                    SpecSchedule("max", 4, max_k=4)).generate([[3, 1, 4, 1, 5]], 12)[0].output
    assert out == greedy_reference(model, [3, 1, 4, 1, 5], 12)
    assert not torch.equal(fused.fuse[:, :64].float(), torch.zeros(64, 64))  # trained, not the start
    top_file = _continued_training_run(model, monkeypatch, tmp_path, "--head-intermediate", "32")
    kept = load_eagle_head(_continued_training_run(model, monkeypatch, tmp_path, "--init-from", str(top_file),
                                                   "--features", "fused", "--lr", "0", layers=layers), model)
    H = model.config.hidden_size
    assert kept.feature_layers == (1, 2)
    assert torch.equal(kept.fuse.float(), torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1))
    with pytest.raises(SystemExit, match="continue it with --features fused"):
        _continued_training_run(model, monkeypatch, tmp_path, "--init-from", str(fused_file))
