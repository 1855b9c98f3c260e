"""Tiny temperatures are greedy, the limit of sampling as T -> 0, on every backend.

l / T overflows fp32 once |l| > 3.4e38 * T: before MIN_SAMPLING_TEMPERATURE (2^-64) such a
request (logits of magnitude 10 at T = 1e-38) read as invalid (num_accepted = -1). Now every
T below 2^-64 behaves as T = 0, on python_ref, the C++ and the Triton kernels, and T = 2^-64
itself still samples (from a softmax that is one-hot here).
"""
import pytest
import torch

import specdec_kernels
from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from tests.test_rejection_sampling import (chain_args, chain_as_tree, make_chain_inputs, make_tree_inputs, tree_args,
                                           triton_chain, triton_tree)

TINY = [1e-45, 1e-38, 1e-30, 1e-25, 2.0**-64 * 0.99]


def backends():
    out = [("python_ref", ref.chain_rejection_sample, ref.tree_rejection_sample),
           ("cpu", ops.chain_rejection_sample, ops.tree_rejection_sample)]
    if specdec_kernels.HAS_TRITON:
        out.append(("triton", triton_chain, triton_tree))
    return out


def test_threshold_is_two_to_the_minus_64():
    assert ops.MIN_SAMPLING_TEMPERATURE == 2.0**-64
    assert torch.tensor(ops.MIN_SAMPLING_TEMPERATURE, dtype=torch.float32).item() == 2.0**-64  # exact in fp32


@pytest.mark.parametrize("name,chain,tree", backends(), ids=[b[0] for b in backends()])
@pytest.mark.parametrize("tiny", TINY)
def test_tiny_temperature_is_greedy(name, chain, tree, tiny):
    batch = 6 if name == "triton" else 24
    inp = make_chain_inputs(batch, 3, 40, sharpness=10.0, gen=torch.Generator().manual_seed(1))
    # Drafts equal to the argmax of their rows for half the requests: greedy accepts them.
    argmax = inp["target_logits"][:, :3].argmax(-1)
    inp["draft_token_ids"][::2] = argmax[::2]
    greedy = dict(inp, temperature=torch.zeros(batch))
    tiny_t = dict(inp, temperature=torch.full((batch,), tiny))
    expected = ref.chain_rejection_sample(*chain_args(greedy))
    assert (expected[1] >= 0).all() and (expected[1][::2] == inp["num_draft_tokens"][::2]).all()
    got = chain(*chain_args(tiny_t))
    for g, e in zip(got, expected):
        assert torch.equal(g, e), f"{name}: T = {tiny} is not greedy"
    tree_expected = ref.tree_rejection_sample(*tree_args(chain_as_tree(greedy)))
    for g, e in zip(tree(*tree_args(chain_as_tree(tiny_t))), tree_expected):
        assert torch.equal(g, e), f"{name}: T = {tiny} is not greedy (tree)"


@pytest.mark.parametrize("name,chain,tree", backends(), ids=[b[0] for b in backends()])
def test_smallest_sampled_temperature_is_valid(name, chain, tree):
    """T = 2^-64 samples; with logits of magnitude ~30 l / T stays finite and the softmax is
    one-hot on the argmax, so the tokens are the greedy ones (the rows have no ties)."""
    batch = 4 if name == "triton" else 16
    inp = make_tree_inputs(batch, 5, 30, sharpness=10.0, with_q=False, gen=torch.Generator().manual_seed(2))
    inp["temperature"] = torch.full((batch,), 2.0**-64)
    got = tree(*tree_args(inp))
    assert (got[2] >= 0).all(), f"{name}: a valid request at T = 2^-64 read as invalid"
    expected = ref.tree_rejection_sample(*tree_args(dict(inp, temperature=torch.zeros(batch))))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_documented_in_the_op_docstrings():
    for fn in (ops.chain_rejection_sample, ops.tree_rejection_sample):
        assert "MIN_SAMPLING_TEMPERATURE" in fn.__doc__
