"""Load a Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer.json])."""
from __future__ import annotations

import glob
import json
import os
from importlib.metadata import PackageNotFoundError, version

import torch

from .config import LlamaConfig
from .llama import Llama


WEIGHT_FORMATS = ("native", "fp32", "bf16", "q8_0", "q4_0")  # no "native-int8act": no blocks to run


def load_hf_dir(path: str, weights: str = "native"):
    """(Llama model, Tokenizer or None) from a directory with config.json and safetensors.

    ``weights``: "native"/"fp32" fp32 tensors (a Hugging Face checkpoint has no block
    format), "bf16", or "q8_0"/"q4_0": quantised on load to GGUF blocks
    (``gguf_blocks.quantize``), e.g. a quantised draft model."""
    from safetensors.torch import load_file

    if weights not in WEIGHT_FORMATS:
        extra = " (native-int8act runs a GGUF file's own blocks; a checkpoint directory has none)" \
            if weights == "native-int8act" else ""
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}{extra}")

    with open(os.path.join(path, "config.json")) as f:
        config = LlamaConfig.from_hf(json.load(f))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    sd = {}
    for f in files:
        sd.update(load_file(f))
    tokenizer = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(path, config.eos_token_ids)
        config.eos_token_ids = tuple(tokenizer.eos_token_ids)
    model = Llama.from_hf_state_dict(config, sd, name=os.path.basename(os.path.normpath(path)),
                                     dtype=torch.bfloat16 if weights == "bf16" else torch.float32)
    if weights in ("q8_0", "q4_0"):
        model = model.quantized(weights.upper())
    stored = "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()}))
    running = {"native": "fp32", "q8_0": "Q8_0", "q4_0": "Q4_0"}.get(weights, weights)
    model.weights_format = f"safetensors, {stored} weights, running as {running}"
    model.vocab_digest = tokenizer.vocab_digest() if tokenizer is not None else None
    return model, tokenizer


def save_hf_dir(model: Llama, path: str, tokenizer=None) -> None:
    """Write config.json + model.safetensors, and with ``tokenizer`` (a ``Tokenizer``) its
    tokenizer.json, tokenizer_config.json and a generation_config.json with every EOS id:
    a checkpoint directory that transformers and vLLM load (e.g. SmolLM2 from its GGUF)."""
    from safetensors.torch import save_file

    # Dense tensors (hf_state_dict dequantises block weights to fp32) in one dtype, the
    # embedding's, which config.json states.
    sd = model.hf_state_dict()
    dtype = sd["model.embed_tokens.weight"].dtype
    sd = {k: v.to(dtype) for k, v in sd.items()}
    os.makedirs(path, exist_ok=True)
    config = model.config.to_hf()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    try:  # without it transformers takes the folder for an old one and warns about its tokenizer's regex
        config["transformers_version"] = version("transformers")
    except PackageNotFoundError:  # the key is optional
        pass
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(sd, os.path.join(path, "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_hf_dir(path)
        eos = list(tokenizer.eos_token_ids) or list(model.config.eos_token_ids)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": eos, "bos_token_id": tokenizer.bos_token_id}, f)
