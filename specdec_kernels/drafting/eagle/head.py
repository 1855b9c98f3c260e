"""EAGLE-style draft head: one decoder layer that runs autoregressively at the feature level.

The target's feature at position t (``f_t``: its last layer's output before the final norm,
what the decode loop calls ``hidden``; it produces the prediction of token t+1) and the
embedding of token t+1 are fused into one vector; one Llama decoder layer (its own small
KV cache over the sequence) turns it into ``g_t``, an estimate of ``f_{t+1}``; the target's
final norm and LM head rows of a reduced *draft vocabulary* turn ``g_t`` into draft logits
for token t+2. Deeper drafts feed ``g`` back in place of the feature the target has not
computed yet (EAGLE's feature-level autoregression)::

    x_t = fc([f_t ; embed(token_{t+1})])          [H]   (fc: [H, 2H])
    g_t = DecoderLayer(x_t, position t, K/V of x_0..x_t)
    draft logits = norm(g_t) @ lm_head[draft_vocab]^T

EAGLE-3's fusion (:meth:`EagleHead.fuse_with`): ``f_t`` is then a learned projection
``fuse`` [H, (k + 1) H] of the target's states after ``feature_layers`` (e.g. layers 2 and 14
of 28) and after its last layer, which the decode loop hands over for every verified row
(``Drafter.feature_layers``, ``Llama.forward(..., feature_layers=)``); the head's own outputs
``g`` estimate the projected feature and are fed back unprojected, as in training (its
``unrolled`` forward). ``fuse`` starts as the last layer alone, so fusion added to a trained
head drafts as it did until trained further. The shipped heads read the last layer alone: in
same-budget probes on this machine fusion was no better (docs/training.md, "What each part
adds"), and the budget went to more data instead.

Only the layer, ``fc`` and the draft vocabulary are stored (bf16, see :func:`save_eagle_head`);
the embedding, final norm and LM head rows are the target's (frozen, attached at load).

Shapes: H hidden size, Hq/Hkv attention heads, D head dim, V target vocabulary, Vd draft
vocabulary.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...models.block import DecoderBlock, layer_keys, linear, rms_norm, rope_at, rope_tables
from ...models.decoder_step import build_stack, default_path
from ...models.llama import dense, is_block_weight
from ...models.skinny_rows import skinny_linear_rows
from ..draft_model.model import DRAFT_WEIGHTS  # --draft-weights: the same choices for an EAGLE head
from ...models.registry import read_metadata

DECODE_FORMATS = (None, "Q8_0", "Q4_0")  # how the decode fast paths run the head's products


class EagleHead(nn.Module):
    """The draft layer. Parameters: ``fc`` [H, 2H]; the decoder layer (``models.block``)
    ``attn_norm`` [H], ``wqkv`` [(Hq+2Hkv)*D, H], ``bqkv`` [(Hq+2Hkv)*D] (with
    ``attention_bias``: a Qwen2 target's layer), ``wo`` [H, Hq*D], ``mlp_norm`` [H],
    ``w_gate_up`` [2I, H], ``w_down`` [H, I]; with ``feature_layers`` ``fuse`` [H, (k + 1) H]
    (:meth:`fuse_with`). Buffers (not trained): ``draft_vocab`` int64
    [Vd] and, once :meth:`attach` ed to a target, its ``embed`` [V, H], ``norm`` [H] and
    ``lm_head_draft`` [Vd, H] (the LM head's rows of the draft vocabulary).

    The layer is the target's :class:`~specdec_kernels.models.block.DecoderBlock` twice over:
    ``block`` multiplies with ``F.linear`` (autograd: :meth:`qkv`, :meth:`output`, the
    trainer), ``decode_block`` with the model's linear on :meth:`decode_weights` (the
    ``decode_*`` fast paths)."""

    def __init__(self, config, draft_vocab: torch.Tensor, *, intermediate_size: int | None = None,
                 attention_bias: bool | None = None, feature_layers=()):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.config = config
        self.hidden_size, self.head_dim = H, D
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.eps = config.rms_norm_eps
        self.attention_bias = config.attention_bias if attention_bias is None else bool(attention_bias)
        self.block = DecoderBlock.of(config, F.linear)
        self.decode_block = DecoderBlock.of(config, self._linear)
        inter = intermediate_size or config.intermediate_size
        self.intermediate_size = inter
        qkv = (config.num_heads + 2 * config.num_kv_heads) * D
        self.fc = nn.Parameter(torch.zeros(H, 2 * H))
        self.attn_norm = nn.Parameter(torch.ones(H))
        self.wqkv = nn.Parameter(torch.randn(qkv, H) * H ** -0.5)
        if self.attention_bias:
            self.bqkv = nn.Parameter(torch.zeros(qkv))
        self.wo = nn.Parameter(torch.randn(H, config.num_heads * D) * (config.num_heads * D) ** -0.5 * 0.1)
        self.mlp_norm = nn.Parameter(torch.ones(H))
        self.w_gate_up = nn.Parameter(torch.randn(2 * inter, H) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(H, inter) * inter ** -0.5 * 0.1)
        with torch.no_grad():
            self.fc[:, :H] = torch.eye(H)  # start as "the feature, plus what the token adds"
            self.fc[:, H:] = torch.randn(H, H) * 0.02
        self.register_buffer("draft_vocab", torch.as_tensor(draft_vocab, dtype=torch.int64).clone(), persistent=True)
        self.embed = self.norm = self.lm_head_draft = self._lm_head_blocks = None
        self.decode_format: str | None = None  # see set_decode_format
        self.int8_activations = False  # see set_decode_format
        self._decode_weights, self._decode_key = None, None
        self.step_path = default_path()  # "fused": the decode halves on a one-layer C++ stack
        self._decode_stack = None
        self._rope_len = 0
        self.metadata: dict = {}
        self.feature_layers: tuple = ()
        self.register_parameter("fuse", None)  # with feature_layers: [H, (k + 1) H] (fuse_with)
        if feature_layers:
            self.fuse_with(feature_layers)

    def fuse_with(self, feature_layers) -> "EagleHead":
        """Read EAGLE-3's fused features: the target's states after the layer counts
        ``feature_layers`` (increasing, below the target's layer count; e.g. (2, 14) of 28) and
        after its last layer, concatenated [.., (k + 1) H], through ``fuse`` [H, (k + 1) H] in
        place of the last layer's state alone. ``fuse`` starts as that state alone (zeros, then
        the identity), so a head given fusion drafts as before until it is trained."""
        layers = tuple(int(n) for n in feature_layers)
        L = self.config.num_layers
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 1 or layers[-1] >= L:
            raise ValueError(f"feature layers must be increasing layer counts in [1, {L - 1}], got {feature_layers}")
        H = self.hidden_size
        self.feature_layers = layers
        self.fuse = nn.Parameter(torch.cat([torch.zeros(H, len(layers) * H), torch.eye(H)], 1).to(self.fc.dtype))
        self._decode_weights = None
        return self

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., (k + 1) H] (the last layer's alone, [..., H], without
        fusion) -> f [..., H], the head's input feature."""
        self._check_width(features)
        return features if self.fuse is None else F.linear(features, self.fuse.to(features.dtype))

    def _check_width(self, features: torch.Tensor) -> None:
        width = self.hidden_size * (len(self.feature_layers) + 1)
        if features.shape[-1] != width:
            raise ValueError(f"the head reads target features of width {width} (feature layers "
                             f"{self.feature_layers or 'none'} and the last), got {tuple(features.shape)}")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def for_target(cls, target, draft_vocab: torch.Tensor, *, init_layer: int | None = -1,
                   intermediate_size: int | None = None) -> "EagleHead":
        """A head for ``target`` (a ``Llama``), its decoder layer copied from the target's
        layer ``init_layer`` (None: random) — a better start than random with little data.
        ``intermediate_size`` (default: the target's) narrows the head's MLP, to the first
        that many of the copied layer's gate / up rows and down columns."""
        I_t = target.config.intermediate_size
        inter = I_t if intermediate_size is None else int(intermediate_size)
        if not 0 < inter <= I_t:
            raise ValueError(f"intermediate_size must be in 1..{I_t} (the target's), got {inter}")
        head = cls(target.config, draft_vocab, intermediate_size=inter)
        if init_layer is not None:
            L = target.layers[init_layer]
            with torch.no_grad():
                for name in layer_keys(head.attention_bias):
                    w = dense(L[name]).float()
                    if name == "w_gate_up":
                        w = torch.cat([w[:inter], w[I_t:I_t + inter]])
                    elif name == "w_down":
                        w = w[:, :inter]
                    getattr(head, name).copy_(w)  # native weights: dequantised
        return head.attach(target)

    def attach(self, target) -> "EagleHead":
        """Use ``target``'s embedding, final norm and LM head (frozen, not copied into the
        state dict). Call after loading or changing the draft vocabulary."""
        if target.config.hidden_size != self.hidden_size:
            raise ValueError(f"target hidden size {target.config.hidden_size} != head's {self.hidden_size}")
        if int(self.draft_vocab.max()) >= target.config.vocab_size:
            raise ValueError("draft vocabulary ids exceed the target's vocabulary")
        self.embed = target.embed_tokens  # rows looked up (and dequantised for block weights) on demand
        self.norm = target.norm
        if is_block_weight(target.lm_head):  # dequantise only the draft rows (the 1.5B's LM head is 0.9 GB as fp32)
            self._lm_head_blocks = target.lm_head.rows(self.draft_vocab)
            self.lm_head_draft = dense(self._lm_head_blocks)
        else:
            self._lm_head_blocks = None
            self.lm_head_draft = dense(target.lm_head)[self.draft_vocab].contiguous()
        self._decode_weights = None
        return self

    def _rope_at(self, positions: torch.Tensor, dtype):
        """The rotary tables at ``positions`` (int64 [T]) as ``dtype`` (``models.block.rope_at``)."""
        self._ensure_rope(int(positions.max()) + 1 if positions.numel() else 1)
        return rope_at(self.cos, self.sin, positions, dtype)

    def _ensure_rope(self, n: int) -> None:
        """Rotary tables (fp32 [R, D]) of at least ``n`` positions."""
        if n > self._rope_len:
            n = max(n, 2 * self._rope_len, 256)
            self.cos, self.sin = rope_tables(self.config, n)
            self._rope_len = n

    # ---- the layer, in pieces the trainer and the drafter share ------------------------------
    def block_weights(self, dtype) -> dict:
        """The decoder layer's parameters as ``dtype`` (autograd follows the casts)."""
        return {n: getattr(self, n).to(dtype) for n in layer_keys(self.attention_bias)}

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[..., H] features (f_t or a draft's g) and int64 [...] next tokens -> x [..., H]."""
        e = self.embed(tokens).to(features.dtype)
        return F.linear(torch.cat([features, e], dim=-1), self.fc.to(features.dtype))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H], positions int64 [T] -> q [T, Hq, D], k, v [T, Hkv, D] (RoPE applied)."""
        return self.block.qkv(self.block_weights(x.dtype), x, self._rope_at(positions, x.dtype))

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + attention output projection + MLP: x [T, H], attn [T, Hq*D] -> g [T, H]."""
        return self.block.output(self.block_weights(x.dtype), x, attn)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [..., H] -> fp32 draft logits [..., Vd] (index into ``draft_vocab``)."""
        w = self.lm_head_draft.to(g.dtype)
        return F.linear(rms_norm(g, self.norm.to(g.dtype), self.eps), w).float()

    # ---- fast paths for decoding (no autograd, the target's dtype, the model's linear) ---------
    def decode_weights(self, dtype) -> dict:
        """The parameters for decoding (cached): contiguous ``dtype`` tensors, for which
        the model's linear picks the skinny kernel for the few rows a draft step has; with
        ``decode_format`` "Q8_0" / "Q4_0" the six products' weights (fc, wqkv, wo, w_gate_up,
        w_down and the draft LM head) are GGUF blocks for ``quantized_linear`` instead.

        Why blocks: each draft depth streams all of them (~9M weights for SmolLM2, the draft
        LM head half of it): 36 MB in fp32, 10 MB as Q8_0, 5 MB as Q4_0, so on a native (GGUF)
        target a depth costs a fraction of the fp32 time. The draft LM head rows are the target's own
        blocks whatever their type: the head drafts from the target's LM head values, not a
        second rounding of them, and on the 1.5B its Q6_K rows ran as fast as Q4_0 copies at
        4-8 rows and 1.5x faster than Q8_0 ones (AVX2, 2 threads). Only a dense target LM
        head is quantised to ``decode_format``.
        With ``int8_activations`` the blocks carry their int8 packing (``int8_activation_linear``,
        as on a "native-int8act" target)."""
        key = (dtype, self.decode_format, self.int8_activations)
        if self._decode_weights is None or self._decode_key != key:
            w = {n: p.detach().to(dtype).contiguous() for n, p in self.named_parameters()}
            w["norm"] = self.norm.to(dtype)
            if self.decode_format is None:
                w["lm_head_draft"] = self.lm_head_draft.to(dtype).contiguous()
            else:
                from ...gguf_blocks import quantize

                def blocks(t):
                    q = quantize(t.float().contiguous(), self.decode_format) if isinstance(t, torch.Tensor) else t
                    return q.with_int8_activations() if self.int8_activations else q

                for n in ("fc", "wqkv", "wo", "w_gate_up", "w_down") + (("fuse",) if self.fuse is not None else ()):
                    w[n] = blocks(w[n])
                own = self._lm_head_blocks  # the target's rows whatever their type: see above
                w["lm_head_draft"] = blocks(own if own is not None else self.lm_head_draft)
            self._decode_weights, self._decode_key, self._decode_stack = w, key, None
        return self._decode_weights

    def decode_stack(self, dtype):
        """The one-layer C++ stack of the decode weights, with the final norm and the draft LM
        head (``models.decoder_step``), that :meth:`decode_layer` and the decode halves run on,
        or None: the Python block runs (``step_path`` "python", weights
        off the CPU, or a dtype other than fp32 — the decode block casts block products'
        fp32 outputs to x's dtype, which the C++ products do not)."""
        w = self.decode_weights(dtype)
        if self.step_path != "fused" or dtype != torch.float32:
            return None
        if self._decode_stack is None:
            stack = build_stack(self.decode_block, [w], w["norm"], w["lm_head_draft"])
            self._decode_stack = False if stack is None else stack  # False: tried, cannot run
        return None if self._decode_stack is False else self._decode_stack

    def set_decode_format(self, fmt: str | None, *, int8_activations: bool = False) -> "EagleHead":
        """How the decode fast paths run the products: None (dense, the target's dtype) or a
        GGUF block type "Q8_0" / "Q4_0" (see :meth:`decode_weights`); ``int8_activations``
        (block formats only): multiply the blocks with int8 activations."""
        fmt = None if fmt is None else str(fmt).upper()
        if fmt not in DECODE_FORMATS:
            raise ValueError(f"decode format must be one of {DECODE_FORMATS}, got {fmt!r}")
        if int8_activations and fmt is None:
            raise ValueError("int8 activations need a block decode format (Q8_0 or Q4_0)")
        self.decode_format, self.int8_activations, self._decode_weights = fmt, bool(int8_activations), None
        return self

    @staticmethod
    def _linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The decode block's product: the model's linear, in x's dtype (quantized_linear
        returns fp32)."""
        return linear(x, w, bias).to(x.dtype)

    @torch.inference_mode()
    def decode_features(self, features: torch.Tensor) -> torch.Tensor:
        """:meth:`fuse_features` on the decode weights (features in the decode dtype)."""
        self._check_width(features)
        if self.fuse is None:
            return features
        return self._linear(features, self.decode_weights(features.dtype)["fuse"])

    @torch.inference_mode()
    def decode_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        w = self.decode_weights(features.dtype)
        return self._linear(torch.cat([features, self.embed(tokens).to(features.dtype)], dim=-1), w["fc"])

    @torch.inference_mode()
    def decode_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """:meth:`qkv` on the decode weights (x [T, H] in the decode dtype)."""
        stack = self.decode_stack(x.dtype)
        if stack is not None:
            return tuple(stack.qkv(0, x, *self._rope_at(positions, x.dtype), *skinny_linear_rows(x.dtype)))
        return self.decode_block.qkv(self.decode_weights(x.dtype), x, self._rope_at(positions, x.dtype))

    @torch.inference_mode()
    def decode_output(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`output` then the draft logits on the decode weights -> (g [T, H], fp32
        draft log-probs [T, Vd])."""
        w = self.decode_weights(x.dtype)
        stack = self.decode_stack(x.dtype)
        if stack is not None:
            g = stack.output(0, x, attn, *skinny_linear_rows(x.dtype))
        else:
            g = self.decode_block.output(w, x, attn)
        logits = linear(rms_norm(g, w["norm"], self.eps), w["lm_head_draft"]).float()
        return g, logits.log_softmax(-1)


    @torch.inference_mode()
    def decode_layer(self, x: torch.Tensor, positions: torch.Tensor, cache, block_table: torch.Tensor,
                     prefix_lens: torch.Tensor, qo_indptr: torch.Tensor, slot_mapping: torch.Tensor):
        """The layer and the draft log-probs over the head's paged cache (its layer 0): x [T, H]
        (:meth:`decode_inputs`), positions int64 [T] (RoPE's); the rows' K/V are written at
        ``slot_mapping``, then each request's rows (``qo_indptr``) attend through
        ``tree_attention`` to its ``prefix_lens`` entries of ``block_table`` and causally to
        each other -> (g [T, H], fp32 draft log-probs [T, Vd]). On the fused path one C++ call
        (``DecoderStack.forward_logits``), with the same bits as the halves."""
        stack = self.decode_stack(x.dtype)
        if stack is not None:
            self._ensure_rope(cache.max_blocks_per_seq * cache.block_size)
            g, logits = stack.forward_logits(x, positions, self.cos, self.sin, cache.k_caches[:1], cache.v_caches[:1],
                                             block_table, prefix_lens, qo_indptr, slot_mapping, None, 1,
                                             *skinny_linear_rows(x.dtype))
            return g, logits.log_softmax(-1)
        q, k, v = self.decode_qkv(x, positions)
        cache.write(0, slot_mapping, k, v)
        attn = torch.empty_like(q)
        torch.ops.specdec.tree_attention(q, cache.k_caches[0], cache.v_caches[0], block_table, prefix_lens,
                                         qo_indptr, None, self.head_dim ** -0.5, attn, None)
        return self.decode_output(x, attn.reshape(attn.shape[0], -1))


