"""specdec::medusa_topk against python_ref (full logits -> log_softmax -> stable top-k).

Backends: the C++ CPU kernel (through the ops.py wrapper and torch.ops.specdec) and the
Triton kernels under TRITON_INTERPRET=1 (small shapes). Float inputs are compared with
tolerances; integer-valued inputs (exact in fp32) are compared id for id, ties included.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec_kernels
from python_ref import medusa as ref
from specdec_kernels import ops
from tests.helpers import requires_triton

# Log-prob tolerances: the kernels compute in fp32 (bf16/fp16 inputs are widened first),
# the reference in float64 from the same input values.
TOL = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-4, rtol=1e-4)}


def make_inputs(M, K, L, V, H, shared, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g) * scale
    res_weight = torch.randn(K, L, H, H, generator=g) / H**0.5
    res_bias = torch.randn(K, L, H, generator=g) * 0.1
    lm_head = torch.randn(*(() if shared else (K,)), V, H, generator=g) / H**0.5
    return [t.to(dtype) for t in (hidden, res_weight, res_bias, lm_head)]


def check_against_ref(ids, logprobs, inputs, top_k, tol):
    """Our ids must be top_k distinct ids whose reference log-probs equal ours, and our
    log-probs must equal the reference's top_k values (so near-ties may swap ids only
    where the reference values are within the tolerance)."""
    hidden, res_weight, res_bias, lm_head = inputs
    logits = ref.medusa_logits(hidden, res_weight, res_bias, lm_head)
    full = torch.log_softmax(logits, dim=-1)
    ref_ids, ref_lp = ref.medusa_topk(hidden, res_weight, res_bias, lm_head, top_k)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert ids.shape == ref_ids.shape and logprobs.shape == ref_ids.shape
    assert ((ids >= 0) & (ids < full.shape[-1])).all()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "ids of a (row, head) must be distinct"
    torch.testing.assert_close(logprobs.double(), ref_lp, **tol)
    torch.testing.assert_close(torch.gather(full, -1, ids), logprobs.double(), **tol)
    assert (logprobs.diff(dim=-1) <= 0).all(), "log-probs must be in descending order"


CASES = [
    # M, K, L, V, H, top_k, shared
    (1, 1, 0, 100, 16, 1, True),
    (1, 4, 1, 1000, 40, 10, True),
    (4, 3, 2, 333, 24, 5, False),
    (7, 5, 1, 257, 19, 64, True),
    (16, 2, 0, 97, 33, 97, False),
    (32, 1, 2, 130, 8, 3, True),
    (3, 5, 2, 1001, 64, 20, False),
]


@pytest.mark.parametrize("M,K,L,V,H,top_k,shared", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matches_reference(M, K, L, V, H, top_k, shared, dtype):
    inputs = make_inputs(M, K, L, V, H, shared, dtype)
    ids, logprobs = ops.medusa_topk(*inputs, top_k)
    check_against_ref(ids, logprobs, inputs, top_k, TOL[dtype])


def integer_inputs(M, K, V, H, shared, seed=0, duplicate_every=0):
    """L = 0 inputs with small integer values: every logit is exact in fp32, so the top-k
    ids must equal the reference's exactly; duplicate_every > 0 copies lm_head rows to
    later rows (exact ties across tiles and parallel chunks)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-3, 4, (M, H), generator=g).float()
    lm_head = torch.randint(-3, 4, (*(() if shared else (K,)), V, H), generator=g).float()
    if duplicate_every:
        for v in range(duplicate_every, V, duplicate_every):
            lm_head[..., v, :] = lm_head[..., v % 7, :]
    return [hidden, torch.zeros(K, 0, H, H), torch.zeros(K, 0, H), lm_head]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("M,K,V,H,top_k,dup", [(3, 2, 500, 8, 12, 31), (5, 3, 2000, 4, 40, 97), (2, 1, 70, 3, 70, 5)])
def test_exact_ties_go_to_the_lower_id(M, K, V, H, top_k, dup, shared):
    inputs = integer_inputs(M, K, V, H, shared, duplicate_every=dup)
    ids, logprobs = ops.medusa_topk(*inputs, top_k)
    ref_ids, ref_lp = ref.medusa_topk(*inputs, top_k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=1e-5, rtol=1e-6)


