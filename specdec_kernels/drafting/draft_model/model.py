"""Trained drafts that run as Llamas: distilled draft models and self-speculation exit heads.

Both come from ``specdec train-draft`` (:mod:`specdec_kernels.drafting.draft_model.training`) and
draft from a *draft vocabulary*: the Vd target ids the target predicts most often. Their LM
head is the target's LM head restricted to those rows, so drafting a token costs a Vd-row
product instead of a V-row one (SmolLM2: 8,192 of 49,152 rows, 0.29 ms instead of 1.7 ms on
Q8_0 blocks — as much as half a decoder layer). ``Llama.draft_vocab`` holds the ids; the
decode loop maps drafted ids back and spreads the draft's q over the full vocabulary (zero
outside the draft vocabulary), so verification stays exact.

- **Draft model** (``kind=draft``): a small Llama of the target's architecture: n decoder
  layers (initialised from the target's first n and distilled), its own final norm, the
  target's embedding (shared, not stored) and LM head rows. It keeps its own paged cache
  (``ModelDrafter``).
- **Exit head** (``kind=exit``) for self-speculation from the target's first L layers: a
  norm and a low-rank adapter ``y = x + U (D x)`` before the target's LM head rows. Folded
  on load into one [Vd, H] head, ``E_d (I + U D)``, so drafting runs the plain
  ``Llama.logits`` with no extra op; the layers (and the KV cache) are the target's.

File format (``.safetensors``, string metadata ``kind``, ``config`` JSON, training info):
draft model — ``layers.{i}.{attn_norm,mlp_norm}`` fp32 (and ``bqkv`` for a Qwen2 target),
``layers.{i}.{wqkv,wo,w_gate_up,w_down}``
bf16, or uint8 GGUF blocks when the metadata names a ``block_type`` (``Q8_0``: the shipped
draft is stored quantised, 1.06 bytes a weight), ``norm`` fp32, ``draft_vocab`` int64;
exit head — ``norm`` [H], ``down`` [r, H], ``up`` [H, r] fp32 and ``draft_vocab``, with
``num_layers`` (L) in the metadata.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from ...models.block import layer_keys
from ...models.llama import Llama, dense, is_block_weight
from ...models.registry import read_metadata
from ...training.distill_data import corpus_files

SHIPPED_DRAFTS = {"smollm2-135m": "draft_smollm2_135m.safetensors"}
SHIPPED_EXITS = {"smollm2-135m": "exit_smollm2_135m.safetensors"}
LINEAR_KEYS = Llama.LINEAR_KEYS
DRAFT_WEIGHTS = ("stored", "fp32", "q8_0", "q4_0")  # how a draft model's linears run (``--draft-weights``)


def default_draft_checkpoint(model_name: str) -> str | None:
    """The package's distilled draft model for a registered model name, or None."""
    from ...models.registry import shipped_file

    return shipped_file(model_name, SHIPPED_DRAFTS)


def default_exit_checkpoint(model_name: str) -> str | None:
    """The package's self-speculation exit head for a registered model name, or None."""
    from ...models.registry import shipped_file

    return shipped_file(model_name, SHIPPED_EXITS)


def _lm_head_rows(target: Llama, vocab: torch.Tensor, block: bool):
    """The target's LM head rows ``vocab``: its own blocks when ``block`` and it has them."""
    if block and is_block_weight(target.lm_head):
        return target.lm_head.rows(vocab)
    return dense(target.lm_head)[vocab].float().contiguous()


def _check_vocab(path, vocab: torch.Tensor, target: Llama) -> torch.Tensor:
    vocab = vocab.to(torch.int64)
    V = target.config.vocab_size
    if vocab.dim() != 1 or vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= V:
        raise ValueError(f"{path}: draft_vocab must be ids in [0, {V}) (the target's vocabulary)")
    if torch.unique(vocab).numel() != vocab.numel():
        raise ValueError(f"{path}: draft_vocab has repeated ids")
    return vocab


