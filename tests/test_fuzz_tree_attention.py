"""Fuzzing tree_attention.

Valid inputs: batches with empty requests and rows owned by nobody, trees of every shape up
to 130 nodes (masks of 1-3 words), arbitrary visibility masks (any bits, including bits of
nodes beyond a request's count, which are ignored), prefixes from 0, paged caches whose
block tables have holes (-1 slots, unused blocks filled with NaN that must never be read),
head dims 1-130, GQA groups, extreme values, any sm_scale: python_ref's output on the C++
kernel and the Triton kernels (interpreter), with every tensor in guarded storage.
Invalid inputs: a clear error (wrong dtype / shape / device / layout; on CPU also faulty
block ids, prefix lengths, qo_indptr, too few mask words) or the documented result (the
Triton kernel skips keys whose block id or table slot is out of range), never a crash.
Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels  # noqa: F401
from python_ref import tree_attention as ref
from specdec_kernels import ops
from tests.helpers import assert_guard_intact, backend_op, guarded, requires_triton, run_guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings
from tests.test_tree_attention import LSE_TOL, TOL, skipping_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ARG_NAMES = ["q", "k_cache", "v_cache", "block_table", "prefix_lens", "qo_indptr", "tree_mask"]


def random_parents(shape, n, gen):
    if n == 0:
        return []
    if shape == "chain":
        return [-1] + list(range(n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@st.composite
def attention_cases(draw, max_batch=3, node_counts=st.integers(0, 12) | st.sampled_from([1, 63, 64, 65, 130]),
                    head_dims=(1, 3, 8, 40, 64, 130), max_prefix=40):
    batch = draw(st.integers(0, max_batch))
    ns = draw(st.lists(node_counts, min_size=batch, max_size=batch))
    prefixes = draw(st.lists(st.integers(0, max_prefix) | st.sampled_from([0, 1, 16, 17]), min_size=batch,
                             max_size=batch))
    Hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    D = draw(st.sampled_from(head_dims))
    block_size = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(DTYPES))
    mask_kind = draw(st.sampled_from(["tree", "tree", "random_bits", "none"]))
    shapes = draw(st.lists(st.sampled_from(["random", "chain", "star"]), min_size=batch, max_size=batch))
    pad_before, pad_after = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    spare_slots = draw(st.integers(0, 3))
    magnitude = draw(st.sampled_from([1.0, 1.0, 30.0, 1e-20]))
    sm_scale = draw(st.sampled_from([None, None, 0.0, 1e-3, 2.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))

    # Paged cache: each request's blocks anywhere in the pool, unused slots -1 (holes), spare
    # blocks full of NaN (never read).
    used = [-(-(p + n) // block_size) for p, n in zip(prefixes, ns)]
    max_blocks = max(used, default=0) + spare_slots
    num_blocks = sum(used) + draw(st.integers(0, 3))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    start = 0
    for b, count in enumerate(used):
        block_table[b, :count] = torch.tensor(perm[start:start + count], dtype=torch.int32)
        start += count
    k_cache = torch.full((num_blocks, block_size, Hkv, D), math.nan)
    v_cache = torch.full((num_blocks, block_size, Hkv, D), math.nan)
    for b in range(batch):  # only the positions a request owns hold numbers
        for pos in range(prefixes[b] + ns[b]):
            blk = int(block_table[b, pos // block_size])
            k_cache[blk, pos % block_size] = torch.randn(Hkv, D, generator=gen) * magnitude
            v_cache[blk, pos % block_size] = torch.randn(Hkv, D, generator=gen)
    T = pad_before + sum(ns) + pad_after
    q = torch.randn(T, Hkv * group, D, generator=gen) * magnitude
    offsets = [pad_before]
    for n in ns:
        offsets.append(offsets[-1] + n)
    words = ref.mask_words_for(max(ns, default=1))
    trees = [random_parents(shape, n, gen) for shape, n in zip(shapes, ns)]
    if mask_kind == "none":
        tree_mask = None
    else:
        tree_mask = torch.cat([torch.zeros(pad_before, words, dtype=torch.int64), ref.batch_mask(trees, words),
                               torch.zeros(pad_after, words, dtype=torch.int64)])
        if mask_kind == "random_bits":  # any visibility set, and garbage bits past each request's nodes
            tree_mask = torch.randint(-(2**63), 2**63 - 1, (T, words), generator=gen, dtype=torch.int64)
    return dict(q=q.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), block_table=block_table,
                prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
                qo_indptr=torch.tensor(offsets, dtype=torch.int32), tree_mask=tree_mask, sm_scale=sm_scale)


def args_of(case):
    return [case[n] for n in ARG_NAMES]


def scale_of(case):
    return case["q"].shape[-1] ** -0.5 if case["sm_scale"] is None else case["sm_scale"]


def run_backend(backend, case, **launcher_kwargs):
    """(out, lse) of the op in guarded storage (run_guarded); ``launcher_kwargs``: the Triton
    launcher's tuning arguments."""
    launch = functools.partial(backend_op(backend, "tree_attention", "tree_attention"), **launcher_kwargs)
    q = case["q"]
    outputs = [torch.full_like(q, 7.0), torch.full(q.shape[:2], 7.0)]
    return run_guarded(launch, list(args_of(case)) + [float(scale_of(case))], outputs)


