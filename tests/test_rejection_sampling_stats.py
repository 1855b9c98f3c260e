"""Exactness of rejection sampling: chi-square goodness of fit of the emitted tokens.

Many requests with different seeds share one target model whose distribution at each
position depends only on the position (row k / a node at depth k gives p_k); drafts are
drawn from a different q (i.i.d. or deterministic children). The token emitted at
position k, among the requests that reach it, must then be distributed as p_k, and the
first two tokens of a generation jointly as p_0(a) p_1(b | a). Seeds are fixed, so the
tests never flake; 120k requests give a chi-square test that detects a 1% shift of
probability mass (it fails the deliberately broken samplers below by many orders of
magnitude). The C++ kernel is tested here; the Triton kernel is tested token for token
against it in test_rejection_sampling.py.
"""
import pytest
import torch
from scipy import stats

from python_ref import rejection_sampling as ref
from specdec_kernels import ops

NUM_REQUESTS = 120_000
VOCAB = 8
P_MIN = 1e-4  # a correct sampler passes every check with p-value above this
P_BROKEN = 1e-8  # a broken one fails with a p-value below this


def target_logits_table(depth, vocab=VOCAB, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(depth, vocab, generator=gen) * 1.2


def draft_table(depth, vocab=VOCAB, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(depth, vocab, generator=gen) * 1.2, dim=-1)


def chisq_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``tokens`` to ``probs`` (cells with probability 0 must be empty)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    expected = probs[~zero].double() / probs[~zero].double().sum() * counts.sum()
    return float(stats.chisquare(counts[~zero].numpy(), expected.numpy()).pvalue)


def position_pvalues(output_token_ids, num_accepted, target_probs):
    """p-value of the token at every position k, over the requests that reach k."""
    assert (num_accepted >= 0).all()
    pvalues = []
    for k in range(target_probs.shape[0]):
        reached = num_accepted >= k
        if reached.sum() < 2000:
            break
        pvalues.append(chisq_pvalue(output_token_ids[reached, k], target_probs[k]))
    return pvalues


def run_chain(k, temperature, *, with_q, top_k=0, top_p=1.0, batch=NUM_REQUESTS, seed_base=0, sampler=None):
    logits_table = target_logits_table(k + 1)
    if top_k or top_p < 1.0:
        logits_table = ref.apply_top_k_top_p(logits_table, torch.full((k + 1,), top_k, dtype=torch.int32),
                                             torch.full((k + 1,), top_p), None)
    # Drafts close to (but not equal to) the target, so that long chains get accepted.
    q_table = 0.4 * draft_table(k) + 0.6 * torch.softmax(logits_table[:k] / temperature, dim=-1)
    gen = torch.Generator().manual_seed(seed_base + 7)
    drafts = torch.stack([torch.multinomial(q_table[i], batch, replacement=True, generator=gen) for i in range(k)], 1)
    logits = logits_table.expand(batch, k + 1, VOCAB).contiguous()
    q = q_table.expand(batch, k, VOCAB).contiguous() if with_q else None
    temp = torch.full((batch,), float(temperature))
    seed = torch.arange(batch, dtype=torch.int64) * 7919 + seed_base
    offset = torch.zeros(batch, dtype=torch.int64)
    num = torch.full((batch,), k, dtype=torch.int32)
    sampler = sampler or ops.chain_rejection_sample
    out, acc = sampler(drafts, num, logits, q, temp, seed, offset)
    return out, acc, torch.softmax(logits_table / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("with_q", [True, False])
def test_chain_positions_follow_target(temperature, with_q):
    k = 3 if with_q else 2  # one-hot drafts are accepted less often (with probability p(x))
    out, acc, probs = run_chain(k, temperature, with_q=with_q)
    # The drafts are accepted often enough that every position is tested.
    assert (acc == k).sum() > 2000
    pvalues = position_pvalues(out, acc, probs)
    assert len(pvalues) == k + 1
    assert min(pvalues) > P_MIN, pvalues


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.7), (5, 0.8)])
def test_chain_with_top_k_top_p_follows_masked_target(with_q, top_k, top_p):
    out, acc, probs = run_chain(2, 1.0, with_q=with_q, top_k=top_k, top_p=top_p)
    assert (probs == 0).any()
    pvalues = position_pvalues(out, acc, probs)
    assert len(pvalues) == 3 and min(pvalues) > P_MIN, pvalues


