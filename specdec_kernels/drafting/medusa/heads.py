"""Medusa heads: K extra decoding heads on a (frozen) base model's last hidden state.

Head k (0-based) is L ResBlocks, x <- x + SiLU(W x + b), followed by an LM head: its own
[V, H] matrix (the public Medusa checkpoints) or the base model's LM head (shared, which
saves K x V x H weights). At decode time ``forward`` runs all heads through the fused
``specdec::medusa_topk`` op and returns each head's top-k candidates with their
log-probabilities; ``logits`` is the plain differentiable path used for training (the loss
and the training step are in ``specdec_kernels.drafting.medusa.loss``).

State dict: the module's keys are those of the Medusa reference implementation's model,
``medusa_head.{k}.{j}.linear.weight`` / ``.bias`` for ResBlock j of head k and
``medusa_head.{k}.{L}.weight`` for a per-head LM head; the files that project publishes
(``medusa_lm_head.pt`` / ``.safetensors``) hold the same keys without the ``medusa_head.``
prefix. ``load_medusa_heads`` reads either. (The reference code builds the L ResBlocks of
a head as one block repeated L times, so their weights are tied; its files store every
copy, so loading them here gives equal, untied blocks — identical for L = 1, which is what
the published checkpoints use.)
"""
from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops

