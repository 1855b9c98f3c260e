"""Loop references of the tree builders (``specdec_kernels.tree``); tests only.

A tree is a Python list ``parents`` of length N (node 0 the root, -1 beyond ``num_nodes``).
Everything walks parent pointers one step at a time.
"""


def ancestors(parents, i):
    """Node i and its ancestors, from i up to the root."""
    out = [i]
    while parents[out[-1]] != -1:
        out.append(parents[out[-1]])
    return out


def depth(parents, num_nodes):
    """Depth per node slot: root 0, padding -1."""
    return [len(ancestors(parents, i)) - 1 if i < num_nodes else -1 for i in range(len(parents))]


def positions(parents, num_nodes, prefix_len):
    return [prefix_len + max(d, 0) for d in depth(parents, num_nodes)]


def mask_bits(parents, num_nodes):
    """Per node slot, the set of visible nodes (itself + ancestors) as a Python int bitset."""
    rows = []
    for i in range(len(parents)):
        bits = 0
        for a in (ancestors(parents, i) if i < num_nodes else [i]):
            bits |= 1 << a
        rows.append(bits)
    return rows


def to_words(bits, num_words):
    """A bitset as num_words signed int64 words, bit j in word j // 64 at position j % 64."""
    words = []
    for w in range(num_words):
        u = (bits >> (64 * w)) & ((1 << 64) - 1)
        words.append(u - (1 << 64) if u >= 1 << 63 else u)
    return words


def mask_words(parents, num_nodes):
    num_words = max(1, (len(parents) + 63) // 64)
    return [to_words(bits, num_words) for bits in mask_bits(parents, num_nodes)]


def children(parents, num_nodes):
    """children[i] = the children of node i in increasing index order."""
    out = [[] for _ in parents]
    for i in range(1, num_nodes):
        out[parents[i]].append(i)
    return out


def first_child_next_sibling(parents, num_nodes):
    kids = children(parents, num_nodes)
    first_child = [k[0] if k else -1 for k in kids]
    next_sibling = [-1] * len(parents)
    for k in kids:
        for a, b in zip(k, k[1:]):
            next_sibling[a] = b
    return first_child, next_sibling, [len(k) for k in kids]


def leaves(parents, num_nodes):
    kids = children(parents, num_nodes)
    return [i for i in range(num_nodes) if not kids[i]]


def paths(parents, num_nodes):
    """Root-to-leaf paths (root first), leaves in index order."""
    return [list(reversed(ancestors(parents, leaf))) for leaf in leaves(parents, num_nodes)]


def medusa_parents(choices):
    """Medusa choices -> (ordered choices, parents, head, rank), nodes sorted by (len, choice)."""
    ordered = sorted((tuple(c) for c in choices), key=lambda t: (len(t), t))
    index = {(): 0}
    for i, c in enumerate(ordered):
        index[c] = i + 1
    parents = [-1] + [index[c[:-1]] for c in ordered]
    head = [-1] + [len(c) - 1 for c in ordered]
    rank = [-1] + [c[-1] for c in ordered]
    return ordered, parents, head, rank


def eagle_select(scores, parents, num_draft_tokens):
    """EAGLE-2 selection for one request, by explicit candidate records.

    scores[d]: list of cumulative scores of step d's candidates; parents[d]: list (one per
    candidate) of indices into step d-1's candidates (parents[0] unused). A candidate's key
    is the minimum score along its path (NaN = -inf); the best num_draft_tokens keys are
    chosen, ties to the lower global index; nodes are ordered by global index.
    Returns (tree parents incl. root, chosen global candidate indices).
    """
    records = []  # (global index, key, parent global index or -1)
    offsets = []
    for d, step in enumerate(scores):
        offsets.append(len(records))
        for c, s in enumerate(step):
            s = float("-inf") if s != s else float(s)
            if d == 0:
                records.append((len(records), s, -1))
            else:
                pg = offsets[d - 1] + parents[d][c]
                records.append((len(records), min(s, records[pg][1]), pg))
    best = sorted(records, key=lambda r: (-r[1], r[0]))[:num_draft_tokens]
    chosen = sorted(r[0] for r in best)
    node = {g: i + 1 for i, g in enumerate(chosen)}
    tree_parents = [-1] + [0 if records[g][2] == -1 else node[records[g][2]] for g in chosen]
    return tree_parents, chosen
