"""Drafters by name: what ``specdec generate --drafter`` and the end-to-end benchmark take."""
from __future__ import annotations

from .drafters import (MEDUSA_SMALL_CHOICES, Drafter, MedusaDrafter, ModelDrafter, NgramDrafter, NgramTreeDrafter,
                       SelfSpecDrafter, medusa_heads_for)

DRAFTERS = ("none", "ngram", "ngram-tree", "self-spec", "medusa", "medusa+ngram", "medusa-untrained", "draft",
            "draft-tree")


def make_drafter(name: str, model, *, self_spec_layers: int = 8, draft_model: str | None = None,
                 medusa_checkpoint: str | None = None, max_k: int = 16) -> Drafter | None:
    """A drafter by name for ``model`` (None for plain autoregressive decoding)."""
    if name in ("none", "ar", None):
        return None
    if name == "ngram":
        return NgramDrafter(max_k=max_k)
    if name == "ngram-tree":
        return NgramTreeDrafter(max_k=max_k)
    if name == "self-spec":
        return SelfSpecDrafter(model, self_spec_layers, max_k=max_k)
    if name == "medusa":  # the package's trained heads for the model unless a checkpoint is given
        return MedusaDrafter(model, medusa_heads_for(model, medusa_checkpoint))
    if name == "medusa+ngram":  # the trained heads' tree plus the prompt-lookup chain as one more branch
        return MedusaDrafter(model, medusa_heads_for(model, medusa_checkpoint), ngram=NgramDrafter(max_k=max_k))
    if name == "medusa-untrained":  # for comparison: zero ResBlocks, the static small tree
        drafter = MedusaDrafter(model, medusa_heads_for(model, "untrained"), MEDUSA_SMALL_CHOICES)
        drafter.name = "medusa-untrained"
        return drafter
    if name in ("draft", "draft-tree"):
        if draft_model:
            from ..models import load_model

            dm, _ = load_model(draft_model)
            if dm.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"draft model vocabulary ({dm.config.vocab_size}) differs from the target's "
                                 f"({model.config.vocab_size})")
        else:  # no second checkpoint ships with the package: a layer-truncated copy of the target
            dm = model.truncated(self_spec_layers)
        return ModelDrafter(dm, tree_width=3 if name == "draft-tree" else 1, max_k=max_k, name=name)
    raise ValueError(f"unknown drafter {name!r}; choose from {DRAFTERS}")