def lse_tolerance(case):
    """The LSE's allowed error per query row and head [T, H]: LSE_TOL, plus what the fp32 scores
    carry. A score is a dot product of D rounded terms, off by about sqrt(D) * eps * sum |q_d k_d|
    <= sqrt(D) * eps * |q| |k| (times the scale): with entries of magnitude 30 the scores run
    into the thousands and differ between summation orders by far more than LSE_TOL."""
    q, k = case["q"].double(), case["k_cache"].double()
    k_norm = k.norm(dim=-1)
    k_max = k_norm[k_norm.isfinite()].max() if k_norm.isfinite().any() else torch.tensor(0.0, dtype=torch.float64)
    D, eps = q.shape[-1], 2.0 ** -24
    return LSE_TOL[case["q"].dtype] + 2 * math.sqrt(D) * eps * abs(scale_of(case)) * q.norm(dim=-1) * k_max


def assert_lse_close(lse, expected_lse, case):
    """lse [T, H] within :func:`lse_tolerance` (and a relative 1e-6: its own fp32 rounding) of
    expected_lse where that is finite, and -inf where it is -inf (rows that see no key)."""
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen) and (lse[~seen] == -math.inf).all()
    err = (lse.double() - expected_lse.double()).abs()
    allowed = lse_tolerance(case) + 1e-6 * expected_lse.double().abs()
    bad = seen & ~(err <= allowed)
    assert not bad.any(), f"LSE off by {err[bad].max():.3g} where {allowed[bad].min():.3g} is allowed\n{case}"


def assert_matches(out, lse, expected_out, expected_lse, dtype, case):
    assert not out.isnan().any(), "NaN in the output: an unused (NaN) cache entry was read"
    torch.testing.assert_close(out.double(), expected_out, **TOL[dtype], msg=lambda m: f"{m}\n{case}")
    assert_lse_close(lse, expected_lse, case)


@fuzz_settings(25)
@given(case=attention_cases())
def test_cpu_matches_reference(case):
    out, lse = run_backend("cpu", case)
    expected_out, expected_lse = ref.tree_attention(*args_of(case), sm_scale=scale_of(case))
    assert_matches(out, lse, expected_out, expected_lse, case["q"].dtype, case)


@requires_triton
@fuzz_settings(4)
@given(case=attention_cases(max_batch=2, node_counts=st.integers(0, 5) | st.sampled_from([65]), head_dims=(1, 8, 40),
                            max_prefix=9),
       num_splits=st.sampled_from([None, 1, 3]))
def test_triton_matches_reference(case, num_splits):
    out, lse = run_backend("triton", case, num_splits=num_splits, block_n=16)
    expected_out, expected_lse = ref.tree_attention(*args_of(case), sm_scale=scale_of(case))
    assert_matches(out, lse, expected_out, expected_lse, case["q"].dtype, case)


