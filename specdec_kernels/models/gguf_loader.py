"""Load a Llama-family GGUF file (llama.cpp's format): config, dequantised weights, tokenizer.

Weights are dequantised to fp32 with the ``gguf`` package. llama.cpp's converter permutes the
rows of attn_q/attn_k so that its RoPE rotates interleaved pairs; ``unpermute_rope_rows``
undoes that, giving the Hugging Face (rotate-half) layout the model uses.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from .config import LlamaConfig


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation: rows (head, pair, 2) -> (head, 2, pair)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture", "llama")
    if arch != "llama":
        raise ValueError(f"only Llama-architecture GGUF files are supported, this one is {arch!r}")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(g("context_length", 8192)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


def load_gguf_state_dict(path: str, config: LlamaConfig | None = None, reader=None) -> tuple[LlamaConfig, dict]:
    """(config, state dict with Hugging Face names, fp32 torch tensors)."""
    import gguf

    reader = reader or gguf.GGUFReader(path)
    config = config or read_config(reader)
    rename = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    sd = {}
    for t in reader.tensors:
        if t.name in rename:
            name = rename[t.name]
        elif t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".")
            if kind not in per_layer:
                continue  # e.g. rope_freqs
            name = f"model.layers.{i}.{per_layer[kind]}.{suffix}"
        else:
            continue
        w = gguf.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        w = np.ascontiguousarray(w)
        sd[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    return config, sd


def _type_label(type_name: str) -> str:
    """``Q4_1`` -> ``4-bit Q4_1``; float types (F32, F16, BF16) as they are."""
    m = re.search(r"\d+", type_name)
    return f"{m.group()}-bit {type_name}" if type_name.startswith(("Q", "IQ", "TQ")) and m else type_name


def dtype_label(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def weights_format(reader, running_dtype: torch.dtype = torch.float32) -> str:
    """How the file stores the weights, read from its tensor types, e.g. ``GGUF, 4-bit Q4_1
    linears / Q8_0 embedding, running as fp32``."""
    def types(names):
        found = sorted({t.tensor_type.name for t in reader.tensors if names(t.name)})
        return "+".join(found)

    linears = types(lambda n: n.startswith("blk.") and not n.endswith("norm.weight") and n.endswith(".weight"))
    parts = [f"{_type_label(linears)} linears"] if linears else []
    embedding = types(lambda n: n == "token_embd.weight")
    if embedding:
        parts.append(f"{_type_label(embedding) if embedding != linears else embedding} embedding")
    output = types(lambda n: n == "output.weight")
    if output:
        parts.append(f"{output} LM head")
    return f"GGUF, {' / '.join(parts)}, running as {dtype_label(running_dtype)}"


def load_gguf(path: str):
    """(Llama model, Tokenizer) from a GGUF file."""
    import gguf

    from .llama import Llama
    from .tokenizer import Tokenizer

    reader = gguf.GGUFReader(path)
    tokenizer = Tokenizer.from_gguf(reader)
    config = read_config(reader)
    config.eos_token_ids = tuple(tokenizer.eos_token_ids)
    config, sd = load_gguf_state_dict(path, config, reader)
    model = Llama.from_hf_state_dict(config, sd, name=str(_field(reader, "general.name", "gguf")))
    model.weights_format = weights_format(reader, model.dtype)
    return model, tokenizer
