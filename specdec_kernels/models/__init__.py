"""Llama-family model, loaders (GGUF, Hugging Face directory), tokenizer, model registry."""
from .config import LlamaConfig, tiny_config
from .llama import Batch, Llama
from .registry import load_model, resolve

__all__ = ["LlamaConfig", "tiny_config", "Batch", "Llama", "load_model", "resolve"]