# ---------------------------------------------------------------------------------------
# Invalid inputs.
# ---------------------------------------------------------------------------------------


def small_case(draw):
    return draw(attention_cases(max_batch=2, node_counts=st.integers(1, 5), head_dims=(8,), max_prefix=9).filter(
        lambda c: c["block_table"].shape[0] > 0))


def strided(t):
    return torch.stack([t, torch.zeros_like(t)], dim=0)[0] if t.dim() == 0 else \
        torch.stack([t, torch.zeros_like(t)], dim=-2).select(-2, 0) if t.dim() >= 2 else \
        torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


LAYOUT_MUTATIONS = {
    "q:dtype": lambda c: {**c, "q": c["q"].double()},
    "q:meta": lambda c: {**c, "q": c["q"].to("meta")},
    "q:2d": lambda c: {**c, "q": c["q"][:, 0]},
    "q:last_dim_strided": lambda c: {**c, "q": torch.stack([c["q"], c["q"]], -1).flatten(-2)[..., ::2]},
    "k_cache:heads_not_dividing": lambda c: {**c, **{
        n: c[n][:, :, :1].expand(-1, -1, c["q"].shape[1] + 1, -1).contiguous() for n in ("k_cache", "v_cache")}},
    "k_cache:dtype": lambda c: {**c, "k_cache": c["k_cache"].double()},
    "k_cache:meta": lambda c: {**c, "k_cache": c["k_cache"].to("meta")},
    "k_cache:head_dim": lambda c: {**c, "k_cache": c["k_cache"][..., :-1]},
    "v_cache:shape": lambda c: {**c, "v_cache": torch.cat([c["v_cache"], c["v_cache"][:, :1]], 1)},
    "k_cache:zero_block_size": lambda c: {**c, "k_cache": c["k_cache"][:, :0], "v_cache": c["v_cache"][:, :0]},
    "block_table:dtype": lambda c: {**c, "block_table": c["block_table"].to(torch.int16)},
    "block_table:1d": lambda c: {**c, "block_table": c["block_table"][0]},
    "prefix_lens:shape": lambda c: {**c, "prefix_lens": torch.cat([c["prefix_lens"], c["prefix_lens"]])},
    "prefix_lens:dtype": lambda c: {**c, "prefix_lens": c["prefix_lens"].float()},
    "qo_indptr:shape": lambda c: {**c, "qo_indptr": c["qo_indptr"][:-1]},
    "qo_indptr:meta": lambda c: {**c, "qo_indptr": c["qo_indptr"].to("meta")},
    "tree_mask:dtype": lambda c: {**c, "tree_mask": (c["tree_mask"] if c["tree_mask"] is not None else torch.zeros(
        c["q"].shape[0], 1, dtype=torch.int64)).int()},
    "tree_mask:zero_words": lambda c: {**c, "tree_mask": torch.zeros(c["q"].shape[0], 0, dtype=torch.int64)},
    "tree_mask:rows": lambda c: {**c, "tree_mask": torch.zeros(c["q"].shape[0] + 1, 1, dtype=torch.int64)},
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(LAYOUT_MUTATIONS))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_layouts_raise(data, mutation, backend):
    case = LAYOUT_MUTATIONS[mutation](small_case(data.draw))
    q = case["q"]
    out = torch.empty(q.shape, dtype=q.dtype) if q.device.type != "meta" else torch.empty(q.shape)
    lse = torch.empty(q.shape[:2]) if q.dim() >= 2 else torch.empty(0)
    if backend == "wrapper":
        fn = lambda: ops.tree_attention(*args_of(case), case["sm_scale"])  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.tree_attention(*args_of(case), float(scale_of(case)), out, lse)  # noqa: E731
    else:
        from specdec_kernels.triton.tree_attention import tree_attention as launcher

        fn = lambda: launcher(*args_of(case), float(scale_of(case)), out, lse)  # noqa: E731
    _, error = call_or_clear_error(fn)
    assert error is not None, f"{mutation} accepted by {backend}"
    assert any(n in str(error) for n in [*ARG_NAMES, "out", "lse"]), f"{mutation} on {backend}: {error}"


