"""Fuzzing medusa_topk.

Valid inputs (M from 0, K heads from 1, L ResBlocks from 0, V and H from 1, top_k from 1 to
V, shared or per-head LM heads, fp32/bf16/fp16 weights, mixed dtypes, exact ties from
integer-valued weights) against python_ref on the C++ and Triton kernels, every tensor in
guarded storage. Invalid inputs (shapes, dtypes, devices, layouts, top_k out of range or not
an int, non-finite hidden states, outputs aliasing each other) raise a clear error or give
the documented result. Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels  # noqa: F401
from python_ref import medusa as ref
from specdec_kernels import ops
from tests.helpers import backend_op, requires_triton, run_guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = ["hidden", "res_weight", "res_bias", "lm_head"]


@st.composite
def medusa_cases(draw, max_m=5, max_heads=3, max_layers=2, vocabs=(1, 2, 7, 100, 513), hiddens=(1, 3, 8, 33),
                 min_m=0, min_layers=0):
    M = draw(st.integers(min_m, max_m))
    K = draw(st.integers(1, max_heads))
    L = draw(st.integers(min_layers, max_layers))
    V = draw(st.sampled_from(vocabs))
    H = draw(st.sampled_from(hiddens))
    shared = draw(st.booleans())
    top_k = draw(st.integers(1, V))
    integer = draw(st.booleans())  # integer-valued: exact in fp32, many exact ties
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=4, max_size=4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if integer:
        hidden = torch.randint(-2, 3, (M, H), generator=gen).float()
        res_weight = torch.zeros(K, L, H, H)  # blocks add SiLU(b): exact only when W = 0 and b = 0
        res_bias = torch.zeros(K, L, H)
        lm_head = torch.randint(-2, 3, (*(() if shared else (K,)), V, H), generator=gen).float()
    else:
        scale = draw(st.sampled_from([1.0, 1.0, 20.0]))
        hidden = torch.randn(M, H, generator=gen) * scale
        res_weight = torch.randn(K, L, H, H, generator=gen) / H**0.5
        res_bias = torch.randn(K, L, H, generator=gen) * 0.1
        lm_head = torch.randn(*(() if shared else (K,)), V, H, generator=gen) / H**0.5
    tensors = [t.to(d) for t, d in zip((hidden, res_weight, res_bias, lm_head), dtypes)]
    return dict(zip(NAMES, tensors), top_k=top_k, exact=integer)


def run_backend(backend, case):
    """(ids, logprobs) of the op in guarded storage (run_guarded)."""
    M, K, top_k = case["hidden"].shape[0], case["res_weight"].shape[0], case["top_k"]
    outputs = [torch.full((M, K, top_k), 7, dtype=torch.int64), torch.full((M, K, top_k), 7.0)]
    return run_guarded(backend_op(backend, "medusa_topk", "medusa"), [case[n] for n in NAMES] + [top_k], outputs)


def check_against_reference(ids, logprobs, case):
    """Exact ids (ties to the lower id) for integer-valued inputs; otherwise our ids must be
    distinct, hold the reference's top values (near-ties may swap) and the log-probs match."""
    hidden, res_weight, res_bias, lm_head = (case[n] for n in NAMES)
    ref_ids, ref_lp = ref.medusa_topk(hidden, res_weight, res_bias, lm_head, case["top_k"])
    if ids.numel() == 0:
        assert ids.shape == ref_ids.shape
        return
    if case["exact"]:
        assert torch.equal(ids, ref_ids), f"\n{ids}\n{ref_ids}"
    full = torch.log_softmax(ref.medusa_logits(hidden, res_weight, res_bias, lm_head), dim=-1)
    tol = dict(atol=5e-4, rtol=2e-4)  # fp32 arithmetic from the same (possibly bf16) values
    torch.testing.assert_close(logprobs.double(), ref_lp, **tol)
    torch.testing.assert_close(torch.gather(full, -1, ids), logprobs.double(), **tol)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()


@fuzz_settings(25)
@given(case=medusa_cases())
def test_cpu_matches_reference(case):
    check_against_reference(*run_backend("cpu", case), case)


@requires_triton
@fuzz_settings(4)
@given(case=medusa_cases(max_m=2, max_heads=2, max_layers=1, vocabs=(1, 7, 100), hiddens=(1, 8)))
def test_triton_matches_reference(case):
    check_against_reference(*run_backend("triton", case), case)


def small_case(draw):
    return draw(medusa_cases(min_m=1, max_m=3, max_heads=2, min_layers=1, max_layers=1, vocabs=(7, 100),
                             hiddens=(8,)).filter(lambda c: c["top_k"] > 1))


