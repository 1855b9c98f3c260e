"""Load a Llama-family GGUF file (llama.cpp's format): config, weights, tokenizer.

``weights``: "native" (default) keeps every linear weight, the embedding and the LM head as
the file's own GGUF blocks (``gguf_blocks.QuantizedWeight``: SmolLM2's file holds Q4_1
linears and a Q8_0 embedding/LM head, 98 MB instead of 540 MB of fp32); "fp32"/"bf16"
dequantise with the ``gguf`` package; "q8_0"/"q4_0" dequantise and quantise again, weight by
weight from the file's blocks (never the whole model in fp32).

Architectures: ``llama`` and ``qwen2`` (a Llama with F32 biases on q, k and v:
``blk.N.attn_{q,k,v}.bias``, fused into one q|k|v bias next to the fused weight).

llama.cpp's converter permutes the rows of attn_q/attn_k of a ``llama`` file so that its RoPE
rotates interleaved pairs; ``unpermute_rope_rows`` undoes that, giving the Hugging Face
(rotate-half) layout the model uses — on block weights as a row gather of whole rows of blocks
(a row of blocks is one output row of the weight). A ``qwen2`` file keeps the Hugging Face rows
(llama.cpp runs Qwen2 with NEOX, i.e. rotate-half, RoPE), so nothing is un-permuted there
(``ROPE_PERMUTED``; checked against transformers' Qwen2 in tests/test_qwen.py).
"""
from __future__ import annotations

import re

import numpy as np
import torch

