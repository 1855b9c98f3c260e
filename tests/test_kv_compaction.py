"""specdec::compact_kv on every backend against the gather-then-scatter reference.

Backends: the C++ CPU kernel (through ``specdec_kernels.compact_kv`` and
``torch.ops.specdec.compact_kv``) and the Triton kernel (its launcher, on CPU tensors under
TRITON_INTERPRET=1, small shapes). Moves are bit copies, so every comparison is exact
(tolerance 0 for every dtype).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec_kernels
from python_ref.kv_compaction import compact_kv as compact_kv_ref
from tests.helpers import requires_triton

if specdec_kernels.HAS_TRITON:
    from specdec_kernels.triton.kv_compaction import compact_kv_triton
else:  # pragma: no cover
    compact_kv_triton = None

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


def cpu_op(*args):
    specdec_kernels.compact_kv(*args)


def triton_op(*args):
    compact_kv_triton(*args)


BACKENDS = [pytest.param(cpu_op, id="cpu")] + [
    pytest.param(triton_op, id="triton", marks=requires_triton),
]


# ------------------------------------------------------------------------------ builders
def random_cache(shape, dtype, gen):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def make_case(
    prefix_lens,
    accepted,
    *,
    tree_sizes=None,
    block_size=4,
    num_layers=2,
    heads=2,
    head_dim=8,
    dtype=torch.float32,
    spare_blocks=2,
    seed=0,
    heads_adjacent=True,
):
    """A batch: request b has its tree nodes at prefix_lens[b] + j (j < tree_sizes[b]),
    accepted path ``accepted[b]`` (node indices). Blocks are shuffled over the pool, the
    block table is -1 padded, accepted_nodes is -1 padded to the longest tree - 1."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    tree_sizes = tree_sizes or [max(a, default=0) + 1 for a in accepted]
    lengths = [p + n for p, n in zip(prefix_lens, tree_sizes)]
    blocks_per_request = [-(-n // block_size) for n in lengths]
    max_blocks = max(blocks_per_request) + 1  # one column of -1 padding at least
    num_blocks = sum(blocks_per_request) + spare_blocks
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, count in enumerate(blocks_per_request):
        block_table[b, :count] = torch.tensor([pool.pop() for _ in range(count)], dtype=torch.int32)
    width = max(max(tree_sizes) - 1, 1)
    accepted_nodes = torch.full((batch, width), -1, dtype=torch.int32)
    for b, path in enumerate(accepted):
        accepted_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
    num_accepted = torch.tensor([len(p) for p in accepted], dtype=torch.int32)
    if heads_adjacent:
        shape = (num_blocks, block_size, heads, head_dim)
        k = [random_cache(shape, dtype, gen) for _ in range(num_layers)]
        v = [random_cache(shape, dtype, gen) for _ in range(num_layers)]
    else:  # [num_blocks, heads, block_size, head_dim] storage seen as [.., block_size, heads, ..]
        shape = (num_blocks, heads, block_size, head_dim)
        k = [random_cache(shape, dtype, gen).transpose(1, 2) for _ in range(num_layers)]
        v = [random_cache(shape, dtype, gen).transpose(1, 2) for _ in range(num_layers)]
    return k, v, block_table, torch.tensor(prefix_lens, dtype=torch.int32), accepted_nodes, num_accepted


def clone_caches(caches):
    return [t.clone() for t in caches]


def run_and_compare(backend, case):
    k, v, *rest = case
    ek, ev = clone_caches(k), clone_caches(v)
    compact_kv_ref(ek, ev, *rest)
    backend(k, v, *rest)
    for layer, (got, want) in enumerate(zip(k + v, ek + ev)):
        assert torch.equal(got, want), f"cache {layer} differs from the reference"
    return ek, ev


def random_tree_path(rng: random.Random, num_nodes: int) -> list[int]:
    """The root path (root excluded) of a random node of a random tree of num_nodes."""
    parents = [-1] + [rng.randrange(i) for i in range(1, num_nodes)]
    node = rng.randrange(num_nodes)
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@st.composite
def batches(draw, max_requests=3, max_nodes=12, max_prefix=20):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    batch = draw(st.integers(1, max_requests))
    tree_sizes = [draw(st.integers(1, max_nodes)) for _ in range(batch)]
    kind = draw(st.sampled_from(["tree", "tree", "chain", "empty"]))
    accepted = []
    for n in tree_sizes:
        if kind == "chain":
            accepted.append(list(range(1, n)))
        elif kind == "empty":
            accepted.append([])
        else:
            accepted.append(random_tree_path(rng, n))
    return dict(
        prefix_lens=[draw(st.integers(0, max_prefix)) for _ in range(batch)],
        accepted=accepted,
        tree_sizes=tree_sizes,
        block_size=draw(st.sampled_from([1, 3, 5, 7, 16])),
        num_layers=draw(st.integers(1, 3)),
        heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([4, 8, 12])),
        dtype=draw(st.sampled_from(DTYPES)),
        heads_adjacent=draw(st.booleans()),
        seed=seed,
    )


# ----------------------------------------------------------------- properties (hypothesis)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_cpu_matches_reference_on_random_trees(params):
    run_and_compare(cpu_op, make_case(**params))


@requires_triton
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_requests=2, max_nodes=9, max_prefix=9))
def test_triton_matches_reference_on_random_trees(params):
    run_and_compare(triton_op, make_case(**params))


