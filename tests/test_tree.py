"""Tree builders (specdec_kernels.tree) against the loop references in python_ref.tree."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from python_ref import tree as ref
from specdec_kernels import tree as T

# ---------------------------------------------------------------------------------------
# Random trees.
# ---------------------------------------------------------------------------------------

SIZES = [1, 2, 3, 7, 63, 64, 65, 128]


@st.composite
def one_tree(draw, n):
    """parents (list, length n) of a tree of exactly n nodes, of some shape."""
    shape = draw(st.sampled_from(["random", "star", "chain", "bushy", "deep"]))
    parents = [-1]
    for i in range(1, n):
        if shape == "star":
            p = 0
        elif shape == "chain":
            p = i - 1
        elif shape == "bushy":
            p = draw(st.integers(0, min(i - 1, 3)))
        elif shape == "deep":
            p = draw(st.integers(max(0, i - 2), i - 1))
        else:
            p = draw(st.integers(0, i - 1))
        parents.append(p)
    return parents


@st.composite
def tree_batch(draw):
    """(parents int32 [B, N], num_nodes int32 [B], python lists) with ragged num_nodes."""
    n = draw(st.sampled_from(SIZES))
    batch = draw(st.integers(1, 3))
    rows, counts = [], []
    for _ in range(batch):
        count = draw(st.sampled_from([n, n, max(1, n - 1), max(1, n // 2), 1]))
        rows.append(draw(one_tree(count)) + [-1] * (n - count))
        counts.append(count)
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32), rows, counts


def check_against_ref(parents, num_nodes, rows, counts, prefix_lens=None):
    n = parents.shape[1]
    tree = T.build_tree(parents, num_nodes, prefix_lens)
    assert tree.tree_mask.shape == (len(rows), n, math.ceil(n / 64))
    assert tree.paths.shape == (len(rows), n, n)
    for b, (p, count) in enumerate(zip(rows, counts)):
        assert tree.depth[b].tolist() == ref.depth(p, count)
        if prefix_lens is not None:
            assert tree.positions[b].tolist() == ref.positions(p, count, int(prefix_lens[b]))
        assert tree.tree_mask[b].tolist() == ref.mask_words(p, count)
        fc, ns, nc = ref.first_child_next_sibling(p, count)
        assert tree.first_child[b].tolist() == fc
        assert tree.next_sibling[b].tolist() == ns
        assert tree.num_children[b].tolist() == nc
        ref_paths = ref.paths(p, count)
        assert int(tree.num_leaves[b]) == len(ref_paths)
        assert tree.is_leaf[b].nonzero().flatten().tolist() == ref.leaves(p, count)
        got = tree.paths[b].tolist()
        for r, path in enumerate(ref_paths):
            assert got[r] == path + [-1] * (n - len(path))
        assert all(v == -1 for row in got[len(ref_paths):] for v in row)
    return tree


# ---------------------------------------------------------------------------------------
# Builders against the reference.
# ---------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(tree_batch(), st.integers(0, 5000))
def test_build_tree_matches_reference(batch, prefix):
    parents, num_nodes, rows, counts = batch
    prefix_lens = torch.arange(len(rows), dtype=torch.int32) * 7 + prefix
    check_against_ref(parents, num_nodes, rows, counts, prefix_lens)


@pytest.mark.parametrize("n", SIZES + [200])
@pytest.mark.parametrize("shape", ["star", "chain"])
def test_stars_and_chains(n, shape):
    p = [-1] + ([0] * (n - 1) if shape == "star" else list(range(n - 1)))
    tree = check_against_ref(torch.tensor([p], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), [p], [n])
    if shape == "chain":
        assert tree.depth[0].tolist() == list(range(n))
        assert int(tree.num_leaves[0]) == 1
        # A chain's mask is lower-triangular (causal) in the unpacked form.
        dense = T.unpack_tree_mask(tree.tree_mask[0], n)
        assert torch.equal(dense, torch.tril(torch.ones(n, n, dtype=torch.bool)))
    else:
        assert int(tree.num_leaves[0]) == max(1, n - 1)
        assert tree.num_children[0, 0] == n - 1


def test_single_node_tree():
    tree = T.build_tree(torch.tensor([[-1]], dtype=torch.int32), prefix_lens=torch.tensor([9]))
    assert tree.depth.tolist() == [[0]]
    assert tree.positions.tolist() == [[9]] and tree.positions.dtype == torch.int64
    assert tree.tree_mask.tolist() == [[[1]]]
    assert tree.paths.tolist() == [[[0]]]
    assert tree.num_leaves.tolist() == [1]
    assert tree.first_child.tolist() == [[-1]] and tree.next_sibling.tolist() == [[-1]]


def test_multiword_mask_bit_positions():
    """Bit j of word j // 64, little-endian; bit 63 is the sign bit; a node past 64 uses word 1."""
    n = 130
    p = list(range(-1, n - 1))  # chain
    mask = T.tree_mask(torch.tensor([p], dtype=torch.int32))
    assert mask.shape == (1, n, 3)
    assert mask[0, 0].tolist() == [1, 0, 0]
    assert mask[0, 63].tolist() == [-1, 0, 0]  # all 64 bits of word 0, incl. the sign bit
    assert mask[0, 64].tolist() == [-1, 1, 0]
    assert mask[0, 129].tolist() == [-1, -1, 3]
    # A star of 130: node 100 sees the root and itself only.
    star = T.tree_mask(torch.tensor([[-1] + [0] * (n - 1)], dtype=torch.int32))
    assert star[0, 100].tolist() == [1, 1 << (100 - 64), 0]
    assert star[0, 63].tolist() == [1 | -(1 << 63), 0, 0]


