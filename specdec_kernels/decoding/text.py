"""Text in, text out: one prompt through the chat template, the model's default drafter and
the decode loop (what ``specdec generate`` does, without the streaming and the statistics).

    import specdec_kernels as sk
    model, tok = sk.load_model("smollm2-135m")
    print(sk.generate(model, tok, "Name three primary colours."))
"""
from __future__ import annotations

from .generator import Generator, SamplingParams
from .registry import default_drafter, default_schedule, make_drafter
from .schedule import SpecSchedule

__all__ = ["generate"]


def generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 128, drafter: str | None = None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, raw: bool = False,
             step_cost=None) -> str:
    """The model's answer to ``prompt`` (a string), speculative decoding included.

    ``model, tokenizer``: what ``load_model`` returns. ``drafter``: a name of
    ``decoding.registry.DRAFTERS`` ("none" = autoregressive); None = the model's default
    (``registry.default_drafter``), with that drafter's default schedule. ``raw``: the prompt
    as it is, without the chat template. ``step_cost``: as ``Generator(step_cost=...)``.
    Greedy (``temperature=0``) output is exactly the model's own autoregressive output,
    whatever the drafter."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__} (token ids go to Generator.generate)")
    if not prompt:
        raise ValueError("prompt is empty: give the text to answer")
    name = drafter or default_drafter(model.name)
    ids = tokenizer.encode(prompt) if raw else tokenizer.chat_prompt(prompt)
    gen = Generator(model, make_drafter(name, model), SpecSchedule(default_schedule(name), 4), step_cost=step_cost)
    (req,) = gen.generate([ids], max_new_tokens, SamplingParams(temperature, top_k, top_p, seed))
    if req.error is not None:
        raise RuntimeError(req.error)
    return tokenizer.decode(req.output, skip_special_tokens=True)
