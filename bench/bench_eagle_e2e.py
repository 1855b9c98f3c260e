"""Incremental e2e for the EAGLE drafters, for time-limited runs on a busy machine:

    python bench/bench_eagle_e2e.py PROMPTS.jsonl [MAX_PROMPTS]

Per prompt (round-robin over categories, as bench_e2e.py picks them): our autoregressive
loop, eagle:max and eagle+ngram:max back to back at batch 1 (48 new tokens, greedy, one
thread). bench/results/e2e_spec_bench_eagle.json is rewritten after every prompt, so a run stopped
by a deadline keeps what it measured (bench_e2e.py writes only at the end). The model runs on
its native (GGUF block) weights, the default.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
from bench.bench_e2e import load_prompts  # noqa: E402
from specdec_kernels.decoding import Generator, SpecSchedule  # noqa: E402
from specdec_kernels.decoding.registry import make_drafter  # noqa: E402
from specdec_kernels.models import load_model  # noqa: E402
model, tok = load_model("smollm2-135m")
prompts = load_prompts(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 26, tok)
out = Path(ROOT) / "bench" / "results" / "e2e_spec_bench_eagle.json"
methods = ["ours-ar", "eagle:max", "eagle+ngram:max"]
Generator(model, None).generate([prompts[0]["ids"]], 4)  # warm-up
for m in methods[1:]:
    make_drafter(m.split(":")[0], model)  # measures the verify-cost curve once, outside the timings
rows = []
for p in prompts:
    ar_out = None
    for m in methods:
        name, _, sched = m.partition(":")
        drafter = make_drafter(name, model, max_k=16) if name != "ours-ar" else None
        gen = Generator(model, drafter, SpecSchedule(sched or "constant", 4))
        t = time.perf_counter()
        (r,) = gen.generate([p["ids"]], 48)
        dt = time.perf_counter() - t
        if m == "ours-ar":
            ar_out = r.output
        rows.append({"id": p["id"], "category": p["category"], "method": m, "tokens": len(r.output), "seconds": dt,
                     "tokens_per_s": len(r.output) / dt, "mean_accepted_length": r.stats.mean_accepted_length,
                     "identical": r.output == ar_out, "stats": r.stats.summary()})
    summ = []
    for m in methods:
        rs = [x for x in rows if x["method"] == m]
        base = {x["id"]: x["tokens_per_s"] for x in rows if x["method"] == "ours-ar"}
        summ.append({"method": m, "prompts": len(rs), "tokens_per_s": statistics.mean(x["tokens_per_s"] for x in rs),
                     "speedup_vs_ours_ar": statistics.mean(x["tokens_per_s"] / base[x["id"]] for x in rs),
                     "mean_accepted_length": statistics.mean(x["mean_accepted_length"] for x in rs),
                     "identical": f"{sum(x['identical'] for x in rs)}/{len(rs)}"})
    out.write_text(json.dumps({"config": {"prompts": os.path.basename(sys.argv[1]), "batch": 1,
                                          "max_new_tokens": 48, "threads": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                               "summary": summ, "runs": rows}, indent=1) + "\n")
    print(p["category"], [(s["method"], round(s["speedup_vs_ours_ar"], 2), round(s["mean_accepted_length"], 2), s["identical"]) for s in summ], flush=True)
