"""specdec::tree_attention: every node's output equals causal attention over its root path.

Two independent oracles: python_ref (loops over the mask bits) and torch SDPA on the K/V
gathered along each node's root path (from `parents`, not from the mask). Backends: the
C++ CPU kernel (torch.ops / the ops.py wrapper) and the Triton kernels under the
interpreter (small shapes).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec_kernels
from python_ref import tree_attention as ref
from specdec_kernels import ops
from tests.helpers import requires_triton

# Output tolerance per dtype (the reference runs in float64 on the same rounded inputs; the
# kernel accumulates in fp32 and rounds its output to the dtype).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
LSE_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3}


# ---------------------------------------------------------------------------------------
# Problem construction.
# ---------------------------------------------------------------------------------------


def chain(n):
    return [-1] + list(range(n - 1))


def star(n):
    return [-1] + [0] * (n - 1)


def random_tree(n, gen):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def make_case(trees, prefixes, Hq, Hkv, D, block_size, dtype=torch.float32, *, seed=0, contiguous=False,
              spare_blocks=3, pad_rows=(0, 0)):
    """A batch of trees (lists of parents) over a paged cache with a shuffled block table.

    contiguous: one block of max_len per request (block_size is ignored). pad_rows: extra
    query rows before the first and after the last request (owned by no request).
    """
    gen = torch.Generator().manual_seed(seed)
    B = len(trees)
    ns = [len(p) for p in trees]
    lens = [p + n for p, n in zip(prefixes, ns)]
    if contiguous:
        block_size = max(max(lens), 1)
    max_blocks = max(max((length + block_size - 1) // block_size for length in lens), 1)
    num_blocks = B * max_blocks + spare_blocks
    block_table = torch.randperm(num_blocks, generator=gen)[: B * max_blocks].to(torch.int32).reshape(B, max_blocks)
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    T = sum(ns) + sum(pad_rows)
    q = torch.randn(T, Hq, D, generator=gen).to(dtype)
    offsets = [pad_rows[0]]
    for n in ns:
        offsets.append(offsets[-1] + n)
    qo_indptr = torch.tensor(offsets, dtype=torch.int32)
    words = ref.mask_words_for(max(ns, default=1))
    tree_mask = torch.cat(
        [torch.zeros(pad_rows[0], words, dtype=torch.int64), ref.batch_mask(trees, words),
         torch.zeros(pad_rows[1], words, dtype=torch.int64)]
    )
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32), qo_indptr=qo_indptr, tree_mask=tree_mask,
        trees=trees,
    )


def op_args(case, mask=True):
    return (case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["prefix_lens"],
            case["qo_indptr"], case["tree_mask"] if mask else None)


def root_path_sdpa(case, sm_scale=None):
    """float64 [T, Hq, D]: each node attends its prefix and its root path (from parents), via SDPA."""
    q, k_cache, v_cache, bt = case["q"], case["k_cache"], case["v_cache"], case["block_table"]
    T, Hq, D = q.shape
    group = Hq // k_cache.shape[2]
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for b, parents in enumerate(case["trees"]):
        begin, prefix = int(case["qo_indptr"][b]), int(case["prefix_lens"][b])
        for i in range(len(parents)):
            positions = list(range(prefix)) + [prefix + j for j in ref.ancestors(parents, i)]
            k = ref.cache_rows(k_cache, bt, b, positions).double().repeat_interleave(group, 1)  # [L, Hq, D]
            v = ref.cache_rows(v_cache, bt, b, positions).double().repeat_interleave(group, 1)
            qi = q[begin + i].double()[:, None, :]  # [Hq, 1, D]
            o = F.scaled_dot_product_attention(qi, k.transpose(0, 1), v.transpose(0, 1), scale=sm_scale)
            out[begin + i] = o[:, 0]
    return out


def assert_close(actual, expected, dtype, what=""):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------
# CPU kernel.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,D", [(1, 64), (3, 64), (4, 128), (8, 64)])
def test_matches_reference_and_root_path(group, D, dtype):
    gen = torch.Generator().manual_seed(group * D)
    trees = [random_tree(11, gen), [-1], star(9), chain(6)]
    case = make_case(trees, [13, 0, 1, 40], Hq=2 * group, Hkv=2, D=D, block_size=16, dtype=dtype, seed=group)
    out, lse = ops.tree_attention(*op_args(case), return_lse=True)
    assert out.dtype == dtype and out.shape == case["q"].shape
    ref_out, ref_lse = ref.tree_attention(*op_args(case))
    assert_close(out, ref_out, dtype, "vs python_ref")
    assert_close(out, root_path_sdpa(case), dtype, "vs SDPA on the root path")
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_TOL[dtype], rtol=0)


TREE_SIZES = st.sampled_from([1, 2, 7, 63, 64, 65, 128]) | st.integers(1, 40)


@st.composite
def trees_strategy(draw):
    batch = draw(st.integers(1, 3))
    trees = []
    for _ in range(batch):
        n = draw(TREE_SIZES)
        shape = draw(st.sampled_from(["random", "star", "chain"]))
        if shape == "star":
            trees.append(star(n))
        elif shape == "chain":
            trees.append(chain(n))
        else:
            trees.append([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
    prefixes = [draw(st.sampled_from([0, 1, 5, 16, 17, 70])) for _ in trees]
    return trees, prefixes


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=trees_strategy(),
    group=st.sampled_from([1, 3, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    D=st.sampled_from([64, 128]),
    block_size=st.sampled_from([1, 5, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_random_trees(data, group, num_kv_heads, D, block_size, dtype, seed):
    trees, prefixes = data
    case = make_case(trees, prefixes, Hq=group * num_kv_heads, Hkv=num_kv_heads, D=D, block_size=block_size,
                     dtype=dtype, seed=seed)
    out, lse = ops.tree_attention(*op_args(case), return_lse=True)
    ref_out, ref_lse = ref.tree_attention(*op_args(case))
    assert_close(out, ref_out, dtype, "vs python_ref")
    assert_close(out, root_path_sdpa(case), dtype, "vs SDPA on the root path")
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("n,prefix", [(1, 0), (1, 33), (7, 20), (70, 3)])
def test_no_mask_is_causal(n, prefix):
    case = make_case([chain(n), chain(3)], [prefix, 9], Hq=6, Hkv=2, D=64, block_size=8)
    causal = ops.tree_attention(*op_args(case, mask=False))
    masked = ops.tree_attention(*op_args(case))  # a chain's mask is causal
    torch.testing.assert_close(causal, masked, atol=0, rtol=0)
    # Dense causal attention over the contiguous sequence (prefix then nodes), per request.
    assert_close(causal, root_path_sdpa(case), torch.float32, "vs causal SDPA")


def test_contiguous_cache_and_strided_q():
    trees = [random_tree(12, torch.Generator().manual_seed(1)), chain(4)]
    case = make_case(trees, [30, 2], Hq=8, Hkv=2, D=128, block_size=0, contiguous=True)
    assert case["k_cache"].shape[1] == 42 and case["block_table"].shape[1] == 1
    # q as a view of a fused QKV projection: non-contiguous rows.
    qkv = torch.randn(case["q"].shape[0], 12, 128)
    qkv[:, :8] = case["q"]
    case_strided = dict(case, q=qkv[:, :8])
    assert not case_strided["q"].is_contiguous()
    out = ops.tree_attention(*op_args(case_strided))
    assert_close(out, root_path_sdpa(case), torch.float32, "strided q")


def test_padded_and_empty_rows_are_zero_not_nan():
    # Rows before qo_indptr[0] and after qo_indptr[B] belong to nobody; request 1 is empty.
    case = make_case([star(5), [], chain(3)], [4, 0, 0], Hq=4, Hkv=4, D=64, block_size=4, pad_rows=(2, 3))
    q = case["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    ops.tree_attention(*op_args(case), out=out, lse=lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:2] == 0).all() and (out[-3:] == 0).all()
    assert (lse[:2] == -math.inf).all() and (lse[-3:] == -math.inf).all()
    assert_close(out, root_path_sdpa(case), torch.float32, "owned rows")
    # A node that sees nothing (empty mask row, no prefix) is defined as 0 / -inf too.
    mask = case["tree_mask"].clone()
    mask[2 + 5 + 1] = 0  # node 1 of the last request (prefix 0)
    out2, lse2 = ops.tree_attention(*op_args(case)[:6], mask, return_lse=True)
    assert not out2.isnan().any() and (out2[8] == 0).all() and (lse2[8] == -math.inf).all()


def test_sm_scale_and_out_argument():
    case = make_case([random_tree(9, torch.Generator().manual_seed(3))], [10], Hq=3, Hkv=1, D=64, block_size=4)
    out = torch.empty_like(case["q"])
    returned = ops.tree_attention(*op_args(case), 0.3, out=out)
    assert returned is out
    ref_out, _ = ref.tree_attention(*op_args(case), sm_scale=0.3)
    assert_close(out, ref_out, torch.float32, "sm_scale")


@pytest.mark.parametrize("nodes", [5, 12])  # 5 * 2 rows per KV head: heads share a work item; 12 * 2: one each
def test_opcheck(nodes):
    case = make_case([star(nodes), chain(3)], [6, 0], Hq=4, Hkv=2, D=64, block_size=4)
    q = case["q"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2])
    torch.library.opcheck(torch.ops.specdec.tree_attention.default, (*op_args(case), 0.125, out, lse))
    torch.library.opcheck(torch.ops.specdec.tree_attention.default, (*op_args(case, mask=False), 0.125, out, None))


# ---------------------------------------------------------------------------------------
# Bad inputs: the wrapper raises ValueError, the C++ kernel RuntimeError, naming the argument.
# ---------------------------------------------------------------------------------------


def _base_case():
    return make_case([star(4), chain(3)], [5, 2], Hq=4, Hkv=2, D=64, block_size=4)


def _with(case, **changes):
    args = dict(zip(["q", "k_cache", "v_cache", "block_table", "prefix_lens", "qo_indptr", "tree_mask"],
                    op_args(case)))
    args.update(changes)
    return args


WRAPPER_ERRORS = [
    (lambda c: dict(q=c["q"].double()), "q must have dtype"),
    (lambda c: dict(q=c["q"][0]), "q must have 3 dimensions"),
    (lambda c: dict(k_cache=c["k_cache"].half()), "k_cache must have dtype"),
    (lambda c: dict(v_cache=c["v_cache"][:, :2]), "v_cache must have shape"),
    (lambda c: dict(k_cache=c["k_cache"][..., :32], v_cache=c["v_cache"][..., :32]),
     "q and k_cache must have the same head dimension"),
    (lambda c: dict(q=c["q"][:, :3]), "multiple of k_cache"),
    # (int64 index tensors are cast by the wrapper: tests/test_api.py)
    (lambda c: dict(block_table=c["block_table"].to(torch.int16)), "block_table must have dtype torch.int32"),
    (lambda c: dict(prefix_lens=c["prefix_lens"][:1]), "prefix_lens must have shape"),
    (lambda c: dict(qo_indptr=c["qo_indptr"][:2]), "qo_indptr must have shape"),
    (lambda c: dict(tree_mask=c["tree_mask"].int()), "tree_mask must have dtype"),
    (lambda c: dict(tree_mask=c["tree_mask"][:3]), "tree_mask must have shape"),
    (lambda c: dict(q=c["q"].transpose(0, 2).contiguous().transpose(0, 2)), "q must be contiguous in its last"),
]


@pytest.mark.parametrize("change,message", WRAPPER_ERRORS)
def test_wrapper_rejects_bad_shapes(change, message):
    case = _base_case()
    with pytest.raises(ValueError, match=message):
        ops.tree_attention(**_with(case, **change(case)))


def test_wrapper_rejects_bad_outputs():
    case = _base_case()
    with pytest.raises(ValueError, match="out must have dtype"):
        ops.tree_attention(**_with(case), out=torch.empty_like(case["q"], dtype=torch.float16))
    with pytest.raises(ValueError, match="lse must have shape"):
        ops.tree_attention(**_with(case), lse=torch.empty(3, 3))


KERNEL_ERRORS = [
    (lambda c: dict(block_table=c["block_table"].index_fill(1, torch.tensor([0]), 99)), "out of range"),
    (lambda c: dict(block_table=c["block_table"].index_fill(1, torch.tensor([0]), -1)), "out of range"),
    (lambda c: dict(qo_indptr=torch.tensor([0, 5, 4], dtype=torch.int32)), "non-decreasing"),
    (lambda c: dict(qo_indptr=torch.tensor([0, 4, 9], dtype=torch.int32)), "q must have a row for every node"),
    (lambda c: dict(qo_indptr=torch.tensor([-1, 4, 7], dtype=torch.int32)), r"qo_indptr\[0\] must be >= 0"),
    (lambda c: dict(prefix_lens=torch.tensor([5, -2], dtype=torch.int32)), r"prefix_lens\[1\] must be >= 0"),
    (lambda c: dict(prefix_lens=torch.tensor([5, 1000], dtype=torch.int32)), "cache positions"),
    (lambda c: dict(q=c["q"].double(), k_cache=c["k_cache"].double(), v_cache=c["v_cache"].double()),
     "q must have dtype float32, bfloat16 or float16"),
    (lambda c: dict(v_cache=c["v_cache"].half()), "v_cache"),
    (lambda c: dict(q=c["q"][:, :3]), "must be a multiple of k_cache"),
    (lambda c: dict(tree_mask=c["tree_mask"][:, :0]), "tree_mask must have shape"),
]


@pytest.mark.parametrize("change,message", KERNEL_ERRORS)
def test_cpu_kernel_rejects_bad_inputs(change, message):
    case = _base_case()
    args = _with(case, **change(case))
    out = torch.empty_like(args["q"])
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.tree_attention(*args.values(), 0.125, out, None)


def test_cpu_kernel_rejects_too_few_mask_words():
    case = make_case([star(65)], [0], Hq=2, Hkv=1, D=64, block_size=16)
    out = torch.empty_like(case["q"])
    with pytest.raises(RuntimeError, match="words per row"):
        torch.ops.specdec.tree_attention(*op_args(case)[:6], case["tree_mask"][:, :1].contiguous(), 0.1, out, None)


@pytest.mark.parametrize("D", [80, 256])
def test_other_head_dims(D):
    case = make_case([random_tree(10, torch.Generator().manual_seed(D)), [-1]], [9, 3], Hq=4, Hkv=1, D=D,
                     block_size=8, dtype=torch.bfloat16)
    out = ops.tree_attention(*op_args(case))
    assert_close(out, root_path_sdpa(case), torch.bfloat16, f"D={D}")


# ---------------------------------------------------------------------------------------
# Triton kernels under the interpreter (small shapes: every program runs in numpy).
# ---------------------------------------------------------------------------------------


def run_triton(case, mask=True, sm_scale=None, **kwargs):
    from specdec_kernels.triton.tree_attention import tree_attention as launcher

    q = case["q"]
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    launcher(*op_args(case, mask), sm_scale, out, lse, **kwargs)
    return out, lse


@requires_triton
@pytest.mark.parametrize(
    "dtype,num_splits", [(torch.float32, None), (torch.float32, 3), (torch.bfloat16, 2), (torch.float16, None)]
)
def test_triton_matches_reference(dtype, num_splits):
    trees = [random_tree(11, torch.Generator().manual_seed(5)), [-1], star(5), []]
    case = make_case(trees, [13, 0, 40, 2], Hq=6, Hkv=2, D=64, block_size=16, dtype=dtype, pad_rows=(1, 2))
    out, lse = run_triton(case, num_splits=num_splits)
    ref_out, ref_lse = ref.tree_attention(*op_args(case))
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, ref_out, dtype, "triton vs python_ref")
    assert_close(out, root_path_sdpa(case), dtype, "triton vs root-path SDPA")
    owned = ref_lse.isfinite()
    assert (lse[~owned] == -math.inf).all() and (out[:1] == 0).all() and (out[-2:] == 0).all()
    torch.testing.assert_close(lse[owned].double(), ref_lse[owned], atol=LSE_TOL[dtype], rtol=0)


@requires_triton
@pytest.mark.parametrize("tile_programs,block_m", [(1, 16), (2, 16), (5, 16), (None, 32)])
def test_triton_tile_loop(tile_programs, block_m):
    # Request 0 has 21 nodes x GROUP 2 = 42 rows, 3 tiles of 16: with 1 or 2 programs per
    # (request, KV head) a program loops over several tiles, with 5 some have none. The block
    # table has spare -1 slots, so the prefixes (cut into splits per request) are far shorter
    # than the table's capacity.
    gen = torch.Generator().manual_seed(17)
    case = make_case([random_tree(21, gen), [], chain(3)], [37, 5, 0], Hq=4, Hkv=2, D=32, block_size=8,
                     pad_rows=(1, 1))
    case["block_table"] = torch.cat([case["block_table"], torch.full((3, 6), -1, dtype=torch.int32)], 1)
    out, lse = run_triton(case, num_splits=3, block_n=16, block_m=block_m, tile_programs=tile_programs)
    ref_out, ref_lse = ref.tree_attention(*op_args(case))
    assert_close(out, ref_out, torch.float32, "triton tile loop vs python_ref")
    owned = ref_lse.isfinite()
    assert (lse[~owned] == -math.inf).all() and (out[~owned] == 0).all()
    torch.testing.assert_close(lse[owned].double(), ref_lse[owned], atol=LSE_TOL[torch.float32], rtol=0)


@requires_triton
def test_triton_multiword_mask_and_gqa():
    gen = torch.Generator().manual_seed(7)
    case = make_case([random_tree(65, gen), chain(3)], [5, 0], Hq=4, Hkv=1, D=32, block_size=8)
    out, lse = run_triton(case, num_splits=2, block_n=16)
    assert_close(out, root_path_sdpa(case), torch.float32, "65 nodes")
    cpu_out, cpu_lse = ops.tree_attention(*op_args(case), return_lse=True)
    torch.testing.assert_close(out, cpu_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, cpu_lse, atol=LSE_TOL[torch.float32], rtol=0)


@requires_triton
def test_triton_no_mask_is_causal():
    case = make_case([chain(5), chain(1)], [7, 18], Hq=3, Hkv=3, D=64, block_size=4, dtype=torch.float16)
    out, _ = run_triton(case, mask=False)
    assert_close(out, root_path_sdpa(case), torch.float16, "causal")


@requires_triton
def test_triton_out_of_range_blocks_are_skipped_not_read():
    # Request 0: prefix 8 in blocks of 4; its first block id is out of range, so positions
    # 0..3 are skipped. Request 1 is untouched. (The CPU kernel raises on the same input:
    # test_cpu_kernel_rejects_bad_inputs.)
    case = make_case([star(3), chain(2)], [8, 3], Hq=2, Hkv=1, D=64, block_size=4, spare_blocks=0)
    expected_other = root_path_sdpa(case)[3:]
    for bad in (10**6, -5):
        bad_case = dict(case, block_table=case["block_table"].clone())
        bad_case["block_table"][0, 0] = bad
        out, lse = run_triton(bad_case)
        assert out.isfinite().all() and lse.isfinite().all()
        assert_close(out[3:], expected_other, torch.float32, "other request")
        # Request 0 attends positions 4..7 of its prefix and its root path, explicitly gathered.
        for node in range(3):
            path = list(range(4, 8)) + [8 + j for j in ref.ancestors(star(3), node)]
            k = ref.cache_rows(case["k_cache"], case["block_table"], 0, path).double()[:, 0]
            v = ref.cache_rows(case["v_cache"], case["block_table"], 0, path).double()[:, 0]
            expected = torch.softmax(k @ case["q"][node].double().T * 64**-0.5, 0).T @ v
            torch.testing.assert_close(out[node].double(), expected, **TOL[torch.float32])
    # A table slot beyond max_blocks (prefix_lens too large): the missing positions are skipped.
    big = dict(case, prefix_lens=torch.tensor([8, 100], dtype=torch.int32))
    out, lse = run_triton(big)
    assert out.isfinite().all() and lse.isfinite().all()


@requires_triton
def test_triton_kernel_is_registered_for_cuda():
    # Imported explicitly: specdec_kernels/__init__.py's `from . import triton` currently
    # returns the top-level triton package bound by its `import triton` (reported).
    import specdec_kernels.triton.tree_attention  # noqa: F401

    assert torch._C._dispatch_has_kernel_for_dispatch_key("specdec::tree_attention", "CUDA")


@pytest.mark.parametrize(
    "dtype,nodes,Hkv", [(torch.float32, 20, 1), (torch.bfloat16, 20, 1), (torch.float32, 1, 2), (torch.float16, 3, 2)]
)
def test_long_prefix(dtype, nodes, Hkv):
    # Few work items and a long prefix (the Triton kernel splits the key range; the CPU
    # kernel never does, see test_rows_are_batch_invariant). With 1 or 3 nodes (decoding)
    # one CPU work item covers all KV heads of a request.
    gen = torch.Generator().manual_seed(11)
    trees = [random_tree(nodes, gen), chain(2)]
    case = make_case(trees, [1300, 1037], Hq=4 * Hkv, Hkv=Hkv, D=64, block_size=16, dtype=dtype)
    out, lse = ops.tree_attention(*op_args(case), return_lse=True)
    ref_out, ref_lse = ref.tree_attention(*op_args(case))
    assert_close(out, ref_out, dtype, "long prefix vs python_ref")
    assert_close(out, root_path_sdpa(case), dtype, "long prefix vs root-path SDPA")
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefix", [0, 5, 30, 64, 95])
def test_rows_are_batch_invariant(prefix, threads):
    """CPU: a tree node's output is bit-identical to the same query decoded alone (one row, no
    mask) after its root path compacted to the positions after the prefix — what the decode
    loop computes for that token once the path is accepted — and to the same tree verified
    with another request in the batch. Prefixes put the tree before, across and after tile
    boundaries (kTile = 32); with 2 threads the work is split differently."""
    gen = torch.Generator().manual_seed(prefix)
    parents = random_tree(40, gen)
    Hq, Hkv, D = 9, 3, 64
    case = make_case([parents, chain(3)], [prefix, 7], Hq=Hq, Hkv=Hkv, D=D, block_size=16, seed=prefix)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tree_out = ops.tree_attention(*op_args(case))
        n = len(parents)
        alone = dict(case, q=case["q"][:n].clone(), block_table=case["block_table"][:1].clone(),
                     prefix_lens=case["prefix_lens"][:1].clone(), qo_indptr=case["qo_indptr"][:2].clone(),
                     tree_mask=case["tree_mask"][:n].clone())
        alone_out = ops.tree_attention(*op_args(alone))
        assert torch.equal(alone_out, tree_out[:len(parents)])
        bt = case["block_table"]
        for i in range(len(parents)):
            path = ref.ancestors(parents, i)  # root .. i, in order
            positions = list(range(prefix)) + [prefix + j for j in path]
            k = ref.cache_rows(case["k_cache"], bt, 0, positions)  # [L, Hkv, D]
            v = ref.cache_rows(case["v_cache"], bt, 0, positions)
            L = len(positions)
            single = dict(q=case["q"][i:i + 1].clone(), k_cache=k[None].contiguous(), v_cache=v[None].contiguous(),
                          block_table=torch.zeros(1, 1, dtype=torch.int32),
                          prefix_lens=torch.tensor([L - 1], dtype=torch.int32),
                          qo_indptr=torch.tensor([0, 1], dtype=torch.int32), tree_mask=None)
            out = ops.tree_attention(*op_args(single, mask=False))
            assert torch.equal(out[0], tree_out[i]), i
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------------------
# Nothing is read or written outside the tensors: every tensor argument in guarded
# (poisoned) storage, boundaries placed next to the guards.
# ---------------------------------------------------------------------------------------


def boundary_case(trees, prefixes, Hq, Hkv, D, block_size, *, spare_slots=2, pad_rows=(0, 0), seed=0):
    """Like make_case, but with the boundaries next to the storage ends: no spare blocks, the
    first request's first block is block 0 and the last request's last block the largest id;
    the last request's keys end on the last row of that block when prefix + n is a multiple of
    block_size; block-table slots past a request's keys are -1 (spare_slots columns at least
    on the longest request; 0 puts the last request's keys against the table's end)."""
    gen = torch.Generator().manual_seed(seed)
    ns = [len(p) for p in trees]
    used = [-(-(p + n) // block_size) for p, n in zip(prefixes, ns)]
    max_blocks = max(used) + spare_slots
    num_blocks = sum(used)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    ids.remove(0)
    ids.remove(num_blocks - 1)
    ids = [0] + ids + [num_blocks - 1]
    block_table = torch.full((len(trees), max_blocks), -1, dtype=torch.int32)
    start = 0
    for b, count in enumerate(used):
        block_table[b, :count] = torch.tensor(ids[start:start + count], dtype=torch.int32)
        start += count
    T = sum(ns) + sum(pad_rows)
    offsets = [pad_rows[0]]
    for n in ns:
        offsets.append(offsets[-1] + n)
    words = ref.mask_words_for(max(ns))
    tree_mask = torch.cat([torch.zeros(pad_rows[0], words, dtype=torch.int64), ref.batch_mask(trees, words),
                           torch.zeros(pad_rows[1], words, dtype=torch.int64)])
    return dict(
        q=torch.randn(T, Hq, D, generator=gen), k_cache=torch.randn(num_blocks, block_size, Hkv, D, generator=gen),
        v_cache=torch.randn(num_blocks, block_size, Hkv, D, generator=gen), block_table=block_table,
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32), qo_indptr=torch.tensor(offsets, dtype=torch.int32),
        tree_mask=tree_mask, trees=trees,
    )


def skipping_reference(case, mask=True):
    """python_ref's rule extended to the Triton kernel's documented handling of faulty data:
    keys whose table slot lies past max_blocks or whose block id lies outside [0, num_blocks)
    are invisible, rows outside [0, T) are not computed (float64 out [T, Hq, D], lse [T, Hq])."""
    q, k_cache, v_cache, bt = case["q"], case["k_cache"], case["v_cache"], case["block_table"]
    T, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    group, max_blocks = Hq // Hkv, bt.shape[1]
    tree_mask = case["tree_mask"] if mask else None
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((T, Hq), -math.inf, dtype=torch.float64)

    def key_ok(b, pos):
        return pos // block_size < max_blocks and 0 <= int(bt[b, pos // block_size]) < num_blocks

    for b in range(bt.shape[0]):
        begin, n, prefix = int(case["qo_indptr"][b]), int(case["qo_indptr"][b + 1] - case["qo_indptr"][b]), \
            max(int(case["prefix_lens"][b]), 0)
        capacity = max_blocks * block_size
        for i in range(n):
            t = begin + i
            if not 0 <= t < T:
                continue
            nodes = ref.visible_nodes(None if tree_mask is None else tree_mask[t], i, n)
            positions = [p for p in range(min(prefix, capacity)) if key_ok(b, p)]
            positions += [prefix + j for j in nodes if prefix + j < capacity and key_ok(b, prefix + j)]
            if not positions:
                continue
            keys = ref.cache_rows(k_cache, bt, b, positions).double().repeat_interleave(group, 1)
            values = ref.cache_rows(v_cache, bt, b, positions).double().repeat_interleave(group, 1)
            scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * D**-0.5
            lse[t] = torch.logsumexp(scores, 1)
            out[t] = torch.einsum("hl,lhd->hd", torch.softmax(scores, 1), values)
    return out, lse


def _tree_guard_cases():
    gen = torch.Generator().manual_seed(21)
    # GQA group 3, head_dim 40 (neither a multiple of BLOCK_D = 64 nor of the CPU's 8-wide
    # vectors), block_size 5; node counts and T * group not multiples of BLOCK_M / BLOCK_N.
    # The last request's 13 + 7 keys end on the last row of the largest block id.
    basic = boundary_case([random_tree(6, gen), [-1], random_tree(7, gen)], [3, 0, 13], Hq=3, Hkv=1, D=40,
                          block_size=5)
    # 65 nodes (two mask words; the last row's second word is the mask's last element) and a
    # table without -1 slots: the last request's keys end at the table's end.
    wide = boundary_case([chain(2), random_tree(65, gen)], [1, 5], Hq=2, Hkv=1, D=16, block_size=7, spare_slots=0)
    # Rows owned by nobody before and after the requests (the first and last rows of q); no
    # mask (causal).
    padded = boundary_case([star(4), chain(3)], [2, 7], Hq=4, Hkv=4, D=24, block_size=3, pad_rows=(2, 3))
    # A prefix long enough for the CPU kernel to split the key range over work items (partials
    # merged per row); the keys end on the last row of the largest block id.
    long_prefix = boundary_case([random_tree(5, gen)], [1099], Hq=2, Hkv=1, D=16, block_size=16, spare_slots=0)
    # Faulty data (the CPU kernel raises; Triton skips): block ids -1 and num_blocks (one past
    # the last block) inside the last request's prefix; both requests' keys running past the
    # table (slot max_blocks: request 1's first slot for request 0, one past block_table's end
    # for request 1); a prefix near INT32_MAX (position arithmetic must not wrap); qo_indptr
    # beyond T and before 0 (rows past either end of q).
    bad_blocks = boundary_case([chain(3), random_tree(5, gen)], [4, 11], Hq=4, Hkv=2, D=16, block_size=4)
    bad_blocks["block_table"][1, 0] = -1
    bad_blocks["block_table"][1, 2] = bad_blocks["k_cache"].shape[0]
    past_table = boundary_case([star(3), random_tree(6, gen)], [2, 9], Hq=2, Hkv=1, D=16, block_size=4,
                               spare_slots=0)
    past_table["prefix_lens"] = torch.tensor([14, 12], dtype=torch.int32)  # capacity 16; n = 3 and 6
    huge_prefix = boundary_case([star(3), random_tree(6, gen)], [2, 9], Hq=2, Hkv=1, D=16, block_size=4,
                                spare_slots=0)
    huge_prefix["prefix_lens"][1] = 2**31 - 3
    rows_outside = boundary_case([chain(4), chain(5)], [3, 6], Hq=2, Hkv=1, D=16, block_size=4)
    rows_outside["qo_indptr"] = torch.tensor([-2, 4, 11], dtype=torch.int32)  # T = 9
    return {
        "basic": (basic, True, None), "wide": (wide, True, None), "padded": (padded, False, None),
        "long_prefix": (long_prefix, True, None),
        "bad_blocks": (bad_blocks, True, "out of range"),
        "past_table": (past_table, True, "cache positions"), "huge_prefix": (huge_prefix, True, "cache positions"),
        "rows_outside": (rows_outside, False, "qo_indptr"),
    }


TREE_GUARD_CASES = _tree_guard_cases()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("name", list(TREE_GUARD_CASES))
def test_nothing_outside_the_tensors_is_read_or_written(backend, name):
    from tests.helpers import assert_guard_intact, guarded

    case, mask, cpu_error = TREE_GUARD_CASES[name]
    q = case["q"]
    args = [guarded(a) if isinstance(a, torch.Tensor) else a for a in op_args(case, mask)]
    out = guarded(torch.full_like(q, float("nan")))
    lse = guarded(torch.full(q.shape[:2], float("nan")))
    if backend == "cpu":
        if cpu_error is not None:  # checked before anything is written
            with pytest.raises(RuntimeError, match=cpu_error):
                torch.ops.specdec.tree_attention(*args, q.shape[-1] ** -0.5, out, lse)
            assert out.isnan().all() and lse.isnan().all()
        else:
            torch.ops.specdec.tree_attention(*args, q.shape[-1] ** -0.5, out, lse)
    else:
        from specdec_kernels.triton.tree_attention import tree_attention as launcher

        launcher(*args, q.shape[-1] ** -0.5, out, lse, num_splits=2,
                 block_n={"wide": 32, "long_prefix": 64}.get(name, 16))
    assert_guard_intact(out)
    assert_guard_intact(lse)
    if backend == "cpu" and cpu_error is not None:
        return
    expected_out, expected_lse = (ref.tree_attention(*op_args(case, mask)) if cpu_error is None
                                  else skipping_reference(case, mask))
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, expected_out, torch.float32, name)
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)
    torch.testing.assert_close(lse[seen].double(), expected_lse[seen], atol=LSE_TOL[torch.float32], rtol=0)


@requires_triton
@pytest.mark.parametrize("change,message", [
    (dict(lse=torch.empty(4, 7).t()), "lse must be contiguous"),
    (dict(out=torch.empty(7, 4, 64)[:, :, :32]), "out must have shape"),
    (dict(tree_mask=torch.zeros(7, 2, dtype=torch.int64)[:, :1]), "tree_mask must be contiguous"),
    (dict(q=torch.randn(7, 4, 128)[:, :, ::2]), "q must be contiguous in its last dimension"),
])
def test_triton_launcher_checks_layouts_it_indexes_with(change, message):
    # Through torch.ops on a CUDA tensor the launcher is the kernel: no wrapper checks first.
    from specdec_kernels.triton.tree_attention import tree_attention as launcher

    case = _base_case()
    args = dict(_with(case), out=torch.empty_like(case["q"]), lse=torch.empty(7, 4))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        launcher(*[args[k] for k in ("q", "k_cache", "v_cache", "block_table", "prefix_lens", "qo_indptr",
                                     "tree_mask")], 0.125, args["out"], args["lse"])
