"""Medusa drafting: heads on the target's last hidden state, a static tree from Medusa
choices, through ``MedusaHeads`` (``drafting.medusa.heads``, fused ``medusa_topk``)."""
from __future__ import annotations

import torch

from ...decoding.drafter import Draft, Drafter
from ...models.llama import Llama, dense, rms_norm
from ...tree import merge_token_trees
from ..ngram import NgramDrafter
from .heads import (MedusaHeads, default_medusa_checkpoint, load_medusa_heads, read_medusa_metadata,
                    read_medusa_state_dict)


def medusa_heads_for(target: Llama, checkpoint=None, *, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
    """MedusaHeads for ``target``.

    ``checkpoint``: a Medusa checkpoint (``.safetensors``/``.pt`` or a state dict with
    Medusa keys, see ``drafting.medusa.heads``); None = the trained heads the package ships
    for this model (``default_medusa_checkpoint``: SmolLM2-135M-Instruct, trained by
    ``specdec train-medusa``) if there are any, else untrained heads; ``"untrained"`` =
    ``num_heads`` untrained heads (zero ResBlocks = identity: every head predicts what the
    LM head predicts, so acceptance is low). The target's LM head is shared unless the
    checkpoint has per-head LM heads."""
    if checkpoint is None:
        checkpoint = default_medusa_checkpoint(target.name) or "untrained"
    if isinstance(checkpoint, str) and checkpoint == "untrained":
        heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads, num_layers,
                            lm_head_weight=dense(target.lm_head), dtype=target.dtype, device=target.device)
    else:
        state = read_medusa_state_dict(checkpoint)
        own_lm_heads = any(k.endswith(".weight") and not k.endswith(("linear.weight", "root_proj.weight"))
                           for k in state)
        heads = load_medusa_heads(state, lm_head_weight=None if own_lm_heads else dense(target.lm_head),
                                  dtype=target.dtype, device=target.device,
                                  metadata=read_medusa_metadata(checkpoint), embed_weight=dense(target.embed))
        if heads.hidden_size != target.config.hidden_size or heads.vocab_size != target.config.vocab_size:
            raise ValueError(f"Medusa heads have H={heads.hidden_size}, V={heads.vocab_size}; the target has "
                             f"H={target.config.hidden_size}, V={target.config.vocab_size}")
    return heads.requires_grad_(False).eval()


# A small tree for 4 heads (depth <= 4, 24 nodes + root).
MEDUSA_SMALL_CHOICES = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0),
                        (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
                        (2, 1), (3, 0), (0, 3), (1, 2), (0, 0, 2), (0, 0, 0, 2)]


class MedusaDrafter(Drafter):
    """Medusa: head k on the hidden state of the node that produced the root predicts the
    token k+1 after the root; the static tree comes from Medusa choices (truncated to the
    speculation length), filled from each head's top-k (``medusa_topk``).

    ``heads``: default ``medusa_heads_for(target)`` (the package's trained heads for the
    model if it ships them). ``choices``: default the tree tuned for the heads (their file's
    ``medusa_choices`` metadata, a JSON list of lists) or ``MEDUSA_SMALL_CHOICES``.

    ``ngram``: an :class:`NgramDrafter` whose prompt-lookup chain (up to the speculation
    length) is merged into the tree as one more branch, sharing the nodes it agrees with.
    The two are complementary: the heads guess fluent continuations, the lookup copies
    spans of the context (summaries, extraction, code edits, repetitive output), and one
    verification forward checks both (the chain adds at most k nodes, none when nothing
    matches)."""

    name = "medusa"
    uses_hidden = True  # the heads read the hidden state that produced the root

    def __init__(self, target: Llama, heads: MedusaHeads | None = None, choices=None, *,
                 ngram: "NgramDrafter | None" = None):
        import json

        from ...tree import medusa_tree

        self.target = target
        self.heads = heads if heads is not None else medusa_heads_for(target)
        if choices is None and "medusa_choices" in getattr(self.heads, "metadata", {}):
            choices = [tuple(c) for c in json.loads(self.heads.metadata["medusa_choices"])]
        choices = [c for c in (choices or MEDUSA_SMALL_CHOICES) if len(c) <= self.heads.num_heads]
        self.tree = medusa_tree(choices)
        self.ngram = ngram
        self.max_nodes = self.tree.num_nodes + (ngram.max_nodes - 1 if ngram is not None else 0)
        self.parents = self.tree.parents.tolist()
        self.depth = self.tree.depth.tolist()
        self.root_hidden: dict = {}  # rid -> [H], the target's hidden state that produced the root
        if ngram is not None:
            self.name = "medusa+ngram"

    def hidden_states(self, gen, req, hidden, tokens):
        # A one-token prompt has no state before its root: zeros (the heads still draft).
        self.root_hidden[req.rid] = hidden[-1] if hidden.shape[0] else hidden.new_zeros(hidden.shape[1])

    def finish(self, gen, req):
        self.root_hidden.pop(req.rid, None)

    @torch.inference_mode()
    def propose(self, gen, reqs, lengths):
        hidden = torch.stack([self.root_hidden[r.rid] for r in reqs])
        hidden = rms_norm(hidden, self.target.norm, self.target.config.rms_norm_eps)
        roots = torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.int64)
        ids, _ = self.heads(hidden, self.tree.top_k, root_ids=roots)  # fused specdec::medusa_topk
        tokens = self.tree.token_ids(roots, ids).tolist()
        drafts = []
        for b, k in enumerate(lengths):
            n = sum(1 for d in self.depth if d <= k)  # nodes are ordered by depth
            parents, toks = self.parents[:n], tokens[b][:n]
            if self.ngram is not None and k > 0:
                chain = self.ngram.lookup(reqs[b].tokens, min(k, self.ngram.max_nodes - 1))
                if chain:
                    parents, toks = merge_token_trees(parents, toks, list(range(-1, len(chain))), [toks[0]] + chain)
            drafts.append(Draft(parents, toks))
        return drafts