def test_padding_rows():
    parents = torch.tensor([[-1, 0, 1, -1, -1]], dtype=torch.int32)
    tree = T.build_tree(parents, torch.tensor([3], dtype=torch.int32), torch.tensor([10]))
    assert tree.depth.tolist() == [[0, 1, 2, -1, -1]]
    assert tree.positions.tolist() == [[10, 11, 12, 10, 10]]
    assert tree.tree_mask[0, :, 0].tolist() == [1, 3, 7, 8, 16]  # padding: own bit only
    assert tree.is_leaf.tolist() == [[False, False, True, False, False]]
    assert tree.num_children.tolist() == [[1, 1, 0, 0, 0]]


def test_standalone_functions_agree_with_build_tree():
    p = [-1, 0, 0, 1, 1, 2, 5, 5]
    parents = torch.tensor([p, p[:5] + [-1] * 3], dtype=torch.int32)
    num_nodes = torch.tensor([8, 5], dtype=torch.int32)
    tree = T.build_tree(parents, num_nodes, max_depth=3, max_leaves=5)
    assert torch.equal(T.tree_depth(parents, num_nodes), tree.depth)
    assert torch.equal(T.tree_mask(parents, num_nodes), tree.tree_mask)
    fc, ns, nc = T.tree_children(parents, num_nodes)
    assert torch.equal(fc, tree.first_child) and torch.equal(ns, tree.next_sibling) and torch.equal(nc, tree.num_children)
    paths, num_leaves = T.tree_paths(parents, num_nodes, max_depth=3, max_leaves=5)
    assert torch.equal(paths, tree.paths) and torch.equal(num_leaves, tree.num_leaves)
    assert paths.shape == (2, 5, 4)
    assert paths[0].tolist() == [[0, 1, 3, -1], [0, 1, 4, -1], [0, 2, 5, 6], [0, 2, 5, 7], [-1] * 4]
    assert num_leaves.tolist() == [4, 3]


