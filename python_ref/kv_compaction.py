"""Reference of specdec::compact_kv: gather every accepted node's K/V, then scatter.

Loops over layers, requests and accepted nodes; reads all sources of a request before
writing any destination, which is correct whatever the overlap. Out-of-range or
out-of-order entries are the kernels' business (tests build valid inputs for this).
"""
from __future__ import annotations

import torch


def cache_index(block_table: torch.Tensor, b: int, pos: int, block_size: int) -> tuple[int, int]:
    """(block, offset) of cache position ``pos`` of request ``b``."""
    return int(block_table[b, pos // block_size]), pos % block_size


def compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted) -> None:
    """In place, like the op: for i < num_accepted[b], position prefix_lens[b] + 1 + i
    <- position prefix_lens[b] + accepted_nodes[b, i], for K and V of every layer."""
    block_size = k_caches[0].shape[1]
    for caches in (k_caches, v_caches):
        for cache in caches:
            for b in range(block_table.shape[0]):
                prefix = int(prefix_lens[b])
                count = max(int(num_accepted[b]), 0)
                sources = [cache_index(block_table, b, prefix + int(accepted_nodes[b, i]), block_size) for i in range(count)]
                gathered = [cache[blk, off].clone() for blk, off in sources]  # [H, D] each
                for i, rows in enumerate(gathered):
                    blk, off = cache_index(block_table, b, prefix + 1 + i, block_size)
                    cache[blk, off] = rows
