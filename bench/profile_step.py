"""Per-step roofline of greedy autoregressive decoding: where a decode step's time goes.

Runs our loop on one chat prompt under ``torch.profiler`` and splits the decode steps' wall
time into the weight products (``quantized_linear`` / ``skinny_linear`` / MKL GEMM),
attention (``tree_attention``), sampling (``tree_rejection_sample`` + argmax), KV-cache
writes and compaction, the other torch ops (norms, RoPE, SiLU, embedding, ...), and the
rest: Python (the loop, the model's Python, the profiler's own per-op cost). The weight
products are also split by kind (``products_ms_per_step``: block type, fp32 or int8
activations, and which weight: q|k|v, o, gate|up, down, LM head; ``ProductTimer``, wall and
thread CPU time, unprofiled), next to the step's process CPU time. Reports the
weight bytes one step streams, the bandwidth the weight products reach on them, and the
machine's copy bandwidth measured in the same run. JSON: bench/results/step_profile_<weights>.json
(another --model: step_profile_<model>_<weights>_t<threads>.json).

    python bench/profile_step.py --weights native --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS_DIR, copy_bandwidth_gbs, machine_info  # noqa: E402
from specdec_kernels.models.registry import WEIGHT_FORMATS  # noqa: E402

CATEGORIES = {  # profiler event name (substring) -> category; first match wins
    "quantized_linear": "weight products", "int8_activation_linear": "weight products", "skinny_linear": "weight products", "aten::addmm": "weight products",
    "aten::mm": "weight products", "aten::linear": None, "aten::matmul": None,
    "tree_attention": "attention", "scaled_dot_product": "prefill attention",
    "tree_rejection_sample": "sampling", "aten::argmax": "sampling",
    "compact_kv": "kv cache", "aten::index_put": "kv cache",
}


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads (linears + LM head)."""
    from specdec_kernels.models.llama import Llama

    def nbytes(w):
        if isinstance(w, tuple):
            return sum(nbytes(p) for p in w)
        return w.nbytes if hasattr(w, "block_type") else w.numel() * w.element_size()

    return sum(nbytes(L[k]) for L in model.layers for k in Llama.LINEAR_KEYS) + nbytes(model.lm_head)


class ProductTimer:
    """Wraps every block weight's ``linear`` to add up, per kind (``<key> <type> <fp32|int8>``,
    key one of q|k|v, o, gate|up, down, LM head), the wall and the thread CPU time of its
    one-row calls (a decode step's; prefill calls have more rows). Thread CPU time is what
    the product costs whatever else the machine runs (with one torch thread it is all of it).
    Only this run's model is touched (the weights are frozen dataclasses: the wrapper is set
    on the instance)."""

    def __init__(self, model):
        from specdec_kernels.models.llama import Llama

        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        for L in model.layers:
            for k in Llama.LINEAR_KEYS:
                self._wrap(L[k], k)
        self._wrap(model.lm_head, "lm_head")

    def _wrap(self, w, key):
        from specdec_kernels.models.llama import is_block_weight

        if isinstance(w, tuple):
            for part in w:
                self._wrap(part, key)
            return
        if not is_block_weight(w):
            return
        name = f"{key} {w.type_name} {'int8' if w.int8_packed is not None else 'fp32'}"
        plain = w.linear

        def timed(x, bias=None):
            if x.reshape(-1, x.shape[-1]).shape[0] != 1:
                return plain(x, bias)
            t0, c0 = time.perf_counter(), time.thread_time()
            out = plain(x, bias)
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
            self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
            return out

        object.__setattr__(w, "linear", timed)

    def reset(self):
        self.wall.clear(), self.cpu.clear()

    def per_step_ms(self, steps: int) -> dict:
        return {k: {"wall": self.wall[k] / steps * 1e3, "thread_cpu": self.cpu[k] / steps * 1e3}
                for k in sorted(self.wall, key=lambda k: -self.wall[k])}


