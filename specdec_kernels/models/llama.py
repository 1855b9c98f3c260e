"""A Llama-family transformer (Llama, SmolLM2, Qwen2, ...) for speculative decoding.

One readable implementation: the layers are ``models.block.DecoderBlock`` (RMSNorm, rotary
embeddings at explicit positions, grouped-query attention, SwiGLU MLP), then a tied or untied
LM head; Qwen2 is the same layer with biases on the q, k and v projections
(``config.attention_bias``: one fused q|k|v bias next to the fused weight, added by the
product itself). Every token that is decoded or verified goes
through ``specdec::tree_attention`` over a paged KV cache: a forward takes the new tokens of a
batch of requests flattened to [T] (request b owns rows ``qo_indptr[b]:qo_indptr[b+1]``), their
positions (``prefix_len + depth`` for tree nodes), and an optional tree mask. Prefill of a
prompt uses torch's scaled_dot_product_attention, which is faster for long causal blocks.

Weights are stored fused (q|k|v and gate|up) so that a layer runs four matrix products; the
q/k rows are in the Hugging Face (rotate-half) convention. A weight is an fp32/bf16 tensor or
a ``gguf_blocks.QuantizedWeight`` (GGUF blocks, e.g. a GGUF file's own Q4_1/Q8_0 bytes:
``weight_format`` "native", or a checkpoint quantised on load: "q8_0"/"q4_0"); every product
goes through ``ops.linear``, which sends block weights to ``quantized_linear``. Block
weights keep fp32 activations, or with ``with_int8_activations`` (weight format
"native-int8act") quantise them to int8 per block as llama.cpp does
(``int8_activation_linear``); the embedding dequantises only the looked-up rows.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .block import DecoderBlock, linear, paged_attention, rms_norm, rope_at, rope_tables
from .config import LlamaConfig
from .decoder_step import build_stack, default_path
from .skinny_rows import skinny_linear_rows
from ..gguf_blocks import QuantizedWeight
from ..kv_cache import PagedKVCache


@dataclass
class Batch:
    """Where the T new tokens of a forward go and what they see.

    block_table: int32 [B, max_blocks] (rows of the requests in this call); prefix_lens: int32
    [B], cache position of each request's first new token; qo_indptr: int32 [B+1];
    slot_mapping: int64 [T], flat cache index (block * block_size + offset) of each new token;
    tree_mask: int64 [T, W] or None (causal among each request's new tokens).
    """

    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor
    slot_mapping: torch.Tensor
    tree_mask: torch.Tensor | None = None


def is_block_weight(w) -> bool:
    """Whether ``w`` is a gguf_blocks.QuantizedWeight."""
    return isinstance(w, QuantizedWeight)


def dense(w) -> torch.Tensor:
    """``w`` as a plain tensor: block weights dequantised to fp32 [N, H] (parts of a weight
    kept separate are concatenated), tensors as they are."""
    if isinstance(w, tuple):
        return torch.cat([dense(p) for p in w])
    return w.dequantize() if is_block_weight(w) else w


class Llama:
    """Weights as plain tensors (no nn.Module machinery on the hot path).

    ``weights`` holds ``embed`` [V, H], ``norm`` [H], ``lm_head`` [V, H] (the embedding when
    tied) and per layer ``layers[i]`` = dict(attn_norm, wqkv [(Hq+2Hkv)*D, H], wo [H, Hq*D],
    mlp_norm, w_gate_up [2I, H], w_down [H, I]) plus, with ``config.attention_bias``, bqkv
    [(Hq+2Hkv)*D] (in the activation dtype: fp32 next to block weights).

    Draft models may carry ``draft_vocab`` (int64 [Vd]): their LM head has Vd rows, the
    target-vocabulary ids of those rows, so ``logits`` are [T, Vd] and index into it (the
    decode loop maps them back; see ``drafting.draft_model.model``).
    """

    def __init__(self, config: LlamaConfig, weights: dict, *, name: str = "llama", weight_format: str | None = None):
        self.config = config
        self.name = name
        self.embed = weights["embed"]
        self.norm = weights["norm"]
        self.lm_head = weights["lm_head"]
        self.layers = weights["layers"]
        if any(("bqkv" in L) != config.attention_bias for L in self.layers):
            raise ValueError(f"config.attention_bias is {config.attention_bias} but the layers "
                             f"{'lack' if config.attention_bias else 'have'} q/k/v biases (bqkv)")
        self.draft_vocab = weights.get("draft_vocab")
        self.vocab_digest: str | None = None  # the tokenizer's (Tokenizer.vocab_digest), set by the loaders
        self.device = self.embed.device
        # Activations (and the KV cache) are fp32 with block weights, else the weights' dtype.
        self.dtype = self.norm.dtype
        if weight_format is None:
            weight_format = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype))
        self.weight_format = weight_format
        self.block = DecoderBlock.of(config)  # every layer's arithmetic (models.block)
        # "fused": forward runs the layers in one C++ call where it can (models.decoder_step,
        # the same bits); "python": the DecoderBlock loop below, the reference.
        self.step_path = default_path()
        self._stack = None  # the C++ DecoderStack, built on first use
        self._embedding_rows: dict[int, torch.Tensor] = {}  # token -> dequantised row (block embeddings)
        self._rope_len = 0
        self._ensure_rope(min(config.max_position_embeddings, 4096))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def random(cls, config: LlamaConfig, seed: int = 0, dtype=torch.float32) -> "Llama":
        """A randomly initialised model (tests): projections scaled to keep activations near unit
        size, norms near 1; with ``config.attention_bias`` q/k/v biases of std 0.5 (Qwen2's
        k biases are large, so they must matter in the tests)."""
        g = torch.Generator().manual_seed(seed)
        H, D, I = config.hidden_size, config.head_dim, config.intermediate_size
        qkv = (config.num_heads + 2 * config.num_kv_heads) * D

        def w(*shape, std=0.02):
            return (torch.randn(*shape, generator=g) * std).to(dtype)

        embed = w(config.vocab_size, H, std=1.0)
        layers = [dict(attn_norm=1 + w(H, std=0.1), wqkv=w(qkv, H, std=H ** -0.5), wo=w(H, config.num_heads * D, std=(config.num_heads * D) ** -0.5),
                       mlp_norm=1 + w(H, std=0.1), w_gate_up=w(2 * config.intermediate_size, H, std=H ** -0.5),
                       w_down=w(H, I, std=I ** -0.5)) for _ in range(config.num_layers)]
        if config.attention_bias:
            for L in layers:
                L["bqkv"] = w(qkv, std=0.5)
        lm_head = embed if config.tie_word_embeddings else w(config.vocab_size, H, std=H ** -0.5)
        return cls(config, dict(embed=embed, norm=1 + w(H, std=0.1), lm_head=lm_head, layers=layers), name="random")

    @classmethod
    def from_hf_state_dict(cls, config: LlamaConfig, sd: dict, *, name: str = "llama",
                           dtype: torch.dtype = torch.float32) -> "Llama":
        """From Hugging Face names (model.layers.N.self_attn.q_proj.weight, ... and q/k/v_proj.bias
        with ``config.attention_bias``), as ``dtype``."""
        def get(k):
            return sd[k].to(dtype).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layers.append(dict(
                attn_norm=get(p + "input_layernorm.weight"),
                wqkv=torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                wo=get(p + "self_attn.o_proj.weight"),
                mlp_norm=get(p + "post_attention_layernorm.weight"),
                w_gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                w_down=get(p + "mlp.down_proj.weight"),
            ))
            if config.attention_bias:
                layers[-1]["bqkv"] = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        embed = get("model.embed_tokens.weight")
        lm_head = embed if (config.tie_word_embeddings or "lm_head.weight" not in sd) else get("lm_head.weight")
        return cls(config, dict(embed=embed, norm=get("model.norm.weight"), lm_head=lm_head, layers=layers), name=name)

    LINEAR_KEYS = ("wqkv", "wo", "w_gate_up", "w_down")

    def quantized(self, block_type: str) -> "Llama":
        """A copy whose linear weights, embedding and LM head are GGUF blocks of
        ``block_type`` ("Q8_0", "Q4_0", ..., via ``gguf_blocks.quantize``); norms stay fp32.
        (How a Hugging Face checkpoint, a draft model or heads become a quantised model.)"""
        def q(w):
            return self.requantized(w, block_type)

        embed = q(self.embed)
        lm_head = embed if self.lm_head is self.embed else q(self.lm_head)
        layers = [{k: (q(v) if k in self.LINEAR_KEYS else v.float()) for k, v in L.items()} for L in self.layers]
        return Llama(self.config, dict(embed=embed, norm=self.norm.float(), lm_head=lm_head, layers=layers,
                                       draft_vocab=self.draft_vocab), name=self.name, weight_format=block_type.lower())

    @staticmethod
    def requantized(w, block_type: str):
        """One weight (a tensor, block weight or tuple of parts) as GGUF blocks of ``block_type``
        (dequantised to fp32 first, parts concatenated): what :meth:`quantized` does to each."""
        from ..gguf_blocks import quantize

        return quantize(dense(w).float(), block_type)

    def with_int8_activations(self) -> "Llama":
        """A copy whose Q4_0 / Q4_1 / Q8_0 block linears and LM head multiply with activations
        quantised to int8 per block of 32 (``ops.int8_activation_linear``, llama.cpp's
        arithmetic: on CPU a one-row product is ~5x and each further row ~3x cheaper than
        ``quantized_linear``'s fp32 activations; outputs differ from those by the activation
        rounding). Still batch-invariant, so speculative decoding stays exact against this
        model's own autoregressive decoding. Embedding lookups and other weights are unchanged;
        ``weight_format`` gets "-int8act"."""
        from ..gguf_blocks import attach_int8_packing

        weights = [self.lm_head] + [L[k] for L in self.layers for k in self.LINEAR_KEYS]
        flat = [p for w in weights for p in (w if isinstance(w, tuple) else (w,)) if is_block_weight(p)]
        packed = dict(zip(map(id, flat), attach_int8_packing(flat)))  # all at once: one pool

        def pack(w):
            if isinstance(w, tuple):
                return tuple(pack(p) for p in w)
            return packed.get(id(w), w)

        layers = [{k: (pack(v) if k in self.LINEAR_KEYS else v) for k, v in L.items()} for L in self.layers]
        return Llama(self.config, dict(embed=self.embed, norm=self.norm, lm_head=pack(self.lm_head), layers=layers,
                                       draft_vocab=self.draft_vocab), name=self.name,
                     weight_format=f"{self.weight_format}-int8act")

    @property
    def int8_activations(self) -> bool:
        """Whether the model multiplies with int8 activations (:meth:`with_int8_activations`;
        drafters built for it then run their block products that way too)."""
        return getattr(self.lm_head, "int8_packed", None) is not None

    def hf_state_dict(self) -> dict:
        """The weights under Hugging Face names (for comparison with transformers)."""
        c = self.config
        D = c.head_dim
        sd = {"model.embed_tokens.weight": dense(self.embed), "model.norm.weight": self.norm}
        if not c.tie_word_embeddings:
            sd["lm_head.weight"] = dense(self.lm_head)
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = dense(L["wqkv"]).split([c.num_heads * D, c.num_kv_heads * D, c.num_kv_heads * D])
            g, u = dense(L["w_gate_up"]).chunk(2)
            sd.update({p + "input_layernorm.weight": L["attn_norm"], p + "self_attn.q_proj.weight": q,
                       p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                       p + "self_attn.o_proj.weight": dense(L["wo"]), p + "post_attention_layernorm.weight": L["mlp_norm"],
                       p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u, p + "mlp.down_proj.weight": dense(L["w_down"])})
            if c.attention_bias:
                qb, kb, vb = L["bqkv"].split([c.num_heads * D, c.num_kv_heads * D, c.num_kv_heads * D])
                sd.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                           p + "self_attn.v_proj.bias": vb})
        return {k: v.contiguous() for k, v in sd.items()}

    def truncated(self, num_layers: int) -> "Llama":
        """The first ``num_layers`` layers with the same final norm and LM head (shares weights)."""
        cfg = LlamaConfig(**{**self.config.__dict__, "num_layers": num_layers})
        return Llama(cfg, dict(embed=self.embed, norm=self.norm, lm_head=self.lm_head, draft_vocab=self.draft_vocab,
                               layers=self.layers[:num_layers]), name=f"{self.name}[:{num_layers}]",
                     weight_format=self.weight_format)

    def new_cache(self, max_batch: int, max_len: int, *, block_size: int = 64) -> PagedKVCache:
        """A paged cache with room for ``max_batch`` requests of ``max_len`` positions."""
        c = self.config
        blocks = -(-max_len // block_size)
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=max_batch * blocks,
                            block_size=block_size, max_batch=max_batch, max_blocks_per_seq=blocks,
                            dtype=self.dtype, device=self.device)

    def _ensure_rope(self, n: int) -> None:
        if n > self._rope_len:
            n = max(n, 2 * self._rope_len)
            self.cos, self.sin = rope_tables(self.config, n)
            self.cos, self.sin = self.cos.to(self.dtype), self.sin.to(self.dtype)
            self._rope_len = n

    # ---- forward ------------------------------------------------------------------------
    def decoder_stack(self):
        """The C++ layer stack ``forward`` runs with ``step_path`` "fused" (built on first use),
        or None: the Python layers run (``step_path`` "python", weights off the CPU, no C++ class)."""
        if self.step_path != "fused":
            return None
        if self._stack is None:
            stack = build_stack(self.block, self.layers, self.norm, self.lm_head) if self.device.type == "cpu" else None
            self._stack = False if stack is None else stack  # False: tried, cannot run
        return None if self._stack is False else self._stack

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [T, H] -> fp32 [T, V] ([T, Vd] with a ``draft_vocab``)."""
        return linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.lm_head).float()

    def embed_tokens(self, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        """[T] int64 (or a list of T ints) -> [T, H] in the activation dtype (block weights:
        only these rows are dequantised)."""
        if is_block_weight(self.embed):
            ids = tokens if isinstance(tokens, list) else (
                tokens.tolist() if tokens.dim() == 1 and tokens.numel() <= 16 else None)
            if ids is not None and 0 < len(ids) <= 16:  # decode steps: rows dequantised once, kept
                rows = [self._embedding_row(t) for t in ids]
                return rows[0] if len(rows) == 1 else torch.cat(rows)
        if isinstance(tokens, list):
            tokens = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        if is_block_weight(self.embed):
            return self.embed.embedding(tokens).to(self.dtype)
        return self.embed[tokens].to(self.dtype)  # a no-op unless a draft shares a target's other-dtype embedding

    EMBEDDING_ROWS_KEPT = 8192  # dequantised embedding rows kept (6 KB each for H = 1536)

    def _embedding_row(self, token: int) -> torch.Tensor:
        """Row ``token`` of a block-weight embedding, dequantised, [1, H] (the same bits as a
        lookup of it among others: each row decodes alone; callers do not write into it). Dequantising a K-quant row in torch ops
        takes ~200 us, a decode step's largest fixed cost; code repeats its tokens."""
        row = self._embedding_rows.get(token)
        if row is None:
            if len(self._embedding_rows) >= self.EMBEDDING_ROWS_KEPT:
                self._embedding_rows.clear()
            row = self.embed.embedding(torch.tensor([token], device=self.device)).to(self.dtype)
            self._embedding_rows[token] = row
        return row

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache, batch: Batch,
                *, num_layers: int | None = None, feature_layers=()) -> torch.Tensor:
        """Run T new tokens (int64 [T], positions int64 [T]) of a batch through the first
        ``num_layers`` layers (all by default), writing their K/V into ``cache`` at
        ``batch.slot_mapping`` (nothing is committed: the caller owns the cache lengths). Returns
        the last hidden states [T, H] (before the final norm); with ``feature_layers`` (layer
        counts, EAGLE-3's low and middle features) [T, (n + 1) H]: the states after those
        layers, then the last (:meth:`with_features`)."""
        return self.with_features(*self._layers_forward(tokens, positions, cache, batch, num_layers, feature_layers))

    def _layers_forward(self, tokens, positions, cache, batch, num_layers, feature_layers) -> tuple:
        """:meth:`forward`'s work: (the last hidden states [T, H], [the states after each of
        ``feature_layers``])."""
        self._check_feature_layers(feature_layers, len(self.layers[:num_layers]))
        stack = self.decoder_stack() if cache.device.type == "cpu" else None
        if stack is not None:
            with self._capturing(stack, feature_layers) as captured:
                h = stack.forward(*self._stack_args(tokens, positions, cache, batch, num_layers))
            return h, captured
        self._ensure_rope(int(positions.max()) + 1)
        rope = rope_at(self.cos, self.sin, positions)
        h = self.embed_tokens(tokens)
        states = {}
        for i, L in enumerate(self.layers[:num_layers]):
            q, k, v = self.block.qkv(L, h, rope)
            h = self.block.output(L, h, paged_attention(cache, i, batch, q, k, v))
            if i + 1 in feature_layers:  # only those asked for: every layer's states would stay alive
                states[i + 1] = h
        return h, [states[n] for n in feature_layers]

    @staticmethod
    def _check_feature_layers(feature_layers, run: int) -> None:
        """``feature_layers`` must be layer counts among the ``run`` layers of the forward."""
        bad = [n for n in feature_layers if not (isinstance(n, int) and 1 <= n <= run)]
        if bad:
            raise ValueError(f"feature layers must be layer counts in [1, {run}], got {list(feature_layers)}")

    @torch.inference_mode()
    def forward_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                       batch: Batch, *, feature_layers=()) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` through every layer, then :meth:`logits` of every row: (hidden [T, H]
        (with ``feature_layers`` [T, (n + 1) H], as :meth:`forward`), fp32 logits [T, V]) — one
        C++ call on the fused step path (a verification step)."""
        self._check_feature_layers(feature_layers, len(self.layers))
        stack = self.decoder_stack() if cache.device.type == "cpu" else None
        if stack is not None:
            with self._capturing(stack, feature_layers) as captured:
                hidden, logits = stack.forward_logits(*self._stack_args(tokens, positions, cache, batch, None))
            return self.with_features(hidden, captured), logits
        hidden, captured = self._layers_forward(tokens, positions, cache, batch, None, feature_layers)
        return self.with_features(hidden, captured), self.logits(hidden)

    def decode_logits(self, tokens: list[int], cache: PagedKVCache, slots: list[int], *,
                      feature_layers=()) -> tuple[torch.Tensor, torch.Tensor]:
        """The autoregressive step: ``tokens[b]`` (an int) at the next position of ``slots[b]``,
        through every layer and the LM head -> (hidden [B, H] (with ``feature_layers`` [B,
        (n + 1) H]), fp32 logits [B, V]); K/V written, nothing committed (:meth:`forward_logits`
        with the cache's ``append_slots`` / ``batch_view``, the same bits). On the fused path
        the batch goes to the C++ stack as the cache's host integers: a tensor made in Python
        costs ~25 us when cold, as every step that has just streamed the weights finds it."""
        self._check_feature_layers(feature_layers, len(self.layers))
        stack = self.decoder_stack() if cache.device.type == "cpu" else None
        if stack is None:
            new = cache.append_slots(slots, 1)
            block_table, prefix_lens = cache.batch_view(slots)
            return self.forward_logits(torch.tensor(tokens, dtype=torch.int64, device=cache.device),
                                       new.cache_positions.long(), cache,
                                       Batch(block_table, prefix_lens, new.qo_indptr, new.slot_mapping),
                                       feature_layers=feature_layers)
        positions, slot_mapping, qo_indptr = cache.plan_append(slots, 1)
        table, prefix_lens = cache.host_view(slots)
        h, skinny = self._stack_inputs(tokens, cache)
        with self._capturing(stack, feature_layers) as captured:
            hidden, logits = stack.forward_logits_host(h, positions, self.cos, self.sin, cache.k_caches, cache.v_caches,
                                                       table, prefix_lens, qo_indptr, slot_mapping, len(self.layers),
                                                       *skinny)
        return self.with_features(hidden, captured), logits

    @staticmethod
    def with_features(hidden: torch.Tensor, features: list) -> torch.Tensor:
        """The hidden states [T, H] after the ``features`` [[T, H], ...] (earlier layers' states)
        as one [T, (n + 1) H] tensor, the last layer's last; ``hidden`` itself when there are none."""
        return torch.cat([*features, hidden], dim=-1) if features else hidden

    @contextlib.contextmanager
    def _capturing(self, stack, feature_layers):
        """Around one C++ stack call: the states after the ``feature_layers`` counts, taken
        into the yielded list once the call is done (nothing asked: an empty list, no calls)."""
        captured = []
        if not feature_layers:
            yield captured
            return
        stack.set_capture(list(feature_layers))
        try:
            yield captured
            captured.extend(stack.take_captured())
        finally:
            stack.set_capture([])

    def _stack_inputs(self, tokens, cache: PagedKVCache) -> tuple[torch.Tensor, tuple[int, int]]:
        """(the embeddings [T, H], the skinny row range) of a stack call; the rotary tables made
        to cover the cache's capacity (the stack reads them at the positions itself, and checks
        the positions against them)."""
        self._ensure_rope(cache.max_blocks_per_seq * cache.block_size)
        h = self.embed_tokens(tokens)
        return h, skinny_linear_rows(h.dtype)

    def _stack_args(self, tokens, positions, cache, batch, num_layers) -> tuple:
        """The arguments of ``DecoderStack.forward`` / ``forward_logits`` for a forward of
        :meth:`forward`'s arguments."""
        h, skinny = self._stack_inputs(tokens, cache)
        n = len(self.layers) if num_layers is None else len(self.layers[:num_layers])
        return (h, positions, self.cos, self.sin, cache.k_caches, cache.v_caches, batch.block_table, batch.prefix_lens,
                batch.qo_indptr, batch.slot_mapping, batch.tree_mask, n, *skinny)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: PagedKVCache, slot: int, *, num_layers: int | None = None,
                commit: bool = True, return_layers=None):
        """Causal forward of one request's tokens (int64 [S]) after the ``start`` tokens its
        cache slot holds (positions start..start+S-1); writes their K/V and commits them.
        Returns hidden [S, H]; with ``return_layers`` (layer counts, e.g. (2, 15, 30)) returns
        (hidden, [the hidden states [S, H] after that many layers, in the given order]) —
        the low/middle/high features of EAGLE-style drafting and its training data."""
        c = self.config
        S = tokens.shape[0]
        start = cache.length(slot)
        if S == 0:
            empty = torch.zeros(0, c.hidden_size, dtype=self.dtype, device=self.device)
            return empty if return_layers is None else (empty, [empty for _ in return_layers])
        self._ensure_rope(start + S)
        captured = {}
        new = cache.append_slots([slot], [S])
        positions = new.cache_positions.to(torch.int64)
        all_slots = cache.slot_mapping(slot, torch.arange(start + S, device=tokens.device))
        # The mask lets query s see keys 0..start+s.
        mask = None if start == 0 else torch.ones(S, start + S, dtype=torch.bool, device=tokens.device).tril(start)
        rope = rope_at(self.cos, self.sin, positions)
        h = self.embed_tokens(tokens)
        for i, L in enumerate(self.layers[:num_layers]):
            q, k, v = self.block.qkv(L, h, rope)
            cache.write(i, new.slot_mapping, k, v)
            keys = cache.k_caches[i].view(-1, c.num_kv_heads, c.head_dim)[all_slots]
            values = cache.v_caches[i].view(-1, c.num_kv_heads, c.head_dim)[all_slots]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            h = self.block.output(L, h, attn[0].transpose(0, 1).reshape(S, -1))
            captured[i + 1] = h
        if commit:
            cache.commit([slot], [S])
        if return_layers is not None:
            captured[0] = self.embed_tokens(tokens)
            return h, [captured[n] for n in return_layers]
        return h
