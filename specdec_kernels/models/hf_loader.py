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
    return Llama.from_hf_state_dict(config, sd, name=os.path.basename(os.path.normpath(path))), tokenizer


def save_hf_dir(model: Llama, path: str, tokenizer=None) -> None:
    """Write config.json + model.safetensors, and with ``tokenizer`` (a ``Tokenizer``) its
    tokenizer.json, tokenizer_config.json and a generation_config.json with every EOS id:
    a checkpoint directory that transformers and vLLM load (e.g. SmolLM2 from its GGUF)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = model.config.to_hf()
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(model.hf_state_dict(), os.path.join(path, "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_hf_dir(path)
        eos = list(tokenizer.eos_token_ids) or list(model.config.eos_token_ids)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": eos, "bos_token_id": tokenizer.bos_token_id}, f)