def _self_cpu_by_category(prof) -> dict:
    """{category: self CPU seconds} of a torch profile's ops (CATEGORIES; a None category is dropped)."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        cat = "other torch ops"
        for key, c in CATEGORIES.items():
            if key in e.key:
                cat = c
                break
        if cat is not None:
            out[cat] = out.get(cat, 0.0) + e.self_cpu_time_total / 1e6
    return out


def _unprofiled_step(model, gen, ids: list, tokens: int) -> tuple[float, float, dict]:
    """One unprofiled generation: (plain step seconds, process CPU seconds per decode step,
    ProductTimer's ms per step of each kind of one-row product)."""
    timer = ProductTimer(model)
    timer.reset()
    c0 = time.process_time()
    (req,) = gen.generate([ids], tokens, stop_at_eos=False)  # unprofiled: plain step time
    run_cpu = time.process_time() - c0
    plain_step = (req.stats.time_draft + req.stats.time_verify + req.stats.time_sample + req.stats.time_compact) / len(req.output)
    # The process's CPU time of the decode steps (prefill's share scaled out by its wall share).
    plain_wall = req.stats.time_prefill + plain_step * len(req.output)
    step_cpu = run_cpu * (plain_step * len(req.output) / plain_wall) / len(req.output)
    products = timer.per_step_ms(len(req.output))
    timer.reset()
    return plain_step, step_cpu, products


def _profiled_step(model, gen, ids: list, tokens: int) -> tuple[int, float, dict]:
    """One generation under the torch profiler: (decode steps, wall seconds per step,
    {category: seconds per step}, "python and the rest" included)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        (req,) = gen.generate([ids], tokens, stop_at_eos=False)
        wall = time.perf_counter() - t0
    steps = len(req.output)
    prefill = req.stats.time_prefill
    decode_wall = wall - prefill
    # Self CPU time per category over the whole run; the prompt's prefill is profiled alone
    # below and subtracted, leaving the decode steps.
    by_cat = _self_cpu_by_category(prof)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_pre:
        cache = model.new_cache(1, len(ids) + 1)
        model.prefill(torch.tensor(ids[:-1]), cache, cache.add_request(len(ids) - 1))
    pre_cat = _self_cpu_by_category(prof_pre)
    per_step = {c: max(by_cat.get(c, 0.0) - pre_cat.get(c, 0.0), 0.0) / steps for c in by_cat}
    step = decode_wall / steps
    per_step.pop("prefill attention", None)  # the prompt's (profiled alone above), not a step's
    per_step["python and the rest"] = max(step - sum(per_step.values()), 0.0)
    return steps, step, per_step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="native", choices=WEIGHT_FORMATS)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps profiled")
    p.add_argument("--prompt", default="Explain how a hash map works, with an example.")
    args = p.parse_args(argv)

    from specdec_kernels.decoding import Generator
    from specdec_kernels.models import load_model

    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy
    model, tok = load_model(args.model, weights=args.weights)
    ids = tok.chat_prompt(args.prompt)
    gen = Generator(model)
    gen.generate([ids], 4)  # warm-up
    plain_step, step_cpu, products = _unprofiled_step(model, gen, ids, args.tokens)
    steps, step, per_step = _profiled_step(model, gen, ids, args.tokens)
    nbytes = weight_bytes(model)
    copy_gbs = copy_bandwidth_gbs()
    gemm = per_step.get("weight products", 0.0)
    result = {
        "machine": machine_info(), "load_average": os.getloadavg(), "model": model.name, "weights": model.weight_format,
        "threads": args.threads, "decode_steps": steps, "step_ms_profiled": step * 1e3, "step_ms_unprofiled": plain_step * 1e3,
        "ms_per_step": {c: v * 1e3 for c, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
        "step_ms_process_cpu": step_cpu * 1e3,
        # Unprofiled, one-row calls only: wall and thread CPU time per kind of product.
        "products_ms_per_step": products,
        "products_ms_total": {t: sum(v[t] for v in products.values()) for t in ("wall", "thread_cpu")},
        "weight_bytes_per_step": nbytes, "weight_products_gbs": nbytes / gemm / 1e9 if gemm else None,
        "copy_bandwidth_gbs": copy_gbs,
        "roofline_step_ms": nbytes / (copy_gbs * 1e9) * 1e3,  # the weights read once at the copy bandwidth
    }
    print(json.dumps(result, indent=1))
    RESULTS_DIR.mkdir(exist_ok=True)
    # The default model keeps the names bench/report.py reads; others get model and threads.
    name = model.weight_format if args.model == "smollm2-135m" else f"{args.model}_{model.weight_format}_t{args.threads}"
    path = RESULTS_DIR / f"step_profile_{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
