"""The hyper-parameters of a Llama-family model (Llama, SmolLM2, Qwen2)."""
from __future__ import annotations

from dataclasses import dataclass


# architecture (GGUF general.architecture, config.json model_type) -> transformers class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # hidden_size // num_heads when None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen2 is a Llama with biases on the q, k and v projections (never on o or the MLP).
    architecture: str = "llama"  # ARCHITECTURES
    attention_bias: bool = False

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {tuple(ARCHITECTURES)}, got {self.architecture!r}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.eos_token_ids = tuple(self.eos_token_ids)

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dictionary (LlamaForCausalLM, Qwen2ForCausalLM);
        a feature the model lacks (another model type, o_proj/MLP biases, a sliding window) is
        a ValueError, never silently dropped."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"config.json: model_type {model_type!r} is not supported; use one of {tuple(ARCHITECTURES)}")
        if model_type == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            # Llama's attention_bias also puts a bias on o_proj, which this model does not have.
            raise ValueError("config.json: a Llama with attention_bias / mlp_bias (biases on o_proj or the MLP) "
                             "is not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json: sliding-window attention (use_sliding_window) is not supported")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 writes it inside rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim"),
            rope_theta=float(rope_theta),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            architecture=model_type,
            attention_bias=model_type == "qwen2",
        )

    def to_hf(self) -> dict:
        """A ``config.json`` dictionary that transformers' LlamaForCausalLM (Qwen2ForCausalLM
        for architecture "qwen2") reads."""
        if self.attention_bias and self.architecture != "qwen2":
            raise ValueError("a Llama with q/k/v biases has no transformers class; set architecture='qwen2'")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("transformers' Qwen2 always has q/k/v biases; this model has none")
        return {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }


def tiny_config(**overrides) -> LlamaConfig:
    """A small random-model configuration for tests (GQA, head_dim 64, untied LM head);
    ``tiny_config(architecture="qwen2", attention_bias=True)`` is a Qwen2-style one."""
    kw = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=32 * 2, rope_theta=10000.0, tie_word_embeddings=False,
              max_position_embeddings=1024)
    kw.update(overrides)
    return LlamaConfig(**kw)
