"""Load a Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer.json])."""
from __future__ import annotations

import glob
import json
import os

from .config import LlamaConfig
from .llama import Llama


def load_hf_dir(path: str):
    """(Llama model, Tokenizer or None) from a directory with config.json and safetensors."""
    from safetensors.torch import load_file

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
    model = Llama.from_hf_state_dict(config, sd, name=os.path.basename(os.path.normpath(path)))
    stored = "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()}))
    running = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(model.dtype), str(model.dtype))
    model.weights_format = f"safetensors, {stored} weights, running as {running}"
    return model, tokenizer


def save_hf_dir(model: Llama, path: str) -> None:
    """Write config.json + model.safetensors (used by tests to hand a model to transformers)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f)
    save_file(model.hf_state_dict(), os.path.join(path, "model.safetensors"))