OUTPUT_MUTATIONS = {
    "out:dtype": lambda q: (torch.empty(q.shape, dtype=torch.float64), None),
    "out:shape": lambda q: (torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype), None),
    "out:last_dim_strided": lambda q: (torch.empty(*q.shape, 2, dtype=q.dtype)[..., 0], None),
    "lse:dtype": lambda q: (torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float64)),
    "lse:shape": lambda q: (torch.empty_like(q), torch.empty(q.shape[0], q.shape[1] + 1)),
    "lse:strided": lambda q: (torch.empty_like(q), torch.empty(q.shape[1], q.shape[0]).t()),
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(OUTPUT_MUTATIONS))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_outputs_raise(data, mutation, backend):
    case = small_case(data.draw)
    out, lse = OUTPUT_MUTATIONS[mutation](case["q"])
    if backend == "wrapper":
        fn = lambda: ops.tree_attention(*args_of(case), case["sm_scale"], out=out, lse=lse)  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.tree_attention(*args_of(case), float(scale_of(case)), out, lse)  # noqa: E731
    else:
        from specdec_kernels.triton.tree_attention import tree_attention as launcher

        fn = lambda: launcher(*args_of(case), float(scale_of(case)), out, lse)  # noqa: E731
    _, error = call_or_clear_error(fn)
    if q_contiguous_out_ok := (error is None and mutation == "lse:strided"):
        # A strided lse is allowed only if written correctly.
        expected = ops.tree_attention(*args_of(case), case["sm_scale"], return_lse=True)[1]
        if backend == "triton":  # another summation order than the C++ kernel's: an ulp or two
            assert_lse_close(lse, expected, case)
        else:
            assert torch.equal(lse, expected), q_contiguous_out_ok
        return
    assert error is not None, f"{mutation} accepted by {backend}"
    assert "out" in str(error) or "lse" in str(error), f"{mutation} on {backend}: {error}"


DATA_FAULTS = ["block_id_minus_one", "block_id_too_large", "block_id_int_max", "prefix_negative", "prefix_huge",
               "prefix_past_table", "indptr_decreasing", "indptr_negative", "indptr_past_rows", "mask_too_narrow"]


