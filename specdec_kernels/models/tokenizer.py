"""Tokenizer and chat template, built from the checkpoint itself (GGUF metadata or an HF dir).

GGUF files of GPT-2-style models store the byte-level BPE vocabulary and merges; we build a
``tokenizers`` BPE from them. Pre-tokenisation follows the file's ``tokenizer.ggml.pre``:

- ``smollm`` (SmolLM/SmolLM2): digits are split one by one before the GPT-2 byte-level regex,
  as in the original tokenizer.json and in llama.cpp. (transformers' GGUF reader has no rule
  for ``smollm`` and uses the plain GPT-2 regex, so it differs from us only on runs of digits.)
- ``qwen2`` (Qwen2, Qwen2.5): the Qwen2 split regex (``QWEN2_SPLIT``: one digit per piece,
  letters with at most one leading non-letter, runs of other symbols with their newlines),
  then byte-level mapping without the GPT-2 regex — as llama.cpp and transformers' GGUF
  reader do (no NFC normalisation: the original tokenizer.json has one, llama.cpp does not).
- anything else: the GPT-2 byte-level regex.

Tokens the file marks as control (e.g. ``<|im_end|>``) are special tokens; those it marks as
user-defined (Qwen2's ``<tool_call>``) are matched whole in the text but are not special.
"""
from __future__ import annotations

import json
import os

CONTROL = 3  # llama.cpp token type of special tokens
USER_DEFINED = 4  # llama.cpp token type of added tokens matched whole but not special

# Qwen2's pre-tokenizer split (its tokenizer.json; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class Tokenizer:
    def __init__(self, tok, *, chat_template: str | None, eos_token_ids, bos_token_id=None):
        self.tok = tok  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.bos_token_id = bos_token_id

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        def field(k, d=None):
            f = reader.fields.get(k)
            return d if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"only byte-level BPE (tokenizer.ggml.model = 'gpt2') GGUF tokenizers are supported, got {kind!r}")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = field("tokenizer.ggml.pre")
        if pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre == "qwen2":
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty == CONTROL]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                        if ty == USER_DEFINED])
        eos = {field("tokenizer.ggml.eos_token_id")}
        # Chat models end a turn with their end-of-turn token; stop on it and on end-of-text
        # (only as special tokens: Qwen2's vocabulary also has "</s>" as plain text).
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"):
            if name in specials:
                eos.add(tok.token_to_id(name))
        return cls(tok, chat_template=field("tokenizer.chat_template"), eos_token_ids={e for e in eos if e is not None},
                   bos_token_id=field("tokenizer.ggml.bos_token_id"))

    @classmethod
    def from_hf_dir(cls, path: str, eos_token_ids=()) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        template = None
        cfg_path = os.path.join(path, "tokenizer_config.json")
        eos = set(eos_token_ids)
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
            template = cfg.get("chat_template")
            if isinstance(cfg.get("eos_token"), str) and tok.token_to_id(cfg["eos_token"]) is not None:
                eos.add(tok.token_to_id(cfg["eos_token"]))
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()
        return cls(tok, chat_template=template, eos_token_ids=eos)

    def save_hf_dir(self, path: str) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template, EOS/BOS tokens) so
        that ``from_hf_dir`` and transformers' ``AutoTokenizer`` (hence engines such as vLLM)
        read the same tokenizer back."""
        os.makedirs(path, exist_ok=True)
        self.tok.save(os.path.join(path, "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
               "model_max_length": 1 << 20}
        if self.eos_token_ids:
            # transformers has one EOS token; the first end-of-turn token when there is one
            # (chat models stop on it), the others are in generation_config.json.
            names = [self.tok.id_to_token(i) for i in self.eos_token_ids]
            cfg["eos_token"] = next((n for n in names if n in ("<|im_end|>", "<|eot_id|>")), names[0])
        if self.bos_token_id is not None:
            cfg["bos_token"] = self.tok.id_to_token(self.bos_token_id)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def vocab_digest(self) -> str:
        """SHA-256 of the token strings in id order: equal for two tokenizers of one
        vocabulary (a draft model must share its target's, ``decoding.registry.draft_by_name``)."""
        import hashlib

        by_id = sorted((i, t) for t, i in self.tok.get_vocab(with_added_tokens=True).items())
        return hashlib.sha256("\n".join(f"{i} {t}" for i, t in by_id).encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The checkpoint's chat template rendered as transformers renders it (sandboxed jinja2
        with trim_blocks / lstrip_blocks and loop controls, a ``tojson`` that keeps non-ASCII and
        does not HTML-escape, ``raise_exception``); ``variables``: more template inputs, e.g.
        ``tools``."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; pass a raw prompt instead")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        # Sandboxed: a template comes with the checkpoint, i.e. it is code from the file.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                          **variables)

    def chat_prompt(self, user_text: str) -> list[int]:
        """Token ids of a one-turn chat (the template applied, generation prompt added)."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]))

    def user_turn_prefix(self, opener: str = "") -> list[int]:
        """Token ids of a one-turn chat cut inside the user's turn, right after ``opener``: a
        chat model continuing them writes a user's message (ended by its end-of-turn token)."""
        cut = "\x00"
        text = self.apply_chat_template([{"role": "user", "content": cut}], add_generation_prompt=False)
        return self.encode(text.split(cut)[0] + opener)
