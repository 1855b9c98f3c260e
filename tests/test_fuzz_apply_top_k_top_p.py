"""Fuzzing apply_top_k_top_p.

Valid inputs (R and V from 1, R = 0, 2-D and 3-D forms, ties, extreme values, -inf
entries, all -inf rows, NaN rows, which stay unchanged, parameters off, at and beyond their
ranges: k <= 0 or >= V, p >= 1, p <= 0, min_p > 1, NaN parameters) against python_ref on
the C++ and Triton kernels, with the logits and parameters in guarded storage; invalid ones
(dtypes, shapes, devices, layouts) raise a clear error. Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels  # noqa: F401
from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from tests.helpers import assert_same, backend_op, requires_triton, run_guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROW_KINDS = ["normal", "rounded", "ties", "extreme", "some_neg_inf", "all_neg_inf", "nan", "huge_spread"]
TOP_K = st.sampled_from([0, -1, 1, 2, 3, 2**31 - 1, -(2**31)]) | st.integers(0, 70)
TOP_P = st.sampled_from([1.0, 0.0, -0.5, 1.5, 1e-9, 0.5, 0.9, 0.999, math.nan]) | st.floats(0.0, 1.0, width=32)
MIN_P = st.sampled_from([0.0, -1.0, 1.0, 2.0, 1e-30, 0.1, 0.5, math.nan]) | st.floats(0.0, 1.0, width=32)


def row(kind, vocab, gen):
    if kind == "normal":
        return torch.randn(vocab, generator=gen) * 3
    if kind == "rounded":
        return (torch.randn(vocab, generator=gen) * 3).round(decimals=1)
    if kind == "ties":
        return torch.randint(-1, 2, (vocab,), generator=gen).float()
    if kind == "extreme":
        pool = torch.tensor([3e38, -3e38, 1e30, 0.0, -1e-45, 88.0])
        return pool[torch.randint(0, len(pool), (vocab,), generator=gen)]
    if kind == "huge_spread":
        return torch.randn(vocab, generator=gen) * 1e4
    if kind == "all_neg_inf":
        return torch.full((vocab,), -math.inf)
    r = torch.randn(vocab, generator=gen)
    if kind == "some_neg_inf":
        r[torch.rand(vocab, generator=gen) < 0.5] = -math.inf
    else:
        r[int(torch.randint(0, vocab, (1,), generator=gen))] = math.nan
    return r


@st.composite
def cases(draw, max_rows=6, vocabs=(1, 2, 5, 64, 300, 1025)):
    rows = draw(st.integers(0, max_rows))
    vocab = draw(st.sampled_from(vocabs))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=rows, max_size=rows))
    logits = torch.stack([row(k, vocab, gen) for k in kinds]) if rows else torch.zeros(0, vocab)
    logits = logits.to(draw(st.sampled_from(DTYPES)))
    which = draw(st.integers(0, 7))
    top_k = torch.tensor(draw(st.lists(TOP_K, min_size=rows, max_size=rows)), dtype=torch.int32)
    top_p = torch.tensor(draw(st.lists(TOP_P, min_size=rows, max_size=rows)), dtype=torch.float32)
    min_p = torch.tensor(draw(st.lists(MIN_P, min_size=rows, max_size=rows)), dtype=torch.float32)
    return dict(logits=logits, top_k=top_k if which & 1 else None, top_p=top_p if which & 2 else None,
                min_p=min_p if which & 4 else None)


def params(case):
    return case["top_k"], case["top_p"], case["min_p"]


def run_backend(backend, case):
    """The op on the case's logits (in place: the output) in guarded storage (run_guarded)."""
    op = backend_op(backend, "apply_top_k_top_p", "rejection_sampling")
    (logits,) = run_guarded(lambda top_k, top_p, min_p, logits: op(logits, top_k, top_p, min_p), list(params(case)),
                            [case["logits"]])
    return logits


@fuzz_settings(30)
@given(case=cases())
def test_cpu_matches_reference(case):
    assert_same(run_backend("cpu", case), ref.apply_top_k_top_p(case["logits"], *params(case)), case)


@requires_triton
@fuzz_settings(5)
@given(case=cases(max_rows=3, vocabs=(1, 5, 64, 1025)))
def test_triton_matches_reference(case):
    assert_same(run_backend("triton", case), ref.apply_top_k_top_p(case["logits"], *params(case)), case)


@fuzz_settings(10)
@given(case=cases(max_rows=4, vocabs=(5, 64)), seq=st.integers(1, 3), per_row=st.booleans())
def test_three_d_form_is_the_flattened_rows(case, seq, per_row):
    """[B, S, V] logits with [B] (repeated over S) or [B, S] parameters."""
    batch, vocab = case["logits"].shape
    logits3 = case["logits"].unsqueeze(1).repeat(1, seq, 1)
    ps3 = [None if p is None else (p.unsqueeze(1).repeat(1, seq) if per_row else p) for p in params(case)]
    got = ops.apply_top_k_top_p(logits3, *ps3, inplace=False)
    flat = [None if p is None else p.repeat_interleave(seq) for p in params(case)]
    assert_same(got.reshape(batch * seq, vocab), ref.apply_top_k_top_p(logits3.reshape(batch * seq, vocab), *flat),
                case)


MUTATIONS = {
    "logits:dtype": lambda c: {**c, "logits": c["logits"].double()},
    "logits:1d": lambda c: {**c, "logits": c["logits"][0]},
    # Meta logits beside a CPU parameter (meta logits with no parameters are a fake-tensor call,
    # which the op accepts: its fake kernel gives the shapes).
    "logits:meta": lambda c: {**c, "logits": c["logits"].to("meta"),
                              "top_k": torch.zeros(c["logits"].shape[0], dtype=torch.int32) if c["top_k"] is None
                              else c["top_k"]},
    "logits:strided": lambda c: {**c, "logits": torch.stack([c["logits"], c["logits"]], -1)[..., 0]},
    "top_k:dtype": lambda c: {**c, "top_k": torch.zeros(c["logits"].shape[0], dtype=torch.int16)},
    "top_k:shape": lambda c: {**c, "top_k": torch.zeros(c["logits"].shape[0] + 1, dtype=torch.int32)},
    "top_p:dtype": lambda c: {**c, "top_p": torch.ones(c["logits"].shape[0], dtype=torch.float64)},
    "top_p:meta": lambda c: {**c, "top_p": torch.ones(c["logits"].shape[0], device="meta")},
    "min_p:shape": lambda c: {**c, "min_p": torch.zeros(1, c["logits"].shape[0])},
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_inputs_raise(data, mutation, backend):
    case = MUTATIONS[mutation](data.draw(cases(max_rows=3, vocabs=(5,)).filter(lambda c: c["logits"].shape[0] > 0)))
    args = (case["logits"], *params(case))
    if backend == "wrapper":
        fn = lambda: ops.apply_top_k_top_p(*args)  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.apply_top_k_top_p(*args)  # noqa: E731
    else:
        from specdec_kernels.triton.rejection_sampling import apply_top_k_top_p as launcher

        fn = lambda: launcher(*args)  # noqa: E731
    _, error = call_or_clear_error(fn)
    assert error is not None, f"{mutation} accepted by {backend}"
    assert any(n in str(error) for n in ["logits", "top_k", "top_p", "min_p", "device"]), str(error)