def data_fault(case, fault, data):
    case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    bt, pl, qi = case["block_table"], case["prefix_lens"], case["qo_indptr"]
    B, max_blocks = bt.shape
    b = data.draw(st.integers(0, B - 1))
    num_blocks = case["k_cache"].shape[0]
    used = -(-(int(pl[b]) + int(qi[b + 1] - qi[b])) // case["k_cache"].shape[1])
    if fault.startswith("block_id"):
        slot = data.draw(st.integers(0, used - 1))
        bt[b, slot] = {"block_id_minus_one": -1, "block_id_too_large": num_blocks,
                       "block_id_int_max": 2**31 - 1}[fault]
        return case, "block_table", "out of range"
    if fault == "prefix_negative":
        pl[b] = -3
        return case, "prefix_lens", "prefix_lens"
    if fault in ("prefix_huge", "prefix_past_table"):
        pl[b] = 2**31 - 2 if fault == "prefix_huge" else max_blocks * case["k_cache"].shape[1]
        return case, "prefix_lens", "cache positions"
    if fault == "indptr_decreasing":
        qi[b + 1] = qi[b] - 1
        return case, "qo_indptr", "qo_indptr"
    if fault == "indptr_negative":
        qi[0] = -1
        return case, "qo_indptr", "qo_indptr"
    if fault == "indptr_past_rows":
        qi[-1] = case["q"].shape[0] + 1
        return case, "qo_indptr", "qo_indptr"
    # mask_too_narrow: a request of 65 nodes with a one-word mask.
    return case, "tree_mask", "words per row"


@pytest.mark.parametrize("fault", DATA_FAULTS)
@fuzz_settings(3)
@given(data=st.data())
def test_cpu_data_faults_raise_before_writing(data, fault):
    if fault == "mask_too_narrow":
        case = data.draw(attention_cases(max_batch=1, node_counts=st.just(65), head_dims=(8,), max_prefix=3).filter(
            lambda c: c["tree_mask"] is not None and c["block_table"].shape[0] == 1))
        case["tree_mask"] = case["tree_mask"][:, :1].contiguous()
        name, message = "tree_mask", "words per row"
    else:
        case, name, message = data_fault(small_case(data.draw), fault, data)
    q = case["q"]
    out, lse = guarded(torch.full_like(q, 7.0)), guarded(torch.full(q.shape[:2], 7.0))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.tree_attention(*[guarded(t) if t is not None else None for t in args_of(case)],
                                         float(scale_of(case)), out, lse)
    assert (out == 7.0).all() and (lse == 7.0).all()
    assert_guard_intact(out)
    assert_guard_intact(lse)


@requires_triton
@pytest.mark.parametrize("fault", ["block_id_minus_one", "block_id_too_large", "block_id_int_max",
                                   "prefix_past_table"])
@fuzz_settings(2)
@given(data=st.data())
def test_triton_skips_faulty_keys(data, fault):
    """The Triton kernel's documented result for faulty block ids and table slots: those
    keys are invisible (tests/test_tree_attention.py's skipping_reference)."""
    case, _, _ = data_fault(small_case(data.draw), fault, data)
    case = {**case, "sm_scale": None}
    # NaN in unused cache entries would make "skipped" and "read" indistinguishable only
    # where the kernel reads them; use numbers so the comparison is about visibility.
    case["k_cache"] = case["k_cache"].nan_to_num(0.5)
    case["v_cache"] = case["v_cache"].nan_to_num(0.5)
    out, lse = run_backend("triton", case, block_n=16)
    expected_out, expected_lse = skipping_reference(case, mask=case["tree_mask"] is not None)
    assert_matches(out, lse, expected_out, expected_lse, case["q"].dtype, case)


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@fuzz_settings(4)
@given(data=st.data())
def test_non_contiguous_inputs_give_the_same_result(data, backend):
    """Strides other than the last dimension's are any (q as a view of a fused QKV, caches
    as views of a larger pool, index tensors with strides)."""
    case = small_case(data.draw)
    expected = ops.tree_attention(*args_of(case), case["sm_scale"], return_lse=True)
    mutated = dict(case)
    for name in ("q", "k_cache", "v_cache"):
        t = case[name]
        mutated[name] = torch.stack([t, torch.zeros_like(t)], dim=-2).select(-2, 0)  # head stride doubled
    for name in ("block_table", "prefix_lens", "qo_indptr"):
        mutated[name] = strided(case[name])
    out = torch.empty_like(case["q"])
    lse = torch.empty(case["q"].shape[:2])
    if backend == "wrapper":
        got = ops.tree_attention(*args_of(mutated), case["sm_scale"], return_lse=True)
    else:
        fn = torch.ops.specdec.tree_attention if backend == "cpu" else \
            __import__("specdec_kernels.triton.tree_attention", fromlist=["tree_attention"]).tree_attention
        fn(*args_of(mutated), float(scale_of(case)), out, lse)
        got = (out, lse)
    tol = TOL[case["q"].dtype]
    torch.testing.assert_close(got[0], expected[0], **tol)
    assert_lse_close(got[1], expected[1], case)  # the Triton kernel sums in another order than the C++ one


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@fuzz_settings(4)
@given(data=st.data())
def test_out_aliasing_q_raises_or_is_correct(data, backend):
    """out written over q (in place): a clear error or the result of the call without it."""
    case = small_case(data.draw)
    expected = ops.tree_attention(*args_of(case), case["sm_scale"], return_lse=True)
    q = case["q"].clone()
    lse = torch.empty(q.shape[:2])
    args = [q if n == "q" else case[n] for n in ARG_NAMES]
    if backend == "cpu":
        fn = torch.ops.specdec.tree_attention
    else:
        from specdec_kernels.triton.tree_attention import tree_attention as fn
    _, error = call_or_clear_error(fn, *args, float(scale_of(case)), q, lse)
    if error is None:
        torch.testing.assert_close(q, expected[0], **TOL[q.dtype])
    else:
        assert "out" in str(error) and "q" in str(error), str(error)
