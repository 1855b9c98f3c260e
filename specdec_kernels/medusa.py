"""Medusa heads: K extra decoding heads on a (frozen) base model's last hidden state.

Head k (0-based) is L ResBlocks, x <- x + SiLU(W x + b), followed by an LM head: its own
[V, H] matrix (the public Medusa checkpoints) or the base model's LM head (shared, which
saves K x V x H weights). At decode time ``forward`` runs all heads through the fused
``specdec::medusa_topk`` op and returns each head's top-k candidates with their
log-probabilities; ``logits`` is the plain differentiable path used for training.

State dict: the module's keys are those of the Medusa reference implementation's model,
``medusa_head.{k}.{j}.linear.weight`` / ``.bias`` for ResBlock j of head k and
``medusa_head.{k}.{L}.weight`` for a per-head LM head; the files that project publishes
(``medusa_lm_head.pt`` / ``.safetensors``) hold the same keys without the ``medusa_head.``
prefix. ``load_medusa_heads`` reads either. (The reference code builds the L ResBlocks of
a head as one block repeated L times, so their weights are tied; its files store every
copy, so loading them here gives equal, untied blocks — identical for L = 1, which is what
the published checkpoints use.)

Training offsets: the base LM head at position t predicts token t + 1; Medusa head k at
position t predicts token t + k + 2, i.e. k + 1 steps beyond the next token (the reference
training code compares ``logits[k, :, :-(2 + k)]`` with ``labels[:, 2 + k:]``). The loss
is sum_k decay^k * CE_k with decay 0.8 (the Medusa paper's lambda_k = 0.8^k).
"""
from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from . import ops

__all__ = ["MedusaHeads", "ResBlock", "load_medusa_heads", "medusa_loss", "train_step"]


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
                 lm_head_weight: torch.Tensor | None = None, dtype=None, device=None):
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
        # Zero ResBlocks are the identity (SiLU(0) = 0): every head starts as the LM head
        # applied to the base hidden state, as in Medusa (which zeroes the weight).
        with torch.no_grad():
            for head in self.medusa_head:
                for j in range(num_layers):
                    head[j].linear.weight.zero_()
                    head[j].linear.bias.zero_()
        self._stacked = None

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

    def forward(self, hidden: torch.Tensor, top_k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [M, H] (or [..., H], flattened) -> (topk_ids int64 [M, K, top_k],
        topk_logprobs fp32 [M, K, top_k]) through the fused specdec::medusa_topk."""
        hidden = hidden.reshape(-1, self.hidden_size)
        res_weight, res_bias, lm_head = self.stacked_weights()
        return ops.medusa_topk(hidden, res_weight, res_bias, lm_head, top_k)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., K, V] with plain (differentiable) PyTorch ops."""
        out = []
        for head in self.medusa_head:
            x = hidden
            for j in range(self.num_layers):
                x = head[j](x)
            out.append(F.linear(x, self.lm_head_weight) if self.shared_lm_head else head[self.num_layers](x))
        return torch.stack(out, dim=-2)


# ---------------------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------------------

_KEY = re.compile(r"^(?:.*medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _read_state_dict(source) -> dict:
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_medusa_heads(source, *, lm_head_weight: torch.Tensor | None = None, dtype=None,
                      device=None) -> MedusaHeads:
    """Build MedusaHeads from a Medusa state dict, a ``.pt`` or a ``.safetensors`` file.

    Keys ``[medusa_head.]{k}.{j}.linear.weight|bias`` (ResBlock j of head k) and
    ``[medusa_head.]{k}.{L}.weight`` (per-head LM head); K, L, H and V are read from them.
    Without per-head LM heads the base model's ``lm_head_weight`` [V, H] is required (and
    may also be passed to share it instead of the checkpoint's per-head copies).
    """
    state = _read_state_dict(source)
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
    heads_mod = MedusaHeads(H, V, K, L, lm_head_weight=lm_head_weight, dtype=dtype, device=device)
    own = {}
    for (k, j, kind), value in blocks.items():
        own[f"medusa_head.{k}.{j}.{kind}"] = value
    if lm_head_weight is None:
        for k, (j, value) in lm_heads.items():
            own[f"medusa_head.{k}.{j}.weight"] = value
    heads_mod.load_state_dict(own, strict=True)
    return heads_mod


# ---------------------------------------------------------------------------------------
# Training on a frozen base model.
# ---------------------------------------------------------------------------------------


def medusa_loss(head_logits: torch.Tensor, input_ids: torch.Tensor, *, decay: float = 0.8,
                ignore_index: int = -100) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """sum_k decay^k * CE(head k's logits at position t, token t + k + 2).

    head_logits: [B, T, K, V] (MedusaHeads.logits of the base model's last hidden states);
    input_ids: int64 [B, T] (entries equal to ignore_index are not scored). Returns the
    weighted loss and the per-head (unweighted) losses.
    """
    B, T, K, V = head_logits.shape
    total = head_logits.new_zeros(())
    per_head = []
    for k in range(K):
        shift = k + 2
        if T <= shift:
            break
        logits_k = head_logits[:, : T - shift, k].reshape(-1, V).float()
        labels_k = input_ids[:, shift:].reshape(-1)
        loss_k = F.cross_entropy(logits_k, labels_k, ignore_index=ignore_index)
        per_head.append(loss_k.detach())
        total = total + decay**k * loss_k
    return total, per_head


def train_step(heads: MedusaHeads, hidden_states: torch.Tensor, input_ids: torch.Tensor,
               optimizer: torch.optim.Optimizer, *, decay: float = 0.8, ignore_index: int = -100) -> dict:
    """One optimisation step of the heads on a frozen base model.

    hidden_states: [B, T, H], the base model's last hidden states for input_ids [B, T]
    (computed under no_grad; the base is not trained). Returns {"loss", "head_losses"}.
    """
    heads.train()
    optimizer.zero_grad(set_to_none=True)
    loss, per_head = medusa_loss(heads.logits(hidden_states.detach()), input_ids, decay=decay,
                                 ignore_index=ignore_index)
    loss.backward()
    optimizer.step()
    return {"loss": float(loss.detach()), "head_losses": [float(x) for x in per_head]}
