"""The paged KV cache: allocation, block table, slot mapping, writes, commit, compact, free."""
import pytest
import torch

from python_ref.kv_compaction import compact_kv as compact_kv_ref
from specdec_kernels.kv_cache import OutOfBlocksError, PagedKVCache

H, D = 2, 4


def make_cache(**kw):
    args = dict(num_blocks=8, block_size=3, max_batch=3, max_blocks_per_seq=4)
    args.update(kw)
    return PagedKVCache(2, H, D, **args)


def read_positions(cache, layer, slot, positions):
    """[len(positions), H, D] K rows of ``slot`` at ``positions``, through the block table."""
    rows = []
    for p in positions:
        block = int(cache.block_table[slot, p // cache.block_size])
        rows.append(cache.k_caches[layer][block, p % cache.block_size])
    return torch.stack(rows)


def test_layout_and_initial_state():
    cache = make_cache(dtype=torch.float16)
    assert len(cache.k_caches) == len(cache.v_caches) == 2
    assert cache.k_caches[0].shape == (8, 3, H, D) and cache.k_caches[0].dtype == torch.float16
    assert cache.block_table.shape == (3, 4) and cache.block_table.dtype == torch.int32
    assert (cache.block_table == -1).all()
    assert cache.lengths.dtype == torch.int32 and cache.lengths.tolist() == [0, 0, 0]
    assert cache.max_len == 12 and cache.num_free_blocks == 8


def test_add_request_reserves_blocks_and_block_table_rows():
    cache = make_cache()
    a = cache.add_request(num_tokens=7)  # 3 blocks of 3
    b = cache.add_request()
    assert (a, b) == (0, 1)
    assert cache.block_table[a].tolist() == [0, 1, 2, -1]
    assert cache.block_table[b].tolist() == [-1, -1, -1, -1]
    assert cache.capacity(a) == 9 and cache.num_free_blocks == 5
    cache.reserve([b], [1])
    assert cache.block_table[b].tolist() == [3, -1, -1, -1]
    cache.reserve([a], [9])  # idempotent: already enough room
    assert cache.num_free_blocks == 4


def test_append_write_read_back_across_blocks():
    cache = make_cache()
    a = cache.add_request()
    b = cache.add_request()
    cache.commit([a], [0])
    slots = cache.append_slots([a, b], [5, 2])
    assert slots.qo_indptr.tolist() == [0, 5, 7]
    assert slots.cache_positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert slots.slot_mapping.dtype == torch.int64
    # a got blocks 0, 1; b got block 2: flat index = block * 3 + offset.
    assert slots.slot_mapping.tolist() == [0, 1, 2, 3, 4, 6, 7]
    k = torch.randn(7, H, D)
    v = torch.randn(7, H, D)
    cache.write(1, slots.slot_mapping, k, v)
    assert torch.equal(read_positions(cache, 1, a, range(5)), k[:5])
    assert torch.equal(read_positions(cache, 1, b, range(2)), k[5:])
    assert torch.equal(cache.k_caches[0], torch.zeros_like(cache.k_caches[0]))  # other layer untouched
    cache.commit([a, b], torch.tensor([5, 2], dtype=torch.int32))
    assert cache.lengths[:2].tolist() == [5, 2]
    # The next tokens go after the committed ones.
    nxt = cache.append_slots([a], 2)
    assert nxt.cache_positions.tolist() == [5, 6]
    assert nxt.slot_mapping.tolist() == [5, int(cache.block_table[a, 2]) * 3 + 0]


def test_slot_mapping_of_positions_agrees_with_append_slots():
    cache = make_cache()
    a = cache.add_request()
    b = cache.add_request(num_tokens=2)  # b: block 0, a: blocks 1, 2, 3, b: block 4 (interleaved)
    cache.reserve([a], [4])
    slots = cache.append_slots([a, b], [8, 4])
    assert cache.slot_mapping(a, torch.arange(8)).tolist() == slots.slot_mapping[:8].tolist()
    assert cache.slot_mapping(b, torch.tensor([3, 0])).tolist() == slots.slot_mapping[[11, 8]].tolist()
    assert cache.slot_mapping(a, torch.tensor([4])).tolist() == [int(cache.block_table[a, 1]) * 3 + 1]


def test_batch_view_gives_rows_in_slot_order():
    cache = make_cache()
    a, b = cache.add_request(4), cache.add_request(2)
    cache.commit([a, b], [4, 2])
    table, prefix = cache.batch_view([b, a])
    assert table.tolist() == [cache.block_table[b].tolist(), cache.block_table[a].tolist()]
    assert prefix.tolist() == [2, 4] and prefix.dtype == torch.int32


def test_free_returns_blocks_and_slot():
    cache = make_cache()
    a = cache.add_request(9)
    cache.commit([a], [9])
    cache.free(a)
    assert cache.num_free_blocks == 8 and (cache.block_table[a] == -1).all() and int(cache.lengths[a]) == 0
    with pytest.raises(ValueError, match="holds no request"):
        cache.free(a)
    assert cache.add_request(1) == a


def test_scratch_blocks_are_never_a_slots():
    cache = make_cache()
    scratch = cache.take_blocks(3)
    assert scratch.dtype == torch.int64 and cache.num_free_blocks == 5 and cache.num_scratch_blocks == 3
    a = cache.add_request(12)  # 4 of the 5 blocks left
    assert not set(cache.block_table[a].tolist()) & set(scratch.tolist())
    cache.free(a)
    assert cache.num_free_blocks + cache.num_scratch_blocks == cache.num_blocks
    with pytest.raises(OutOfBlocksError, match="need 6 scratch blocks, 5 free"):
        cache.take_blocks(6)


def test_limits_raise():
    cache = make_cache(num_blocks=4)
    a = cache.add_request()
    with pytest.raises(ValueError, match="exceed max_len 12"):
        cache.reserve([a], [13])
    cache.reserve([a], [12])
    b = cache.add_request()
    with pytest.raises(OutOfBlocksError, match="need 1 blocks, 0 free"):
        cache.reserve([b], [1])
    with pytest.raises(ValueError, match="cannot commit"):
        cache.commit([a], [13])
    cache.add_request()
    with pytest.raises(OutOfBlocksError, match="slots are in use"):
        cache.add_request()
    with pytest.raises(ValueError, match=r"k must have shape \[2, 2, 4\]"):
        cache.write(0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, H, D + 1), torch.zeros(2, H, D))


def test_contiguous_mode():
    cache = PagedKVCache.contiguous(1, H, D, max_batch=2, max_len=10)
    assert cache.k_caches[0].shape == (2, 10, H, D) and cache.block_table.shape == (2, 1)
    a = cache.add_request(10)
    b = cache.add_request(3)
    assert cache.block_table.tolist() == [[0], [1]]
    slots = cache.append_slots([b], [3])
    assert slots.slot_mapping.tolist() == [10, 11, 12]
    with pytest.raises(ValueError, match="max_len 10"):
        cache.reserve([a], [11])


@pytest.mark.parametrize("contiguous", [False, True])
def test_compact_moves_accepted_nodes_and_commits(contiguous):
    if contiguous:
        cache = PagedKVCache.contiguous(2, H, D, max_batch=2, max_len=16)
    else:
        cache = make_cache(num_blocks=10, max_blocks_per_seq=5)
    a, b = cache.add_request(4), cache.add_request(2)
    cache.commit([a, b], [4, 2])
    slots = cache.append_slots([a, b], [6, 5])  # tree nodes 0..5 and 0..4
    for layer in range(2):
        cache.write(layer, slots.slot_mapping, torch.randn(11, H, D), torch.randn(11, H, D))
    accepted = torch.tensor([[2, 5, -1], [1, 2, 3]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 3], dtype=torch.int32)
    expected_k = [t.clone() for t in cache.k_caches]
    expected_v = [t.clone() for t in cache.v_caches]
    table, prefix = cache.batch_view([a, b])
    compact_kv_ref(expected_k, expected_v, table, prefix, accepted, num_accepted)
    cache.compact([a, b], accepted, num_accepted)
    for layer in range(2):
        assert torch.equal(cache.k_caches[layer], expected_k[layer])
        assert torch.equal(cache.v_caches[layer], expected_v[layer])
    assert cache.length(a) == 7 and cache.length(b) == 6 and cache.lengths[:2].tolist() == [7, 6]


def test_compact_with_nan_row_commits_nothing_for_that_request():
    cache = make_cache()
    a, b = cache.add_request(2), cache.add_request(2)
    cache.commit([a, b], [2, 2])
    slots = cache.append_slots([a, b], [3, 3])
    cache.write(0, slots.slot_mapping, torch.randn(6, H, D), torch.randn(6, H, D))
    cache.compact((s for s in [a, b]), torch.tensor([[1, 2], [2, -1]], dtype=torch.int32),
                  torch.tensor([2, -1], dtype=torch.int32))
    assert (cache.length(a), cache.length(b)) == (5, 2)


def test_compact_of_roots_alone_commits_them_and_moves_nothing():
    """An autoregressive step (no drafted nodes, D = 0): each root is committed, a NaN row
    (-1) commits nothing, the caches are untouched, and a count past the nodes is refused."""
    cache = make_cache()
    a, b = cache.add_request(2), cache.add_request(2)
    cache.commit([a, b], [2, 2])
    slots = cache.append_slots([a, b], [1, 1])
    cache.write(0, slots.slot_mapping, torch.randn(2, H, D), torch.randn(2, H, D))
    before = [t.clone() for t in cache.k_caches + cache.v_caches]
    none = torch.zeros(2, 0, dtype=torch.int32)
    cache.compact([a, b], none, torch.tensor([0, -1], dtype=torch.int32))
    assert (cache.length(a), cache.length(b)) == (3, 2) and cache.lengths[:2].tolist() == [3, 2]
    assert all(torch.equal(x, y) for x, y in zip(before, cache.k_caches + cache.v_caches))
    with pytest.raises(ValueError, match="0 or -1"):
        cache.compact([a, b], none, torch.tensor([1, 0], dtype=torch.int32))