def attention_reference(q, k, v, mask=None):
    """Plain attention for the head: q [T, Hq, D], k, v [S, Hkv, D], mask bool [T, S] (True
    = visible) or None (all visible) -> [T, Hq*D]. Grouped-query heads are repeated."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


# ---------------------------------------------------------------------------------------
# Files.
# ---------------------------------------------------------------------------------------

SHIPPED_HEADS = {"smollm2-135m": "eagle_smollm2_135m.safetensors",
                 "qwen2.5-coder-1.5b": "eagle_qwen2.5_coder_1.5b.safetensors"}


def default_eagle_checkpoint(model_name: str, *, must_exist: bool = True) -> str | None:
    """Path of the package's trained EAGLE head for a registered model name (also matched on
    the model's file name), or None if none ships."""
    from ...models.registry import shipped_file

    return shipped_file(model_name, SHIPPED_HEADS, must_exist=must_exist)


def save_eagle_head(head: EagleHead, path, *, dtype=torch.bfloat16, metadata: dict | None = None) -> None:
    """Write the trainable parameters (``dtype``) and ``draft_vocab`` (int64) to a
    ``.safetensors`` file with string metadata (the training command's settings and scores)."""
    from safetensors.torch import save_file

    state = {n: p.detach().to(dtype).contiguous().clone() for n, p in head.named_parameters()}
    state["draft_vocab"] = head.draft_vocab.detach().to(torch.int64).clone()
    meta = {**head.metadata, **(metadata or {}), "intermediate_size": str(head.intermediate_size),
            "feature_layers": ",".join(map(str, head.feature_layers))}
    save_file(state, os.fspath(path), metadata={str(k): str(v) for k, v in meta.items()})


