"""Drafters by name: what ``specdec generate --drafter`` and the end-to-end benchmark take.

``DRAFTER_INFO`` is the one table of drafters: each name with the speculation-length schedule
it runs with unless ``--schedule`` says otherwise (the one that suits how it drafts) and a
one-line description. A new drafter adds a row here and a branch in ``make_drafter``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..models.llama import Llama
    from .drafter import Drafter


class DrafterInfo(NamedTuple):
    schedule: str  # default speculation-length schedule (SpecSchedule.KINDS)
    description: str  # one line, shown by --help
    draft_weights: bool = False  # runs weights of its own that --draft-weights formats (a draft model, a head)


DRAFTER_INFO = {
    "none": DrafterInfo("constant", "no drafter: plain autoregressive decoding, one token per step"),
    "ngram": DrafterInfo("heuristic", "prompt lookup: the continuation of the latest earlier match of the last "
                                      "tokens, as a chain (length grows while all drafts are accepted)"),
    "ngram-tree": DrafterInfo("max", "prompt lookup over several earlier matches merged into one tree, sized by "
                                     "expected accepted tokens over the measured verify cost (no drafts where "
                                     "the output copies nothing)"),
    "self-spec": DrafterInfo("max", "the target's first layers with the exit head shipped for the model (or "
                                    "--exit-head) draft a chain sized by the measured step cost"),
    "self-spec-plain": DrafterInfo("max", "plain early exit after --self-spec-layers layers through the target's own "
                                          "norm and LM head (for comparison)"),
    "medusa": DrafterInfo("constant", "the Medusa heads shipped for the model (or --medusa-checkpoint) draft a tree"),
    "medusa+ngram": DrafterInfo("constant", "the Medusa tree plus the prompt-lookup chain as one more branch"),
    "medusa-untrained": DrafterInfo("constant", "untrained Medusa heads on a static small tree (for comparison)"),
    "draft": DrafterInfo("max", "the distilled draft model shipped for the model (or --draft-model: a draft file, "
                                "or a model of the same vocabulary such as qwen2.5-coder-0.5b) drafts a chain sized "
                                "by the measured step cost", True),
    "draft-tree": DrafterInfo("max", "the draft model's chain plus its next-best first tokens (top 3 at the "
                                     "root)", True),
    "draft+ngram": DrafterInfo("max", "the draft model's chain plus the prompt-lookup tries; a request whose tries "
                                      "promise more runs no draft forward that step", True),
    "draft-untrained": DrafterInfo("max", "the distilled draft's architecture before distillation: the target's "
                                          "first layers, norm and LM head (for comparison)"),
    "eagle": DrafterInfo("max", "the EAGLE-style head shipped for the model (or --eagle-checkpoint) drafts a "
                                "dynamic tree sized by the measured step cost", True),
    "eagle+ngram": DrafterInfo("max", "the EAGLE tree plus the prompt-lookup chain as one more branch", True),
    "eagle-untrained": DrafterInfo("max", "an untrained EAGLE head (for comparison)", True),
}
DRAFTERS = tuple(DRAFTER_INFO)
WITH_DRAFT_WEIGHTS = tuple(n for n, i in DRAFTER_INFO.items() if i.draft_weights)  # what --draft-weights applies to
DRAFT_MODEL_DRAFTERS = ("draft", "draft-tree", "draft+ngram")  # drafting with a draft model of load_draft
# Drafters that run a trained file: (what it is, the flag that gives one, the drafter that
# needs none). Without the flag they take the file the package ships for the model, and a
# model without one is an error, never a silent fallback to an untrained drafter.
TRAINED = {"medusa": ("Medusa heads", "--medusa-checkpoint", "medusa-untrained"),
           "eagle": ("EAGLE head", "--eagle-checkpoint", "eagle-untrained"),
           "self-spec": ("self-speculation exit head", "--exit-head", "self-spec-plain"),
           "draft": ("distilled draft model", "--draft-model", "draft-untrained")}
# The drafter a model runs by default (`specdec generate`, `specdec_kernels.generate`): the one
# measured to pay on it (docs/drafters.md, "The default"). SmolLM2-135M: ngram-tree, the
# fastest at batch 1 on the package's prompts and on Spec-Bench in every format measured
# (1.84x fp32 / 1.11x native / 1.13x int8 activations over our autoregressive decoding), and
# it needs no trained weights. A model without an entry gets DEFAULT_DRAFTER: prompt lookup
# works for any model, and its sizing switches drafting off where nothing is copied.
DEFAULT_DRAFTER = "ngram-tree"
DEFAULT_DRAFTER_FOR = {"smollm2-135m": "ngram-tree"}


def default_drafter(model_name: str) -> str:
    """The drafter ``model_name`` (a registered name or a model's ``name``, e.g. its file
    name) runs when none is asked for: DEFAULT_DRAFTER_FOR's entry whose key the name
    contains (letters and digits only), else DEFAULT_DRAFTER."""
    import re

    def squash(text):
        return re.sub(r"[^a-z0-9]", "", str(text).lower())

    name = squash(model_name)
    return next((d for key, d in DEFAULT_DRAFTER_FOR.items() if squash(key) in name), DEFAULT_DRAFTER)


def default_schedule(name: str | None) -> str:
    """The schedule ``name`` runs with when none is given."""
    return DRAFTER_INFO[name or "none"].schedule if (name or "none") in DRAFTER_INFO else "constant"


def trained_file(kind: str, model, given: str | None, shipped: str | None, shipped_for) -> str:
    """``given`` (a file or setting the user passed), else ``shipped`` (the package's file for
    ``model``, one of the models ``shipped_for``); neither is a ValueError that names the model
    and what to do instead."""
    if given is not None:
        return given
    if shipped is None:
        what, flag, instead = TRAINED[kind]
        raise ValueError(f"no trained {what} ships for model {model.name!r} (the package ships them for "
                         f"{', '.join(sorted(shipped_for))}): pass {flag} FILE, or use the drafter {instead}")
    return shipped


def make_drafter(name: str, model, *, self_spec_layers: int = 8, draft_model: str | Llama | None = None,
                 medusa_checkpoint: str | None = None, max_k: int = 16,
                 eagle_checkpoint: str | None = None, draft_weights: str = "stored",
                 exit_head: str | None = None, draft_vocab: int | None = None) -> Drafter | None:
    """A drafter by name for ``model`` (None for plain autoregressive decoding).

    ``draft_model``: a draft file of ``specdec train-draft`` (.safetensors) or a model name /
    checkpoint of the same vocabulary; None = the distilled draft shipped for the model; or a
    draft already loaded by :func:`load_draft` (a ``Llama``), used as it is.
    ``draft_weights``: how a draft file's linears run ("stored", "fp32", "q8_0", "q4_0"); for
    an EAGLE head "stored" means Q4_0 blocks on a GGUF-block target, dense otherwise.
    ``draft_vocab``: the tokens a whole model drafting by name drafts from, its most frequent
    ones (``draft_model.DRAFT_VOCAB_SIZE`` when None; 0 = its whole vocabulary).
    ``exit_head``: the self-speculation exit head file; None = the shipped one; "none" =
    plain early exit. A trained drafter (``TRAINED``) without a file given for a model the
    package ships none for is a ValueError naming the model."""
    # Imported here: the table above serves --help and argument checks without loading the
    # decode loop's modules.
    from ..drafting.medusa.drafter import MEDUSA_SMALL_CHOICES, MedusaDrafter, medusa_heads_for
    from ..drafting.draft_model.drafter import ModelDrafter, SelfSpecDrafter
    from ..drafting.ngram import NgramDrafter, NgramTreeDrafter

    if name in ("none", "ar", None):
        return None
    if name == "ngram":
        return NgramDrafter(max_k=max_k)
    if name == "ngram-tree":
        return NgramTreeDrafter(max_k=max_k)
    if name in ("self-spec", "self-spec-plain"):
        from ..drafting.draft_model.model import SHIPPED_EXITS, default_exit_checkpoint, exit_model

        if name == "self-spec":
            exit_head = trained_file("self-spec", model, exit_head, default_exit_checkpoint(model.name), SHIPPED_EXITS)
        exit_m = None if name == "self-spec-plain" or exit_head == "none" else exit_model(model, exit_head)
        drafter = SelfSpecDrafter(model, self_spec_layers, exit_model=exit_m, max_k=max_k, sized=True)
        if name == "self-spec-plain":
            drafter.name = name
        return drafter
    if name in ("medusa", "medusa+ngram"):  # the package's trained heads for the model unless a checkpoint is given
        from ..drafting.medusa.heads import SHIPPED_HEADS, default_medusa_checkpoint

        heads = medusa_heads_for(model, trained_file("medusa", model, medusa_checkpoint,
                                                     default_medusa_checkpoint(model.name), SHIPPED_HEADS))
        # medusa+ngram: the trained heads' tree plus the prompt-lookup chain as one more branch
        return MedusaDrafter(model, heads, ngram=NgramDrafter(max_k=max_k) if name == "medusa+ngram" else None)
    if name == "medusa-untrained":  # for comparison: zero ResBlocks, the static small tree
        drafter = MedusaDrafter(model, medusa_heads_for(model, "untrained"), MEDUSA_SMALL_CHOICES)
        drafter.name = "medusa-untrained"
        return drafter
    if name in ("eagle", "eagle+ngram", "eagle-untrained"):  # the package's trained head unless one is given
        from ..drafting.eagle.head import SHIPPED_HEADS, default_eagle_checkpoint, eagle_head_for
        from ..drafting.eagle.drafter import EagleDrafter

        checkpoint = "untrained" if name == "eagle-untrained" else \
            trained_file("eagle", model, eagle_checkpoint, default_eagle_checkpoint(model.name), SHIPPED_HEADS)
        head = eagle_head_for(model, checkpoint, weights=draft_weights)
        return EagleDrafter(model, head, lookup=NgramTreeDrafter(max_k=max_k) if name == "eagle+ngram" else None,
                            name=name)
    if name in DRAFT_MODEL_DRAFTERS or name == "draft-untrained":
        from ..models.llama import Llama

        if name == "draft-untrained":  # the shipped draft's layers and vocabulary, before distillation
            if isinstance(draft_model, Llama):
                raise ValueError("draft-untrained builds its draft from the shipped one: it takes no draft_model")
            from ..drafting.draft_model.model import default_draft_checkpoint, draft_model_for, truncated_draft

            shipped = default_draft_checkpoint(model.name)
            if shipped is None:
                dm = model.truncated(self_spec_layers)
            else:
                d = draft_model_for(model, shipped)
                dm = truncated_draft(model, d.config.num_layers, d.draft_vocab)
        elif isinstance(draft_model, Llama):  # loaded before (load_draft), e.g. once for many runs
            dm = draft_model
        else:
            dm = load_draft(model, draft_model, draft_weights, draft_vocab)
        return ModelDrafter(dm, tree_width=3 if name == "draft-tree" else 1, max_k=max_k, name=name, sized=True,
                            lookup=NgramTreeDrafter(max_k=max_k) if name == "draft+ngram" else None)
    raise ValueError(f"unknown drafter {name!r}; choose from {DRAFTERS}")


def load_draft(target, draft_model: str | None = None, draft_weights: str = "stored", draft_vocab: int | None = None):
    """The draft model of the ``draft`` drafters (make_drafter's ``draft_model``,
    ``draft_weights`` and ``draft_vocab``) for ``target``: a draft file of ``specdec
    train-draft`` (.safetensors), a model of the target's vocabulary by name or path
    (:func:`draft_by_name`), or None for the distilled draft shipped for the target (a
    ValueError naming the target where none ships). Loading a whole model takes seconds:
    pass the result to make_drafter as ``draft_model`` to make several drafters of it."""
    from ..drafting.draft_model.model import SHIPPED_DRAFTS, default_draft_checkpoint, load_draft_model

    draft_model = trained_file("draft", target, draft_model, default_draft_checkpoint(target.name), SHIPPED_DRAFTS)
    if str(draft_model).endswith(".safetensors"):  # a draft file (given or shipped)
        return load_draft_model(draft_model, target, draft_weights)
    return draft_by_name(target, draft_model, draft_weights, draft_vocab)  # a model of the target's vocabulary


def draft_by_name(target, name_or_path: str, draft_weights: str = "stored", draft_vocab: int | None = None):
    """A whole model (registered name, GGUF file or checkpoint folder) as the draft of
    ``target``: loaded in the target's weight format (``draft_weights`` "stored"), or as
    fp32 / q8_0 / q4_0 (blocks with int8 activations when the target's products use them).
    Its vocabulary must be the target's: the same size and, where both
    loaders recorded it, the same tokens (``Llama.vocab_digest``). It drafts from the
    ``draft_vocab`` tokens (default ``DRAFT_VOCAB_SIZE``; 0 or more than the vocabulary: all)
    the Python standard library's sources use most, and its end-of-turn tokens
    (``draft_model.frequency_ranked_vocab``, FR-Spec): a smaller LM head, a cheaper draft token."""
    from ..drafting.draft_model.model import (DRAFT_VOCAB_SIZE, corpus_token_counts, frequency_ranked_vocab,
                                              with_draft_vocab)
    from ..models import load_model

    weights = target.weight_format if draft_weights == "stored" else draft_weights
    dm, tok = load_model(name_or_path, weights=weights)
    if dm.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft model {name_or_path!r} has a vocabulary of {dm.config.vocab_size:,} tokens, the "
                         f"target {target.name!r} one of {target.config.vocab_size:,}: a draft must share the "
                         "target's vocabulary")
    ours, theirs = getattr(target, "vocab_digest", None), getattr(dm, "vocab_digest", None)
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(f"draft model {name_or_path!r} has as many tokens as the target {target.name!r} but not the "
                         "same ones: a draft must share the target's vocabulary")
    if target.int8_activations and not dm.int8_activations:  # q8_0 / q4_0 blocks made on load
        dm = dm.with_int8_activations()  # its speed is what matters; exactness is the target's
    size = DRAFT_VOCAB_SIZE if draft_vocab is None else draft_vocab
    if 0 < size < dm.config.vocab_size:
        counts = corpus_token_counts(tok, dm.config.vocab_size)
        dm = with_draft_vocab(dm, frequency_ranked_vocab(counts, size, always=tok.eos_token_ids))
    return dm
