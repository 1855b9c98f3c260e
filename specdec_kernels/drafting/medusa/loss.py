"""The Medusa heads' loss and one training step (on a frozen base model).

Offsets: the base LM head at position t predicts token t + 1; Medusa head k (0-based) at
position t predicts token t + k + 2, i.e. k + 1 steps beyond the next token (the reference
training code compares ``logits[k, :, :-(2 + k)]`` with ``labels[:, 2 + k:]``). The loss is
sum_k decay^k * CE_k with decay 0.8 (the Medusa paper's lambda_k = 0.8^k), CE_k the mean
cross-entropy of head k over its scored targets.

Targets come per row and head (``targets[..., k]``, negative = not scored), so that the same
loss serves the trainer's flat rows of self-distillation data (:func:`medusa_targets`) and
whole sequences (:func:`sequence_targets`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .heads import MedusaHeads

__all__ = ["medusa_loss", "medusa_targets", "sequence_targets", "heads_loss"]


def medusa_targets(tokens: torch.Tensor, seq_start: torch.Tensor, num_heads: int) -> torch.Tensor:
    """int64 [N, num_heads]: head k's target for row i is tokens[i + k + 1] when that row is
    in the same sequence, else -1 (ignored). Row i's hidden state produced tokens[i]."""
    N = tokens.shape[0]
    seq_id = torch.repeat_interleave(torch.arange(seq_start.shape[0] - 1), seq_start.diff())
    out = torch.full((N, num_heads), -1, dtype=torch.int64)
    for k in range(num_heads):
        shift = k + 1
        if shift >= N:
            break
        same = seq_id[shift:] == seq_id[:-shift]
        out[:-shift, k] = torch.where(same, tokens[shift:], torch.full_like(tokens[shift:], -1))
    return out


def sequence_targets(input_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """int64 [B, T, num_heads]: head k's target at position t is input_ids[:, t + k + 2], -1
    (not scored) past the end of the sequence or where that token is negative (e.g. -100
    for a prompt position that is not to be scored). input_ids: int64 [B, T].

    The hidden state at position t produced token t + 1: the rows of :func:`medusa_targets`
    over each sequence's tokens 1..T-1."""
    B, T = input_ids.shape
    out = torch.full((B, T, num_heads), -1, dtype=torch.int64)
    if T > 1:
        seq_start = torch.arange(0, B * (T - 1) + 1, T - 1)
        rows = medusa_targets(input_ids[:, 1:].cpu().reshape(-1), seq_start, num_heads)
        out[:, : T - 1] = rows.view(B, T - 1, num_heads)
    return out.clamp(min=-1).to(input_ids.device)


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, *, decay: float = 0.8
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_k decay^k * CE_k, per-head CE_k fp32 [K], detached).

    head_logits: [..., K, V] (e.g. ``MedusaHeads.logits``, or logits over a subset of the
    vocabulary that ``targets`` index); targets: int64 [..., K], negative = not scored. CE_k
    is the mean over head k's scored targets (0 when it has none)."""
    K, V = head_logits.shape[-2:]
    logits = head_logits.reshape(-1, K, V).float()
    t = targets.reshape(-1, K)
    valid = t >= 0
    losses = F.cross_entropy(logits.reshape(-1, V), t.clamp(min=0).reshape(-1), reduction="none").view(t.shape)
    per_head = (losses * valid).sum(0) / valid.sum(0).clamp(min=1)
    weights = torch.tensor([decay**k for k in range(K)], device=per_head.device)
    return (per_head * weights).sum(), per_head.detach()


def heads_loss(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, *, decay: float = 0.8,
               root_ids: torch.Tensor | None = None, lm_head: torch.Tensor | None = None) -> tuple:
    """The heads' training loss on one batch (the base model is not trained).

    hidden: [..., H], the base model's (final-normed) hidden states, computed without grad;
    targets: int64 [..., K] (see :func:`medusa_loss`); root_ids: int64 [...] for
    root-conditioned heads. ``lm_head`` [Vs, H]: score the heads' states against these rows
    instead of the heads' LM heads (``targets`` then index its rows: the trainer's softmax
    over the tokens of the data). Returns (loss, per-head losses fp32 [K], logits [..., K,
    V or Vs])."""
    hidden = hidden.detach()
    if lm_head is None:
        logits = heads.logits(hidden, root_ids)
    else:
        logits = torch.stack(heads.head_states(hidden, root_ids), dim=-2) @ lm_head.T
    loss, per_head = medusa_loss(logits, targets, decay=decay)
    return loss, per_head, logits
