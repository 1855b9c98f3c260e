"""Token-tree representations and builders for tree speculative decoding.

A batch of draft trees is given by ``parents`` int32 [B, N]: node 0 of every request is the
root (the last verified token, ``parents[b, 0] == -1``), node i < ``num_nodes[b]`` has its
parent at ``parents[b, i] < i`` (so a parent always precedes its children and no cycle is
possible), and entries beyond ``num_nodes[b]`` are -1 (padding). ``num_nodes`` int32 [B]
defaults to N for every request.

From that, :func:`build_tree` computes on the tensors' device, with no host synchronisation
(no ``.item()``, no data-dependent shapes, so it traces under ``torch.compile(fullgraph=True)``
and can be captured in CUDA graphs):

- ``depth`` int32 [B, N]: root 0, padding -1;
- ``positions`` int64 [B, N] = ``prefix_lens[b] + depth`` (int64 because RoPE tables and
  Hugging Face ``position_ids`` are indexed with int64; padding nodes get ``prefix_lens[b]``
  so that they still index a valid table row);
- ``tree_mask`` int64 [B, N, W], W = ceil(N / 64), in the layout of ``specdec::tree_attention``:
  row i holds node i's own bit and the bits of all its ancestors, bit j in word j // 64 at
  bit position j % 64 (little-endian; bit 63 is the sign bit of the int64 word). A padding
  row has its own bit only, so it never attends an empty set. :func:`ragged_rows` /
  :func:`tree_mask_ragged` turn it into the ragged [T, W] form (rows concatenated over the
  requests as given by ``qo_indptr``);
- ``first_child`` / ``next_sibling`` int32 [B, N] (children in increasing index order, the
  order in which ``tree_rejection_sample`` tries them), ``num_children`` int32 [B, N];
- ``is_leaf`` bool [B, N], ``num_leaves`` int32 [B] and ``paths`` int32 [B, max_leaves,
  max_depth + 1]: row r is the root-to-leaf path of the r-th leaf (leaves in node-index order),
  root first, -1 padded; rows r >= num_leaves[b] are all -1 (Medusa/EAGLE "retrieve indices").

The ancestor relation is computed by pointer jumping (ancestor doubling): with J_0 = parent
and M_0 = own bit, M_{k+1}[i] = M_k[i] | M_k[J_k[i]] and J_{k+1}[i] = J_k[J_k[i]]. After
ceil(log2 N) rounds every row holds all ancestors; the work is O(B N W log N) with fixed shapes.
Depth uses the same jumps, and paths reuse the jump tables (the k-th ancestor of a node is
found from the binary digits of k).

The builders never read or write out of bounds whatever ``parents`` holds: an entry outside
[0, i) for node i < num_nodes[b] is treated as "no parent" (the node becomes the root of its
own subtree), so invalid input gives a forest instead of a crash. :func:`validate_parents`
is the separate, explicit check that rejects such trees with a ValueError; it synchronises
with the host (it reads the values) and so is meant for tests, debugging and configuration
time, not for the decode loop's hot path.

Converters:

- :func:`medusa_tree` turns a Medusa "choices" list (e.g. :data:`MC_SIM_7B_63`) into parents
  plus the (head, top-k rank) of every node; :meth:`MedusaTree.token_ids` fills the tree's
  token ids from per-head top-k lists (the output of ``specdec::medusa_topk``).
- :func:`eagle_tree_from_expansions` turns EAGLE-2-style per-depth expansions (cumulative
  log-prob scores of candidates and the candidate each group was expanded from) into a tree
  of the globally best ``num_draft_tokens`` candidates, with their parents and token ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "merge_token_trees",
    "MC_SIM_7B_63",
    "Tree",
    "MedusaTree",
    "EagleTree",
    "build_tree",
    "validate_parents",
    "tree_depth",
    "tree_positions",
    "tree_mask",
    "tree_children",
    "tree_paths",
    "num_mask_words",
    "unpack_tree_mask",
    "ragged_rows",
    "tree_mask_ragged",
    "qo_indptr_from_num_nodes",
    "chain_parents",
    "medusa_tree",
    "eagle_tree_from_expansions",
]

# The 63-candidate Medusa tree tuned for Vicuna-7B ("mc_sim_7b_63" of the Medusa
# repository, medusa/model/medusa_choices.py). Each tuple is a path of top-k ranks: the
# tuple (a, b) is the rank-b token of Medusa head 1 following the rank-a token of head 0.
# With the root the tree has 64 nodes.
MC_SIM_7B_63: list[tuple[int, ...]] = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0),
    (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2),
    (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0),
    (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
]

_WORD_BITS = 64


# ---------------------------------------------------------------------------------------
# Argument checks (shapes and dtypes only: no values are read, so no host sync).
# ---------------------------------------------------------------------------------------


def _check_parents(parents, num_nodes) -> None:
    if not isinstance(parents, torch.Tensor):
        raise ValueError(f"parents must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dtype != torch.int32:
        raise ValueError(f"parents must have dtype torch.int32, got {parents.dtype}")
    if parents.dim() != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents must have shape [B, N] with N >= 1, got {list(parents.shape)}")
    if num_nodes is not None:
        if not isinstance(num_nodes, torch.Tensor):
            raise ValueError(f"num_nodes must be a torch.Tensor or None, got {type(num_nodes).__name__}")
        if num_nodes.dtype != torch.int32:
            raise ValueError(f"num_nodes must have dtype torch.int32, got {num_nodes.dtype}")
        if num_nodes.shape != (parents.shape[0],):
            raise ValueError(f"num_nodes must have shape [{parents.shape[0]}] (one per request), "
                             f"got {list(num_nodes.shape)}")
        if num_nodes.device != parents.device:
            raise ValueError(f"num_nodes must be on {parents.device} (the device of parents), got {num_nodes.device}")


def num_mask_words(num_nodes: int) -> int:
    """Number of int64 words W of a mask row for trees of up to ``num_nodes`` nodes."""
    return max(1, (num_nodes + _WORD_BITS - 1) // _WORD_BITS)


def _num_jump_levels(n: int) -> int:
    # Depth <= n - 1, and after L rounds of doubling the jumps cover 2**L - 1 steps.
    return max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------
# Core: sanitised parents and the pointer-jumping tables.
# ---------------------------------------------------------------------------------------


def _path_bounds(n: int, max_depth, max_leaves) -> tuple[int, int]:
    """The static path bounds for N-node trees: defaults N - 1 and N; raise if out of range."""
    max_depth = n - 1 if max_depth is None else int(max_depth)
    max_leaves = n if max_leaves is None else int(max_leaves)
    if max_depth < 0 or max_leaves < 1:
        raise ValueError(f"max_depth must be >= 0 and max_leaves >= 1, got {max_depth} and {max_leaves}")
    return max_depth, max_leaves


def _sanitise(parents: torch.Tensor, num_nodes: Optional[torch.Tensor]):
    """valid bool [B, N], has_parent bool [B, N], parent int64 [B, N] (self for roots)."""
    batch, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    if num_nodes is None:
        valid = torch.ones(batch, n, dtype=torch.bool, device=parents.device)
    else:
        valid = idx[None, :] < num_nodes[:, None].to(torch.int64)
    p = parents.to(torch.int64)
    has_parent = valid & (p >= 0) & (p < idx[None, :])
    # Roots and padding point at themselves: jumping from them stays put.
    jump0 = torch.where(has_parent, p, idx[None, :].expand(batch, n))
    return valid, has_parent, jump0


def _jump_tables(has_parent: torch.Tensor, jump0: torch.Tensor):
    """Pointer-jumping tables: jumps[k][b, i] = the min(2**k, depth)-th ancestor of i.

    Returns (jumps, depth) with depth int64 [B, N] (roots and padding 0).
    """
    n = jump0.shape[1]
    jumps = [jump0]
    dist = has_parent.to(torch.int64)  # steps actually taken by jumps[k]
    cur = jump0
    for _ in range(_num_jump_levels(n)):
        dist = dist + torch.gather(dist, 1, cur)
        cur = torch.gather(cur, 1, cur)
        jumps.append(cur)
    return jumps, dist


def _own_bits(n: int, words: int, device) -> torch.Tensor:
    """int64 [n, words]: row i has bit i set (word i // 64, bit i % 64)."""
    idx = torch.arange(n, device=device)
    bit = torch.bitwise_left_shift(torch.ones(n, dtype=torch.int64, device=device), idx % _WORD_BITS)
    own = torch.zeros(n, words, dtype=torch.int64, device=device)
    return own.scatter_(1, (idx // _WORD_BITS)[:, None], bit[:, None])


def _mask_from_jumps(jumps, words: int) -> torch.Tensor:
    batch, n = jumps[0].shape
    mask = _own_bits(n, words, jumps[0].device)[None].expand(batch, n, words).contiguous()
    for jump in jumps[:-1]:
        # Before round k a row holds its ancestors up to distance 2**k - 1; OR in those of
        # the node 2**k steps up, which doubles the covered distance.
        mask = mask | torch.gather(mask, 1, jump[:, :, None].expand(batch, n, words))
    return mask


# ---------------------------------------------------------------------------------------
# Public builders.
# ---------------------------------------------------------------------------------------


def tree_depth(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depth of every node: int32 [B, N]; root 0, padding (i >= num_nodes[b]) -1."""
    _check_parents(parents, num_nodes)
    valid, has_parent, jump0 = _sanitise(parents, num_nodes)
    _, depth = _jump_tables(has_parent, jump0)
    return torch.where(valid, depth, -1).to(torch.int32)


def tree_positions(depth: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """RoPE positions int64 [B, N] = prefix_lens[b] + depth[b, i] (padding: prefix_lens[b]).

    ``prefix_lens`` int32/int64 [B] is the cache position of the root (node 0), so the root's
    position is ``prefix_lens[b]`` and a node at depth d sits where the d-th token after the
    root would sit in a plain sequence.
    """
    if not isinstance(prefix_lens, torch.Tensor) or prefix_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("prefix_lens must be an int32 or int64 tensor of shape [B]")
    if prefix_lens.shape != (depth.shape[0],):
        raise ValueError(f"prefix_lens must have shape [{depth.shape[0]}], got {list(prefix_lens.shape)}")
    if prefix_lens.device != depth.device:
        raise ValueError(f"prefix_lens must be on {depth.device}, got {prefix_lens.device}")
    return prefix_lens.to(torch.int64)[:, None] + depth.to(torch.int64).clamp(min=0)


def tree_mask(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bit-packed ancestor mask int64 [B, N, W], W = ceil(N / 64), tree_attention's layout.

    Bit j of ``mask[b, i, j // 64]`` (bit position j % 64) is set iff node j is node i or one
    of its ancestors. Padding rows hold only their own bit.
    """
    _check_parents(parents, num_nodes)
    _, has_parent, jump0 = _sanitise(parents, num_nodes)
    jumps, _ = _jump_tables(has_parent, jump0)
    return _mask_from_jumps(jumps, num_mask_words(parents.shape[1]))


def unpack_tree_mask(mask: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """bool [..., num_nodes]: the bits of packed rows ``mask`` int64 [..., W] (for tests/debugging)."""
    words = mask.shape[-1]
    shifts = torch.arange(_WORD_BITS, device=mask.device, dtype=torch.int64)
    bits = torch.bitwise_right_shift(mask[..., :, None], shifts) & 1
    return bits.reshape(*mask.shape[:-1], words * _WORD_BITS)[..., :num_nodes].to(torch.bool)


def tree_children(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None):
    """First-child / next-sibling lists.

    Returns ``(first_child, next_sibling, num_children)``, each int32 [B, N]: the children of
    node i are first_child[i], next_sibling[first_child[i]], ... in increasing index order;
    -1 ends a list. Padding nodes have no children and no siblings.
    """
    _check_parents(parents, num_nodes)
    _, has_parent, jump0 = _sanitise(parents, num_nodes)
    return _children(has_parent, jump0)


def _children(has_parent: torch.Tensor, jump0: torch.Tensor):
    batch, n = jump0.shape
    device = jump0.device
    idx = torch.arange(n, device=device)[None, :].expand(batch, n)
    # Nodes without a parent scatter into a trash column n.
    target = torch.where(has_parent, jump0, n)
    first = torch.full((batch, n + 1), n, dtype=torch.int64, device=device)
    first = first.scatter_reduce(1, target, idx, reduce="amin", include_self=True)[:, :n]
    first_child = torch.where(first == n, -1, first)
    num_children = torch.zeros(batch, n + 1, dtype=torch.int64, device=device)
    num_children = num_children.scatter_add(1, target, torch.ones_like(target))[:, :n]
    # Next sibling: sort nodes by parent (stable, so index order within a family); the next
    # element in that order is the next sibling when it has the same parent. Parentless
    # nodes get distinct keys n + i, so they have no siblings.
    key = torch.where(has_parent, jump0, n + idx)
    sorted_key, order = torch.sort(key, dim=1, stable=True)
    same = sorted_key[:, 1:] == sorted_key[:, :-1]
    nxt = torch.where(same, order[:, 1:], -1)
    nxt = torch.cat([nxt, torch.full((batch, 1), -1, dtype=nxt.dtype, device=device)], dim=1)
    next_sibling = torch.empty_like(nxt).scatter_(1, order, nxt)
    return first_child.to(torch.int32), next_sibling.to(torch.int32), num_children.to(torch.int32)


def _paths(jumps, depth, is_leaf, max_depth: int, max_leaves: int):
    batch, n = depth.shape
    device = depth.device
    k = torch.arange(max_depth + 1, device=device)
    # Entry k of a node's path is its (depth - k)-th ancestor (k <= depth), else -1.
    steps = depth[:, :, None] - k[None, None, :]  # [B, N, D+1]
    cur = torch.arange(n, device=device)[None, :, None].expand(batch, n, max_depth + 1)
    for level, jump in enumerate(jumps[:-1]):
        take = ((torch.bitwise_right_shift(steps.clamp(min=0), level) & 1) == 1)
        up = torch.gather(jump, 1, cur.reshape(batch, -1)).view(batch, n, max_depth + 1)
        cur = torch.where(take, up, cur)
    rows = torch.where(steps >= 0, cur, -1)
    slot = torch.cumsum(is_leaf.to(torch.int64), dim=1) - 1
    slot = torch.where(is_leaf & (slot < max_leaves), slot, max_leaves)  # trash row max_leaves
    out = torch.full((batch, max_leaves + 1, max_depth + 1), -1, dtype=torch.int64, device=device)
    out = out.scatter(1, slot[:, :, None].expand(batch, n, max_depth + 1), rows)
    return out[:, :max_leaves].to(torch.int32)


def tree_paths(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None, *,
               max_depth: Optional[int] = None, max_leaves: Optional[int] = None):
    """Root-to-leaf paths ("retrieve indices").

    Returns ``(paths, num_leaves)``: paths int32 [B, max_leaves, max_depth + 1], row r = the
    node indices from the root (column 0, always 0) to the r-th leaf in node-index order, -1
    padded; rows r >= num_leaves[b] are -1. num_leaves int32 [B].

    max_depth (static int, default N - 1) bounds the tree depth and max_leaves (default N) the
    leaf count; both fix the output shape so nothing depends on the data. A deeper path is
    cut after column max_depth (its leaf is missing) and leaves beyond max_leaves are dropped:
    pass bounds that hold (``validate_parents(..., max_depth=...)`` checks the depth).
    """
    _check_parents(parents, num_nodes)
    n = parents.shape[1]
    max_depth, max_leaves = _path_bounds(n, max_depth, max_leaves)
    valid, has_parent, jump0 = _sanitise(parents, num_nodes)
    jumps, depth = _jump_tables(has_parent, jump0)
    _, _, num_children = _children(has_parent, jump0)
    is_leaf = valid & (num_children == 0)
    depth = torch.where(valid, depth, -1)
    paths = _paths(jumps, depth, is_leaf, max_depth, max_leaves)
    return paths, is_leaf.sum(dim=1).to(torch.int32)


@dataclass
class Tree:
    """Everything the decode loop needs about a batch of draft trees (see the module doc).

    All tensors are on the device of ``parents``; B requests, N node slots, W = ceil(N/64).
    """

    parents: torch.Tensor  # int32 [B, N], -1 for the root and padding
    num_nodes: torch.Tensor  # int32 [B]
    depth: torch.Tensor  # int32 [B, N], padding -1
    positions: Optional[torch.Tensor]  # int64 [B, N] = prefix_lens + depth, when prefix_lens given
    tree_mask: torch.Tensor  # int64 [B, N, W]
    first_child: torch.Tensor  # int32 [B, N], -1 = none
    next_sibling: torch.Tensor  # int32 [B, N], -1 = none
    num_children: torch.Tensor  # int32 [B, N]
    is_leaf: torch.Tensor  # bool [B, N]
    num_leaves: torch.Tensor  # int32 [B]
    paths: torch.Tensor  # int32 [B, max_leaves, max_depth + 1], -1 padded

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.parents.shape[1]

    def qo_indptr(self) -> torch.Tensor:
        """int32 [B + 1]: offsets of each request's rows in the ragged (concatenated) layout."""
        return qo_indptr_from_num_nodes(self.num_nodes)

    def ragged_tree_mask(self, qo_indptr: torch.Tensor, num_rows: int) -> torch.Tensor:
        """int64 [num_rows, W]: the mask rows of all requests concatenated (see tree_mask_ragged)."""
        return tree_mask_ragged(self.tree_mask, qo_indptr, num_rows)

    def ragged_positions(self, qo_indptr: torch.Tensor, num_rows: int) -> torch.Tensor:
        """int64 [num_rows]: the positions concatenated like the mask rows (padding rows 0)."""
        if self.positions is None:
            raise ValueError("positions were not built: pass prefix_lens to build_tree")
        return ragged_rows(self.positions, qo_indptr, num_rows, fill=0)


def build_tree(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None,
               prefix_lens: Optional[torch.Tensor] = None, *, max_depth: Optional[int] = None,
               max_leaves: Optional[int] = None) -> Tree:
    """Build every representation of a batch of trees at once (one set of jump tables).

    parents int32 [B, N]; num_nodes int32 [B] or None (= N); prefix_lens int32/int64 [B] or
    None (then ``positions`` is None); max_depth / max_leaves as in :func:`tree_paths`.
    No host synchronisation; invalid parents are treated as described in the module doc.
    """
    _check_parents(parents, num_nodes)
    batch, n = parents.shape
    if num_nodes is None:
        num_nodes = torch.full((batch,), n, dtype=torch.int32, device=parents.device)
    max_depth, max_leaves = _path_bounds(n, max_depth, max_leaves)
    valid, has_parent, jump0 = _sanitise(parents, num_nodes)
    jumps, depth = _jump_tables(has_parent, jump0)
    depth = torch.where(valid, depth, -1)
    mask = _mask_from_jumps(jumps, num_mask_words(n))
    first_child, next_sibling, num_children = _children(has_parent, jump0)
    is_leaf = valid & (num_children == 0)
    paths = _paths(jumps, depth, is_leaf, max_depth, max_leaves)
    depth32 = depth.to(torch.int32)
    positions = None if prefix_lens is None else tree_positions(depth32, prefix_lens)
    return Tree(
        parents=parents, num_nodes=num_nodes, depth=depth32, positions=positions, tree_mask=mask,
        first_child=first_child, next_sibling=next_sibling, num_children=num_children,
        is_leaf=is_leaf, num_leaves=is_leaf.sum(dim=1).to(torch.int32), paths=paths,
    )


def chain_parents(batch: int, n: int, device=None) -> torch.Tensor:
    """parents int32 [batch, n] of a chain (node i's parent is i - 1)."""
    return (torch.arange(n, dtype=torch.int32, device=device) - 1)[None, :].expand(batch, n).contiguous()


# ---------------------------------------------------------------------------------------
# Ragged (concatenated) layout.
# ---------------------------------------------------------------------------------------


def qo_indptr_from_num_nodes(num_nodes: torch.Tensor) -> torch.Tensor:
    """int32 [B + 1] = [0, cumsum(num_nodes)]: row offsets of the requests when concatenated."""
    zero = torch.zeros(1, dtype=torch.int64, device=num_nodes.device)
    return torch.cat([zero, torch.cumsum(num_nodes.to(torch.int64), 0)]).to(torch.int32)


def ragged_rows(x: torch.Tensor, qo_indptr: torch.Tensor, num_rows: int, fill=0) -> torch.Tensor:
    """Concatenate per-request rows: x [B, N, ...] -> [num_rows, ...].

    Output row t belongs to request b with qo_indptr[b] <= t < qo_indptr[b+1] and is
    x[b, t - qo_indptr[b]]. ``num_rows`` is a static int (typically the T of the attention
    call) so that nothing depends on the data; rows t >= qo_indptr[B], and rows whose local
    index is >= N, are ``fill``.
    """
    if not isinstance(qo_indptr, torch.Tensor) or qo_indptr.dtype not in (torch.int32, torch.int64):
        raise ValueError("qo_indptr must be an int32 or int64 tensor of shape [B + 1]")
    batch, n = x.shape[0], x.shape[1]
    if qo_indptr.shape != (batch + 1,):
        raise ValueError(f"qo_indptr must have shape [{batch + 1}] (B + 1), got {list(qo_indptr.shape)}")
    if qo_indptr.device != x.device:
        raise ValueError(f"qo_indptr must be on {x.device}, got {qo_indptr.device}")
    indptr = qo_indptr.to(torch.int64)
    t = torch.arange(num_rows, device=x.device, dtype=torch.int64)
    req = torch.searchsorted(indptr[1:].contiguous(), t, right=True)
    req_c = req.clamp(max=batch - 1)
    local = t - indptr[req_c]
    ok = (req < batch) & (local >= 0) & (local < n)
    rows = x[req_c, local.clamp(0, n - 1)]
    ok = ok.view(num_rows, *([1] * (rows.dim() - 1)))
    return torch.where(ok, rows, torch.full_like(rows, fill))


def tree_mask_ragged(mask: torch.Tensor, qo_indptr: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Ragged tree_attention mask int64 [num_rows, W] from the batched one [B, N, W].

    Row qo_indptr[b] + j is node j of request b; bits stay request-local (bit j = node j of
    the same request). Rows outside every request (or past N) are 0.
    """
    return ragged_rows(mask, qo_indptr, num_rows, fill=0)


# ---------------------------------------------------------------------------------------
# Validation (explicit; synchronises with the host).
# ---------------------------------------------------------------------------------------


def validate_parents(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None, *,
                     max_depth: Optional[int] = None) -> None:
    """Raise ValueError unless ``parents`` (+ ``num_nodes``) describes valid trees.

    Checks, per request b: 1 <= num_nodes[b] <= N; the root ``parents[b, 0] == -1``; for
    0 < i < num_nodes[b] a parent in range (0 <= parents[b, i] < num_nodes[b]) that precedes
    its child (parents[b, i] < i; a parent at or after its child is reported as a cycle when
    following parents from i comes back to i, else as a child before its parent); padding
    entries (i >= num_nodes[b]) equal -1; and, when given, depth <= max_depth.

    Unlike the builders this reads the values, so it copies them to the host (a device
    synchronisation): call it in tests, when loading a tree configuration, or when debugging,
    not on every decode step.
    """
    _check_parents(parents, num_nodes)
    batch, n = parents.shape
    p = parents.detach().to("cpu", torch.int64)
    if num_nodes is None:
        nn = [n] * batch
    else:
        nn = num_nodes.detach().to("cpu", torch.int64).tolist()
    for b in range(batch):
        count = nn[b]
        if count < 1 or count > n:
            raise ValueError(f"num_nodes[{b}] = {count} must be in [1, {n}] (every tree has its root, node 0)")
    idx = torch.arange(n)
    valid = idx[None, :] < torch.tensor(nn)[:, None]
    bad_root = p[:, 0] != -1
    if bad_root.any():
        b = int(bad_root.nonzero()[0, 0])
        raise ValueError(f"missing root: parents[{b}, 0] = {int(p[b, 0])}, but node 0 is the root and "
                         f"its parent must be -1")
    body = valid.clone()
    body[:, 0] = False
    rows = p.tolist()
    bad = body & ((p < 0) | (p >= idx[None, :]))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        par = rows[b][i]
        count = nn[b]
        if par == -1:
            raise ValueError(f"missing parent: parents[{b}, {i}] = -1 but only node 0 may be a root "
                             f"(node {i} < num_nodes[{b}] = {count})")
        if par < -1 or par >= count:
            raise ValueError(f"parent out of range: parents[{b}, {i}] = {par}, expected a node index in "
                             f"[0, {i}) (num_nodes[{b}] = {count})")
        # par >= i: either a cycle through i or a child listed before its parent.
        seen, cur = set(), i
        while 0 < cur < count and cur not in seen and 0 <= rows[b][cur] < count:
            seen.add(cur)
            cur = rows[b][cur]
            if cur == i:
                raise ValueError(f"cycle: following parents from node {i} of request {b} returns to node "
                                 f"{i} (parents[{b}, {i}] = {par})")
        raise ValueError(f"child before its parent: parents[{b}, {i}] = {par} but a parent must precede "
                         f"its child (parents[b, i] < i)")
    bad_pad = ~valid & (p != -1)
    if bad_pad.any():
        b, i = (int(v) for v in bad_pad.nonzero()[0])
        raise ValueError(f"padding not -1: parents[{b}, {i}] = {rows[b][i]} but node {i} >= "
                         f"num_nodes[{b}] = {nn[b]} is padding")
    if max_depth is not None:
        depth = tree_depth(parents.detach().cpu(), None if num_nodes is None else num_nodes.detach().cpu())
        worst = int(depth.max())
        if worst > max_depth:
            b = int((depth.max(dim=1).values == worst).nonzero()[0, 0])
            raise ValueError(f"tree too deep: request {b} has depth {worst} > max_depth = {max_depth}")


# ---------------------------------------------------------------------------------------
# Medusa "choices" trees.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MedusaTree:
    """A static Medusa tree (same for every request and step).

    Node 0 is the root; node i > 0 is ``choices[i - 1]``: the token of top-k rank
    ``rank[i] = choices[i-1][-1]`` of Medusa head ``head[i] = len(choices[i-1]) - 1``,
    appended after its parent, the node of ``choices[i-1][:-1]``. Nodes are ordered by
    (depth, choice), the order the Medusa repository uses, so parents precede children.

    parents, head, rank, depth: int32 [N] on ``device``; head and rank are -1 at the root.
    Build it on the device the decode loop runs on (``medusa_tree(choices, device=...)``), so
    that :meth:`token_ids` copies nothing from the host (and stays CUDA-graph capturable).

    The root-to-leaf paths (``build_tree(tree.batch_parents(B)).paths``) are the rows of
    Medusa's ``retrieve_indices`` in node-index order of the leaves (Medusa lists the same
    rows starting from the last choice), int32 and -1 padded.
    """

    choices: tuple
    parents: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor
    depth: torch.Tensor
    num_heads: int  # heads used = max depth
    top_k: int  # top-k entries needed per head = max rank + 1

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    def batch_parents(self, batch: int) -> torch.Tensor:
        """parents int32 [batch, N] (the same tree for every request)."""
        return self.parents[None, :].expand(batch, -1).contiguous()

    def token_ids(self, root_token_ids: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Fill the tree with tokens: int64 [B, N].

        root_token_ids int64 [B] (node 0); topk_ids int64 [B, K, top_k] — per request the
        top-k token ids of each of the K >= num_heads Medusa heads, best first (the
        ``topk_ids`` of ``specdec::medusa_topk``), with top_k >= self.top_k. Node i gets
        ``topk_ids[b, head[i], rank[i]]``. Pure gathers, no host sync.
        """
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 3:
            raise ValueError("topk_ids must be a tensor of shape [B, num_heads, top_k]")
        batch, heads, k = topk_ids.shape
        if heads < self.num_heads or k < self.top_k:
            raise ValueError(f"topk_ids must have shape [B, >= {self.num_heads}, >= {self.top_k}] for this tree, "
                             f"got {list(topk_ids.shape)}")
        if not isinstance(root_token_ids, torch.Tensor) or root_token_ids.shape != (batch,):
            raise ValueError(f"root_token_ids must be a tensor of shape [{batch}]")
        device = topk_ids.device
        flat_index = (self.head.clamp(min=0).to(torch.int64) * k + self.rank.clamp(min=0)).to(device)
        tokens = topk_ids.reshape(batch, heads * k)[:, flat_index].to(torch.int64)
        is_root = (self.head < 0).to(device)
        return torch.where(is_root[None, :], root_token_ids.to(torch.int64)[:, None], tokens)


def medusa_tree(choices: Sequence[Sequence[int]] = MC_SIM_7B_63, device=None) -> MedusaTree:
    """Convert a Medusa choices list into a :class:`MedusaTree` (host-side, done once).

    Raises ValueError on an empty choice, a negative rank, a duplicate, or a choice whose
    prefix (its parent) is not in the list.
    """
    normalised = []
    for c in choices:
        t = tuple(int(v) for v in c)
        if len(t) == 0:
            raise ValueError("medusa choices: an empty choice () is the root and must not be listed")
        if any(v < 0 for v in t):
            raise ValueError(f"medusa choices: negative top-k rank in {t}")
        normalised.append(t)
    if len(set(normalised)) != len(normalised):
        dup = next(t for t in normalised if normalised.count(t) > 1)
        raise ValueError(f"medusa choices: duplicate choice {dup}")
    ordered = sorted(normalised, key=lambda t: (len(t), t))
    node_of = {(): 0}
    for i, t in enumerate(ordered, start=1):
        node_of[t] = i
    parents, head, rank, depth = [-1], [-1], [-1], [0]
    for t in ordered:
        if t[:-1] not in node_of:
            raise ValueError(f"medusa choices: the parent {t[:-1]} of {t} is missing")
        parents.append(node_of[t[:-1]])
        head.append(len(t) - 1)
        rank.append(t[-1])
        depth.append(len(t))

    def as_tensor(v):
        return torch.tensor(v, dtype=torch.int32, device=device)

    return MedusaTree(
        choices=tuple(ordered), parents=as_tensor(parents), head=as_tensor(head), rank=as_tensor(rank),
        depth=as_tensor(depth), num_heads=max(depth), top_k=max(rank) + 1,
    )


# ---------------------------------------------------------------------------------------
# EAGLE-2 dynamic trees.
# ---------------------------------------------------------------------------------------


@dataclass
class EagleTree:
    """The tree selected from EAGLE-2 expansions: N = num_draft_tokens + 1 nodes (root first).

    parents int32 [B, N]; candidate int64 [B, N] = index of the node's candidate in the
    concatenation of all steps' candidates (root -1); token_ids int64 [B, N] (root =
    root_token_ids, or -1 when not given; None when no token lists were given); scores fp32
    [B, N] (the selection key, root 0).
    """

    parents: torch.Tensor
    candidate: torch.Tensor
    token_ids: Optional[torch.Tensor]
    scores: torch.Tensor


def eagle_tree_from_expansions(scores: Sequence[torch.Tensor], parents: Sequence[Optional[torch.Tensor]],
                               num_draft_tokens: int, token_ids: Optional[Sequence[torch.Tensor]] = None,
                               root_token_ids: Optional[torch.Tensor] = None) -> EagleTree:
    """Select the best ``num_draft_tokens`` candidates of an EAGLE-2 expansion into a tree.

    EAGLE-2 drafts in steps. Step 0 expands the root into C_0 candidates (its top-k tokens);
    step d > 0 expands a beam of G_d candidates of step d-1 into C_d candidates (each beam
    node's top-k, so C_d = G_d * k, in groups of k). Every candidate carries its cumulative
    log-probability (the sum of the draft log-probs along its path). The verified tree is the
    root plus the ``num_draft_tokens`` candidates with the highest cumulative score over all
    steps — a set that contains the parent of every member, because a child's cumulative
    log-prob is never above its parent's.

    scores[d]: float [B, C_d], cumulative scores of step d's candidates.
    parents[d]: None for d = 0 (the parent is the root); for d > 0 an integer tensor [B, C_d]
        (the parent of each candidate) or [B, G_d] with C_d a multiple of G_d (the parent of
        each consecutive group of C_d / G_d candidates), holding indices into step d-1's
        candidates (0 <= v < C_{d-1}; values outside are clamped, never read out of bounds).
    token_ids[d] (optional): int64 [B, C_d], the token of each candidate.
    root_token_ids (optional): int64 [B], the root's token.

    Ordering and ties: nodes are sorted by candidate index (step-major), so a parent precedes
    its children. The selection key is the score made monotone along paths (min with the
    parent's key; NaN counts as -inf) and ties go to the lower candidate index, so the
    selected set is closed under taking parents even when scores tie (torch.topk's tie order
    is unspecified, which could select a child without its parent) or are not log-probs.
    With genuine log-probs the key equals the score.

    Returns an :class:`EagleTree` with N = num_draft_tokens + 1 nodes. No host sync.
    """
    sizes = _expansion_sizes(scores, parents, num_draft_tokens, token_ids)
    batch = scores[0].shape[0]
    device = scores[0].device
    all_keys, all_parents = _monotone_keys(scores, parents, sizes)

    # Stable descending sort: equal keys keep candidate order, so parents come first.
    _, order = torch.sort(all_keys, dim=1, descending=True, stable=True)
    chosen, _ = torch.sort(order[:, :num_draft_tokens], dim=1)
    chosen_parent = torch.gather(all_parents, 1, chosen)
    # The parent's node index is its rank among the chosen candidates, plus one (the root).
    parent_node = torch.searchsorted(chosen, chosen_parent.clamp(min=0)) + 1
    parent_node = torch.where(chosen_parent < 0, 0, parent_node)
    root = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    tree_parents = torch.cat([root, parent_node], dim=1).to(torch.int32)
    candidate = torch.cat([root, chosen], dim=1)
    node_scores = torch.cat([torch.zeros(batch, 1, device=device), torch.gather(all_keys, 1, chosen)], dim=1)

    tokens = None
    if token_ids is not None:
        for d, t in enumerate(token_ids):
            if not isinstance(t, torch.Tensor) or t.shape != (batch, sizes[d]):
                raise ValueError(f"token_ids[{d}] must have shape [{batch}, {sizes[d]}], got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        all_tokens = torch.cat([t.to(torch.int64) for t in token_ids], dim=1)
        root_tok = root if root_token_ids is None else root_token_ids.to(torch.int64).view(batch, 1)
        tokens = torch.cat([root_tok, torch.gather(all_tokens, 1, chosen)], dim=1)
    return EagleTree(parents=tree_parents, candidate=candidate, token_ids=tokens, scores=node_scores)


def _expansion_sizes(scores, parents, num_draft_tokens: int, token_ids) -> list:
    """The candidate counts C_d of ``eagle_tree_from_expansions``' steps, after checking the
    list lengths, the score tensors and ``num_draft_tokens`` (ValueError)."""
    if len(scores) == 0:
        raise ValueError("scores must hold at least one expansion step")
    if len(parents) != len(scores):
        raise ValueError(f"parents must have one entry per step ({len(scores)}), got {len(parents)}")
    if parents[0] is not None:
        raise ValueError("parents[0] must be None: step 0 candidates are children of the root")
    if token_ids is not None and len(token_ids) != len(scores):
        raise ValueError(f"token_ids must have one entry per step ({len(scores)}), got {len(token_ids)}")
    batch = scores[0].shape[0]
    sizes = []
    for d, s in enumerate(scores):
        if not isinstance(s, torch.Tensor) or s.dim() != 2 or s.shape[0] != batch or not s.is_floating_point():
            raise ValueError(f"scores[{d}] must be a float tensor of shape [{batch}, C_{d}], got "
                             f"{getattr(s, 'shape', type(s).__name__)}")
        sizes.append(s.shape[1])
    total = sum(sizes)
    if not 0 <= num_draft_tokens <= total:
        raise ValueError(f"num_draft_tokens must be in [0, {total}] (the number of candidates), got {num_draft_tokens}")
    return sizes


def _monotone_keys(scores, parents, sizes: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys fp32 [B, sum C_d], parents int64 [B, sum C_d]) over all steps' candidates, in
    candidate (step-major) order: each key is the score with NaN as -inf, made monotone
    along paths (min with the parent's key); each parent is the global candidate index of
    the candidate's parent (-1: the root). Checks ``parents[d]`` (ValueError)."""
    batch = scores[0].shape[0]
    device = scores[0].device
    keys, parent_global = [], []
    offset = 0
    prev_key = None
    for d, s in enumerate(scores):
        key = torch.nan_to_num(s.to(torch.float32), nan=float("-inf"))
        if d == 0:
            par = torch.full((batch, sizes[0]), -1, dtype=torch.int64, device=device)
        else:
            p = parents[d]
            if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.shape[0] != batch or p.is_floating_point():
                raise ValueError(f"parents[{d}] must be an integer tensor of shape [{batch}, C_{d}] or [{batch}, G_{d}]")
            if p.shape[1] != sizes[d]:
                if p.shape[1] == 0 or sizes[d] % p.shape[1] != 0:
                    raise ValueError(f"parents[{d}] has {p.shape[1]} columns, which neither equals nor divides "
                                     f"C_{d} = {sizes[d]}")
                p = p.repeat_interleave(sizes[d] // p.shape[1], dim=1)
            local = p.to(torch.int64).clamp(0, sizes[d - 1] - 1)
            key = torch.minimum(key, torch.gather(prev_key, 1, local))
            par = local + (offset - sizes[d - 1])
        keys.append(key)
        parent_global.append(par)
        prev_key = key
        offset += sizes[d]
    return torch.cat(keys, dim=1), torch.cat(parent_global, dim=1)


def merge_token_trees(parents: list, tokens: list, other_parents: list, other_tokens: list) -> tuple[list, list]:
    """The union of two draft trees with the same root (``parents[i] < i``, token ids): the
    other tree's nodes are appended after the first's, except where the path already has
    the node (the same parent and token), which is shared. Returns (parents, tokens)."""
    parents, tokens = list(parents), list(tokens)
    child = {(parents[i], tokens[i]): i for i in range(len(parents) - 1, 0, -1)}
    where = [0] * len(other_parents)
    for j in range(1, len(other_parents)):
        key = (where[other_parents[j]], other_tokens[j])
        if key not in child:
            child[key] = len(tokens)
            parents.append(key[0])
            tokens.append(key[1])
        where[j] = child[key]
    return parents, tokens