# ---- draft models ---------------------------------------------------------------------------
def save_draft_model(layers: list, norm: torch.Tensor, draft_vocab: torch.Tensor, config: dict, path, *,
                     block_type: str | None = "Q8_0", metadata: dict | None = None) -> None:
    """Write a draft model: ``layers`` (dicts of fp32 tensors, the Llama layout), ``norm``
    [H], ``draft_vocab`` int64 [Vd], ``config`` (LlamaConfig fields of the draft). Linear
    weights are stored as GGUF blocks of ``block_type`` (None: bf16)."""
    from safetensors.torch import save_file

    from ...gguf_blocks import quantize

    state = {"norm": norm.detach().float().contiguous(), "draft_vocab": draft_vocab.to(torch.int64).contiguous()}
    for i, L in enumerate(layers):
        for k, v in L.items():
            v = v.detach().float()
            if k in LINEAR_KEYS:
                v = quantize(v.contiguous(), block_type).blocks if block_type else v.to(torch.bfloat16)
            state[f"layers.{i}.{k}"] = v.contiguous()
    meta = {**(metadata or {}), "kind": "draft", "config": json.dumps(config),
            "block_type": block_type or ""}
    save_file(state, os.fspath(path), metadata={str(k): str(v) for k, v in meta.items()})


def load_draft_model(path, target: Llama, weights: str = "stored") -> Llama:
    """The draft model in ``path`` for ``target`` (whose embedding and LM head rows it
    shares). ``weights``: "stored" (as the file holds them: the shipped draft is Q8_0
    blocks), "fp32" (dequantised), "q8_0" / "q4_0" (GGUF blocks via ``quantized_linear``;
    with int8 activations when the target's products use them)."""
    from safetensors.torch import load_file

    from ...gguf_blocks import QuantizedWeight, quantize
    from ...models.config import LlamaConfig

    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be one of {DRAFT_WEIGHTS}, got {weights!r}")
    meta = read_metadata(path)
    if meta.get("kind") != "draft":
        raise ValueError(f"{path}: not a draft model file (kind={meta.get('kind')!r}); write one with "
                         "specdec train-draft --kind draft")
    state = load_file(os.fspath(path))
    fields = json.loads(meta["config"])
    tc = target.config
    if fields["hidden_size"] != tc.hidden_size or fields.get("vocab_size", tc.vocab_size) != tc.vocab_size:
        raise ValueError(f"{path}: the draft has hidden size {fields['hidden_size']}; the target has "
                         f"{tc.hidden_size}")
    config = LlamaConfig(**{**tc.__dict__, **fields})
    vocab = _check_vocab(path, state["draft_vocab"], target)
    stored = meta.get("block_type") or None
    H = config.hidden_size
    layers = []
    for i in range(config.num_layers):
        L = {}
        for k in layer_keys(config.attention_bias):
            v = state[f"layers.{i}.{k}"]
            if k in LINEAR_KEYS:
                h = config.intermediate_size if k == "w_down" else (config.num_heads * config.head_dim if k == "wo" else H)
                if stored:
                    v = QuantizedWeight(v.contiguous(), stored, (v.shape[0], h))
                if weights == "fp32" or (weights == "stored" and not stored):
                    v = dense(v).float()
                elif weights in ("q8_0", "q4_0") and not (stored and stored.lower() == weights):
                    v = quantize(dense(v).float().contiguous(), weights.upper())
            else:
                v = v.float()
            L[k] = v
        layers.append(L)
    block = any(is_block_weight(v) for v in layers[0].values())
    fmt = (stored.lower() if weights == "stored" and stored else weights if weights != "stored" else "fp32")
    model = Llama(config, dict(embed=target.embed, norm=state["norm"].float(), layers=layers, draft_vocab=vocab,
                               lm_head=_lm_head_rows(target, vocab, block)),
                  name=f"draft-{config.num_layers}L[{os.path.basename(str(path))}]", weight_format=fmt)
    if block and target.int8_activations:  # its speed is what matters; exactness is the target's
        model = model.with_int8_activations()
    model.metadata = meta
    return model


def truncated_draft(target: Llama, num_layers: int, draft_vocab: torch.Tensor | None = None) -> Llama:
    """The draft before distillation: the target's first ``num_layers`` layers, final norm and
    LM head (restricted to ``draft_vocab`` if given), its own cache (``ModelDrafter``)."""
    d = target.truncated(num_layers)
    return d if draft_vocab is None else with_draft_vocab(d, draft_vocab)


