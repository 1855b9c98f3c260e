"""Prompt lookup (no model): the continuation of earlier occurrences of the request's last
tokens.

- :class:`NgramDrafter` — the latest occurrence of the last n tokens, as a chain;
- :class:`NgramTreeDrafter` — several occurrences merged into a trie, sized by measured
  acceptance tables (:func:`ngram_tables_for`) against the step-cost curve.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..decoding.cost_model import best_node_count
from ..decoding.drafter import Draft, Drafter, SizedDrafter
from ..tree import merge_token_trees


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) in the request's tokens and propose what followed.

    ``min_ngram`` = 2 by default: a one-token match is mostly a coincidence (a common word or
    punctuation), and a rejected draft costs a wider verification. SmolLM2-135M, 1 thread, 4
    of the package's prompts x 2, 48 tokens, constant k = 4, same process: min 1 gave 1.09x
    our autoregressive tokens/s (mean accepted length 1.94), min 2 gave 1.28x (1.87)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, max_k: int = 16):
        self.max_ngram, self.min_ngram, self.max_nodes = max_ngram, min_ngram, max_k + 1

    def lookup(self, tokens: list, k: int) -> list:
        arr = np.asarray(tokens, dtype=np.int64)
        L = arr.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = arr[L - n:]
            # Windows starting at 0..L-n-1 (strictly before the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start: start + k].tolist()
        return []

    def propose(self, gen, reqs, lengths):
        return [Draft.chain(r.tokens[-1], self.lookup(r.tokens, k) if k > 0 else []) for r, k in zip(reqs, lengths)]



def accepted_on_tree(parents: list, tokens: list, accepted: list) -> int:
    """How many of a step's ``accepted`` drafted tokens (in order) lie on the token tree
    (``parents``, ``tokens``; node 0 the root) from its root: a lookup's own evidence when its
    tree was merged with another drafter's."""
    node, count = 0, 0
    for t in accepted:
        node = next((j for j in range(1, len(parents)) if parents[j] == node and tokens[j] == t), None)
        if node is None:
            break
        count += 1
    return count


class Candidates(NamedTuple):
    """A request's trie of prompt-lookup continuations (node 0 = the root; every node's
    parent precedes it), as :meth:`NgramTreeDrafter.candidates` builds it."""

    tokens: list  # int token ids
    parents: list  # int, parents[0] = -1
    depths: list  # int, root 0
    ranked: list  # [(p, node)] over the non-root nodes, most probable first (ties: shallower, earlier), at most max_nodes - 1
    guess: tuple = ()  # (token, unscaled probability) of the lookup's most probable node; () if it has none
    opened: frozenset = frozenset()  # the nodes answer openings predict (NgramTreeDrafter.opening_tries)

    def tree(self, n: int) -> tuple[list, list]:
        """(parents, token ids) of the tree of the root and the ``n`` best-ranked nodes (a
        tree: a node never ranks above its parent), ordered by depth."""
        keep = sorted((i for _, i in self.ranked[:n]), key=lambda i: (self.depths[i], i))  # parents before children
        new = {0: 0}
        parents, ids = [-1], [self.tokens[0]]
        for i in keep:
            new[i] = len(ids)
            parents.append(new[self.parents[i]])
            ids.append(self.tokens[i])
        return parents, ids


def one_hot_chain(draft: Draft, vocab_size: int) -> Draft:
    """A chain ``draft`` with its q rows: row i one-hot on node i + 1's token (its one
    deterministic child; ``tree_rejection_sample`` accepts it with probability p'(x), as it
    does a draft without q rows), the leaf's row zero. For a sampled request in a batch whose
    other drafts carry q rows."""
    if any(p != i - 1 for i, p in enumerate(draft.parents)):
        raise ValueError(f"one_hot_chain needs a chain, got parents {draft.parents}")
    probs = torch.zeros(len(draft.tokens), vocab_size, dtype=torch.float32)
    for i, t in enumerate(draft.tokens[1:]):
        probs[i, t] = 1.0
    return Draft(draft.parents, draft.tokens, probs)


def key_ends_at(tokens, end: int, key: tuple) -> bool:
    """Whether ``tokens[end - len(key):end]`` are the ids ``key`` (a list or an int array)."""
    return end >= len(key) and tuple(int(t) for t in tokens[end - len(key):end]) == key


