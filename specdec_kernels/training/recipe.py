"""What every drafter's training recipe shares: the learning-rate schedule, the hand-written
validation prompts, the reduced draft vocabulary and the acceptance check by real decoding."""
from __future__ import annotations

import math
import time

import torch

# Validation prompts: the package's default prompt file plus these, written by hand unlike
# the templates (the template-held-out sequences overrate the heads: their prompts are near
# copies of training ones). Never the benchmark's prompts.
VALIDATION_PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "What are the benefits of regular exercise for older adults?",
    "Write a Python function that returns the sum of the squares of a list, with a docstring.",
    "Give me three tips for writing a good cover letter.",
    "Describe the water cycle in a short paragraph.",
    "My tomato plants have yellow leaves. What could be wrong?",
    "Translate to English: Je voudrais réserver une table pour deux personnes ce soir.",
    "A car travels 150 km in 2.5 hours. What is its average speed? Explain the steps.",
    "Write a short thank-you note to a colleague who helped me move house.",
    "Compare cats and dogs as pets in a few sentences.",
    "Pretend you are a museum guide and introduce a painting of a stormy sea.",
    "What is the difference between a virus and a bacterium?",
]


def warmup_cosine(opt, total: int, *, max_warmup: int = 30):
    """The learning-rate schedule of every trainer here: linear warm-up over min(max_warmup,
    total / 10) updates, then a cosine decay to 0 at ``total``."""
    warmup = min(max_warmup, max(1, total // 10))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup)))))


def optimizer_step(opt, sched, loss: torch.Tensor, params, *, max_grad_norm: float | None = 1.0) -> None:
    """One update: backward, clip the gradient norm (None: no clipping), step the optimiser
    and the learning-rate schedule."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    sched.step()


def fit(module, params: list, num_items: int, batch_size: int, step, evaluate, *, epochs: int, lr: float,
        seed: int, weight_decay: float = 0.0, betas: tuple = (0.9, 0.95), max_warmup: int = 30,
        max_grad_norm: float | None = 1.0, max_updates: int = 0, max_seconds: float = 0, stop_after: int = 0,
        score_before: bool = False, on_best=None, desc: str = "train", log=print, progress: bool = True) -> dict:
    """The one training loop of every recipe here.

    AdamW over ``params`` with :func:`warmup_cosine` across the run's updates. Each epoch
    visits the ``num_items`` training items (sequences or rows) in a seeded random order,
    ``batch_size`` at a time: ``step(indices) -> (loss, postfix)`` gives the batch's loss (a
    tensor with a graph) and what the progress bar shows. After each epoch ``evaluate() ->
    (score, record, message)`` scores the held-out data (higher is better; score None: no
    held-out data, the last epoch is kept); ``message`` is logged. The best epoch's weights
    (``module``'s state dict) are restored at the end, and ``on_best(record)`` is called
    whenever an epoch improves on the best so far (so an interrupted run keeps it).
    ``score_before``: score before training too, and keep the weights it started from unless an
    epoch beats them. ``max_updates`` (0 = off) shortens the schedule itself; ``max_seconds``
    (a wall-clock safety net) and ``stop_after`` (updates; the schedule unchanged: replays
    a run a time limit stopped) stop early, and the result says so.

    Returns {"before": the record before training or None, "history": a record per epoch,
    "best": the best record (None if no epoch was scored), "best_epoch" (-1: before
    training), "updates", "stopped_early", "seconds"}."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    per_epoch = math.ceil(num_items / batch_size)
    total = per_epoch * epochs if not max_updates else min(max_updates, per_epoch * epochs)
    sched = warmup_cosine(opt, total, max_warmup=max_warmup)
    order = torch.Generator().manual_seed(seed)
    history, best, before = [], None, None  # best: (score, epoch, record, state)

    def snapshot():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    if score_before:
        score, before, message = evaluate()
        log(f"{desc}: before training: {message}")
        best = (score, -1, before, snapshot())
    bar = tqdm(total=total, desc=desc, unit="step", disable=not progress)
    module.train()
    t0, done, stopped, epoch = time.perf_counter(), 0, False, -1
    for epoch in range(epochs):
        perm = torch.randperm(num_items, generator=order).tolist()
        for s in range(0, num_items, batch_size):
            if done >= total:
                break
            if (max_seconds and time.perf_counter() - t0 > max_seconds) or (stop_after and done >= stop_after):
                stopped = True
                break
            loss, postfix = step(perm[s: s + batch_size])
            optimizer_step(opt, sched, loss, params, max_grad_norm=max_grad_norm)
            done += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, **postfix)
        score, record, message = evaluate()
        module.train()
        history.append(record)
        log(f"{desc}: epoch {epoch}: {message}")
        if score is not None and (best is None or score > best[0]):
            best = (score, epoch, record, snapshot())
            if on_best is not None:
                on_best(record)
        if done >= total or stopped:
            break
    bar.close()
    if best is not None and best[1] != epoch:
        log(f"{desc}: keeping {'the weights it started from' if best[1] < 0 else f'epoch {best[1]}'} (best held-out score)")
        module.load_state_dict(best[3])
    return {"before": before, "history": history, "best": best[2] if best else None,
            "best_epoch": best[1] if best else None, "updates": done, "stopped_early": stopped,
            "seconds": time.perf_counter() - t0}


def draft_vocabulary(targets: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """int64 [size]: the target tokens ranked by frequency, then the lowest ids not yet in
    (byte-pair merges are numbered roughly by frequency); the whole vocabulary, in order,
    when size is 0 or >= V."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    t = targets[targets >= 0]
    counts = torch.bincount(t, minlength=vocab_size)
    seen = torch.nonzero(counts).flatten()
    seen = seen[counts[seen].argsort(descending=True, stable=True)][:size]
    rest = torch.ones(vocab_size, dtype=torch.bool)
    rest[seen] = False
    fill = torch.nonzero(rest).flatten()[: size - seen.numel()]
    return torch.cat([seen, fill])


@torch.no_grad()
def decode_acceptance(target, tok, drafter, prompts: list, *, schedule=None, max_new_tokens: int = 48,
                      compare_autoregressive: bool = True) -> dict:
    """Mean accepted length of real greedy decoding of ``prompts`` (chat-templated; never the
    benchmark's) with ``drafter`` at batch 1 under ``schedule`` (default: a constant chain of
    4), and, with ``compare_autoregressive``, whether every output equals autoregressive
    decoding's."""
    from ..decoding.generator import Generator
    from ..decoding.schedule import SpecSchedule

    schedule = schedule or SpecSchedule("constant", 4)
    emitted = steps = 0
    same = True
    for text in prompts:
        ids = tok.chat_prompt(text)
        (r,) = Generator(target, drafter, schedule).generate([ids], max_new_tokens)
        if compare_autoregressive:
            (ar,) = Generator(target, None).generate([ids], max_new_tokens)
            same &= r.output == ar.output
        emitted, steps = emitted + r.stats.emitted, steps + r.stats.steps
    out = {"mean_accepted_length": round(emitted / max(1, steps), 3), "prompts": len(prompts)}
    if compare_autoregressive:
        out["identical_to_autoregressive"] = same
    return out
