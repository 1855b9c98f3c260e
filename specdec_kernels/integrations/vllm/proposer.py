"""Our multi-match n-gram drafting as a vLLM ``custom_class`` proposer (chains).

vLLM (0.32) builds a custom proposer with ``cls(vllm_config)``, calls ``load_model(model)``
once and, after every step, ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)``; it returns one list of draft token ids per request (possibly empty),
which vLLM verifies as a chain (``vllm/v1/worker/gpu_model_runner.py``,
``propose_draft_token_ids``, the ``custom_class`` branch).

Drafting reuses :class:`specdec_kernels.decoding.NgramTreeDrafter`'s matching: every earlier
occurrence of the request's last tokens (longest, then most recent, up to ``MAX_MATCHES``)
puts its continuation into a trie whose nodes carry an estimated acceptance probability (the
noisy-or over the matches through them). vLLM verifies chains, not trees, so the proposer
walks the trie from the root along the most probable child and stops where that child's
probability falls below ``MIN_PROB`` or at ``num_speculative_tokens``. Where several earlier
occurrences disagree, the chain follows the continuation most of them (and the longest)
support; a plain prompt lookup (vLLM's ``ngram``) takes the latest longest match alone.

The probabilities come from the acceptance tables measured for the served model
(:func:`~specdec_kernels.drafting.ngram.ngram_tables_for`, found by the model's directory or
served name, e.g. ``qwen2.5-coder-1.5b-bf16-hf``), and the class's otherwise. Tables with answer
openings (how the model's answers begin after a chat template's assistant header) also draft
the first tokens of an answer, which the prompt cannot predict: vLLM does not say where a
request's prompt ends, so the proposer finds the answer's start from the openings' keys
(:meth:`~specdec_kernels.drafting.ngram.NgramTreeDrafter.answer_start`).

Tune by subclassing (vLLM passes no other arguments): ``class MyProposer(SpecdecNgramProposer):
MIN_PROB = 0.3`` and ``speculative_config={"model": "mymodule.MyProposer", ...}``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...drafting.ngram import NgramTreeDrafter, ngram_tables_for
from .compat import check_vllm_version


def trie_chain(trie: NgramTreeDrafter, tokens, k: int, min_prob: float, answer_start: int | None = None) -> list[int]:
    """The most probable path of ``trie``'s multi-match trie for ``tokens`` (a sequence of
    ints): from the root, the most probable child (ties: the earlier node) while its
    estimated acceptance probability is >= ``min_prob``, at most ``k`` tokens.
    ``answer_start``: where the answer begins in ``tokens``, for the tables' answer openings
    (``NgramTreeDrafter.candidates``); None: none."""
    cand = trie.candidates(tokens, k, answer_start=answer_start)
    tok, par, ranked = cand.tokens, cand.parents, cand.ranked
    prob = {node: p for p, node in ranked}
    best_child: dict[int, int] = {}
    for node in range(1, len(tok)):
        parent = par[node]
        if prob.get(node, 0.0) > prob.get(best_child.get(parent, -1), -1.0):
            best_child[parent] = node
    out, node = [], 0
    while len(out) < k and node in best_child and prob.get(best_child[node], 0.0) >= min_prob:
        node = best_child[node]
        out.append(int(tok[node]))
    return out


def served_name(model_config) -> str:
    """The name the proposer looks its tables up by: the served model name and the model's
    (``model_config.model``, a path or a hub id), each without its parent folders, which say
    nothing of the model."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    names = [Path(str(n).rstrip("/")).name for n in (served, model_config.model) if n]
    return " ".join(dict.fromkeys(n for n in names if n))


class SpecdecNgramProposer:
    """vLLM custom proposer: chains from ``NgramTreeDrafter``'s multi-match trie."""

    MAX_NGRAM = None  # a match is scored by up to this many agreeing tokens (None: the tables' length)
    MAX_MATCHES = 8   # earlier occurrences merged into the trie
    MIN_PROB = 0.15   # stop the chain below this estimated acceptance probability

    def __init__(self, vllm_config):
        check_vllm_version()
        spec, model_config = vllm_config.speculative_config, vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model_config.max_model_len)
        self.model_name = served_name(model_config)
        tables = ngram_tables_for(self.model_name)
        # Every trie node is ranked (max_nodes bounds the ranking), so the walk sees them all.
        self.trie = NgramTreeDrafter(self.MAX_NGRAM, self.k, max_nodes=self.k * self.MAX_MATCHES + 1,
                                     max_matches=self.MAX_MATCHES, tables=tables)
        self.trie.check_vocab(model_config.get_vocab_size())

    def load_model(self, *args, **kwargs) -> None:
        """No model: drafts come from the request's own tokens."""

    def chain(self, tokens, k: int) -> list[int]:
        """The draft chain (at most ``k`` token ids) for a request whose tokens so far are
        ``tokens`` (the last one = the token the drafts follow)."""
        return trie_chain(self.trie, tokens, k, self.MIN_PROB, self.trie.answer_start(tokens))

    def propose(self, sampled_token_ids, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        """One draft chain per request of the batch (vLLM's ``custom_class`` interface).

        sampled_token_ids: list (one per request) of the tokens this step emitted (empty: the
        request is still in prefill or was discarded, no drafts); num_tokens_no_spec: int
        [max_num_reqs], tokens of each request so far; token_ids_cpu: int32 [max_num_reqs,
        max_model_len], the requests' tokens (prompt + output)."""
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            k = min(self.k, self.max_model_len - n - 1)
            if len(sampled) == 0 or k <= 0:
                drafts.append([])
                continue
            drafts.append(self.chain(token_ids_cpu[i, :n], k))
        return drafts