def load_eagle_head(path, target) -> EagleHead:
    """An :class:`EagleHead` from a file of :func:`save_eagle_head`, attached to ``target``
    (parameters in the target's dtype, eval mode, no gradients)."""
    from safetensors.torch import load_file

    state = load_file(os.fspath(path))
    meta = read_metadata(path)
    missing = {"fc", "wqkv", "wo", "w_gate_up", "w_down", "draft_vocab"} - set(state)
    if missing:
        raise ValueError(f"{path}: not an EAGLE head file (missing {sorted(missing)})")
    if state["fc"].shape != (target.config.hidden_size, 2 * target.config.hidden_size):
        raise ValueError(f"{path}: fc has shape {tuple(state['fc'].shape)}, the target's hidden size is "
                         f"{target.config.hidden_size}")
    H = target.config.hidden_size
    layers = tuple(int(n) for n in meta.get("feature_layers", "").split(",") if n.strip())
    if ("fuse" in state) != bool(layers) or ("fuse" in state and state["fuse"].shape != (H, (len(layers) + 1) * H)):
        raise ValueError(f"{path}: its fusion weight {tuple(state['fuse'].shape) if 'fuse' in state else None} does "
                         f"not fit its feature layers {layers or 'none'} (hidden size {H})")
    head = EagleHead(target.config, state["draft_vocab"], intermediate_size=state["w_down"].shape[1],
                     attention_bias="bqkv" in state, feature_layers=layers)
    head.load_state_dict({k: v.float() for k, v in state.items()})
    head.metadata = meta
    head.to(target.dtype)
    return head.attach(target).eval().requires_grad_(False)