__all__ = ["MedusaHeads", "ResBlock", "default_medusa_checkpoint", "load_medusa_heads", "read_medusa_metadata",
           "read_medusa_state_dict", "save_medusa_heads"]


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), the Medusa residual block (key names ``linear.weight/bias``)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads of L ResBlocks each, with per-head LM heads or a shared one.

    hidden_size H, vocab_size V, num_heads K, num_layers L. ``lm_head_weight``: the base
    model's LM head [V, H] to share (kept as a non-persistent buffer: it is neither in the
    state dict nor trained); when None each head gets its own [V, H] LM head.

    The fused op wants the weights stacked ([K, L, H, H], [K, L, H], [K, V, H]); to keep
    one copy in memory the module's parameters are made views of those stacked tensors
    (re-stacked automatically after ``.to()`` or anything else that replaces them).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1, *,
                 lm_head_weight: torch.Tensor | None = None, dtype=None, device=None,
                 embed_weight: torch.Tensor | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads} and {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.shared_lm_head = lm_head_weight is not None
        if lm_head_weight is not None:
            if tuple(lm_head_weight.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"lm_head_weight must have shape [{vocab_size}, {hidden_size}], got {list(lm_head_weight.shape)}"
                )
            self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        factory = dict(dtype=dtype, device=device)
        heads = []
        for _ in range(num_heads):
            layers = [ResBlock(hidden_size) for _ in range(num_layers)]
            if not self.shared_lm_head:
                layers.append(nn.Linear(hidden_size, vocab_size, bias=False))
            heads.append(nn.Sequential(*layers).to(**factory))
        self.medusa_head = nn.ModuleList(heads)
        # Root conditioning (optional, not in the Medusa reference): the heads' input is
        # h + root_proj(rms(embed[root])), see ``head_input``.
        self.root_conditioned = embed_weight is not None
        if embed_weight is not None:
            if embed_weight.shape[-1] != hidden_size:
                raise ValueError(f"embed_weight must have shape [V, {hidden_size}], got {list(embed_weight.shape)}")
            self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
            self.root_proj = nn.Linear(hidden_size, hidden_size, bias=False).to(**factory)
            with torch.no_grad():
                self.root_proj.weight.zero_()  # starts as plain Medusa
        # Zero ResBlocks are the identity (SiLU(0) = 0): every head starts as the LM head
        # applied to the base hidden state, as in Medusa (which zeroes the weight).
        with torch.no_grad():
            for head in self.medusa_head:
                for j in range(num_layers):
                    head[j].linear.weight.zero_()
                    head[j].linear.bias.zero_()
        self._stacked = None
        self.draft_vocab = None  # int64 [Vd] or None, see set_draft_vocab
        self._draft_lm_head = None
        self.metadata: dict = {}  # the checkpoint file's metadata (str -> str), if any

    # -- the stacked weights of the fused op ------------------------------------------

    def _params(self):
        """[(stacked name, index, parameter)] in stacking order."""
        out = []
        for k, head in enumerate(self.medusa_head):
            for j in range(self.num_layers):
                out.append(("res_weight", (k, j), head[j].linear.weight))
                out.append(("res_bias", (k, j), head[j].linear.bias))
            if not self.shared_lm_head:
                out.append(("lm_head", (k,), head[self.num_layers].weight))
        return out

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(res_weight [K, L, H, H], res_bias [K, L, H], lm_head [V, H] or [K, V, H])."""
        params = self._params()
        st = self._stacked
        if st is None or any(p.data_ptr() != st[name][idx].data_ptr() or p.dtype != st[name].dtype
                             for name, idx, p in params):
            st = self._restack(params)
        lm = self.lm_head_weight if self.shared_lm_head else st["lm_head"]
        return st["res_weight"], st["res_bias"], lm

    @torch.no_grad()
    def _restack(self, params):
        K, L, H, V = self.num_heads, self.num_layers, self.hidden_size, self.vocab_size
        ref = next((p for _, _, p in params), None)
        dtype = ref.dtype if ref is not None else (self.lm_head_weight.dtype if self.shared_lm_head else torch.float32)
        device = ref.device if ref is not None else (self.lm_head_weight.device if self.shared_lm_head else None)
        st = {
            "res_weight": torch.empty(K, L, H, H, dtype=dtype, device=device),
            "res_bias": torch.empty(K, L, H, dtype=dtype, device=device),
        }
        if not self.shared_lm_head:
            st["lm_head"] = torch.empty(K, V, H, dtype=dtype, device=device)
        for name, idx, p in params:
            dst = st[name][idx]
            dst.copy_(p.data)
            p.data = dst  # the parameter becomes a view of the stacked tensor
        self._stacked = st
        return st

    # -- inference and training paths ---------------------------------------------------

    def head_input(self, hidden: torch.Tensor, root_ids: torch.Tensor | None = None) -> torch.Tensor:
        """What the ResBlocks see: ``hidden`` [..., H], plus, for root-conditioned heads,
        ``root_proj(rms_norm(embed[root_ids]))`` (root_ids int64 [...], the token each hidden
        state produced: the root of the draft tree).

        Why (a deviation from Medusa-1, in the spirit of Hydra/EAGLE): a Medusa head must
        infer the root token from the hidden state through one ResBlock, which it does
        poorly; given the root's embedding, head 0 of SmolLM2-135M predicts the token after
        the root about 1.5x as often (held-out top-1 0.23 -> 0.34 on 14k tokens). It costs
        one [H, H] product per step and is exact at decode time (the root is known)."""
        if not self.root_conditioned:
            return hidden
        if root_ids is None:
            raise ValueError("these Medusa heads are root-conditioned: pass root_ids (the tokens the hidden states "
                             "produced)")
        emb = self.embed_weight[root_ids.to(self.embed_weight.device)].to(hidden.dtype)
        return hidden + self.root_proj(F.rms_norm(emb, (emb.shape[-1],)))

    def forward(self, hidden: torch.Tensor, top_k: int = 10, root_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [M, H] (or [..., H], flattened) -> (topk_ids int64 [M, K, top_k],
        topk_logprobs fp32 [M, K, top_k]) through the fused specdec::medusa_topk.
        ``root_ids`` int64 [M]: needed by root-conditioned heads (see ``head_input``).

        With a draft vocabulary (:meth:`set_draft_vocab`) the top-k and the log-softmax run
        over those tokens only, and the ids are mapped back to the full vocabulary."""
        hidden = hidden.reshape(-1, self.hidden_size)
        if self.root_conditioned:
            hidden = self.head_input(hidden, None if root_ids is None else root_ids.reshape(-1))
        res_weight, res_bias, lm_head = self.stacked_weights()
        if self.draft_vocab is None:
            return ops.medusa_topk(hidden, res_weight, res_bias, lm_head, top_k)
        if self._draft_lm_head is None or self._draft_lm_head.dtype != lm_head.dtype:
            self._draft_lm_head = lm_head[self.draft_vocab.to(lm_head.device)].contiguous()
        ids, logprobs = ops.medusa_topk(hidden, res_weight, res_bias, self._draft_lm_head, top_k)
        return self.draft_vocab.to(ids.device)[ids], logprobs

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> "MedusaHeads":
        """Restrict drafting (``forward``) to ``token_ids`` (int64 [Vd], distinct, < V), or
        lift the restriction with None. Needs the shared LM head.

        Why: at batch 1 on a CPU the heads' cost is streaming the [V, H] LM head once per
        step (V = 49152 for SmolLM2: 113 MB in fp32, ~20% of a decode step); the tokens the
        heads ever predict right are the frequent ones, so the few thousand most frequent
        tokens of the training data keep nearly all the acceptance at a fraction of the
        cost (the idea of FR-Spec's frequency-ranked draft vocabulary). Lossless: the
        target verifies whatever is drafted. ``logits`` (training) keeps the full vocabulary.
        """
        if token_ids is None:
            self.draft_vocab = self._draft_lm_head = None
            return self
        if not self.shared_lm_head:
            raise ValueError("set_draft_vocab needs heads with the shared LM head")
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.vocab_size}), got {token_ids.numel()} ids")
        if torch.unique(token_ids).numel() != token_ids.numel():
            raise ValueError("draft vocabulary ids must be distinct")
        self.draft_vocab = token_ids.to(self.lm_head_weight.device)
        self._draft_lm_head = None
        return self

    def head_states(self, hidden: torch.Tensor, root_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """hidden [..., H] -> K tensors [..., H]: each head's ResBlocks, before its LM head."""
        hidden = self.head_input(hidden, root_ids)
        out = []
        for head in self.medusa_head:
            x = hidden
            for j in range(self.num_layers):
                x = head[j](x)
            out.append(x)
        return out

    def logits(self, hidden: torch.Tensor, root_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., K, V] with plain (differentiable) PyTorch ops."""
        states = self.head_states(hidden, root_ids)
        out = [F.linear(x, self.lm_head_weight) if self.shared_lm_head else head[self.num_layers](x)
               for head, x in zip(self.medusa_head, states)]
        return torch.stack(out, dim=-2)

    def save(self, path, *, dtype=None, metadata: dict | None = None) -> None:
        """Write the heads to ``path`` (see :func:`save_medusa_heads`)."""
        save_medusa_heads(self, path, dtype=dtype, metadata=metadata)


# ---------------------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------------------

_KEY = re.compile(r"^(?:.*medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
_ROOT_KEY = re.compile(r"^(?:.*\.)?root_proj\.weight$")


def read_medusa_state_dict(source) -> dict:
    """The tensors of a Medusa checkpoint: a ``.safetensors`` or ``torch.save`` file (a dict
    is returned as it is)."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def read_medusa_metadata(source) -> dict:
    """The string metadata of a ``.safetensors`` file ({} for anything else)."""
    if isinstance(source, dict) or not os.fspath(source).endswith(".safetensors"):
        return {}
    from ...models.registry import read_metadata

    return read_metadata(source)


def save_medusa_heads(heads: MedusaHeads, path, *, dtype=None, metadata: dict | None = None) -> None:
    """Write ``heads``' state dict (the Medusa keys; the shared LM head is not included) to a
    ``.safetensors`` file, or with ``torch.save`` for any other suffix. ``dtype`` (e.g.
    torch.bfloat16) converts the stored tensors.

    The parameters are views of the stacked tensors of the fused op (they share storage),
    which ``safetensors`` refuses to write: every tensor is cloned into its own storage.
    A draft vocabulary (``set_draft_vocab``) is stored as ``draft_vocab`` (int64), and
    ``heads.metadata`` updated with ``metadata`` as the file's string metadata.
    """
    state = {k: v.detach().to(dtype or v.dtype).clone().contiguous() for k, v in heads.state_dict().items()}
    if heads.draft_vocab is not None:
        state["draft_vocab"] = heads.draft_vocab.detach().to(torch.int64).clone().cpu()
    meta = {**heads.metadata, **(metadata or {})}
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, path, metadata={str(k): str(v) for k, v in meta.items()})
    else:
        torch.save(state, path)