def test_chain_joint_distribution_of_first_two_tokens():
    """Token 1 comes from this call if draft 0 was accepted, else from a second call; the
    target at position 1 depends on token 0, so the pair must follow p0(a) p1(b | a)."""
    batch = NUM_REQUESTS
    p0_logits = target_logits_table(1, seed=3)[0]
    p1_logits = target_logits_table(VOCAB, seed=4)  # row a: logits after token a
    q0, q1 = draft_table(2, seed=5)
    gen = torch.Generator().manual_seed(11)
    d0 = torch.multinomial(q0, batch, replacement=True, generator=gen)
    d1 = torch.multinomial(q1, batch, replacement=True, generator=gen)
    logits = torch.stack([p0_logits.expand(batch, VOCAB), p1_logits[d0],
                          torch.zeros(batch, VOCAB)], dim=1).contiguous()
    q = torch.stack([q0.expand(batch, VOCAB), q1.expand(batch, VOCAB)], dim=1).contiguous()
    seed = torch.arange(batch, dtype=torch.int64) + 10**6
    offset = torch.zeros(batch, dtype=torch.int64)
    temp = torch.ones(batch)
    out, acc = ops.chain_rejection_sample(torch.stack([d0, d1], 1), torch.full((batch,), 2, dtype=torch.int32), logits,
                                          q, temp, seed, offset)
    first = out[:, 0]
    second = out[:, 1].clone()
    redo = acc == 0
    # Second call for the requests whose draft 0 was rejected: one fresh draft from q1.
    n = int(redo.sum())
    d1b = torch.multinomial(q1, n, replacement=True, generator=gen)
    logits2 = torch.stack([p1_logits[first[redo]], torch.zeros(n, VOCAB)], dim=1).contiguous()
    out2, _ = ops.chain_rejection_sample(d1b.unsqueeze(1), torch.ones(n, dtype=torch.int32), logits2,
                                         q1.expand(n, 1, VOCAB).contiguous(), torch.ones(n), seed[redo], offset[redo] + 3)
    second[redo] = out2[:, 0]
    joint = (torch.softmax(p0_logits, -1).unsqueeze(1) * torch.softmax(p1_logits, -1)).reshape(-1)
    assert chisq_pvalue(first * VOCAB + second, joint) > P_MIN


TREES = {
    "binary": [-1, 0, 0, 1, 1, 2, 2],
    "wide": [-1, 0, 0, 0, 0, 1, 1],
    "mixed": [-1, 0, 0, 1, 3, 3, 2, 6],
}


def run_tree(parents, temperature, *, iid, batch=NUM_REQUESTS, seed_base=0):
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    max_depth = max(depth)
    logits_table = target_logits_table(max_depth + 1, seed=6)
    q_table = 0.4 * draft_table(max_depth + 1, seed=8) + 0.6 * torch.softmax(logits_table / temperature, dim=-1)
    gen = torch.Generator().manual_seed(seed_base + 9)
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    for node in range(n):
        children = [j for j in range(1, n) if parents[j] == node]
        if not children:
            continue
        qd = q_table[depth[node]]
        if iid:
            draws = torch.multinomial(qd, batch * len(children), replacement=True, generator=gen).view(batch, -1)
        else:  # deterministic children: distinct tokens (a random top-k style choice per request)
            draws = torch.multinomial(qd.expand(batch, VOCAB), len(children), replacement=False, generator=gen)
        tokens[:, children] = draws
    logits = logits_table[depth].expand(batch, n, VOCAB).contiguous()
    q = q_table[depth].expand(batch, n, VOCAB).contiguous() if iid else None
    par = torch.tensor(parents, dtype=torch.int32).expand(batch, n).contiguous()
    seed = torch.arange(batch, dtype=torch.int64) * 104729 + seed_base
    _, out, acc = ops.tree_rejection_sample(par, tokens, torch.full((batch,), n, dtype=torch.int32), logits, q,
                                            torch.full((batch,), float(temperature)), seed,
                                            torch.zeros(batch, dtype=torch.int64))
    return out, acc, torch.softmax(logits_table / temperature, dim=-1)


@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("iid", [True, False])
@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_tree_positions_follow_target(shape, iid, temperature):
    out, acc, probs = run_tree(TREES[shape], temperature, iid=iid)
    pvalues = position_pvalues(out, acc, probs)
    assert len(pvalues) >= 3
    assert min(pvalues) > P_MIN, pvalues


# ---------------------------------------------------------------------------------------
# The same checks fail for broken samplers (so they can fail at all).
# ---------------------------------------------------------------------------------------


def torch_chain_sampler(mode):
    """A vectorised chain sampler in plain torch (torch's RNG); ``mode`` breaks it:
    'correct', 'recover_from_p' (recovered token from p instead of the residual),
    'accept_with_p' (accept with probability p(x) instead of p(x)/q(x))."""

    def sample(drafts, num, logits, q, temp, seed, offset):
        gen = torch.Generator().manual_seed(123)
        batch, k = drafts.shape
        p = torch.softmax(logits / temp[:, None, None], dim=-1)
        out = torch.full((batch, k + 1), -1, dtype=torch.int64)
        acc = torch.zeros(batch, dtype=torch.int32)
        alive = torch.ones(batch, dtype=torch.bool)
        rows = torch.arange(batch)
        for i in range(k + 1):
            if i == k:
                tok = torch.multinomial(p[:, i], 1, generator=gen)[:, 0]
                out[alive, i] = tok[alive]
                break
            x = drafts[:, i]
            px = p[rows, i, x]
            qx = q[rows, i, x]
            ratio = px if mode == "accept_with_p" else px / qx
            accept = torch.rand(batch, generator=gen) <= ratio
            residual = torch.clamp(p[:, i] - q[:, i], min=0) if mode != "recover_from_p" else p[:, i]
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, i])
            rec = torch.multinomial(residual, 1, generator=gen)[:, 0]
            out[alive, i] = torch.where(accept, x, rec)[alive]
            acc[alive & accept] += 1
            alive = alive & accept
        return out, acc

    return sample


@pytest.mark.parametrize("mode", ["correct", "recover_from_p", "accept_with_p"])
def test_statistical_check_detects_broken_samplers(mode):
    out, acc, probs = run_chain(3, 1.0, with_q=True, sampler=torch_chain_sampler(mode))
    pvalues = position_pvalues(out, acc, probs)
    if mode == "correct":
        assert min(pvalues) > P_MIN, pvalues
    else:
        assert min(pvalues) < P_BROKEN, pvalues
