"""Per-step roofline of greedy autoregressive decoding: where a decode step's time goes.

Runs our loop on one chat prompt under ``torch.profiler`` and splits the decode steps' wall
time into the weight products (``quantized_linear`` / ``skinny_linear`` / MKL GEMM),
attention (``tree_attention``), sampling (``tree_rejection_sample`` + argmax), KV-cache
writes and compaction, the other torch ops (norms, RoPE, SiLU, embedding, ...), and the
rest: Python (the loop, the model's Python, the profiler's own per-op cost). Reports the
weight bytes one step streams, the bandwidth the weight products reach on them, and the
machine's copy bandwidth measured in the same run. JSON: bench/results/step_profile_<weights>.json.

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
    "tree_attention": "attention", "scaled_dot_product": "attention",
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
    (req,) = gen.generate([ids], args.tokens, stop_at_eos=False)  # unprofiled: plain step time
    plain_step = (req.stats.time_draft + req.stats.time_verify + req.stats.time_sample + req.stats.time_compact) / len(req.output)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        (req,) = gen.generate([ids], args.tokens, stop_at_eos=False)
        wall = time.perf_counter() - t0
    steps = len(req.output)
    prefill = req.stats.time_prefill
    decode_wall = wall - prefill
    # Self CPU time per category over the whole run; the prompt's prefill is profiled alone
    # below and subtracted, leaving the decode steps.
    by_cat: dict[str, float] = {}
    for e in prof.key_averages():
        cat = "other torch ops"
        for key, c in CATEGORIES.items():
            if key in e.key:
                cat = c
                break
        if cat is None:
            continue
        by_cat[cat] = by_cat.get(cat, 0.0) + e.self_cpu_time_total / 1e6
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_pre:
        cache = model.new_cache(1, len(ids) + 1)
        model.prefill(torch.tensor(ids[:-1]), cache, cache.add_request(len(ids) - 1))
    pre_cat: dict[str, float] = {}
    for e in prof_pre.key_averages():
        cat = "other torch ops"
        for key, c in CATEGORIES.items():
            if key in e.key:
                cat = c
                break
        if cat is not None:
            pre_cat[cat] = pre_cat.get(cat, 0.0) + e.self_cpu_time_total / 1e6
    per_step = {c: max(by_cat.get(c, 0.0) - pre_cat.get(c, 0.0), 0.0) / steps for c in by_cat}
    step = decode_wall / steps
    per_step["python and the rest"] = max(step - sum(per_step.values()), 0.0)
    nbytes = weight_bytes(model)
    copy_gbs = copy_bandwidth_gbs()
    gemm = per_step.get("weight products", 0.0)
    result = {
        "machine": machine_info(), "load_average": os.getloadavg(), "model": model.name, "weights": model.weight_format,
        "threads": args.threads, "decode_steps": steps, "step_ms_profiled": step * 1e3, "step_ms_unprofiled": plain_step * 1e3,
        "ms_per_step": {c: v * 1e3 for c, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
        "weight_bytes_per_step": nbytes, "weight_products_gbs": nbytes / gemm / 1e9 if gemm else None,
        "copy_bandwidth_gbs": copy_gbs,
        "roofline_step_ms": nbytes / (copy_gbs * 1e9) * 1e3,  # the weights read once at the copy bandwidth
    }
    print(json.dumps(result, indent=1))
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"step_profile_{model.weight_format}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
