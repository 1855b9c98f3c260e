"""Reference of ``specdec::tree_attention`` and of the tree mask it reads (tests only).

Loops over requests, nodes and heads: gather the cache positions a node may see (the
whole prefix, then the tree nodes whose bit is set in its mask row), softmax in float64,
weighted sum of the values. Obviously right, slow.
"""
from __future__ import annotations

import math

import torch


def mask_words_for(num_nodes: int) -> int:
    """Number of int64 words a mask row needs for ``num_nodes`` nodes (at least 1)."""
    return max(1, (num_nodes + 63) // 64)


def _to_int64(word: int) -> int:
    """The int64 with the bit pattern of the unsigned 64-bit ``word``."""
    return word - (1 << 64) if word >= (1 << 63) else word


def ancestors(parents: list[int], i: int) -> list[int]:
    """Nodes on the root path of node ``i`` (itself included), root first."""
    path = []
    while i != -1:
        path.append(i)
        i = parents[i]
    return path[::-1]


def mask_from_parents(parents: list[int], num_words: int | None = None) -> torch.Tensor:
    """int64 [N, W] mask of one tree: bit j of word j // 64 of row i is set iff node j is
    node i or one of its ancestors. ``parents[0] = -1``, ``parents[i] < i``."""
    n = len(parents)
    num_words = mask_words_for(n) if num_words is None else num_words
    rows = []
    for i in range(n):
        words = [0] * num_words
        for j in ancestors(parents, i):
            words[j // 64] |= 1 << (j % 64)
        rows.append([_to_int64(w) for w in words])
    return torch.tensor(rows, dtype=torch.int64).reshape(n, num_words)


def batch_mask(trees: list[list[int]], num_words: int | None = None) -> torch.Tensor:
    """The masks of several trees (lists of parents) stacked in qo_indptr order: [T, W]."""
    if num_words is None:
        num_words = mask_words_for(max((len(p) for p in trees), default=1))
    parts = [mask_from_parents(p, num_words) for p in trees]
    return torch.cat(parts) if parts else torch.zeros(0, num_words, dtype=torch.int64)


def visible_nodes(tree_mask_row: torch.Tensor | None, i: int, n: int) -> list[int]:
    """Tree nodes (< n) visible to node i: the set bits of its mask row, or 0..i when None."""
    if tree_mask_row is None:
        return list(range(i + 1))
    words = [int(w) & ((1 << 64) - 1) for w in tree_mask_row.tolist()]
    return [j for j in range(n) if (words[j // 64] >> (j % 64)) & 1]


def cache_rows(cache: torch.Tensor, block_table: torch.Tensor, b: int, positions: list[int]) -> torch.Tensor:
    """K or V rows [len(positions), Hkv, D] of request ``b`` at the given cache positions."""
    block_size = cache.shape[1]
    pos = torch.tensor(positions, dtype=torch.long)
    blocks = block_table[b].long()[pos // block_size]  # the block holding each position
    return cache[blocks, pos % block_size]


def tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask=None, sm_scale=None):
    """Returns (out float64 [T, Hq, D], lse float64 [T, Hq]); rows owned by no request, and
    rows that see no key, are 0 with lse = -inf."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((T, Hq), -math.inf, dtype=torch.float64)
    for b in range(block_table.shape[0]):
        begin, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n, prefix = end - begin, int(prefix_lens[b])
        for i in range(n):
            row = None if tree_mask is None else tree_mask[begin + i]
            positions = list(range(prefix)) + [prefix + j for j in visible_nodes(row, i, n)]
            if not positions:
                continue
            keys = cache_rows(k_cache, block_table, b, positions).double()  # [L, Hkv, D]
            values = cache_rows(v_cache, block_table, b, positions).double()
            for hq in range(Hq):
                h = hq // group
                scores = keys[:, h] @ q[begin + i, hq].double() * sm_scale
                lse[begin + i, hq] = torch.logsumexp(scores, 0)
                out[begin + i, hq] = torch.softmax(scores, 0) @ values[:, h]
    return out, lse