MUTATIONS = {
    "hidden:dtype": lambda c: {**c, "hidden": c["hidden"].double()},
    "hidden:1d": lambda c: {**c, "hidden": c["hidden"][0]},
    "hidden:meta": lambda c: {**c, "hidden": c["hidden"].to("meta")},
    "hidden:size": lambda c: {**c, "hidden": torch.cat([c["hidden"], c["hidden"][:, :1]], 1)},
    "res_weight:dtype": lambda c: {**c, "res_weight": c["res_weight"].to(torch.int32)},
    "res_weight:no_heads": lambda c: {**c, "res_weight": c["res_weight"][:0], "res_bias": c["res_bias"][:0]},
    "res_weight:shape": lambda c: {**c, "res_weight": c["res_weight"][..., :-1]},
    "res_weight:strided": lambda c: {**c, "res_weight": torch.stack([c["res_weight"], c["res_weight"]], -1)[..., 0]},
    "res_bias:shape": lambda c: {**c, "res_bias": c["res_bias"][..., :-1]},
    "lm_head:shape": lambda c: {**c, "lm_head": c["lm_head"][..., :-1]},
    "lm_head:heads": lambda c: {**c, "lm_head": torch.zeros(c["res_weight"].shape[0] + 1, *c["lm_head"].shape[-2:],
                                                            dtype=c["lm_head"].dtype)},
    "lm_head:strided": lambda c: {**c, "lm_head": torch.stack([c["lm_head"], c["lm_head"]], -1)[..., 0]},
    "lm_head:empty_vocab": lambda c: {**c, "lm_head": c["lm_head"][..., :0, :], "top_k": 1},
    "top_k:zero": lambda c: {**c, "top_k": 0},
    "top_k:negative": lambda c: {**c, "top_k": -3},
    "top_k:above_vocab": lambda c: {**c, "top_k": c["lm_head"].shape[-2] + 1},
    "top_k:huge": lambda c: {**c, "top_k": 2**40},
    "top_k:float": lambda c: {**c, "top_k": 2.0},
    "top_k:bool": lambda c: {**c, "top_k": True},
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_inputs_raise(data, mutation, backend):
    if mutation == "top_k:bool" and backend != "wrapper":
        return  # torch.ops' int argument takes True as 1 (a valid top_k); the wrapper rejects a bool
    case = MUTATIONS[mutation](small_case(data.draw))
    M = case["hidden"].shape[0] if case["hidden"].dim() == 2 else 1
    K = max(case["res_weight"].shape[0], 1)
    k = case["top_k"] if isinstance(case["top_k"], int) and 0 < case["top_k"] < 4096 else 1
    ids, logprobs = torch.empty(M, K, k, dtype=torch.int64), torch.empty(M, K, k)
    args = [case[n] for n in NAMES]
    if backend == "wrapper":
        fn = lambda: ops.medusa_topk(*args, case["top_k"])  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.medusa_topk(*args, case["top_k"], ids, logprobs)  # noqa: E731
    else:
        from specdec_kernels.triton.medusa import medusa_topk as launcher

        fn = lambda: launcher(*args, case["top_k"], ids, logprobs)  # noqa: E731
    _, error = call_or_clear_error(fn)
    if error is None and mutation.endswith(":strided") and backend == "triton":  # strides honoured: must be right
        expected = ops.medusa_topk(*[case[n].contiguous() for n in NAMES], case["top_k"])
        assert torch.equal(ids, expected[0]), f"{mutation} on {backend}: wrong ids"
        return
    assert error is not None, f"{mutation} accepted by {backend}"
    names = [*NAMES, "top_k", "topk_ids", "topk_logprobs", "device"]
    assert any(n in str(error) for n in names), f"{mutation} on {backend}: {error}"


OUTPUT_MUTATIONS = {
    "topk_ids:dtype": lambda ids, lp: (ids.int(), lp),
    "topk_ids:shape": lambda ids, lp: (ids[..., :-1], lp),
    "topk_logprobs:dtype": lambda ids, lp: (ids, lp.double()),
    "topk_logprobs:strided": lambda ids, lp: (ids, torch.stack([lp, lp], -1)[..., 0]),
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(OUTPUT_MUTATIONS))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_outputs_raise_or_are_correct(data, mutation, backend):
    case = small_case(data.draw)
    args = [case[n] for n in NAMES]
    expected = ops.medusa_topk(*args, case["top_k"])
    M, K, k = expected[0].shape
    ids, logprobs = OUTPUT_MUTATIONS[mutation](torch.empty(M, K, k, dtype=torch.int64), torch.empty(M, K, k))
    if backend == "wrapper":
        fn = lambda: ops.medusa_topk(*args, case["top_k"], out=(ids, logprobs))  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.medusa_topk(*args, case["top_k"], ids, logprobs)  # noqa: E731
    else:
        from specdec_kernels.triton.medusa import medusa_topk as launcher

        fn = lambda: launcher(*args, case["top_k"], ids, logprobs)  # noqa: E731
    _, error = call_or_clear_error(fn)
    if error is None:  # then it must be right
        assert torch.equal(ids, expected[0]) and torch.equal(logprobs, expected[1]), f"{mutation} on {backend}"
    else:
        assert "topk_ids" in str(error) or "topk_logprobs" in str(error), f"{mutation} on {backend}: {error}"


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@fuzz_settings(3)
@given(data=st.data())
def test_non_finite_hidden_raises_on_cpu(data, poison):
    """Documented: non-finite logits raise on CPU (RuntimeError)."""
    case = small_case(data.draw)
    hidden = case["hidden"].clone()
    hidden[data.draw(st.integers(0, hidden.shape[0] - 1)), data.draw(st.integers(0, hidden.shape[1] - 1))] = poison
    args = [hidden, case["res_weight"], case["res_bias"], case["lm_head"]]
    _, error = call_or_clear_error(ops.medusa_topk, *args, case["top_k"])
    # An infinite hidden value can give finite logits only through a zero weight column;
    # with random weights every logit of the row is non-finite.
    assert isinstance(error, RuntimeError), error