class NgramTables(NamedTuple):
    """:class:`NgramTreeDrafter`'s acceptance model: a lookup continuation's i-th token is
    accepted with probability ``first[m - 1] * rank[r] * next[m - 1] ** (i - 1)`` for a match
    of m tokens (past the tables' end: their last entry) at rank r among the matches of that
    length (0 = the most recent)."""

    first: tuple
    next: tuple
    rank: tuple
    # Answer openings: (key, opening, count) — ``count`` answers to prompts ending in the
    # tokens ``key`` began with the tokens ``opening`` and went on in ways too rare to keep
    # (NgramTreeDrafter.opening_tries).
    openings: tuple = ()


# Tables measured per model by bench/fit_ngram_tables.py (its greedy outputs, the counts and
# the simulation that fitted them are recorded with each entry).
NGRAM_TABLES_PATH = Path(__file__).resolve().parent.parent / "data" / "ngram_tables.json"


def ngram_tables_for(model_name: str) -> NgramTables | None:
    """The acceptance tables measured for ``model_name`` (a registered name or a model's
    ``name``, e.g. "Qwen2.5 Coder 1.5B Instruct GGUF"): the entry of NGRAM_TABLES_PATH whose
    key the name contains (letters and digits only), or None if none was measured for it."""
    def squash(text):
        return re.sub(r"[^a-z0-9]", "", str(text).lower())

    try:
        entries = json.loads(NGRAM_TABLES_PATH.read_text())
    except FileNotFoundError:
        return None
    name = squash(model_name)
    entry = next((e for key, e in entries.items() if squash(key) in name), None)
    if entry is None:
        return None
    try:
        openings = tuple((tuple(map(int, key)), tuple(map(int, opening)), int(count))
                         for key, opening, count in entry.get("openings", ()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{NGRAM_TABLES_PATH}: the openings of {model_name!r} must be [key ids, opening ids, "
                         f"count] rows ({e})") from None
    if any(not key or not opening or count < 1 or min(key + opening) < 0 for key, opening, count in openings):
        raise ValueError(f"{NGRAM_TABLES_PATH}: every opening of {model_name!r} needs a key, tokens (ids >= 0) "
                         "and a count >= 1")
    tables = NgramTables(tuple(entry["first"]), tuple(entry["next"]), tuple(entry["rank"]), openings)
    if not (tables.first and len(tables.first) == len(tables.next) and tables.rank and tables.rank[0] == 1.0
            and all(0.0 < p < 1.0 for p in tables.first + tables.next) and all(0.0 < p <= 1.0 for p in tables.rank)):
        raise ValueError(f"{NGRAM_TABLES_PATH}: the tables of {model_name!r} must be probabilities in (0, 1), "
                         "first and next of one length, rank starting at 1.0")
    return tables


class NgramTreeDrafter(SizedDrafter):
    """Prompt lookup as a token tree: the continuations of *several* earlier occurrences of the
    request's last tokens, merged into one trie, sized by an estimate of each node's
    acceptance probability against the measured cost of verifying more rows, and verified in
    one target forward (``tree_attention`` + ``tree_rejection_sample``).

    Matches: every position ``j < L-1`` whose token equals the last token, with its match
    length ``m`` (how many tokens agree backwards from there, at most ``max_ngram``) and its
    rank among the matches of the same length (0 = the most recent); the ``max_matches``
    longest (then most recent) put their next ``k`` tokens into a trie.

    Acceptance model: the i-th token (i = 1, 2, ...) of a match's continuation is accepted
    with probability ``FIRST[m] * RANK[rank] * NEXT[m] ** (i - 1)``; a trie node's probability
    is the noisy-or over the matches through it, so a child never scores above its parent and
    the most probable nodes always form a tree. The tables depend on the model (how much it
    copies, how it loops): a model with tables measured for it (:func:`ngram_tables_for`,
    bench/fit_ngram_tables.py) uses those; any other uses the class's, measured on greedy
    SmolLM2-135M outputs (64 tokens) of the Spec-Bench dev prompts: the most recent match of
    one token predicts the next token 21% of the time, of two tokens 46%, three 64%, six or
    more 85%; once a continuation is being accepted, its next token follows with ~70% (short
    matches) to 86% (m >= 6) — copying and the small model's loops make long matches common.

    Size: over the whole batch, the most probable nodes are kept while they pay for
    themselves: the number of verified rows ``R`` (B roots + the kept nodes) maximises
    expected tokens per step over step cost, ``(B + sum p) / cost(R, B)``, where ``cost`` is
    the step-cost curve of the target (``decoding.cost_model``: seconds per verification step
    against rows and batch size, measured for the loaded model, weight format, thread count
    and CPU at first use and cached per machine; or the ``step_cost`` given here or to the
    Generator). On fp32 weights an extra row costs ~5% of a one-row step up to ~12 rows; on
    GGUF block weights the quantised GEMM streams the blocks once for all rows, so extra rows
    are cheaper still — the curve, not a table, says how many pay. When no node pays for itself the step is a
    plain autoregressive one (no extra rows); at batch B > 1 the few nodes that still pay go
    to the requests with the most probable drafts.

    Per request, the tables are checked against what the target emits (:meth:`verified`):
    every step, drafted or not, the probability the trie gave its most probable node (a
    first-level one) is compared with whether the emitted token was that node's, and the
    request's probabilities
    are scaled by (hits + PRIOR) / (expected hits + PRIOR) over a decaying window (DECAY); a
    step that drafted adds its accepted count to the hits and its drafted nodes' summed
    probability to the expected hits (remembered over ~30 steps, DRAFT_DECAY), so drafts that are accepted less often than the tables
    say (the 1.5B writing new code: 35% against a promised 50%+, where a row costs half a
    step) lower the scale until they stop. On a
    prompt with nothing to copy (open questions: the matches are common words and
    punctuation) the tables promise hits that never come, the scale falls within a few steps,
    no node pays for its row, and the steps are plain autoregressive ones — so the default
    drafter costs nothing measurable where it cannot help; when the output starts copying,
    the hits raise the scale again.

    Answer openings: at an answer's start nothing in the prompt predicts its first tokens (a
    chat model's code answer opens with a fence and a language name). Tables with
    ``openings`` (how the model's answers began after a prompt with the same last tokens,
    measured by bench/fit_ngram_tables.py) add those that agree with the answer so far to the
    trie (:meth:`opening_tries`), combined with the matches as a noisy-or; what they deliver
    is no evidence on the lookup's tables, so it leaves the per-request scale alone.

    Deterministic drafts (no ``probs``): greedy decoding is exact, and sampling stays exact
    because ``tree_rejection_sample`` treats deterministic siblings as one-hot proposals
    (the trie has distinct sibling tokens).
    """

    name = "ngram-tree"
    # Indexed by min(m, len) - 1 / min(rank, len - 1). FIRST: the measured rates above for m
    # >= 6, shrunk for short matches (0.21, 0.46, 0.64, 0.70, 0.70 measured): weak drafts are
    # worth fewer rows than their marginal rate says (several one-token matches agreeing are
    # one piece of evidence, not independent ones); the shrink maximised the simulated speedup
    # (greedy outputs + the fp32 verify-cost table measured then) over the 120 dev prompts: 1.43x -> 1.48x.
    FIRST = (0.10, 0.23, 0.45, 0.49, 0.49, 0.85)
    NEXT = (0.60, 0.68, 0.72, 0.75, 0.78, 0.86)
    RANK = (1.0, 0.85, 0.75, 0.55)
    DECAY = 0.85  # per step: the scale follows about the last 7 steps
    DRAFT_DECAY = 0.97  # per step, for the drafted steps' evidence: about the last 30 steps
    PRIOR = 0.5  # expected hits the tables are trusted for before any evidence (small: a wrong draft costs a row)
    MAX_SCALE = 1.25  # the tables were fitted to this model family: evidence may raise them a little

    def __init__(self, max_ngram: int | None = None, max_k: int = 16, *, max_nodes: int = 16, max_matches: int = 8,
                 step_cost=None, tables: NgramTables | str | None = None):
        """``step_cost``: a ``cost_model.StepCost``, a callable ``rows -> cost relative to a
        one-row step``, or a sequence of those relative costs at 1, 2, ... rows; default: the
        Generator's ``step_cost`` (the target's measured curve unless it was given one),
        taken at ``start``.
        ``tables``: the acceptance tables (:class:`NgramTables`), or a model name whose
        measured ones to use; default: those measured for the Generator's target, found by
        its name at ``start`` (the class's, SmolLM2-135M's, where none were). ``max_ngram``:
        the longest match length told apart; default: the tables' length."""
        self._given_max_ngram = max_ngram
        self.max_ngram, self.max_k, self.max_matches = max_ngram or len(self.FIRST), max_k, max_matches
        self.openings: dict = {}  # key (the prompt's last tokens) -> [(opening, count)] (opening_tries)
        self._opening_len = 0  # the longest opening's tokens
        self._tables_given = tables is not None
        if isinstance(tables, str):
            name, tables = tables, ngram_tables_for(tables)
            if tables is None:
                raise ValueError(f"no prompt-lookup tables were measured for {name!r} (bench/fit_ngram_tables.py "
                                 f"measures them into {NGRAM_TABLES_PATH.name})")
        self.use_tables(tables)
        self._own_step_cost(step_cost)
        self.max_nodes = max_nodes  # per request, root included
        self._seen: dict = {}  # rid -> [hits, expected hits] of first-level tokens, decayed
        self._guess: dict = {}  # rid -> (root's position + 1, {most probable token: its raw probability})
        self._promised: dict = {}  # rid -> the raw probabilities of this step's drafted nodes, summed
        self._merged: dict = {}  # rid -> (parents, tokens) merged into another drafter's draft (merge_into)
        self._paid: dict = {}  # rid -> [accepted drafted tokens, their promised count], decayed

    def use_tables(self, tables: NgramTables | None) -> None:
        """Rate matches with ``tables`` and draft its answer openings (None: keep the current ones)."""
        if tables is None:
            return
        self.FIRST, self.NEXT, self.RANK = tables.first, tables.next, tables.rank
        self.max_ngram = self._given_max_ngram or len(self.FIRST)
        self.openings = {}
        for key, opening, count in tables.openings:
            self.openings.setdefault(key, []).append((opening, count))
        self._opening_len = max((len(opening) for _, opening, _ in tables.openings), default=0)

    def opening_tries(self, tokens: list, answer_start: int, k: int) -> dict:
        """{continuation prefix: probability} of the answer openings whose key ends the prompt
        (``tokens[:answer_start]``) and which begin with the answer so far
        (``tokens[answer_start:]``), at most ``k`` deep. Of the n answers known to
        have begun with ``answer`` (an opening that ends there is one whose continuation was too
        rare to keep), a prefix that c continued with is accepted with probability c / (n + 1):
        the counts are a small sample of the model's answers, and an opening seen once is an
        even bet, not a certainty."""
        answer = tuple(tokens[answer_start:])
        counts, n = {}, 0
        for key, openings in self.openings.items():
            if not key_ends_at(tokens, answer_start, key):
                continue
            for opening, count in openings:
                if len(opening) >= len(answer) and opening[:len(answer)] == answer:
                    n += count
                    rest = opening[len(answer): len(answer) + k]
                    for d in range(1, len(rest) + 1):
                        counts[rest[:d]] = counts.get(rest[:d], 0) + count
        return {prefix: c / (n + 1) for prefix, c in counts.items()}

    def answer_start(self, tokens) -> int | None:
        """Where the answer begins in ``tokens``, found from the openings' keys, for a caller
        that is not told the prompt's length (vLLM's proposer): the latest position p, at most
        as far back as the longest opening, with the last tokens of some key just before it
        (``tokens[p - len(key):p] == key``, p < len(tokens)); None where no key ends there."""
        n = len(tokens)
        for p in range(n - 1, max(0, n - self._opening_len), -1):
            if any(key_ends_at(tokens, p, key) for key in self.openings):
                return p
        return None

    def check_vocab(self, vocab_size: int | None) -> None:
        """A clear error where the answer openings draft ids outside a vocabulary of
        ``vocab_size`` tokens (tables measured for another model); None: no check."""
        largest = max((max(opening) for ops in self.openings.values() for opening, _ in ops), default=-1)
        if vocab_size is not None and largest >= vocab_size:
            raise ValueError(f"the answer openings draft token id {largest}, outside the model's vocabulary of "
                             f"{vocab_size}: tables measured for another model?")

    def start(self, gen, reqs):
        self._take_step_cost(gen)
        if not self._tables_given:
            self.use_tables(ngram_tables_for(gen.model.name))
        self.check_vocab(getattr(getattr(gen.model, "config", None), "vocab_size", None))
        self.admit(gen, reqs)

    def admit(self, gen, reqs):
        for r in reqs:
            self._seen[r.rid] = [0.0, 0.0]
            self._paid[r.rid] = [0.0, 0.0]
            self._guess.pop(r.rid, None)
            self._promised.pop(r.rid, None)

    def scale(self, rid) -> float:
        """Request ``rid``'s factor on the tables' probabilities: (hits + PRIOR) / (expected + PRIOR)."""
        hits, expected = self._seen.get(rid, (0.0, 0.0))
        accepted, promised = self._paid.get(rid, (0.0, 0.0))
        return min(self.MAX_SCALE, (hits + accepted + self.PRIOR) / (expected + promised + self.PRIOR))

    def verified(self, gen, reqs, num_accepted):
        for r, accepted in zip(reqs, num_accepted):
            guess = self._guess.pop(r.rid, None)
            promised = self._promised.pop(r.rid, None)
            seen = self._seen.get(r.rid)
            if seen is None:
                continue
            if guess is not None and len(r.tokens) > guess[0]:
                pos, first = guess
                seen[0] = self.DECAY * seen[0] + (1.0 if r.tokens[pos] in first else 0.0)
                seen[1] = self.DECAY * seen[1] + sum(first.values())
            # The drafted nodes' expected accepted count (sum of their probabilities) against the
            # accepted count: the evidence of the steps that paid for rows, remembered longer
            # (DRAFT_DECAY): a loss comes back every few steps when its memory is short.
            paid = self._paid[r.rid]
            paid[0] *= self.DRAFT_DECAY
            paid[1] *= self.DRAFT_DECAY
            if promised is not None and accepted >= 0:
                paid[0] += accepted
                paid[1] += promised

    def finish(self, gen, req):
        self._seen.pop(req.rid, None)
        self._merged.pop(req.rid, None)
        self._guess.pop(req.rid, None)
        self._promised.pop(req.rid, None)
        self._paid.pop(req.rid, None)

    def matches(self, arr: np.ndarray) -> tuple:
        """(end, length): every earlier occurrence of the last token (``arr[end] == arr[-1]``,
        end < L-1) with how many tokens agree backwards from it (1..max_ngram), longest first,
        then most recent, at most ``max_matches``."""
        L = arr.shape[0]
        end = np.flatnonzero(arr[: L - 1] == arr[L - 1])
        if end.size == 0:
            return end, end
        length = np.ones(end.size, dtype=np.int64)
        alive = np.ones(end.size, dtype=bool)
        for n in range(1, min(self.max_ngram, L - 1)):
            prev = end - n
            alive &= prev >= 0
            alive[alive] &= arr[prev[alive]] == arr[L - 1 - n]
            if not alive.any():
                break
            length += alive
        order = np.lexsort((-end, -length))[: self.max_matches]
        return end[order], length[order]

    def candidates(self, tokens: list, k: int, scale: float = 1.0, answer_start: int | None = None) -> Candidates:
        """The trie of a request's matches, at most ``k`` deep, its nodes ranked by
        probability (see :class:`Candidates`), each probability times ``scale`` (the
        request's, :meth:`scale`; at most 0.99). ``answer_start``: where the answer begins in
        ``tokens`` (the prompt's length); with it, the tables' answer openings for this prompt
        (:meth:`opening_tries`) join the trie, their probabilities (not scaled: they are not
        the lookup's) combined with the matches' as a noisy-or."""
        root = tokens[-1]
        opening = {}
        if self.openings and answer_start is not None and k > 0 and len(tokens) - answer_start < self._opening_len:
            opening = self.opening_tries(tokens, answer_start, k)
        if k <= 0 or (len(tokens) < 2 and not opening) or self.max_nodes < 2:
            return Candidates([root], [-1], [0], [])
        arr = np.asarray(tokens, dtype=np.int64)
        ends, lengths = self.matches(arr)
        # Trie: children[node] = {token: child}; miss[node] = prod over matches of (1 - p);
        # p_open[node] = the openings' probability of it.
        children, tok, par, miss, p_open = [{}], [root], [-1], [1.0], [0.0]

        def child_of(node: int, t: int) -> int:
            child = children[node].get(t)
            if child is None:
                child = len(tok)
                children[node][t] = child
                children.append({})
                tok.append(t)
                par.append(node)
                miss.append(1.0)
                p_open.append(0.0)
            return child

        prev_m, rank = 0, 0
        for e, m in zip(ends.tolist(), lengths.tolist()):
            rank = rank + 1 if m == prev_m else 0
            prev_m = m
            mi = min(m, len(self.FIRST)) - 1
            p = self.FIRST[mi] * self.RANK[min(rank, len(self.RANK) - 1)]
            node = 0
            for t in arr[e + 1: e + 1 + k].tolist():
                node = child_of(node, t)
                miss[node] *= 1.0 - p
                p *= self.NEXT[mi]
        lookup_nodes = len(tok)
        for prefix in sorted(opening, key=len):  # parents first
            node = 0
            for t in prefix:
                node = child_of(node, t)
            p_open[node] = opening[prefix]
        prob = [min(0.99, (1.0 - m) * scale) for m in miss]
        prob = [1.0 - (1.0 - q) * (1.0 - o) if o else q for q, o in zip(prob, p_open)]
        depth = Draft(par, tok).depths()
        order = sorted(range(1, len(tok)), key=lambda i: (-min(0.99, prob[i]), miss[i], depth[i], i))
        ranked = [(min(0.99, prob[i]), i) for i in order[: self.max_nodes - 1]]
        # The lookup's own most probable node (first-level), what request_candidates scores.
        best = min(range(1, lookup_nodes), key=lambda i: (miss[i], i), default=None)
        guess = (tok[best], min(0.99, (1.0 - miss[best]) * scale) / scale) if best is not None else ()
        return Candidates(tok, par, depth, ranked, guess, frozenset(i for i, o in enumerate(p_open) if o))

    def select(self, ranked: list) -> list:
        """How many of each request's ranked nodes to keep: the most probable nodes of the
        batch, as many as maximise (B + sum p) / cost(B + kept) (``cost_model.best_node_count``)."""
        B = len(ranked)
        pool = sorted(((-p, b, j) for b, r in enumerate(ranked) for j, (p, _) in enumerate(r)))
        best_n, _ = best_node_count([-neg_p for neg_p, _, _ in pool], self.cost, batch=B)
        keep = [0] * B
        for _, b, j in pool[:best_n]:
            keep[b] = max(keep[b], j + 1)  # a request's picks are a prefix of its ranking
        return keep

    def build(self, tokens: list, k: int) -> tuple:
        """(parents, token ids) of the draft tree of one request alone (batch 1)."""
        cand = self.candidates(tokens, k)
        return cand.tree(self.select([cand.ranked])[0])

    def request_candidates(self, r, k: int) -> Candidates:
        """Request ``r``'s trie at most ``k`` deep, its probabilities times the request's
        :meth:`scale`. Its most probable node (always first-level) and that node's unscaled
        probability are kept, to be scored against the emitted token in :meth:`verified`:
        what decides whether a step drafts at all."""
        scale = self.scale(r.rid)
        prompt = getattr(r, "prompt", None)
        c = self.candidates(r.tokens, min(k, self.max_k), scale, answer_start=None if prompt is None else len(prompt))
        self._guess[r.rid] = (len(r.tokens), dict([c.guess]) if c.guess else {})
        return c

    def greedy_candidates(self, reqs, caps) -> list:
        """Each greedy request's trie (:meth:`request_candidates`, at most its cap deep), or
        None: a cap of 0, or a sampled request (another drafter's tree for it carries q rows a
        looked-up node does not have). For a drafter that merges the tries into its own drafts."""
        return [self.request_candidates(r, k) if k > 0 and r.sampling.temperature <= 0 else None
                for r, k in zip(reqs, caps)]

    def chain_candidates(self, r, k: int) -> Candidates:
        """Request ``r``'s trie (:meth:`request_candidates`) reduced to its most probable path:
        for a sampled request whose tree cannot mix the lookup's deterministic children with
        another drafter's drawn ones. Each node of a chain has one child, whose deterministic
        proposal is exactly a one-hot q row (:func:`one_hot_chain`)."""
        c = self.request_candidates(r, k)
        best_child = {}
        for p, i in c.ranked:  # most probable first: the first child seen of a node is its best
            best_child.setdefault(c.parents[i], (p, i))
        path, node = [], 0
        while node in best_child:
            path.append(best_child[node])
            node = best_child[node][1]
        return c._replace(ranked=path)

    def sampled_chains(self, reqs, caps, wins, vocab_size: int) -> dict:
        """{batch row: Draft} for the sampled requests (a cap > 0) whose chain
        (:meth:`chain_candidates`, sized by :meth:`select`) ``wins(b, c, n)`` says to draft
        this step instead of the other drafter's: the chain with one-hot q rows
        (:func:`one_hot_chain`), promised and remembered as :meth:`merge_into` does. For a
        drafter whose sampled drafts carry q rows: a node's q row is the one all its children
        were drawn from, so drawn and looked-up children cannot share a node."""
        out = {}
        for b, (r, k) in enumerate(zip(reqs, caps)):
            if k <= 0 or r.sampling.temperature <= 0:
                continue
            c = self.chain_candidates(r, k)
            n = self.select([c.ranked])[0]
            if n == 0 or not wins(b, c, n):
                continue
            (chain,) = self.merge_into([r], [Draft.root_only(r.tokens[-1])], [c], [n])
            out[b] = one_hot_chain(chain, vocab_size)
        return out

    def merge_into(self, reqs, drafts: list, cands: list, keep: list) -> list:
        """Each request's ``keep[b]`` best nodes of ``cands[b]`` merged into ``drafts[b]`` (another
        drafter's; paths shared where they agree). They are promised (:meth:`promise`) and
        remembered, so that :meth:`verified_merged` counts only the accepted tokens on them."""
        for b, (r, c, n) in enumerate(zip(reqs, cands, keep)):
            if c is None or n == 0:
                continue
            self.promise(r, c, n)
            parents, tokens = c.tree(n)
            self._merged[r.rid] = (parents, tokens)
            drafts[b] = Draft(*merge_token_trees(drafts[b].parents, drafts[b].tokens, parents, tokens))
        return drafts

    def verified_merged(self, gen, reqs, num_accepted) -> None:
        """:meth:`verified` for tries merged by :meth:`merge_into`: the evidence of each request
        is the accepted tokens on its own merged nodes (the other drafter's are not the
        tables' evidence)."""
        self.verified(gen, reqs, [self.merged_accepted(r, n) for r, n in zip(reqs, num_accepted)])

    def merged_accepted(self, r, n: int) -> int:
        """How many of the ``n`` accepted tokens of ``r``'s step lie on its merged nodes (all
        ``n`` when nothing was merged); forgets them."""
        tree, n = self._merged.pop(r.rid, None), int(n)
        if tree is None or n <= 0:
            return n
        return accepted_on_tree(*tree, r.tokens[len(r.tokens) - (n + 1): len(r.tokens) - 1])

    def promise(self, r, c: Candidates, n: int) -> None:
        """The ``n`` best nodes of ``c`` are drafted for ``r``: what they promise (their
        unscaled probabilities, summed) is scored against its accepted count in :meth:`verified`
        — unless answer openings are among them: what those deliver is no evidence on the
        lookup's tables."""
        if n > 0 and not any(i in c.opened for _, i in c.ranked[:n]):
            self._promised[r.rid] = sum(p for p, _ in c.ranked[:n]) / self.scale(r.rid)

    def propose(self, gen, reqs, lengths):
        cands = [self.request_candidates(r, k) for r, k in zip(reqs, lengths)]
        keep = self.select([c.ranked for c in cands])
        for r, c, n in zip(reqs, cands, keep):
            self.promise(r, c, n)
        return [Draft(*c.tree(n)) for c, n in zip(cands, keep)]
