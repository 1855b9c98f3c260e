"""The one decoder block every model of the package runs: a Llama layer, Qwen2's with q/k/v biases.

    h   = x + wo @ attention(rope(q), rope(k), v),   q|k|v = wqkv @ rms_norm(x) (+ bqkv)
    out = h + w_down @ (silu(gate) * up),            gate|up = w_gate_up @ rms_norm(h)

The target's decode/verification forward and its prefill, the distilled draft models and the
self-speculation prefix (both are Llamas), the EAGLE head's decoder layer and the autograd
twins that train them (``drafting.draft_model.training.DraftLM``, the EAGLE trainer) all run
:class:`DecoderBlock`. Two things differ between them, and both are explicit:

- **the product** (``DecoderBlock.linear``): the model's :func:`linear` when decoding
  (``ops.linear``, which picks the skinny kernel for few rows, or GGUF blocks through
  ``QuantizedWeight.linear``; no autograd), ``F.linear`` in the trainers (autograd);
- **the attention** between :meth:`DecoderBlock.qkv` and :meth:`DecoderBlock.output`: the
  caller's, because the keys live in different places — :func:`paged_attention` (write the
  new K/V into the paged cache, then ``tree_attention`` with the tree/verification rows of a
  ``Batch``), SDPA over a prompt (prefill), :func:`causal_attention` (training batches), the
  EAGLE trainer's unrolled attention.

A layer's weights ``L`` are a mapping: ``attn_norm`` [H], ``wqkv`` [(Hq+2Hkv)*D, H],
optional ``bqkv`` [(Hq+2Hkv)*D], ``wo`` [H, Hq*D], ``mlp_norm`` [H], ``w_gate_up`` [2I, H],
``w_down`` [H, I] (a dict of tensors / GGUF block weights, or an ``nn.ParameterDict``).
The q/k rows are in the Hugging Face (rotate-half) convention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..gguf_blocks import QuantizedWeight
from .skinny_rows import skinny_linear_rows

LAYER_KEYS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")  # + "bqkv" with attention_bias


def layer_keys(attention_bias: bool) -> tuple:
    """The names of a layer's weights (with Qwen2's ``bqkv`` when ``attention_bias``)."""
    return LAYER_KEYS + (("bqkv",) if attention_bias else ())


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The decode paths' product, x @ w^T (+ bias [N]): block weights through
    ``QuantizedWeight.linear``, tensors through ``ops.linear`` with the model's rule for which
    row counts go to skinny_linear (``skinny_rows.skinny_linear_rows``); ``w`` may be a tuple
    of row blocks kept separate (block weights of different types that cannot be
    concatenated), whose outputs are concatenated (the bias is cut at the same rows)."""
    if isinstance(w, tuple):
        biases = bias.split([p.shape[0] for p in w]) if bias is not None else [None] * len(w)
        return torch.cat([linear(x, p, b) for p, b in zip(w, biases)], dim=-1)
    if isinstance(w, QuantizedWeight):
        return w.linear(x, bias)  # every row count: the blocks' batch-invariant kernel
    return ops.linear(x, w, bias, skinny_rows=skinny_linear_rows(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim: ``specdec::rms_norm`` (one
    pass, batch-invariant; the fused decode step calls the same kernel), or ``F.rms_norm``
    where autograd needs it (the trainers) or the weight has another dtype than x."""
    if weight.dtype != x.dtype or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.specdec.rms_norm(x, weight, eps, out)  # the op directly: ~2 per layer per step
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate|up [..., 2I] -> [..., I]: ``specdec::silu_and_mul`` (one pass,
    the same bits on every CPU; the fused decode step calls the same loop), or torch's ops
    where autograd needs them (the trainers)."""
    if torch.is_grad_enabled() and gate_up.requires_grad:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    torch.ops.specdec.silu_and_mul(gate_up, out)  # the op directly: once per layer per step
    return out


# ---- rotary embeddings --------------------------------------------------------------------------
def rope_tables(config, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: fp32 [max_pos, head_dim] for :func:`apply_rope`.

    The rotate-half rotation is ``x * cos + cat(-x2, x1) * sin``; the sign is folded into the
    first half of the sin table, so that the rotation is ``x * cos + roll(x, D/2) * sin``
    (one ``roll`` instead of two slices, a negation and a cat, and bit-identical:
    ``(-a) * b == a * (-b)`` exactly)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    return emb.cos(), torch.cat([-sin[:, : d // 2], sin[:, d // 2:]], dim=-1)


def rope_at(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype=None):
    """The tables of :func:`rope_tables` at ``positions`` (int64 [T]), as ``dtype`` (default:
    theirs), shaped [T, 1, D] to broadcast over the heads (gathered once per forward, used by
    every layer)."""
    cos, sin = cos[positions], sin[positions]
    if dtype is not None:
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D]; cos, sin [T, 1, D] (:func:`rope_at`)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


# ---- the block ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecoderBlock:
    """The layer's arithmetic for a model shape; weights are passed per call (one block object
    serves every layer). ``linear(x, w, bias=None)`` is the product (module docstring).

    Shapes: x [..., T, H] (decode paths: [T, H]; training batches: [B, T, H]); rope: the
    pair of :func:`rope_at` for the T positions."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    linear: Callable = linear

    @classmethod
    def of(cls, config, linear: Callable = linear) -> "DecoderBlock":
        """The block of a ``LlamaConfig`` (or any config with its head and norm fields)."""
        return cls(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, linear)

    def qkv(self, L, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> q [..., T, Hq, D], k, v [..., T, Hkv, D], RoPE applied to q and k.

        q and k are rotated together (one rope over the q|k columns, fewer ops per layer), so
        they are views with the last dim contiguous, not contiguous tensors."""
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.linear(rms_norm(x, L["attn_norm"], self.eps), L["wqkv"], L.get("bqkv"))
        qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
        q, k = apply_rope(qk.unflatten(-1, (Hq + Hkv, D)), *rope).split([Hq, Hkv], dim=-2)
        return q, k, v.unflatten(-1, (Hkv, D))

    def output(self, L, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, attention output projection, then the MLP with its residual: x [..., H]
        (the block's input), attn [..., Hq*D] -> [..., H]."""
        h = x + self.linear(attn, L["wo"])
        gate_up = self.linear(rms_norm(h, L["mlp_norm"], self.eps), L["w_gate_up"])
        return h + self.linear(silu_and_mul(gate_up), L["w_down"])

    def __call__(self, L, x: torch.Tensor, rope, attend: Callable) -> torch.Tensor:
        """The whole block: ``attend(q, k, v)`` -> [..., T, Hq*D] is the attention."""
        q, k, v = self.qkv(L, x, rope)
        return self.output(L, x, attend(q, k, v))


# ---- attentions ---------------------------------------------------------------------------------
def paged_attention(cache, layer: int, batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode / verification attention of one layer: write the new tokens' k, v [T, Hkv, D]
    into ``cache`` at ``batch.slot_mapping`` (nothing committed), then ``tree_attention`` of q
    [T, Hq, D] over each request's committed prefix and its new rows (``batch``: a
    ``models.llama.Batch``; ``tree_mask`` None is causal) -> [T, Hq*D]."""
    cache.write(layer, batch.slot_mapping, k, v)
    # The op directly, not ops.tree_attention: the wrapper's Python argument checks cost
    # ~tens of microseconds per layer per step, and the C++/Triton kernel checks every
    # argument again anyway (RuntimeError).
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.specdec.tree_attention(q, cache.k_caches[layer], cache.v_caches[layer], batch.block_table,
                                     batch.prefix_lens, batch.qo_indptr, batch.tree_mask,
                                     1.0 / math.sqrt(q.shape[-1]), out, None)
    return out.view(out.shape[0], -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of training batches (autograd): q [B, T, Hq, D], k, v [B, T, Hkv, D]
    -> [B, T, Hq*D]."""
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True)
    return a.transpose(1, 2).flatten(-2)


__all__ = ["DecoderBlock", "LAYER_KEYS", "apply_rope", "causal_attention", "layer_keys", "linear",
           "paged_attention", "rms_norm", "rope_at", "rope_tables"]