# --------------------------------------------------------------------- explicit cases
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_dims_and_dtypes(backend, dtype, head_dim):
    # Block size 5 (not a power of two); request 0's path crosses two block boundaries and
    # its destinations P+2, P+3 are the sources of path nodes 2 and 3 (overlap).
    case = make_case(
        [3, 7], [[2, 3, 6, 9], [1, 4]], tree_sizes=[11, 6], block_size=5, heads=2, head_dim=head_dim, dtype=dtype
    )
    before = clone_caches(case[0])
    ek, _ = run_and_compare(backend, case)
    assert not all(torch.equal(a, b) for a, b in zip(before, ek))  # something did move


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_destinations_change(backend):
    prefix_lens, accepted = [4, 0, 9], [[1, 3, 5], [2], [3, 4]]
    case = make_case(prefix_lens, accepted, tree_sizes=[7, 4, 6], block_size=3, num_layers=3)
    k, v, block_table, *_ = case
    before_k, before_v = clone_caches(k), clone_caches(v)
    run_and_compare(backend, case)
    allowed = torch.zeros(k[0].shape[:2], dtype=torch.bool)
    for b, (p, path) in enumerate(zip(prefix_lens, accepted)):
        for i in range(len(path)):
            pos = p + 1 + i
            allowed[block_table[b, pos // 3], pos % 3] = True
    for got, old in zip(k + v, before_k + before_v):
        changed = (got != old).flatten(2).any(-1)
        assert changed.any() and not (changed & ~allowed).any()
        # Every destination received its source's K/V (checked against the reference
        # above); node 0 and the prefix never move.


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_accepted_and_full_chain_change_nothing(backend):
    case = make_case([5, 2, 0], [[], [1, 2, 3, 4], [1, 2]], tree_sizes=[6, 5, 3], block_size=3)
    k, v, *rest = case
    before = clone_caches(k + v)
    backend(k, v, *rest)
    assert all(torch.equal(a, b) for a, b in zip(k + v, before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_num_accepted_moves_nothing(backend):
    # num_accepted = -1 marks a NaN row of the rejection samplers.
    k, v, bt, pl, nodes, _ = make_case([2], [[2, 3]], tree_sizes=[4])
    before = clone_caches(k + v)
    backend(k, v, bt, pl, nodes, torch.tensor([-1], dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(k + v, before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_contiguous_cache(backend):
    # One block of max_len per request: block_table = [[0], [1]].
    gen = torch.Generator().manual_seed(1)
    k = [torch.randn(2, 16, 3, 8, generator=gen) for _ in range(2)]
    v = [torch.randn(2, 16, 3, 8, generator=gen) for _ in range(2)]
    bt = torch.tensor([[1], [0]], dtype=torch.int32)
    case = (k, v, bt, torch.tensor([3, 10], dtype=torch.int32),
            torch.tensor([[2, 4, 5], [1, 3, -1]], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32))
    run_and_compare(backend, case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_index_tensors(backend):
    k, v, bt, pl, nodes, counts = make_case([1, 6], [[2, 5], [3]], tree_sizes=[7, 4], block_size=2)
    wide = torch.full((2, nodes.shape[1] * 2), -7, dtype=torch.int32)
    wide[:, ::2] = nodes
    run_and_compare(backend, (k, v, bt.t().contiguous().t(), pl, wide[:, ::2], counts))


# ----------------------------------------------------------- data-dependent faults
def faulty_cases():
    """(name, case, index of the invalid move or None when the whole request is invalid)."""
    base = dict(prefix_lens=[2, 3], tree_sizes=[6, 5], block_size=3)
    out = []
    # Source beyond the block table capacity (node 40).
    case = make_case(accepted=[[1, 3], [2, 4]], **base)
    case[4][0, 1] = 40
    out.append(("node beyond capacity", case, "lies outside the block table capacity"))
    # Source position in a -1 block table entry (capacity covers it, the block is unset).
    case = make_case(accepted=[[1, 3], [2, 4]], **base)
    pos = 2 + 5
    case[4][0, 1] = 5
    case[2][0, pos // 3] = -1
    out.append(("unset block", case, "is not a block id"))
    # A block id beyond the pool.
    case = make_case(accepted=[[1, 3], [2, 4]], **base)
    case[2][1, (3 + 4) // 3] = 10_000
    out.append(("block id out of range", case, "is not a block id"))
    # Node 0 (the root) inside the accepted range, and a negative node.
    case = make_case(accepted=[[1, 3], [2, 4]], **base)
    case[4][1, 0] = 0
    out.append(("node 0", case, "strictly increasing node indices >= 1"))
    case = make_case(accepted=[[1, 3], [2, 4]], **base)
    case[4][0, 1] = -1
    out.append(("-1 inside the accepted range", case, "strictly increasing"))
    return out


@pytest.mark.parametrize("name,case,message", faulty_cases(), ids=[c[0] for c in faulty_cases()])
def test_cpu_raises_on_faulty_indices_and_leaves_caches_unchanged(name, case, message):
    k, v, *rest = case
    before = clone_caches(k + v)
    with pytest.raises(RuntimeError, match=message):
        specdec_kernels.compact_kv(k, v, *rest)
    assert all(torch.equal(a, b) for a, b in zip(k + v, before))


def test_cpu_raises_on_unordered_nodes_and_too_many_accepted():
    k, v, bt, pl, nodes, counts = make_case([2], [[2, 3]], tree_sizes=[5])
    with pytest.raises(RuntimeError, match=r"got 2 at index 1 after 3"):
        specdec_kernels.compact_kv(k, v, bt, pl, torch.tensor([[3, 2, -1, -1]], dtype=torch.int32), counts)
    with pytest.raises(RuntimeError, match=r"num_accepted\[0\] = 5 exceeds accepted_nodes.size\(1\) = 4"):
        specdec_kernels.compact_kv(k, v, bt, pl, nodes, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"prefix_lens\[0\] must be >= 0"):
        specdec_kernels.compact_kv(k, v, bt, torch.tensor([-1], dtype=torch.int32), nodes, counts)


def valid_move_reference(k, v, block_table, prefix_lens, accepted_nodes, num_accepted, block_size, num_blocks):
    """Gather-then-scatter of the moves the Triton kernel documents as valid (others skipped)."""
    capacity = block_table.shape[1] * block_size
    for caches in (k, v):
        for cache in caches:
            for b in range(block_table.shape[0]):
                p = int(prefix_lens[b])
                moves = []
                for i in range(min(max(int(num_accepted[b]), 0), accepted_nodes.shape[1])):
                    node = int(accepted_nodes[b, i])
                    src, dst = p + node, p + 1 + i
                    if node < 1 or p < 0 or src >= capacity or dst >= capacity:
                        continue
                    sb, db = int(block_table[b, src // block_size]), int(block_table[b, dst // block_size])
                    if 0 <= sb < num_blocks and 0 <= db < num_blocks:
                        moves.append(((sb, src % block_size), (db, dst % block_size)))
                rows = [cache[s].clone() for s, _ in moves]
                for (_, d), row in zip(moves, rows):
                    cache[d] = row


@requires_triton
@pytest.mark.parametrize("name,case,message", faulty_cases(), ids=[c[0] for c in faulty_cases()])
def test_triton_skips_faulty_moves(name, case, message):
    k, v, *rest = case
    ek, ev = clone_caches(k), clone_caches(v)
    valid_move_reference(ek, ev, *rest, block_size=k[0].shape[1], num_blocks=k[0].shape[0])
    compact_kv_triton(k, v, *rest)
    assert all(torch.equal(a, b) for a, b in zip(k + v, ek + ev))


@requires_triton
def test_triton_clamps_num_accepted():
    k, v, bt, pl, nodes, _ = make_case([2, 0], [[1, 2], [3]], tree_sizes=[4, 4])
    counts = torch.tensor([99, 1], dtype=torch.int32)  # clamped to accepted_nodes.shape[1] = 3
    ek, ev = clone_caches(k), clone_caches(v)
    valid_move_reference(ek, ev, bt, pl, nodes, counts, block_size=k[0].shape[1], num_blocks=k[0].shape[0])
    compact_kv_triton(k, v, bt, pl, nodes, counts)
    assert all(torch.equal(a, b) for a, b in zip(k + v, ek + ev))


# ------------------------------------------------------------------------ bad inputs
def good_args():
    return make_case([2, 3], [[1, 3], [2]], tree_sizes=[5, 4], block_size=3)


def bad_inputs(wrapper=False):
    """Bad inputs for the raw op, or (wrapper=True) for the wrapper, which casts int64 index
    tensors to int32 (tests/test_api.py), so it gets int16 ones as the wrong dtype."""
    k, v, bt, pl, nodes, counts = good_args()
    i32 = torch.int32
    wrong = torch.int16 if wrapper else torch.int64
    return [
        ("empty lists", ([], [], bt, pl, nodes, counts), "k_caches must hold at least one layer"),
        ("list lengths", (k, v[:1], bt, pl, nodes, counts), "k_caches and v_caches must have the same length"),
        ("3-d cache", ([t[0] for t in k], [t[0] for t in v], bt, pl, nodes, counts), "k_caches.* 4 dimensions"),
        ("layer shapes", (k, [v[0], v[1][:, :2]], bt, pl, nodes, counts), r"v_caches\[1\] must have .*shape"),
        ("layer dtypes", (k, [v[0], v[1].half()], bt, pl, nodes, counts), r"v_caches\[1\] must have .*dtype"),
        ("head_dim stride", ([t.transpose(2, 3) for t in k], [t.transpose(2, 3) for t in v], bt, pl, nodes, counts),
         "contiguous in head_dim"),
        ("block_table dtype", (k, v, bt.to(wrong), pl, nodes, counts), r"block_table must have dtype (torch.int32|Int)"),
        ("block_table dims", (k, v, bt[0], pl, nodes, counts), "block_table must have 2 dimensions"),
        ("prefix_lens shape", (k, v, bt, pl[:1], nodes, counts), r"prefix_lens must have shape \[2\]|prefix_lens.size\(0\) must be 2"),
        ("accepted_nodes dtype", (k, v, bt, pl, nodes.to(wrong), counts), r"accepted_nodes must have dtype (torch.int32|Int)"),
        ("accepted_nodes rows", (k, v, bt, pl, nodes[:1], counts), r"accepted_nodes must have shape \[2, \*\]|accepted_nodes.size\(0\) must be 2"),
        ("num_accepted shape", (k, v, bt, pl, nodes, counts.to(i32)[None]), r"num_accepted must have (shape \[2\]|1 dimensions)"),
    ]


@pytest.mark.parametrize("name,args,message", bad_inputs(wrapper=True), ids=[b[0] for b in bad_inputs()])
def test_wrapper_rejects_bad_inputs(name, args, message):
    with pytest.raises(ValueError, match=message):
        specdec_kernels.compact_kv(*args)


@pytest.mark.parametrize("name,args,message", bad_inputs(), ids=[b[0] for b in bad_inputs()])
def test_cpu_kernel_rejects_bad_inputs(name, args, message):
    # The C++ kernel checks the same things itself (callers of torch.ops.specdec.*).
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.compact_kv(*args)


# --------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_opcheck(dtype):
    k, v, *rest = make_case([2, 3], [[1, 3], [2]], tree_sizes=[5, 4], block_size=3, dtype=dtype)
    torch.library.opcheck(torch.ops.specdec.compact_kv, (k, v, *rest))


def test_kv_cache_class_round_trip_uses_op():
    # The cache's compact() calls the op; here only to tie both files together.
    from specdec_kernels.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 1, 4, num_blocks=4, block_size=2, max_batch=1, max_blocks_per_seq=4)
    slot = cache.add_request()
    positions = cache.append_slots([slot], [5])
    values = torch.arange(5.0)[:, None, None].expand(5, 1, 4)
    cache.write(0, positions.slot_mapping, values, -values)
    cache.compact([slot], torch.tensor([[2, 4, -1, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    flat_k = cache.k_caches[0].view(-1, 4)[positions.slot_mapping, 0]
    assert flat_k.tolist() == [0.0, 2.0, 4.0, 3.0, 4.0] and cache.length(slot) == 3


def test_wrapper_checks_every_layer_on_every_call():
    # No memo of checked lists: a list that passed once, with one layer swapped for a bad
    # tensor, is rejected on the next call.
    k, v, *rest = good_args()
    specdec_kernels.compact_kv(k, v, *rest)
    with pytest.raises(ValueError, match=r"v_caches\[1\] must have dtype"):
        specdec_kernels.compact_kv(k, [v[0], v[1].half()], *rest)
    with pytest.raises(ValueError, match=r"k_caches\[1\] must have the strides"):
        specdec_kernels.compact_kv([k[0], k[1].transpose(0, 1).contiguous().transpose(0, 1)], v, *rest)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_zero_width(backend):
    k = [torch.randn(2, 4, 1, 8)]
    v = [torch.randn(2, 4, 1, 8)]
    before = clone_caches(k + v)
    i32 = torch.int32
    backend(k, v, torch.zeros(0, 2, dtype=i32), torch.zeros(0, dtype=i32), torch.zeros(0, 3, dtype=i32),
            torch.zeros(0, dtype=i32))
    backend(k, v, torch.tensor([[0, 1]], dtype=i32), torch.tensor([2], dtype=i32), torch.zeros(1, 0, dtype=i32),
            torch.zeros(1, dtype=i32))
    assert all(torch.equal(a, b) for a, b in zip(k + v, before))


def test_wrapper_traces_with_torch_compile_fullgraph():
    # backend="eager": Dynamo tracing of the wrapper and the fake without Inductor's
    # code generation (the op is opaque to Inductor anyway).
    case = make_case([2, 3], [[1, 3], [2]], tree_sizes=[5, 4], block_size=3)
    k, v, *rest = case
    ek, ev = clone_caches(k), clone_caches(v)
    compact_kv_ref(ek, ev, *rest)

    @torch.compile(backend="eager", fullgraph=True)
    def step(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
        specdec_kernels.compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
        return k_caches[0].sum()

    step(k, v, *rest)
    assert all(torch.equal(a, b) for a, b in zip(k + v, ek + ev))


# ------------------------------------- nothing is read or written outside the tensors
def guarded_cache(t):
    """guarded() storage for a cache tensor, keeping its layout (a transposed view of a
    contiguous guarded tensor when the heads are not adjacent)."""
    from tests.helpers import guarded

    return guarded(t) if t.is_contiguous() else guarded(t.transpose(1, 2)).transpose(1, 2)


def at_the_edges(case, trim_table=True):
    """Relabels the blocks (a permutation: the data stay valid) so that the first request's
    first block is block 0 and the last request's last used block is the largest id; with
    trim_table, drops block_table's -1 column when the last request needs every other slot,
    so that its last block id is block_table's last element."""
    k, v, bt, pl, nodes, counts = case
    bt = bt.clone()
    last = bt.shape[0] - 1
    used = int((bt[last] >= 0).sum())
    for slot, new in (((last, used - 1), k[0].shape[0] - 1), ((0, 0), 0)):
        old = int(bt[slot])
        bt[bt == old], bt[bt == new] = -2, old
        bt[bt == -2] = new
    if trim_table and used == bt.shape[1] - 1:
        bt = bt[:, :-1].contiguous()
    nodes = nodes[:, :int(counts.max())].contiguous()  # the longest path fills accepted_nodes
    return (k, v, bt, pl, nodes, counts)


def _kv_guard_cases():
    cases = {}
    # Three requests (the first with room after its path: a wrong bound on it reads the next
    # row's valid entries and makes moves); the last one's final move reads the last row of the largest block id
    # (prefix 4 + 8 nodes = 4 blocks of 3, the table's last slot) and uses the full width of
    # accepted_nodes (6 entries: BLOCK_A = 8, a partial tile; its last element is read);
    # head_dim 6 (BLOCK_D = 16, a partial tile); three heads, three layers.
    paths = [[2, 3], [1, 4, 5], [1, 2, 4, 5, 6, 7]]
    base = dict(tree_sizes=[10, 7, 8], block_size=3, num_layers=3, heads=3, head_dim=6, spare_blocks=0)
    for dtype in (torch.float32, torch.uint8):
        for adjacent in (True, False):
            name = f"{str(dtype)[6:]}-{'adjacent' if adjacent else 'strided'}-heads"
            cases[name] = (at_the_edges(make_case([2, 5, 4], paths, dtype=dtype, heads_adjacent=adjacent, **base)),
                           None)
    # -1 slots after every request's blocks (the table's last column stays -1).
    cases["spare-slots"] = (at_the_edges(make_case([2, 5, 4], paths, **base), trim_table=False), None)
    # Faulty data (the CPU kernel raises before any write; Triton skips the move). On the
    # first request a wrong bound reads the next row of block_table / accepted_nodes (valid
    # values, so the skipped move would be done); on the last one past the tensor's end:
    # a source one past the table (slot max_blocks), a destination block one past the last
    # block (whose source block is valid), num_accepted past accepted_nodes' width, a
    # negative prefix (slots before block_table's start).
    def faulty(change, message):
        k, v, bt, pl, nodes, counts = at_the_edges(make_case([2, 5, 4], paths, **base))
        change(bt, pl, nodes, counts, num_blocks=k[0].shape[0], capacity=bt.shape[1] * 3)
        return (k, v, bt, pl, nodes, counts), message

    def past_table(bt, pl, nodes, counts, num_blocks, capacity):
        nodes[0, 1] = capacity - int(pl[0])  # source position = capacity
        nodes[2, 5] = capacity - int(pl[2])

    def past_cache(bt, pl, nodes, counts, num_blocks, capacity):
        bt[2, 2] = num_blocks  # destinations 6..8 of the last request; the source 9 is valid

    def past_width(bt, pl, nodes, counts, num_blocks, capacity):
        counts[0] = counts[2] = nodes.shape[1] + 9

    def negative_prefix(bt, pl, nodes, counts, num_blocks, capacity):
        pl[0] = -7  # positions -5..-4 -> -6..-5

    cases["source-past-table"] = faulty(past_table, "outside the block table capacity")
    cases["block-past-cache"] = faulty(past_cache, "is not a block id")
    cases["count-past-width"] = faulty(past_width, "exceeds accepted_nodes.size")
    cases["negative-prefix"] = faulty(negative_prefix, "must be >= 0")
    return cases


KV_GUARD_CASES = _kv_guard_cases()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("name", list(KV_GUARD_CASES))
def test_nothing_outside_the_tensors_is_read_or_written(backend, name):
    from tests.helpers import assert_guard_intact, guarded

    (k, v, *index_args), cpu_error = KV_GUARD_CASES[name]
    gk, gv = [guarded_cache(t) for t in k], [guarded_cache(t) for t in v]
    args = [guarded(t) for t in index_args]
    ek, ev = clone_caches(k), clone_caches(v)
    if cpu_error is None:
        compact_kv_ref(ek, ev, *index_args)
    elif backend == "triton":
        valid_move_reference(ek, ev, *index_args, block_size=k[0].shape[1], num_blocks=k[0].shape[0])
    if backend == "cpu" and cpu_error is not None:
        with pytest.raises(RuntimeError, match=cpu_error):
            torch.ops.specdec.compact_kv(gk, gv, *args)
    elif backend == "cpu":
        torch.ops.specdec.compact_kv(gk, gv, *args)
    else:
        compact_kv_triton(gk, gv, *args)
    for layer, (got, want) in enumerate(zip(gk + gv, ek + ev)):
        assert_guard_intact(got)
        assert torch.equal(got, want), f"cache {layer} differs from the reference"