def decode_format_for(target, weights: str = "stored") -> str | None:
    """The head's decode format for ``weights`` (``--draft-weights``): "stored" follows the
    target — GGUF Q4_0 blocks when the target runs GGUF blocks (``weight_format`` "native",
    "q8_0", "q4_0"), dense in the target's dtype otherwise; "fp32" dense; "q8_0" / "q4_0"
    those blocks. Why Q4_0: a draft depth is a few rows through every product of the head;
    Q4_0 streams half the bytes of Q8_0, and on AVX2 its unsigned 4-bit weights multiply
    faster than Q8_0's signed ones. On the 1.5B (AVX2, 2 threads) a depth of 8 rows took 2.8
    ms against 3.4 (4.2 with the old Q8_0 copy of the LM head), and its trees accepted as many
    tokens (docs/benchmarks.md, "The EAGLE head's products as Q4_0 blocks")."""
    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"EAGLE head weights must be one of {DRAFT_WEIGHTS}, got {weights!r}")
    if weights == "stored":
        return "Q4_0" if is_block_weight(target.lm_head) else None
    return None if weights == "fp32" else weights.upper()


def eagle_head_for(target, checkpoint=None, *, draft_vocab_size: int = 4096, weights: str = "stored") -> EagleHead:
    """The head for ``target``: ``checkpoint`` (a file), None = the package's trained head
    for the model if it ships one, else an untrained head (``"untrained"``: the decoder layer
    copied from the target's last layer, the lowest ``draft_vocab_size`` ids as the draft
    vocabulary — for tests and comparisons, expect low acceptance). ``weights``: how its
    products run while decoding (:func:`decode_format_for`); block products use int8
    activations when the target's do (``Llama.int8_activations``)."""
    fmt = decode_format_for(target, weights)
    if checkpoint is None:
        checkpoint = default_eagle_checkpoint(target.name) or "untrained"
    if checkpoint == "untrained":
        V = target.config.vocab_size
        head = EagleHead.for_target(target, torch.arange(min(V, draft_vocab_size)))
        head = head.to(target.dtype).attach(target).eval().requires_grad_(False)
    else:
        head = load_eagle_head(checkpoint, target)
    return head.set_decode_format(fmt, int8_activations=fmt is not None and getattr(target, "int8_activations", False))


__all__ = ["DECODE_FORMATS", "EagleHead", "attention_reference", "decode_format_for",
           "default_eagle_checkpoint", "eagle_head_for", "load_eagle_head", "save_eagle_head", "read_metadata"]