# Trained heads shipped with the package, by model name (``specdec train-medusa`` writes them).
SHIPPED_HEADS = {"smollm2-135m": "medusa_smollm2_135m.safetensors"}


def default_medusa_checkpoint(model_name: str, *, must_exist: bool = True) -> str | None:
    """Path of the package's trained Medusa heads for a registered model name (e.g.
    ``smollm2-135m``, also matched on the model's file name), or None if none ships."""
    from ...models.registry import shipped_file

    return shipped_file(model_name, SHIPPED_HEADS, must_exist=must_exist)


def load_medusa_heads(source, *, lm_head_weight: torch.Tensor | None = None, dtype=None,
                      device=None, metadata: dict | None = None,
                      embed_weight: torch.Tensor | None = None) -> MedusaHeads:
    """Build MedusaHeads from a Medusa state dict, a ``.pt`` or a ``.safetensors`` file.

    Keys ``[medusa_head.]{k}.{j}.linear.weight|bias`` (ResBlock j of head k) and
    ``[medusa_head.]{k}.{L}.weight`` (per-head LM head); K, L, H and V are read from them.
    Without per-head LM heads the base model's ``lm_head_weight`` [V, H] is required (and
    may also be passed to share it instead of the checkpoint's per-head copies).
    A ``draft_vocab`` entry (int64 [Vd], written by ``save_medusa_heads``) becomes the
    heads' draft vocabulary when the LM head is shared; ``heads.metadata`` is the file's
    metadata (or ``metadata``). A ``root_proj.weight`` [H, H] makes root-conditioned heads
    (``MedusaHeads.head_input``), which need the base model's ``embed_weight`` [V, H].
    """
    state = read_medusa_state_dict(source)
    metadata = dict(metadata) if metadata is not None else read_medusa_metadata(source)
    blocks, lm_heads = {}, {}
    for key, value in state.items():
        match = _KEY.match(key)
        if match is None:
            continue
        k, j, kind = int(match.group(1)), int(match.group(2)), match.group(3)
        if kind == "weight":
            lm_heads[k] = (j, value)
        else:
            blocks[(k, j, kind)] = value
    heads = sorted({k for k, _, _ in blocks} | set(lm_heads))
    if not heads or heads != list(range(len(heads))):
        raise ValueError(f"no Medusa heads 0..K-1 found in the state dict (heads seen: {heads})")
    K = len(heads)
    L = len({j for k, j, _ in blocks if k == 0})
    for k in range(K):
        for j in range(L):
            for kind in ("linear.weight", "linear.bias"):
                if (k, j, kind) not in blocks:
                    raise ValueError(f"missing medusa_head.{k}.{j}.{kind}")
        if k in lm_heads and lm_heads[k][0] != L:
            raise ValueError(f"head {k}: LM head found at index {lm_heads[k][0]}, expected {L} (after {L} ResBlocks)")
    if lm_heads and len(lm_heads) != K:
        raise ValueError(f"per-head LM heads found for heads {sorted(lm_heads)} but there are {K} heads")
    if lm_head_weight is None and not lm_heads:
        raise ValueError("the state dict has no per-head LM heads: pass the base model's lm_head_weight")
    if L > 0:
        H = blocks[(0, 0, "linear.weight")].shape[1]
    else:
        H = (lm_head_weight if lm_head_weight is not None else lm_heads[0][1]).shape[1]
    V = (lm_head_weight if lm_head_weight is not None else lm_heads[0][1]).shape[0]
    ref = next(iter(blocks.values()), None)
    if dtype is None:
        dtype = ref.dtype if ref is not None else (lm_heads[0][1].dtype if lm_heads else lm_head_weight.dtype)
    root_key = next((k for k in state if _ROOT_KEY.match(k)), None)
    if root_key is not None and embed_weight is None:
        raise ValueError("the checkpoint has root-conditioned heads (root_proj.weight): pass the base model's "
                         "embed_weight")
    heads_mod = MedusaHeads(H, V, K, L, lm_head_weight=lm_head_weight, dtype=dtype, device=device,
                            embed_weight=embed_weight if root_key is not None else None)
    own = {}
    if root_key is not None:
        own["root_proj.weight"] = state[root_key]
    for (k, j, kind), value in blocks.items():
        own[f"medusa_head.{k}.{j}.{kind}"] = value
    if lm_head_weight is None:
        for k, (j, value) in lm_heads.items():
            own[f"medusa_head.{k}.{j}.weight"] = value
    heads_mod.load_state_dict(own, strict=True)
    heads_mod.metadata = metadata
    if "draft_vocab" in state and heads_mod.shared_lm_head:
        heads_mod.set_draft_vocab(state["draft_vocab"])
    return heads_mod
