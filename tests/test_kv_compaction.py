"""specdec::compact_kv against the gather-then-scatter reference (python_ref)."""
import pytest
import torch

import specdec_kernels
from python_ref.kv_compaction import compact_kv as compact_kv_ref


def test_basic_paged_matches_reference():
    num_layers, num_blocks, block_size, heads, head_dim = 3, 10, 5, 2, 8
    k = [torch.randn(num_blocks, block_size, heads, head_dim) for _ in range(num_layers)]
    v = [torch.randn(num_blocks, block_size, heads, head_dim) for _ in range(num_layers)]
    block_table = torch.tensor([[3, 1, 7, -1], [0, 2, 4, 5]], dtype=torch.int32)
    prefix_lens = torch.tensor([2, 9], dtype=torch.int32)
    # Request 0: node 3 -> position 2+2 is node 2's source... destinations overlap sources.
    accepted = torch.tensor([[1, 3, 4, 9], [2, 3, 7, -1]], dtype=torch.int32)
    num_accepted = torch.tensor([4, 3], dtype=torch.int32)
    ek, ev = [t.clone() for t in k], [t.clone() for t in v]
    compact_kv_ref(ek, ev, block_table, prefix_lens, accepted, num_accepted)
    specdec_kernels.compact_kv(k, v, block_table, prefix_lens, accepted, num_accepted)
    for got, want in zip(k + v, ek + ev):
        assert torch.equal(got, want)