def test_paths_bounds_truncate_as_documented():
    chain = T.chain_parents(1, 6)
    paths, _ = T.tree_paths(chain, max_depth=2)
    assert paths[0, 0].tolist() == [0, 1, 2]  # cut after column max_depth
    star = torch.tensor([[-1, 0, 0, 0, 0]], dtype=torch.int32)
    paths, num_leaves = T.tree_paths(star, max_leaves=2)
    assert paths[0].tolist() == [[0, 1, -1, -1, -1], [0, 2, -1, -1, -1]] and num_leaves.tolist() == [4]


def test_invalid_parents_stay_in_bounds():
    """Builders never index out of bounds; bad entries make the node a root (a forest)."""
    parents = torch.tensor([[5, 0, 7, 2, -9, 3]], dtype=torch.int32)
    tree = T.build_tree(parents)
    assert tree.depth.tolist() == [[0, 1, 0, 1, 0, 2]]
    assert tree.tree_mask[0, :, 0].tolist() == [1, 3, 4, 12, 16, 44]


# ---------------------------------------------------------------------------------------
# Ragged layout.
# ---------------------------------------------------------------------------------------


def test_ragged_mask_and_positions():
    rows = [[-1, 0, 0, 1], [-1, 0, -1, -1], [-1, -1, -1, -1]]
    counts = [4, 2, 1]
    parents = torch.tensor(rows, dtype=torch.int32)
    num_nodes = torch.tensor(counts, dtype=torch.int32)
    tree = T.build_tree(parents, num_nodes, torch.tensor([3, 0, 11]))
    qo_indptr = tree.qo_indptr()
    assert qo_indptr.tolist() == [0, 4, 6, 7] and qo_indptr.dtype == torch.int32
    mask = tree.ragged_tree_mask(qo_indptr, 9)  # two padding rows at the end
    expected = []
    for p, c in zip(rows, counts):
        expected += ref.mask_words(p, c)[:c]
    assert mask.tolist() == expected + [[0], [0]]
    assert tree.ragged_positions(qo_indptr, 7).tolist() == [3, 4, 4, 5, 0, 1, 11]
    # Requests may own more rows than their tree (padding slots) or none.
    mask2 = T.tree_mask_ragged(tree.tree_mask, torch.tensor([0, 0, 4, 5]), 5)
    assert mask2[:, 0].tolist() == [1, 3, 4, 8, 1]


def test_ragged_rows_multiword():
    n = 70
    chain = T.chain_parents(2, n)
    mask = T.tree_mask(chain, torch.tensor([n, 66], dtype=torch.int32))
    ragged = T.tree_mask_ragged(mask, torch.tensor([0, n, n + 66]), n + 66)
    assert ragged.shape == (n + 66, 2)
    assert torch.equal(ragged[:n], mask[0]) and torch.equal(ragged[n:], mask[1, :66])


