"""chain_rejection_sample / tree_rejection_sample: every backend against python_ref,
cross-backend and batch-independent determinism, edge cases, bad inputs, opcheck, compile.
(The chi-square exactness tests are in tests/test_rejection_sampling_stats.py.)"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec_kernels
from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from tests.conftest import requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_chain_inputs(batch, max_drafts, vocab, *, dtype=torch.float32, with_q=True, greedy_mask=None, gen=None,
                      sharpness=3.0, num_drafts=None):
    """Random chain inputs whose drafts are drawn from q (so acceptances are frequent)."""
    gen = gen or torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, max_drafts + 1, vocab, generator=gen) * sharpness).to(dtype)
    q = torch.softmax(torch.randn(batch, max(max_drafts, 1), vocab, generator=gen) * sharpness, dim=-1)[:, :max_drafts]
    # Make the draft close to the target on some rows so that chains get accepted.
    q = 0.5 * q + 0.5 * torch.softmax(logits[:, :max_drafts].float(), dim=-1)
    q = q / q.sum(-1, keepdim=True)
    if max_drafts > 0:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, max_drafts)
    else:
        drafts = torch.zeros(batch, 0, dtype=torch.int64)
    if num_drafts is None:
        num_drafts = torch.randint(0, max_drafts + 1, (batch,), generator=gen, dtype=torch.int32)
    temperature = torch.rand(batch, generator=gen) + 0.5
    if greedy_mask is not None:
        temperature[greedy_mask] = 0.0
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    offset = torch.randint(0, 2**40, (batch,), generator=gen)
    return dict(draft_token_ids=drafts, num_draft_tokens=num_drafts.to(torch.int32), target_logits=logits,
                draft_probs=q.contiguous() if with_q else None, temperature=temperature, seed=seed, offset=offset)


def chain_args(inp):
    return (inp["draft_token_ids"], inp["num_draft_tokens"], inp["target_logits"], inp["draft_probs"],
            inp["temperature"], inp["seed"], inp["offset"])


def random_parents(num_nodes, gen, max_nodes=None):
    max_nodes = max_nodes or num_nodes
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    return parents + [-1] * (max_nodes - num_nodes)


def make_tree_inputs(batch, max_nodes, vocab, *, dtype=torch.float32, with_q=True, greedy_mask=None, gen=None,
                     sharpness=3.0):
    gen = gen or torch.Generator().manual_seed(0)
    num_nodes = torch.randint(1, max_nodes + 1, (batch,), generator=gen, dtype=torch.int32)
    parents = torch.tensor([random_parents(int(n), gen, max_nodes) for n in num_nodes], dtype=torch.int32)
    logits = (torch.randn(batch, max_nodes, vocab, generator=gen) * sharpness).to(dtype)
    q = torch.softmax(torch.randn(batch, max_nodes, vocab, generator=gen) * sharpness, dim=-1)
    q = 0.5 * q + 0.5 * torch.softmax(logits.float(), dim=-1)
    q = q / q.sum(-1, keepdim=True)
    tokens = torch.zeros(batch, max_nodes, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, int(num_nodes[b])):
            tokens[b, i] = int(torch.multinomial(q[b, int(parents[b, i])], 1, generator=gen))
    temperature = torch.rand(batch, generator=gen) + 0.5
    if greedy_mask is not None:
        temperature[greedy_mask] = 0.0
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    offset = torch.randint(0, 2**40, (batch,), generator=gen)
    return dict(parents=parents, tree_token_ids=tokens, num_nodes=num_nodes, target_logits=logits,
                draft_probs=q if with_q else None, temperature=temperature, seed=seed, offset=offset)


def tree_args(inp):
    return (inp["parents"], inp["tree_token_ids"], inp["num_nodes"], inp["target_logits"], inp["draft_probs"],
            inp["temperature"], inp["seed"], inp["offset"])


def chain_as_tree(inp):
    """The same request as a tree with parents [-1, 0, 1, ...]."""
    drafts = inp["draft_token_ids"]
    batch, k = drafts.shape
    q = inp["draft_probs"]
    if q is not None:
        q = torch.cat([q, torch.full((batch, 1, q.shape[2]), 1.0 / q.shape[2])], dim=1)
    return dict(parents=torch.arange(-1, k, dtype=torch.int32).expand(batch, k + 1).contiguous(),
                tree_token_ids=torch.cat([torch.zeros(batch, 1, dtype=torch.int64), drafts], dim=1),
                num_nodes=inp["num_draft_tokens"] + 1, target_logits=inp["target_logits"], draft_probs=q,
                temperature=inp["temperature"], seed=inp["seed"], offset=inp["offset"])


def triton_chain(*args):
    from specdec_kernels.triton import rejection_sampling as tr

    draft_token_ids = args[0]
    out = torch.empty(draft_token_ids.shape[0], draft_token_ids.shape[1] + 1, dtype=torch.int64)
    num = torch.empty(draft_token_ids.shape[0], dtype=torch.int32)
    tr.chain_rejection_sample(*args, out, num)
    return out, num


def triton_tree(*args):
    from specdec_kernels.triton import rejection_sampling as tr

    parents = args[0]
    batch, n = parents.shape
    an = torch.empty(batch, n - 1, dtype=torch.int32)
    out = torch.empty(batch, n, dtype=torch.int64)
    num = torch.empty(batch, dtype=torch.int32)
    tr.tree_rejection_sample(*args, an, out, num)
    return an, out, num


def assert_same(got, expected):
    for g, e in zip(got, expected):
        assert torch.equal(g, e), f"\ngot      {g}\nexpected {e}"


# ---------------------------------------------------------------------------------------
# Against python_ref.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_q", [True, False])
def test_chain_cpu_matches_reference(dtype, with_q):
    inp = make_chain_inputs(12, 4, 37, dtype=dtype, with_q=with_q, greedy_mask=torch.arange(12) % 4 == 0)
    inp["num_draft_tokens"][:2] = torch.tensor([0, 4], dtype=torch.int32)
    assert_same(ops.chain_rejection_sample(*chain_args(inp)), ref.chain_rejection_sample(*chain_args(inp)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_q", [True, False])
def test_tree_cpu_matches_reference(dtype, with_q):
    inp = make_tree_inputs(12, 7, 29, dtype=dtype, with_q=with_q, greedy_mask=torch.arange(12) % 5 == 0)
    assert_same(ops.tree_rejection_sample(*tree_args(inp)), ref.tree_rejection_sample(*tree_args(inp)))


@pytest.mark.parametrize("vocab,dtype", [(8193, torch.float32), (8193, torch.bfloat16), (49153, torch.float16)])
def test_large_vocab_cpu_matches_reference(vocab, dtype):
    # Flat logits (sharpness 0.3): rejections land in the residual race over the whole row.
    inp = make_chain_inputs(3, 2, vocab, dtype=dtype, sharpness=0.3, greedy_mask=torch.tensor([False, False, True]),
                            num_drafts=torch.tensor([2, 1, 2]))
    assert_same(ops.chain_rejection_sample(*chain_args(inp)), ref.chain_rejection_sample(*chain_args(inp)))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 5), k=st.integers(0, 5), vocab=st.integers(1, 70), with_q=st.booleans(),
       seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES))
def test_chain_cpu_matches_reference_hypothesis(batch, k, vocab, with_q, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    greedy = torch.rand(batch, generator=gen) < 0.3
    inp = make_chain_inputs(batch, k, vocab, dtype=dtype, with_q=with_q, greedy_mask=greedy, gen=gen)
    assert_same(ops.chain_rejection_sample(*chain_args(inp)), ref.chain_rejection_sample(*chain_args(inp)))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 4), n=st.integers(1, 9), vocab=st.integers(1, 40), with_q=st.booleans(),
       seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES))
def test_tree_cpu_matches_reference_hypothesis(batch, n, vocab, with_q, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    greedy = torch.rand(batch, generator=gen) < 0.3
    inp = make_tree_inputs(batch, n, vocab, dtype=dtype, with_q=with_q, greedy_mask=greedy, gen=gen)
    assert_same(ops.tree_rejection_sample(*tree_args(inp)), ref.tree_rejection_sample(*tree_args(inp)))
