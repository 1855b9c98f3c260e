"""apply_top_k_top_p: CPU and Triton against python_ref, ties, NaN rows, 3-D form, errors, opcheck."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from tests.helpers import requires_triton


def make_params(rows, vocab, gen):
    top_k = torch.randint(0, vocab + 2, (rows,), generator=gen, dtype=torch.int32)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen) * 0.95 + 0.02)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.2)
    return top_k, top_p, min_p


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 300), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), which=st.integers(1, 7))
def test_cpu_matches_reference(rows, vocab, seed, dtype, which):
    gen = torch.Generator().manual_seed(seed)
    # Rounded values create ties at the k-th value and at the top-p threshold.
    logits = (torch.randn(rows, vocab, generator=gen) * 3).round(decimals=1).to(dtype)
    top_k, top_p, min_p = make_params(rows, vocab, gen)
    args = (top_k if which & 1 else None, top_p if which & 2 else None, min_p if which & 4 else None)
    expected = ref.apply_top_k_top_p(logits, *args)
    got = ops.apply_top_k_top_p(logits.clone(), *args)
    assert torch.equal(got, expected)


def test_ties_at_the_kth_value_are_kept():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    got = ops.apply_top_k_top_p(logits.clone(), torch.tensor([2], dtype=torch.int32))
    assert got.tolist() == [[float("-inf"), 3.0, 2.0, 2.0, float("-inf")]]
    # top-p: the largest value is always kept; ties at the threshold are all kept.
    got = ops.apply_top_k_top_p(logits.clone(), None, torch.tensor([0.01]))
    assert (got > float("-inf")).sum() == 1
    got = ops.apply_top_k_top_p(torch.tensor([[0.0, 0.0, 0.0, -5.0]]), None, torch.tensor([0.5]))
    assert (got > float("-inf")).tolist() == [[True, True, True, False]]


def test_nan_rows_are_left_unchanged_and_off_rows_untouched():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    got = ops.apply_top_k_top_p(logits.clone(), torch.tensor([2, 2, 0], dtype=torch.int32),
                                torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0]))
    assert torch.equal(got[1].isnan(), logits[1].isnan()) and torch.equal(got[1][~got[1].isnan()],
                                                                        logits[1][~logits[1].isnan()])
    assert torch.equal(got[2], logits[2]) and (got[0] > float("-inf")).sum() == 2


def test_three_dimensional_logits_with_per_request_params():
    logits = torch.randn(2, 3, 20)
    top_k = torch.tensor([3, 5], dtype=torch.int32)
    got = ops.apply_top_k_top_p(logits.clone(), top_k, torch.tensor([0.9, 1.0]))
    expected = ref.apply_top_k_top_p(logits.view(6, 20), top_k.repeat_interleave(3), torch.tensor([0.9, 1.0]).repeat_interleave(3))
    assert torch.equal(got.view(6, 20), expected)
    out = ops.apply_top_k_top_p(logits, top_k, inplace=False)
    assert out.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize("kwargs,name", [
    (dict(top_k=torch.tensor([1, 2], dtype=torch.int16)), "top_k"),  # int64 is cast (tests/test_api.py)
    (dict(top_k=torch.tensor([1, 2, 3], dtype=torch.int32)), "top_k"),
    (dict(top_p=torch.tensor([0.5, 0.5], dtype=torch.float64)), "top_p"),
    (dict(min_p=torch.tensor([[0.5]])), "min_p"),
])
def test_bad_inputs_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ops.apply_top_k_top_p(torch.randn(2, 8), **kwargs)
    with pytest.raises(ValueError, match="logits"):
        ops.apply_top_k_top_p(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="top_k"):
        torch.ops.specdec.apply_top_k_top_p(torch.randn(2, 8), torch.tensor([1, 2]), None, None)


def test_opcheck():
    torch.library.opcheck(torch.ops.specdec.apply_top_k_top_p,
                          (torch.randn(3, 12), torch.tensor([2, 0, 5], dtype=torch.int32), torch.tensor([0.5, 1.0, 0.8]),
                           torch.tensor([0.0, 0.1, 0.0])))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(dtype):
    from specdec_kernels.triton import rejection_sampling as tr

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 1100, generator=gen) * 3).round(decimals=1).to(dtype)
    logits[4, 7] = float("nan")
    top_k = torch.tensor([3, 0, 50, 1100, 10], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.6, 0.9, 0.3, 0.5])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1])
    expected = ref.apply_top_k_top_p(logits, top_k, top_p, min_p)
    got = logits.clone()
    tr.apply_top_k_top_p(got, top_k, top_p, min_p)
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())


INF = float("inf")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("logits,top_k,top_p,min_p", [
    ([[3.0], [INF]], None, None, [0.0, 1.0]),  # exp(+inf - +inf) is NaN: not kept by min-p (the reference)
    ([[INF, 1.0, INF]], None, None, [0.5]),
    ([[INF, 1.0, 2.0]], None, [0.5], None),  # top-p keeps the +inf entries alone
    ([[INF, 1.0, 2.0]], [1], None, None),
    ([[INF, 1.0, 2.0], [-INF, 1.0, 2.0]], [2, 2], [0.9, 0.9], [0.3, 0.3]),
    ([[4.6, -0.9, 1.7], [-4.2, 1.2, 2.5]], None, None, [0.0, float("nan")]),  # a NaN parameter is off
    ([[4.6, -0.9, 1.7], [-4.2, 1.2, 2.5]], None, [float("nan"), 0.5], None),
])
def test_non_finite_rows_and_parameters_match_the_reference(backend, dtype, logits, top_k, top_p, min_p):
    """A +inf logit (an overflowed row) and a NaN top_p / min_p get the reference's result on
    every backend: the fuzzer found the Triton kernel keeping a +inf logit under min-p, and
    taking a NaN min_p as 1, where the reference and C++ drop it and take it as off."""
    logits = torch.tensor(logits, dtype=dtype)
    args = (None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
            None if top_p is None else torch.tensor(top_p), None if min_p is None else torch.tensor(min_p))
    expected = ref.apply_top_k_top_p(logits, *args)
    got = logits.clone()
    if backend == "cpu":
        torch.ops.specdec.apply_top_k_top_p(got, *args)
    else:
        from specdec_kernels.triton import rejection_sampling as tr

        tr.apply_top_k_top_p(got, *args)
    assert torch.equal(got, expected), (got, expected)


# ---------------------------------------------------------------------------------------
# Nothing is read or written outside the tensors (every tensor in guarded storage).
# ---------------------------------------------------------------------------------------


def _guard_cases():
    gen = torch.Generator().manual_seed(11)
    # V = 1061: two Triton tiles of BLOCK_V = 1024, the second partial. The largest logit of
    # every row is its last entry (the row's end; the last row's end is the storage's end);
    # k = V - 1 (the largest k that masks), k = V and k > V (off), k < 0 (off), top_p = 0
    # (keeps only the maximum), min_p > 1 (clamped to 1).
    V = 1061
    logits = (torch.randn(4, V, generator=gen) * 2).round(decimals=1)
    logits[:, -1] = 9.0
    logits[1, -1] = 9.5  # a unique maximum (top-p 0 keeps exactly one)
    big = (logits, torch.tensor([V - 1, V, V + 7, -2], dtype=torch.int32), torch.tensor([1.0, 0.0, 1.0, 0.7]),
           torch.tensor([0.0, 0.0, 1.5, 0.05]))
    # A NaN row and an all -inf row (both left as they are) around an ordinary last row.
    small = (torch.randn(3, 37, generator=gen), torch.tensor([5, 2, 36], dtype=torch.int32),
             torch.tensor([0.8, 0.5, 0.6]), torch.tensor([0.1, 0.0, 0.02]))
    small[0][0, 36] = float("nan")
    small[0][1] = float("-inf")
    return {
        "partial-tile-fp32": big,
        "partial-tile-bf16": tuple(t[2:] for t in (big[0].to(torch.bfloat16), *big[1:])),
        "nan-and-inf-rows": small,
        "top-k-only": (small[0][2:].clone(), small[1][2:], None, None),
        "top-p-only-fp16": (big[0][-2:].half(), None, big[2][-2:], None),
    }


GUARD_CASES = _guard_cases()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("name", list(GUARD_CASES))
def test_nothing_outside_the_tensors_is_read_or_written(backend, name):
    from tests.helpers import assert_guard_intact, guarded

    logits, top_k, top_p, min_p = GUARD_CASES[name]
    expected = ref.apply_top_k_top_p(logits, top_k, top_p, min_p)
    args = [None if t is None else guarded(t) for t in (logits, top_k, top_p, min_p)]
    if backend == "cpu":
        torch.ops.specdec.apply_top_k_top_p(*args)
    else:
        from specdec_kernels.triton import rejection_sampling as tr

        tr.apply_top_k_top_p(*args)
    for t in args:
        if t is not None:
            assert_guard_intact(t)
    got = args[0]
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert (got.isneginf() & ~logits.isneginf()).any(), "the case masks nothing"


@requires_triton
@pytest.mark.parametrize("logits,params,message", [
    (torch.randn(8, 3).t(), {}, "logits must be a contiguous"),
    (torch.randn(3, 8), dict(top_k=torch.tensor([1, 2], dtype=torch.int32)), "top_k must be"),
    (torch.randn(3, 8), dict(min_p=torch.zeros(3, dtype=torch.float64)), "min_p must be"),
])
def test_triton_launcher_checks_shapes_it_indexes_with(logits, params, message):
    # Through torch.ops on a CUDA tensor the launcher is the kernel: no wrapper checks first.
    from specdec_kernels.triton import rejection_sampling as tr

    args = {**dict(top_k=None, top_p=None, min_p=None), **params}
    with pytest.raises(ValueError, match=message):
        tr.apply_top_k_top_p(logits, args["top_k"], args["top_p"], args["min_p"])