# ---------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,counts,message",
    [
        ([[0, 0, 1]], None, r"missing root: parents\[0, 0\] = 0"),
        ([[3, 0, 1]], None, r"missing root"),
        ([[-1, 0, -1]], None, r"missing parent: parents\[0, 2\] = -1"),
        ([[-1, 0, 3, 0]], None, r"child before its parent: parents\[0, 2\] = 3"),
        ([[-1, 2, 1]], None, r"cycle: following parents from node 1"),
        ([[-1, 1, 0]], None, r"cycle: following parents from node 1 .*parents\[0, 1\] = 1"),
        ([[-1, 0, 7]], None, r"parent out of range: parents\[0, 2\] = 7"),
        ([[-1, 0, -3]], None, r"parent out of range: parents\[0, 2\] = -3"),
        ([[-1, 0, 2], [-1, 0, 1]], [2, 3], r"padding not -1: parents\[0, 2\] = 2"),
        ([[-1, 0, 0]], [0], r"num_nodes\[0\] = 0 must be in \[1, 3\]"),
        ([[-1, 0, 0]], [4], r"num_nodes\[0\] = 4 must be in \[1, 3\]"),
        ([[-1, 0, 0], [-1, 0, 5]], [3, 3], r"parent out of range: parents\[1, 2\] = 5"),
    ],
)
def test_validate_parents_errors(rows, counts, message):
    parents = torch.tensor(rows, dtype=torch.int32)
    num_nodes = None if counts is None else torch.tensor(counts, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        T.validate_parents(parents, num_nodes)


def test_validate_parents_accepts_valid_and_checks_depth():
    T.validate_parents(torch.tensor([[-1, 0, 1, 1], [-1, 0, -1, -1]], dtype=torch.int32),
                       torch.tensor([4, 2], dtype=torch.int32), max_depth=2)
    T.validate_parents(T.medusa_tree().batch_parents(2))
    with pytest.raises(ValueError, match=r"tree too deep: request 0 has depth 3 > max_depth = 2"):
        T.validate_parents(T.chain_parents(1, 4), max_depth=2)


@settings(max_examples=20, deadline=None)
@given(tree_batch())
def test_validate_parents_accepts_random_trees(batch):
    parents, num_nodes, _, _ = batch
    T.validate_parents(parents, num_nodes)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: T.build_tree(torch.tensor([[-1, 0]])), r"parents must have dtype torch.int32, got torch.int64"),
        (lambda: T.build_tree(torch.tensor([-1, 0], dtype=torch.int32)), r"parents must have shape \[B, N\]"),
        (lambda: T.build_tree([[-1, 0]]), r"parents must be a torch.Tensor"),
        (lambda: T.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32), torch.tensor([2])),
         r"num_nodes must have dtype torch.int32"),
        (lambda: T.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)),
         r"num_nodes must have shape \[1\]"),
        (lambda: T.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32), prefix_lens=torch.tensor([1.0])),
         r"prefix_lens must be an int32 or int64 tensor"),
        (lambda: T.tree_paths(torch.tensor([[-1, 0]], dtype=torch.int32), max_depth=-1), r"max_depth must be >= 0"),
        (lambda: T.ragged_rows(torch.zeros(2, 3), torch.tensor([0, 3]), 3), r"qo_indptr must have shape \[3\]"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------
# No host synchronisation: meta device and torch.compile(fullgraph=True).
# ---------------------------------------------------------------------------------------


def test_builders_run_on_meta_device():
    """Meta tensors have no values: any .item()/.tolist()/data-dependent shape would raise."""
    n, batch = 65, 3
    parents = torch.empty(batch, n, dtype=torch.int32, device="meta")
    num_nodes = torch.empty(batch, dtype=torch.int32, device="meta")
    tree = T.build_tree(parents, num_nodes, torch.empty(batch, dtype=torch.int64, device="meta"), max_depth=9)
    assert tree.tree_mask.shape == (batch, n, 2) and tree.tree_mask.device.type == "meta"
    assert tree.paths.shape == (batch, n, 10)
    assert tree.positions.shape == (batch, n) and tree.positions.dtype == torch.int64
    assert tree.ragged_tree_mask(tree.qo_indptr(), batch * n).shape == (batch * n, 2)
    medusa = T.medusa_tree(device="meta")
    tokens = medusa.token_ids(torch.empty(batch, dtype=torch.int64, device="meta"),
                              torch.empty(batch, 5, 10, dtype=torch.int64, device="meta"))
    assert tokens.shape == (batch, 64)
    eagle = T.eagle_tree_from_expansions(
        [torch.empty(batch, 4, device="meta"), torch.empty(batch, 16, device="meta")],
        [None, torch.empty(batch, 4, dtype=torch.int64, device="meta")], 10,
        [torch.empty(batch, 4, dtype=torch.int64, device="meta"), torch.empty(batch, 16, dtype=torch.int64, device="meta")])
    assert eagle.parents.shape == (batch, 11) and eagle.token_ids.shape == (batch, 11)


# ATen ops that read tensor values on the host or give a data-dependent output shape.
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero",
               "repeat_interleave.Tensor", "item")