from .config import LlamaConfig


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` of ``path`` that reads the same fields and tensors ~30x faster.

    The reader slices its ``np.memmap`` once per value, and a memmap slice is a memmap whose
    ``__array_finalize__`` runs Python code: a 151k-token vocabulary made ~1.5M such slices
    (17 s of a 1.5B load). Here ``data`` is the same mapping seen as a plain ndarray, so the
    slices are plain views of the mapped file (nothing is read or copied up front), and
    arrays of strings and numbers are read in one loop each (``_array_field_parts``: 2.1 s ->
    0.5 s for the 1.5B's file on a Zen 4 core)."""
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, mapped):
            self._mapped = mapped.view(np.ndarray)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == gguf.GGUFValueType.ARRAY and self.byte_order == "I":
                parts = _array_field_parts(self, orig_offs)
                if parts is not None:
                    return parts
            return super()._get_field_parts(orig_offs, raw_type)

    try:
        return _PlainViewReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:  # a file cut short or not GGUF
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _array_field_parts(reader, orig_offs: int):
    """What ``GGUFReader._get_field_parts`` returns for the array at ``orig_offs`` (size, parts,
    data indices, types: a part per element, a string's length and bytes apart), read in one
    loop instead of through the reader's generic per-value code, which took ~2 s of every
    load for a 151k-token vocabulary and its merges; None for nested arrays (left to the reader). A file that
    ends inside the array is a ValueError."""
    import gguf

    buf, T = reader.data, gguf.GGUFValueType
    raw_itype = reader._get(orig_offs, np.uint32)
    alen = reader._get(orig_offs + 4, np.uint64)
    if len(raw_itype) != 1 or len(alen) != 1:
        raise ValueError(f"GGUF file ends inside the array at byte {orig_offs}")
    itype, n = T(raw_itype[0]), int(alen[0])
    offs, parts, data = orig_offs + 12, [raw_itype, alen], []
    if itype == T.STRING:
        view = memoryview(buf)
        for _ in range(n):
            if offs + 8 > len(buf):
                raise ValueError(f"GGUF file ends inside the string array at byte {orig_offs}")
            length = int.from_bytes(view[offs:offs + 8], "little")
            if offs + 8 + length > len(buf):
                raise ValueError(f"GGUF file ends inside the string array at byte {orig_offs}")
            parts += (buf[offs:offs + 8].view(np.uint64), buf[offs + 8:offs + 8 + length])
            data.append(len(parts) - 1)
            offs += 8 + length
    elif itype in reader.gguf_scalar_to_np:
        dtype = np.dtype(reader.gguf_scalar_to_np[itype])
        end = offs + n * dtype.itemsize
        if end > len(buf):
            raise ValueError(f"GGUF file ends inside the {itype.name} array at byte {orig_offs}")
        values = buf[offs:end].view(dtype)
        parts += [values[i:i + 1] for i in range(n)]
        data = list(range(2, 2 + n))
        offs = end
    else:
        return None
    return offs - orig_offs, parts, data, [T.ARRAY] + ([itype] if n else [])


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation: rows (head, pair, 2) -> (head, 2, pair)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_row_order(num_rows: int, n_head: int) -> torch.Tensor:
    """int64 [num_rows]: the file's row index of each un-permuted row (``unpermute_rope_rows``
    applied to the row numbers), for a row gather of block weights."""
    return torch.from_numpy(np.ascontiguousarray(unpermute_rope_rows(np.arange(num_rows), n_head)))


# general.architecture -> whether llama.cpp's converter permuted the q/k rows (and biases)
ROPE_PERMUTED = {"llama": True, "qwen2": False}
QKV_BIASES = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}


def read_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture", "llama")
    if arch not in ROPE_PERMUTED:
        raise ValueError(f"only {' / '.join(ROPE_PERMUTED)} GGUF files are supported, this one is {arch!r}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    biases = {n.split(".", 2)[2] for n in names if n.startswith("blk.") and n.endswith(".bias")}
    if biases and biases != QKV_BIASES:
        raise ValueError(f"this {arch} file has biases {sorted(biases)}; the model supports only "
                         f"{sorted(QKV_BIASES)} (all three)")
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
        architecture=arch,
        attention_bias=bool(biases),
    )


def load_gguf_state_dict(path: str, config: LlamaConfig | None = None, reader=None) -> tuple[LlamaConfig, dict]:
    """(config, state dict with Hugging Face names, fp32 torch tensors)."""
    reader = reader or open_gguf(path)
    config = config or read_config(reader)
    rename = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    sd = {}
    permuted = ROPE_PERMUTED[config.architecture]
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
        w = dequantize_tensor(t).reshape([int(d) for d in reversed(t.shape)])
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        w = np.ascontiguousarray(w)
        sd[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    return config, sd


def dequantize_tensor(t) -> np.ndarray:
    """fp32 values of a ``gguf.ReaderTensor`` (flat): the block formats quantized_linear reads
    through ``gguf_blocks.dequantize`` (vectorised torch, bit-identical to ``gguf.dequantize``,
    which is numpy and took minutes for the 1.5B's K-quant blocks), any other type through
    ``gguf.dequantize``."""
    import gguf

    from .. import gguf_blocks, ops

    tid = int(t.tensor_type)
    if tid in ops.GGUF_BLOCK_FORMATS:
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8).reshape(-1))  # out of the read-only mapping
        return gguf_blocks.dequantize(raw, tid).numpy()
    return np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)


def _type_label(type_name: str) -> str:
    """``Q4_1`` -> ``4-bit Q4_1``; float types (F32, F16, BF16) as they are."""
    m = re.search(r"\d+", type_name)
    return f"{m.group()}-bit {type_name}" if type_name.startswith(("Q", "IQ", "TQ")) and m else type_name


def weights_format(reader, running: str = "fp32") -> str:
    """How the file stores the weights, read from its tensor types, and how the model runs
    them, e.g. ``GGUF, 4-bit Q4_1 linears / Q8_0 embedding, running as fp32`` (``running``:
    a label such as fp32, bf16, Q8_0, or "native" / "native-int8act" for the file's own
    blocks)."""
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
    how = {"native": "running on its own blocks",
           "native-int8act": "running on its own blocks with int8 activations"}.get(running, f"running as {running}")
    return f"GGUF, {' / '.join(parts)}, {how}"


def load_gguf_native(reader, config: LlamaConfig, *, name: str = "gguf", requantize: str | None = None):
    """A Llama on the file's own blocks: QuantizedWeight linears (q/k rows un-permuted by a row
    gather where the architecture's file permuted them, ``ROPE_PERMUTED``; q|k|v and gate|up
    fused by concatenating rows when the parts share a block type, else kept as a tuple of
    parts), QuantizedWeight embedding (rows dequantised on lookup) and LM head (the embedding
    when tied), fp32 norms and q|k|v biases. ``requantize`` ("Q8_0", "Q4_0"): each block
    weight requantised to that type as it is read (``Llama.quantized``'s bytes), so the file's
    own blocks are held one weight at a time, not as a second model."""
    import gguf

    from ..gguf_blocks import QuantizedWeight
    from .llama import Llama

    tensors = {t.name: t for t in reader.tensors}
    permuted = ROPE_PERMUTED[config.architecture]
    q_heads, kv_heads = (config.num_heads, config.num_kv_heads) if permuted else (None, None)

    # Rows are gathered and concatenated with numpy (one single-threaded copy out of the file
    # mapping per weight): torch.cat / index_select on uint8 go through torch's thread pool,
    # which took seconds per call on a loaded 2-core machine.
    def rows(key: str, n_head: int | None = None) -> tuple:
        """(uint8 [N, row bytes] array, block type, (N, H)) of a 2-d tensor, q/k rows un-permuted."""
        t = tensors[key]
        H, N = (int(d) for d in t.shape)
        data = np.asarray(t.data).view(np.uint8).reshape(N, -1)
        if n_head:
            data = data[rope_row_order(N, n_head).numpy()]
        return data, int(t.tensor_type), (N, H)

    def block_weight(data, block_type, shape) -> QuantizedWeight:
        return QuantizedWeight(torch.from_numpy(np.array(data, copy=True, order="C")), block_type, shape)

    def final(w):
        """``w`` (a block weight or a tuple of parts) as the model keeps it."""
        return w if requantize is None else Llama.requantized(w, requantize)

    def blocks(key: str, n_head: int | None = None) -> QuantizedWeight:
        return final(block_weight(*rows(key, n_head)))

    def vector(key: str, n_head: int | None = None) -> torch.Tensor:
        t = tensors[key]
        v = torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32))
        return v[rope_row_order(v.shape[0], n_head)] if n_head else v

    def fused(parts):
        if len({bt for _, bt, _ in parts}) == 1:
            data = np.concatenate([d for d, _, _ in parts])
            return final(QuantizedWeight(torch.from_numpy(data), parts[0][1], (data.shape[0], parts[0][2][1])))
        return final(tuple(block_weight(*p) for p in parts))

    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        layers.append(dict(
            attn_norm=vector(p + "attn_norm.weight"),
            wqkv=fused([rows(p + "attn_q.weight", q_heads), rows(p + "attn_k.weight", kv_heads),
                        rows(p + "attn_v.weight")]),
            wo=blocks(p + "attn_output.weight"),
            mlp_norm=vector(p + "ffn_norm.weight"),
            w_gate_up=fused([rows(p + "ffn_gate.weight"), rows(p + "ffn_up.weight")]),
            w_down=blocks(p + "ffn_down.weight"),
        ))
        if config.attention_bias:
            layers[-1]["bqkv"] = torch.cat([vector(p + "attn_q.bias", q_heads), vector(p + "attn_k.bias", kv_heads),
                                            vector(p + "attn_v.bias")])
    embed = blocks("token_embd.weight")
    lm_head = blocks("output.weight") if "output.weight" in tensors else embed
    return Llama(config, dict(embed=embed, norm=vector("output_norm.weight"), lm_head=lm_head, layers=layers),
                 name=name, weight_format="native" if requantize is None else requantize.lower())


WEIGHT_FORMATS = ("native", "native-int8act", "fp32", "bf16", "q8_0", "q4_0")


def load_gguf(path: str, weights: str = "native"):
    """(Llama model, Tokenizer) from a GGUF file; ``weights`` one of WEIGHT_FORMATS (module
    docstring)."""
    from .llama import Llama
    from .tokenizer import Tokenizer

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    reader = open_gguf(path)
    tokenizer = Tokenizer.from_gguf(reader)
    config = read_config(reader)
    config.eos_token_ids = tuple(tokenizer.eos_token_ids)
    name = str(_field(reader, "general.name", "gguf"))
    if weights in ("native", "native-int8act"):
        model = load_gguf_native(reader, config, name=name)
        if weights == "native-int8act":
            model = model.with_int8_activations()
        model.weights_format = weights_format(reader, weights)
    elif weights in ("q8_0", "q4_0"):
        # Requantised weight by weight as the file's blocks are read (the same bytes as from the
        # fp32 state dict, without the whole model in fp32, 4 bytes a weight, or in the file's
        # blocks beside the new ones).
        model = load_gguf_native(reader, config, name=name, requantize=weights.upper())
        model.weights_format = weights_format(reader, weights.upper())
    else:
        config, sd = load_gguf_state_dict(path, config, reader)
        model = Llama.from_hf_state_dict(config, sd, name=name,
                                         dtype=torch.bfloat16 if weights == "bf16" else torch.float32)
        model.weights_format = weights_format(reader, weights)
    model.vocab_digest = tokenizer.vocab_digest()
    return model, tokenizer