def with_draft_vocab(model: Llama, vocab: torch.Tensor) -> Llama:
    """``model`` drafting from the ids ``vocab`` (int64 [Vd]) only: its LM head restricted to
    those rows (blocks stay blocks, with their int8-activation packing where the head had one;
    the other weights are shared). The decode loop maps drafted ids back and puts q = 0
    outside ``vocab``, which rejection sampling handles exactly."""
    d = model.truncated(model.config.num_layers)
    d.name, d.vocab_digest, d.metadata = model.name, model.vocab_digest, getattr(model, "metadata", {})
    d.draft_vocab = vocab.to(torch.int64)
    d.lm_head = _lm_head_rows(model, d.draft_vocab, is_block_weight(model.lm_head))
    if getattr(model.lm_head, "int8_packed", None) is not None:
        d.lm_head = d.lm_head.with_int8_activations()
    return d


# ---- frequency-ranked draft vocabulary (FR-Spec) ------------------------------------------
# A whole model drafting for its sibling (``--draft-model NAME``) spends much of a draft token
# on its LM head: the Qwen2.5-Coder-0.5B's is 151,936 x 896 Q8_0, 146 of the 490 MB a step
# reads. As FR-Spec does, the head runs over the Vd tokens a corpus uses most; a drafted token
# is then always one of those, and the rare tokens the target picks are only lost acceptance.
DRAFT_VOCAB_SIZE = 65536  # the default cut (``--draft-vocab``): measured best in docs/drafters.md
CORPUS_BYTES = 8 * 2**20  # of source text counted
def corpus_token_counts(tokenizer, vocab_size: int, max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """int64 [vocab_size]: how often each token occurs in the first ``max_bytes`` of
    :func:`corpus_files`, cached per tokenizer and corpus in the package's cache ("vocab");
    the first count shows a progress bar (a few seconds)."""
    from tqdm import tqdm

    from ..._platform import package_cache_dir

    files = corpus_files()
    key = f"{tokenizer.vocab_digest()[:16]}-{vocab_size}-{max_bytes}-{len(files)}-stdlib{sys.version_info[0]}.{sys.version_info[1]}"
    path = os.path.join(package_cache_dir("vocab"), key + ".pt")
    if os.path.exists(path):
        try:
            counts = torch.load(path)
        except Exception:  # an unreadable entry (cut short, corrupt) is counted again
            counts = None
        if isinstance(counts, torch.Tensor) and counts.shape == (vocab_size,) and counts.dtype == torch.int64:
            return counts
    counts, read = torch.zeros(vocab_size, dtype=torch.int64), 0
    with tqdm(total=max_bytes, unit="B", unit_scale=True, desc="counting draft-vocabulary tokens", leave=False) as bar:
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read(max_bytes - read)
            counts += torch.bincount(torch.tensor(tokenizer.encode(text), dtype=torch.int64), minlength=vocab_size)
            read += len(text)
            bar.update(len(text))
            if read >= max_bytes:
                break
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(counts, tmp)
    os.replace(tmp, path)  # never a half-written file under the final name
    return counts


def frequency_ranked_vocab(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """int64 [size], ascending: the ids ``always`` (e.g. the end-of-turn tokens) and the
    most frequent others by ``counts`` (ties: the lower id)."""
    always = sorted(set(int(t) for t in always))
    V = counts.numel()
    if not 0 < size <= V or len(always) > size or any(not 0 <= t < V for t in always):
        raise ValueError(f"a draft vocabulary of {size} tokens must be in (0, {V}] and hold the ids {always}")
    keep = torch.zeros(V, dtype=torch.bool)
    keep[always] = True
    order = torch.sort(-counts, stable=True).indices  # descending counts, ties by the lower id
    keep[order[~keep[order]][: size - len(always)]] = True
    return keep.nonzero().flatten()


def draft_model_for(target: Llama, checkpoint: str | None = None, *, weights: str = "stored",
                    fallback_layers: int = 8) -> Llama:
    """The draft model for ``target``: ``checkpoint`` (a file of ``specdec train-draft``),
    None = the one the package ships for the model, else (none ships) the target's first
    ``fallback_layers`` layers, untrained."""
    if checkpoint is None:
        checkpoint = default_draft_checkpoint(target.name)
    if checkpoint is None:
        d = target.truncated(fallback_layers)  # shares the target's weights, packing included
        return d if weights in ("stored", target.weight_format) else _requantize(d, weights)
    return load_draft_model(checkpoint, target, weights)


def _requantize(model: Llama, weights: str) -> Llama:
    if weights == "fp32":
        layers = [{k: dense(v).float() for k, v in L.items()} for L in model.layers]
        return Llama(model.config, dict(embed=model.embed, norm=model.norm.float(), lm_head=dense(model.lm_head).float(),
                                        layers=layers, draft_vocab=model.draft_vocab), name=model.name, weight_format="fp32")
    return model.quantized(weights.upper())


# ---- exit heads (self-speculation) ---------------------------------------------------------
def save_exit_head(norm: torch.Tensor, down: torch.Tensor, up: torch.Tensor, draft_vocab: torch.Tensor,
                   num_layers: int, path, *, metadata: dict | None = None) -> None:
    """Write an exit head for the target's first ``num_layers`` layers: norm [H], down [r, H],
    up [H, r] (fp32), draft_vocab int64 [Vd]."""
    from safetensors.torch import save_file

    state = {"norm": norm, "down": down, "up": up, "draft_vocab": draft_vocab.to(torch.int64)}
    state = {k: (v.detach().float() if k != "draft_vocab" else v).contiguous() for k, v in state.items()}
    meta = {**(metadata or {}), "kind": "exit", "num_layers": str(int(num_layers))}
    save_file(state, os.fspath(path), metadata={str(k): str(v) for k, v in meta.items()})


def fold_exit_head(lm_head_rows: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 [Vd, H]: ``E_d (I + U D)`` — logits of the adapted features y = x + U(Dx) as one
    product with the folded head (E_d [Vd, H], down D [r, H], up U [H, r])."""
    return lm_head_rows + (lm_head_rows @ up) @ down


def exit_model(target: Llama, path) -> Llama:
    """Self-speculation drafter model: ``target.truncated(L)`` with the exit head in ``path``
    as its final norm and (folded, draft-vocabulary) LM head. Shares the target's layers and
    KV cache; the folded head is stored like the target's (GGUF Q8_0 blocks when the target
    runs on blocks, else the target's dtype)."""
    from safetensors.torch import load_file

    from ...gguf_blocks import quantize

    meta = read_metadata(path)
    if meta.get("kind") != "exit":
        raise ValueError(f"{path}: not an exit head file (kind={meta.get('kind')!r}); write one with "
                         "specdec train-draft --kind exit")
    state = load_file(os.fspath(path))
    L = int(meta["num_layers"])
    if not 1 <= L <= target.config.num_layers:
        raise ValueError(f"{path}: exit after {L} layers, the target has {target.config.num_layers}")
    H = target.config.hidden_size
    if state["norm"].shape != (H,) or state["down"].shape[1] != H or state["up"].shape[0] != H:
        raise ValueError(f"{path}: exit head shapes do not match the target's hidden size {H}")
    vocab = _check_vocab(path, state["draft_vocab"], target)
    head = fold_exit_head(dense(target.lm_head)[vocab].float(), state["down"].float(), state["up"].float())
    d = target.truncated(L)
    d.draft_vocab = vocab
    d.norm = state["norm"].to(target.dtype)
    d.lm_head = quantize(head.contiguous(), "Q8_0") if is_block_weight(target.lm_head) else head.to(target.dtype)
    d.name = f"{target.name}[:{L}]+exit"
    # The drafter's prior acceptance reads held_out_top1, as draft files record it; exit files
    # record the same held-out agreement as top1.
    d.metadata = {"held_out_top1": meta["top1"], **meta} if "top1" in meta else meta
    return d


def exit_model_for(target: Llama, checkpoint: str | None = None) -> Llama | None:
    """The exit-head drafter model for ``target`` (``checkpoint`` or the shipped one), or None
    when neither exists."""
    checkpoint = checkpoint or default_exit_checkpoint(target.name)
    return exit_model(target, checkpoint) if checkpoint else None


__all__ = ["DRAFT_VOCAB_SIZE", "DRAFT_WEIGHTS", "corpus_files", "corpus_token_counts", "default_draft_checkpoint",
           "default_exit_checkpoint", "draft_model_for", "exit_model", "exit_model_for", "fold_exit_head",
           "frequency_ranked_vocab", "load_draft_model", "read_metadata", "save_draft_model", "save_exit_head",
           "truncated_draft", "with_draft_vocab"]