def test_all_equal_logits():
    V, H = 300, 4
    inputs = [torch.ones(2, H), torch.zeros(1, 0, H, H), torch.zeros(1, 0, H), torch.ones(V, H)]
    ids, logprobs = ops.medusa_topk(*inputs, 10)
    assert torch.equal(ids, torch.arange(10).expand(2, 1, 10))
    torch.testing.assert_close(logprobs, torch.full((2, 1, 10), -torch.log(torch.tensor(float(V))).item()))


def test_result_does_not_depend_on_thread_count():
    """One thread against two (forced: torch may default to one thread, and then the test
    would compare a run with itself)."""
    inputs = make_inputs(5, 3, 1, 2000, 32, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ids1, lp1 = ops.medusa_topk(*inputs, 16)
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        ids2, lp2 = ops.medusa_topk(*inputs, 16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(lp1, lp2, atol=1e-6, rtol=0)


@settings(max_examples=15, deadline=None)
@given(
    M=st.integers(1, 32),
    K=st.integers(1, 5),
    L=st.integers(0, 2),
    V=st.integers(1, 300),
    H=st.integers(1, 40),
    shared=st.booleans(),
    data=st.data(),
)
def test_hypothesis_cpu(M, K, L, V, H, shared, data):
    top_k = data.draw(st.integers(1, min(V, 64)))
    seed = data.draw(st.integers(0, 2**31))
    inputs = make_inputs(M, K, L, V, H, shared, seed=seed)
    ids, logprobs = ops.medusa_topk(*inputs, top_k)
    check_against_ref(ids, logprobs, inputs, top_k, TOL[torch.float32])


def test_out_tensors_are_written():
    inputs = make_inputs(2, 2, 1, 50, 8, True)
    out = (torch.full((2, 2, 4), -7, dtype=torch.int64), torch.zeros(2, 2, 4))
    ids, logprobs = ops.medusa_topk(*inputs, 4, out=out)
    assert ids is out[0] and logprobs is out[1]
    ref_ids, ref_lp = ops.medusa_topk(*inputs, 4)
    assert torch.equal(ids, ref_ids) and torch.equal(logprobs, ref_lp)


def test_empty_batch():
    inputs = make_inputs(0, 2, 1, 50, 8, True)
    ids, logprobs = ops.medusa_topk(*inputs, 3)
    assert ids.shape == (0, 2, 3) and logprobs.shape == (0, 2, 3)


def test_opcheck():
    inputs = make_inputs(3, 2, 1, 70, 8, False)
    out = (torch.empty(3, 2, 5, dtype=torch.int64), torch.empty(3, 2, 5))
    torch.library.opcheck(torch.ops.specdec.medusa_topk.default, (*inputs, 5, *out))


def test_torch_compile_fullgraph():
    inputs = make_inputs(2, 2, 1, 70, 8, True)
    fn = torch.compile(lambda *a: ops.medusa_topk(*a, 5), fullgraph=True, backend="eager")
    ids, lp = fn(*inputs)
    ref_ids, ref_lp = ops.medusa_topk(*inputs, 5)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)


def test_nan_logits_raise_on_cpu():
    inputs = make_inputs(2, 2, 0, 50, 8, True)
    inputs[0][1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="row 1, head 0 are not finite"):
        ops.medusa_topk(*inputs, 3)


def _bad(**changes):
    args = dict(zip(("hidden", "res_weight", "res_bias", "lm_head"), make_inputs(2, 3, 1, 40, 8, True)))
    args["top_k"] = 4
    args.update(changes)
    return args


BAD_INPUTS = [
    (dict(hidden=torch.zeros(2, 8, 1)), "hidden must have 2 dimensions"),
    (dict(hidden=torch.zeros(2, 8, dtype=torch.int64)), "hidden must have dtype"),
    (dict(res_weight=torch.zeros(3, 1, 8)), "res_weight must have 4 dimensions"),
    (dict(res_weight=torch.zeros(3, 1, 8, 7)), r"res_weight must have shape \[3, 1, 8, 8\]"),
    (dict(res_weight=torch.zeros(0, 1, 8, 8)), "at least one head"),
    (dict(res_bias=torch.zeros(3, 2, 8)), r"res_bias must have shape \[3, 1, 8\]"),
    (dict(lm_head=torch.zeros(40, 9)), r"lm_head must have shape \[V, 8\] \(shared\) or \[3, V, 8\]"),
    (dict(lm_head=torch.zeros(2, 40, 8)), r"lm_head must have shape \[V, 8\] \(shared\) or \[3, V, 8\]"),
    (dict(lm_head=torch.zeros(8, 40).T), "lm_head must be contiguous"),
    (dict(top_k=0), r"top_k must be an int in \[1, V = 40\]"),
    (dict(top_k=41), r"top_k must be an int in \[1, V = 40\]"),
]


@pytest.mark.parametrize("changes,message", BAD_INPUTS)
def test_bad_inputs_raise_in_wrapper(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.medusa_topk(**_bad(**changes))


@pytest.mark.parametrize(
    "changes,outs,message",
    [
        (dict(top_k=41), None, r"top_k must lie in \[1, V = 40\]"),
        (dict(top_k=0), None, r"top_k must lie in \[1, V = 40\]"),
        (dict(hidden=torch.zeros(2, 8, dtype=torch.int64)), None, "hidden must be float32"),
        (dict(res_bias=torch.zeros(3, 1, 7)), None, r"res_bias must have shape \[3, 1, 8\]"),
        (dict(lm_head=torch.zeros(40, 9)), None, "lm_head must have shape"),
        ({}, (torch.empty(2, 3, 4, dtype=torch.int32), torch.empty(2, 3, 4)), "topk_ids must have dtype Long"),
        ({}, (torch.empty(2, 3, 4, dtype=torch.int64), torch.empty(2, 3, 5)), r"topk_logprobs must have shape \[2, 3, 4\]"),
    ],
)
def test_bad_inputs_raise_in_cpu_kernel(changes, outs, message):
    args = _bad(**changes)
    top_k = args["top_k"]
    if outs is None:
        outs = (torch.empty(2, 3, max(top_k, 0), dtype=torch.int64), torch.empty(2, 3, max(top_k, 0)))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.medusa_topk(
            args["hidden"], args["res_weight"], args["res_bias"], args["lm_head"], top_k, *outs
        )


# ---------------------------------------------------------------------------------------
# Triton kernels under the interpreter.
# ---------------------------------------------------------------------------------------

TRITON_CASES = [
    # M, K, L, V, H, top_k, shared
    (1, 1, 0, 50, 16, 1, True),
    (3, 2, 1, 70, 8, 5, False),
    (2, 3, 2, 45, 12, 16, True),
]


@requires_triton
@pytest.mark.parametrize("M,K,L,V,H,top_k,shared", TRITON_CASES)
def test_triton_matches_reference(M, K, L, V, H, top_k, shared):
    from specdec_kernels.triton import medusa as tm

    inputs = make_inputs(M, K, L, V, H, shared)
    ids = torch.empty(M, K, top_k, dtype=torch.int64)
    logprobs = torch.empty(M, K, top_k)
    tm.medusa_topk(*inputs, top_k, ids, logprobs)
    check_against_ref(ids, logprobs, inputs, top_k, TOL[torch.float32])


@requires_triton
@pytest.mark.parametrize("top_k", [1, 7, 70])
def test_triton_multi_tile_merge_and_large_top_k(top_k):
    """Many vocabulary tiles, merged over several steps; top_k > 64 takes the fallback."""
    from specdec_kernels.triton import medusa as tm

    inputs = make_inputs(3, 2, 1, 150, 16, False, seed=3)
    ids = torch.empty(3, 2, top_k, dtype=torch.int64)
    logprobs = torch.empty(3, 2, top_k)
    tm.medusa_topk(*inputs, top_k, ids, logprobs, block_v=16, block_t=4, block_c=16)
    check_against_ref(ids, logprobs, inputs, top_k, TOL[torch.float32])


@requires_triton
def test_triton_exact_ties():
    from specdec_kernels.triton import medusa as tm

    inputs = integer_inputs(2, 2, 90, 4, False, duplicate_every=11)
    ids = torch.empty(2, 2, 9, dtype=torch.int64)
    logprobs = torch.empty(2, 2, 9)
    tm.medusa_topk(*inputs, 9, ids, logprobs, block_v=16, block_c=16)
    ref_ids, ref_lp = ref.medusa_topk(*inputs, 9)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs.double(), ref_lp, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("K,L", [(1, 2), (2, 1)])
def test_inputs_are_not_modified(K, L):
    inputs = make_inputs(3, K, L, 60, 8, True)
    copies = [t.clone() for t in inputs]
    ops.medusa_topk(*inputs, 4)
    for t, c in zip(inputs, copies):
        assert torch.equal(t, c)


# ---------------------------------------------------------------------------------------
# Nothing is read or written outside the tensors (every tensor in guarded storage).
# ---------------------------------------------------------------------------------------

GUARD_CASES = {
    # M, K, L, V, H, top_k, shared, weight dtype. M = 5 (CPU: 3 + 2 activation rows; Triton:
    # a partial BLOCK_M tile), V = 37 (CPU: 9 groups of 4 weight rows + 1, a partial vocabulary
    # tile of 32; Triton with block_v 16: 3 tiles, the last partial), H = 19 (a partial 8-wide
    # vector / 16-wide bf16 vector; a partial BLOCK_K tile). The largest id wins (the last
    # lm_head row, at the storage's end), and top_k = V takes every id (V = 21: one partial
    # CPU tile, two Triton tiles), the largest last.
    "per-head-lm-head": (5, 3, 2, 37, 19, 5, False, torch.float32),
    "all-ids": (2, 1, 0, 21, 19, 21, True, torch.float32),
    "bf16-weights": (5, 2, 1, 37, 19, 7, False, torch.bfloat16),
    "fallback-top-k": (2, 1, 1, 67, 9, 66, True, torch.float32),  # Triton: top_k > 64 path
}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("name", list(GUARD_CASES))
def test_nothing_outside_the_tensors_is_read_or_written(backend, name):
    from tests.helpers import assert_guard_intact, guarded

    M, K, L, V, H, top_k, shared, dtype = GUARD_CASES[name]
    hidden, res_weight, res_bias, lm_head = make_inputs(M, K, L, V, H, shared, seed=5)
    # The last vocabulary row is the best for every (row, head): a scaled copy of the head's
    # input direction (ResBlocks change it little: weights / sqrt(H), bias 0.1).
    lm_head[..., -1, :] = hidden.sum(0) / hidden.sum(0).norm() * 3
    inputs = [hidden.float(), *(t.to(dtype) for t in (res_weight, res_bias, lm_head))]
    args = [guarded(t) for t in inputs]
    ids = guarded(torch.full((M, K, top_k), -7, dtype=torch.int64))
    logprobs = guarded(torch.full((M, K, top_k), float("nan")))
    if backend == "cpu":
        torch.ops.specdec.medusa_topk(*args, top_k, ids, logprobs)
    else:
        from specdec_kernels.triton import medusa as tm

        tm.medusa_topk(*args, top_k, ids, logprobs, block_v=16, block_t=2, block_c=16)
    assert_guard_intact(ids)
    assert_guard_intact(logprobs)
    check_against_ref(ids, logprobs, inputs, top_k, TOL[dtype])
    assert (ids == V - 1).any(), "the largest id is never chosen"


@requires_triton
@pytest.mark.parametrize("outs,top_k,message", [
    ((torch.empty(2, 3, 5, dtype=torch.int64), torch.empty(2, 3, 4)), 4, "topk_ids must be"),
    ((torch.empty(2, 3, 4, dtype=torch.int64), torch.empty(2, 4, 3).transpose(1, 2)), 4, "topk_logprobs must be"),
    ((torch.empty(2, 3, 41, dtype=torch.int64), torch.empty(2, 3, 41)), 41, r"top_k must be an int in \[1, V = 40\]"),
])
def test_triton_launcher_checks_shapes_it_indexes_with(outs, top_k, message):
    # Through torch.ops on a CUDA tensor the launcher is the kernel: no wrapper checks first.
    from specdec_kernels.triton import medusa as tm

    args = _bad()
    with pytest.raises(ValueError, match=message):
        tm.medusa_topk(args["hidden"], args["res_weight"], args["res_bias"], args["lm_head"], top_k, *outs)
    with pytest.raises(ValueError, match="res_bias must have shape"):
        tm.medusa_topk(args["hidden"], args["res_weight"], args["res_bias"][:, :, :7], args["lm_head"], 4,
                       torch.empty(2, 3, 4, dtype=torch.int64), torch.empty(2, 3, 4))