def test_builders_never_sync_on_real_tensors():
    """Record every ATen op the builders dispatch on real CPU tensors: none may sync."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    parents = torch.tensor([[-1, 0, 0, 1, 2, -1], [-1, 0, 1, 2, 3, 4]], dtype=torch.int32)
    num_nodes = torch.tensor([5, 6], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 4, generator=gen), torch.randn(2, 16, generator=gen)]
    medusa = T.medusa_tree()
    with Recorder() as recorder:
        tree = T.build_tree(parents, num_nodes, torch.tensor([3, 4]))
        tree.ragged_tree_mask(tree.qo_indptr(), 12)
        tree.ragged_positions(tree.qo_indptr(), 12)
        T.tree_paths(parents, num_nodes, max_depth=3)
        T.eagle_tree_from_expansions(scores, [None, torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])], 6,
                                     [torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 16, dtype=torch.int64)],
                                     torch.tensor([1, 2]))
        medusa.token_ids(torch.tensor([1, 2]), torch.zeros(2, 4, 10, dtype=torch.int64))
    assert "aten.gather.default" in recorder.ops  # the recorder saw the builders' ops
    syncing = [op for op in recorder.ops if any(bad in op for bad in SYNCING_OPS)]
    assert syncing == []
    # The recorder does catch a sync.
    with Recorder() as recorder:
        T.validate_parents(parents, num_nodes)
    assert any(bad in op for op in recorder.ops for bad in SYNCING_OPS)


def _tree_fields(parents, num_nodes, prefix_lens):
    t = T.build_tree(parents, num_nodes, prefix_lens, max_depth=8)
    return t.depth, t.positions, t.tree_mask, t.first_child, t.next_sibling, t.paths, t.num_leaves


def _eagle_fields(s0, s1, p1, k0, k1):
    e = T.eagle_tree_from_expansions([s0, s1], [None, p1], 6, [k0, k1])
    return e.parents, e.token_ids


def test_builders_trace_fullgraph_under_torch_compile():
    """fullgraph=True turns any graph break (e.g. .item()) into an error."""
    torch._dynamo.reset()
    rows = [[-1, 0, 0, 1, 3, 2, 5, -1], [-1, 0, 1, 2, 3, 4, 5, 6]]
    parents = torch.tensor(rows, dtype=torch.int32)
    num_nodes = torch.tensor([7, 8], dtype=torch.int32)
    prefix_lens = torch.tensor([4, 0], dtype=torch.int32)
    compiled = torch.compile(_tree_fields, fullgraph=True, backend="aot_eager")
    got = compiled(parents, num_nodes, prefix_lens)
    want = _tree_fields(parents, num_nodes, prefix_lens)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert got[2][0, :, 0].tolist() == [v[0] for v in ref.mask_words(rows[0], 7)]

    gen = torch.Generator().manual_seed(1)
    args = (torch.rand(2, 4, generator=gen).log(), torch.rand(2, 16, generator=gen).log() - 1,
            torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]), torch.arange(8).view(2, 4), torch.arange(32).view(2, 16))
    compiled_eagle = torch.compile(_eagle_fields, fullgraph=True, backend="aot_eager")
    for g, w in zip(compiled_eagle(*args), _eagle_fields(*args)):
        assert torch.equal(g, w)


# ---------------------------------------------------------------------------------------
# Medusa.
# ---------------------------------------------------------------------------------------


def test_mc_sim_7b_63_is_ordered_like_a_medusa_choice_list():
    """63 distinct tuples of top-k ranks in Medusa's order of decreasing estimated
    acceptance: a node is never more likely than its parent or than its sibling of the next
    better rank, so both come before it (medusa_tree itself accepts any order)."""
    choices = T.MC_SIM_7B_63
    assert len(choices) == 63
    assert len(set(choices)) == 63
    assert all(isinstance(c, tuple) and all(isinstance(r, int) and r >= 0 for r in c) for c in choices)
    index = {c: i for i, c in enumerate(choices)}
    for i, c in enumerate(choices):
        if len(c) > 1:
            assert index[c[:-1]] < i, (c, "after its parent")
        if c[-1] > 0:
            assert index[c[:-1] + (c[-1] - 1,)] < i, (c, "after its better-ranked sibling")


def test_medusa_tree_mc_sim_7b_63():
    medusa = T.medusa_tree(T.MC_SIM_7B_63)
    assert medusa.num_nodes == 64 and medusa.num_heads == 4 and medusa.top_k == 10
    ordered, parents, head, rank = ref.medusa_parents(T.MC_SIM_7B_63)
    assert medusa.parents.tolist() == parents and medusa.head.tolist() == head and medusa.rank.tolist() == rank
    assert list(medusa.choices) == ordered
    tree = T.build_tree(medusa.batch_parents(1), prefix_lens=torch.tensor([100]), max_depth=4)
    # Depth histogram: root, 10 first-head tokens, 28, 23, 2.
    assert torch.bincount(tree.depth[0]).tolist() == [1, 10, 28, 23, 2]
    assert torch.equal(tree.depth[0], medusa.depth)
    assert tree.positions[0].max() == 104
    # 42 root-to-leaf paths of at most 5 nodes (Medusa's retrieve_indices is [42, 5]).
    assert int(tree.num_leaves[0]) == 42 and tree.paths.shape == (1, 64, 5)
    # The mask encodes exactly the prefix relation of the choices.
    dense = T.unpack_tree_mask(tree.tree_mask[0], 64)
    names = [()] + list(medusa.choices)
    for i, ci in enumerate(names):
        for j, cj in enumerate(names):
            assert bool(dense[i, j]) == (ci[: len(cj)] == cj), (ci, cj)
    # Every path is a chain of prefixes ending at a leaf.
    for row in tree.paths[0, :42].tolist():
        nodes = [v for v in row if v >= 0]
        assert [len(names[v]) for v in nodes] == list(range(len(nodes)))
        assert all(names[b][:-1] == names[a] for a, b in zip(nodes, nodes[1:]))
        assert bool(tree.is_leaf[0, nodes[-1]])


def test_medusa_token_ids():
    medusa = T.medusa_tree([(0,), (1,), (0, 0), (0, 2), (1, 0), (0, 2, 1)])
    assert medusa.parents.tolist() == [-1, 1 - 1, 0, 1, 1, 2, 4]
    batch, heads, k = 2, 3, 4
    topk_ids = torch.arange(batch * heads * k, dtype=torch.int64).view(batch, heads, k) + 1000
    tokens = medusa.token_ids(torch.tensor([7, 8]), topk_ids)
    for b in range(batch):
        want = [[7, 8][b]] + [int(topk_ids[b, len(c) - 1, c[-1]]) for c in medusa.choices]
        assert tokens[b].tolist() == want
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[B, >= 3, >= 3\]"):
        medusa.token_ids(torch.tensor([7, 8]), topk_ids[:, :2])


@pytest.mark.parametrize(
    "choices,message",
    [
        ([(0,), (1, 0)], r"the parent \(1,\) of \(1, 0\) is missing"),
        ([(0,), (0,)], r"duplicate choice \(0,\)"),
        ([(0,), ()], r"empty choice"),
        ([(0,), (0, -1)], r"negative top-k rank"),
    ],
)
def test_medusa_bad_choices(choices, message):
    with pytest.raises(ValueError, match=message):
        T.medusa_tree(choices)


# ---------------------------------------------------------------------------------------
# EAGLE-2.
# ---------------------------------------------------------------------------------------


def _eagle_expansion(batch, top_k, depth, gen):
    """Simulate EAGLE-2 drafting: per step, top_k children of each of top_k beam nodes."""
    scores, parents, tokens = [], [None], []
    logp = torch.log_softmax(torch.randn(batch, top_k, generator=gen), -1)
    scores.append(logp)
    tokens.append(torch.randint(0, 1000, (batch, top_k), generator=gen))
    beam_scores, beam = torch.topk(logp, top_k, dim=-1)
    for _ in range(1, depth):
        child = torch.log_softmax(torch.randn(batch, top_k, top_k, generator=gen), -1)
        cu = (child + beam_scores[:, :, None]).reshape(batch, top_k * top_k)
        scores.append(cu)
        parents.append(beam)  # group form [B, top_k]: the beam node of each group of top_k
        tokens.append(torch.randint(0, 1000, (batch, top_k * top_k), generator=gen))
        beam_scores, beam = torch.topk(cu, top_k, dim=-1)
    return scores, parents, tokens


@pytest.mark.parametrize("top_k,depth,num_draft", [(4, 5, 20), (10, 6, 60), (2, 1, 2), (3, 4, 0)])
def test_eagle_selection_matches_reference(top_k, depth, num_draft):
    gen = torch.Generator().manual_seed(top_k * 100 + depth)
    batch = 3
    scores, parents, tokens = _eagle_expansion(batch, top_k, depth, gen)
    root = torch.tensor([11, 22, 33])
    eagle = T.eagle_tree_from_expansions(scores, parents, num_draft, tokens, root)
    assert eagle.parents.shape == (batch, num_draft + 1)
    all_tokens = torch.cat(tokens, 1)
    all_scores = torch.cat(scores, 1)
    for b in range(batch):
        per_cand = [[None] * top_k] + [p[b].repeat_interleave(top_k).tolist() for p in parents[1:]]
        want_parents, chosen = ref.eagle_select([s[b].tolist() for s in scores], per_cand, num_draft)
        assert eagle.parents[b].tolist() == want_parents
        assert eagle.candidate[b].tolist() == [-1] + chosen
        assert eagle.token_ids[b].tolist() == [int(root[b])] + all_tokens[b, chosen].tolist()
        # Genuine log-probs: the key is the score itself, and the chosen are the global top-N.
        assert torch.equal(eagle.scores[b, 1:], all_scores[b, chosen])
        if num_draft:
            assert all_scores[b, chosen].min() >= torch.topk(all_scores[b], num_draft).values.min()
    T.validate_parents(eagle.parents)


def test_eagle_matches_eagle_bookkeeping():
    """EAGLE's own index arithmetic (cnets.py topK_genrate) gives the same parents.

    There, parents_list[0] = [0] and step d >= 1 contributes beam + 1 + (flat offset of step
    d-1) per group of top_k; a selected flat index c has parent "1 + flat index" =
    parents_list[c // top_k], and its node index is 1 + its rank among the selected.
    """
    gen = torch.Generator().manual_seed(7)
    top_k, depth, num_draft = 5, 5, 30
    scores, parents, _ = _eagle_expansion(1, top_k, depth, gen)
    eagle = T.eagle_tree_from_expansions(scores, parents, num_draft)
    offsets = [0]
    for s in scores:
        offsets.append(offsets[-1] + s.shape[1])
    parents_list = [0] + [int(v) + 1 + offsets[d - 1] for d in range(1, depth) for v in parents[d][0]]
    selected = sorted(torch.topk(torch.cat(scores, 1)[0], num_draft).indices.tolist())
    eagle_parents = [-1]
    for c in selected:
        parent_plus_one = parents_list[c // top_k]
        eagle_parents.append(0 if parent_plus_one == 0 else 1 + selected.index(parent_plus_one - 1))
    assert eagle.candidate[0, 1:].tolist() == selected
    assert eagle.parents[0].tolist() == eagle_parents


def test_eagle_ties_keep_parents():
    """Equal scores (log-prob 0 children) must not select a child without its parent."""
    s0 = torch.tensor([[-1.0, -1.0]])
    s1 = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])  # children of candidates 1 and 0 tie with them
    eagle = T.eagle_tree_from_expansions([s0, s1], [None, torch.tensor([[1, 0]])], 3)
    # Candidates 0, 1 (step 0) then 2 (child of candidate 1): all keys tie, lowest index wins.
    assert eagle.candidate.tolist() == [[-1, 0, 1, 2]]
    assert eagle.parents.tolist() == [[-1, 0, 0, 2]]
    assert eagle.token_ids is None
    # Non-monotone scores (a child above its parent) and NaN are made safe too.
    s1 = torch.tensor([[5.0, float("nan"), -3.0, -4.0]])
    eagle = T.eagle_tree_from_expansions([torch.tensor([[-2.0, -1.0]]), s1], [None, torch.tensor([[0, 0, 1, 1]])], 2)
    T.validate_parents(eagle.parents)
    assert eagle.candidate.tolist() == [[-1, 0, 1]]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(scores=[], parents=[], num_draft_tokens=0), r"at least one expansion step"),
        (dict(scores=[torch.zeros(1, 2)], parents=[torch.zeros(1, 2)], num_draft_tokens=1), r"parents\[0\] must be None"),
        (dict(scores=[torch.zeros(1, 2)], parents=[None], num_draft_tokens=3), r"num_draft_tokens must be in \[0, 2\]"),
        (dict(scores=[torch.zeros(1, 2), torch.zeros(1, 6)], parents=[None, torch.zeros(1, 4, dtype=torch.int64)],
              num_draft_tokens=1), r"parents\[1\] has 4 columns"),
        (dict(scores=[torch.zeros(1, 2, dtype=torch.int64)], parents=[None], num_draft_tokens=1), r"scores\[0\] must be a float"),
        (dict(scores=[torch.zeros(1, 2)], parents=[None], num_draft_tokens=1, token_ids=[torch.zeros(1, 3)]),
         r"token_ids\[0\] must have shape \[1, 2\]"),
    ],
)
def test_eagle_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        T.eagle_tree_from_expansions(**kwargs)


def test_eagle_tree_feeds_build_tree():
    gen = torch.Generator().manual_seed(3)
    scores, parents, tokens = _eagle_expansion(2, 8, 6, gen)
    eagle = T.eagle_tree_from_expansions(scores, parents, 60, tokens)
    tree = T.build_tree(eagle.parents, prefix_lens=torch.tensor([50, 60]), max_depth=6)
    for b in range(2):
        p = eagle.parents[b].tolist()
        assert tree.depth[b].tolist() == ref.depth(p, 61)
        assert tree.tree_mask[b].tolist() == ref.mask_words(p, 61)
    # A step-d candidate sits at depth d + 1.
    offsets = torch.tensor([0] + [s.shape[1] for s in scores]).cumsum(0)
    step = torch.searchsorted(offsets, eagle.candidate[:, 1:].contiguous(), right=True) - 1
    assert torch.equal(tree.depth[:, 1:].long(), step + 1)



def test_merge_token_trees_shares_matching_nodes():
    from specdec_kernels.tree import merge_token_trees

    parents, tokens = [-1, 0, 0, 1], [7, 3, 4, 5]
    chain = [3, 5, 9, 1]  # shares root -> 3 -> 5, then two new nodes
    assert merge_token_trees(parents, tokens, list(range(-1, len(chain))), [7] + chain) == \
        ([-1, 0, 0, 1, 3, 4], [7, 3, 4, 5, 9, 1])
    # A tree: both branches of the other tree land under the shared node.
    assert merge_token_trees(parents, tokens, [-1, 0, 1, 1], [7, 4, 6, 8]) == ([-1, 0, 0, 1, 2, 2], [7, 3, 4, 5, 6, 8])
    assert merge_token_trees(parents, tokens, [-1], [7]) == (parents, tokens)
