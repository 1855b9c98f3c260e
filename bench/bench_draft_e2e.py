"""End-to-end benchmark of the trained drafters: the distilled draft model (stored Q8_0, and
run as fp32 / Q4_0), before and after distillation, self-speculation with the trained exit
head against plain early exit, and the EAGLE head's dynamic trees — against our
autoregressive loop, same weights, same run.

    python bench/bench_draft_e2e.py --prompts SPEC_BENCH.jsonl --max-prompts 26 \\
        --out bench/results/e2e_spec_bench_draft.json
    python bench/bench_draft_e2e.py --out bench/results/e2e_draft.json     (the package's prompts)
    python bench/bench_draft_e2e.py --prompts SPEC_BENCH.jsonl --methods ar,eagle@fp32,eagle,eagle+ngram \\
        --out bench/results/e2e_spec_bench_eagle.json

Methods (``--methods``, comma-separated): ``ar``; a drafter name of ``specdec generate
--drafter`` (its chain or tree sized by the measured step cost); ``NAME@WEIGHTS`` runs a
draft model's or an EAGLE head's linears as fp32 / q8_0 / q4_0 (``--draft-weights``);
``NAME~FILE`` uses that EAGLE head / draft-model file instead of the shipped one (two heads
compared in one run); ``NAME:fixed`` drafts a fixed chain of 4 instead (how the
acceptance rate before and after distillation is compared: the same chains, so the rate does
not depend on how many tokens the sizing chose to draft). ``self-spec-plain`` exits after the
same layer as the shipped exit head.

Per prompt (round-robin over categories) every method runs back to back at batch 1 (greedy,
one thread, ``--max-new-tokens``), so machine noise hits all alike; the JSON is rewritten
after every prompt. Reported per method: tokens/s (mean over prompts), speedup over ``ar``
(mean of per-prompt ratios; median too), mean accepted length, acceptance rate (accepted /
drafted tokens), and whether every output equals autoregressive.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specdec_kernels.models.registry import WEIGHT_FORMATS  # noqa: E402

DEFAULT_METHODS = ("ar,draft-untrained:fixed,draft:fixed,draft,draft@fp32,draft@q4_0,draft-tree,"
                   "self-spec-plain:fixed,self-spec:fixed,self-spec")


def make(method, model, exit_layers):
    """(drafter or None, schedule) for a method string (module docstring)."""
    from specdec_kernels.decoding import SpecSchedule
    from specdec_kernels.decoding.registry import make_drafter

    name, _, mode = method.partition(":")
    name, _, checkpoint = name.partition("~")
    name, _, weights = name.partition("@")
    if name == "ar":
        return None, SpecSchedule("constant", 1)
    drafter = make_drafter(name, model, max_k=16, draft_weights=weights or "stored", self_spec_layers=exit_layers,
                           eagle_checkpoint=checkpoint or None,
                           draft_model=checkpoint if checkpoint and name.startswith("draft") else None)
    if mode == "fixed":
        drafter.sized = False
        return drafter, SpecSchedule("constant", 4)
    return drafter, SpecSchedule("max", 4, max_k=16)


def summarise(rows, methods, key=lambda r: True):
    base = {r["id"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    out = []
    for m in methods:
        rs = [r for r in rows if r["method"] == m and key(r) and r["id"] in base]
        if not rs:
            continue
        ratios = [r["tokens_per_s"] / base[r["id"]] for r in rs]
        drafted = sum(r["stats"]["drafted"] for r in rs)
        accepted = sum(r["stats"]["emitted"] - r["stats"]["steps"] for r in rs)
        out.append({"method": m, "prompts": len(rs), "tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in rs), 2),
                    "speedup_vs_ar": round(statistics.mean(ratios), 3), "median_speedup_vs_ar": round(statistics.median(ratios), 3),
                    "mean_accepted_length": round(statistics.mean(r["mean_accepted_length"] for r in rs), 3),
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}"})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", default=None, help="a Spec-Bench-style .jsonl (None: the package's prompts)")
    p.add_argument("--max-prompts", type=int, default=26, help="prompts, round-robin over categories")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated methods (module docstring)")
    p.add_argument("--model", default="smollm2-135m", help="target model")
    p.add_argument("--weights", default="native", choices=WEIGHT_FORMATS, help="target weight format")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "e2e_draft.json"), help="JSON output")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the target's step-cost curve again (and cache it) before the runs: the sizing "
                        "of every drafter follows it, and a curve cached on a loaded machine misleads it")
    args = p.parse_args(argv)
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy
    from tqdm import tqdm

    from bench.bench_e2e import load_prompts
    from specdec_kernels.decoding import Generator
    from specdec_kernels.drafting.draft_model.model import exit_model_for
    from specdec_kernels.models import load_model

    model, tok = load_model(args.model, args.weights)
    from specdec_kernels.decoding.cost_model import step_cost_for

    cost = step_cost_for(model, recalibrate=args.recalibrate)
    prompts = load_prompts(args.prompts, args.max_prompts, tok)
    methods = args.methods.split(",")
    exit_m = exit_model_for(model)
    exit_layers = exit_m.config.num_layers if exit_m is not None else 8
    runners = {m: make(m, model, exit_layers) for m in methods}  # measures the step cost once, outside the timings
    Generator(model, None).generate([prompts[0]["ids"]], 4)  # warm-up
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts) * len(methods), desc="draft e2e", unit="run")
    for p_ in prompts:
        ar_out = Generator(model, None).generate([p_["ids"]], args.max_new_tokens)[0].output
        for m in methods:
            drafter, schedule = runners[m]
            gen = Generator(model, drafter, schedule)
            t = time.perf_counter()
            (r,) = gen.generate([p_["ids"]], args.max_new_tokens)
            dt = time.perf_counter() - t
            rows.append({"id": p_["id"], "category": p_["category"], "method": m, "tokens": len(r.output),
                         "seconds": round(dt, 4), "tokens_per_s": len(r.output) / dt,
                         "mean_accepted_length": r.stats.mean_accepted_length, "identical": r.output == ar_out,
                         "stats": r.stats.summary()})
            bar.update(1)
        summary = summarise(rows, methods)
        cats = sorted({r["category"] for r in rows})
        by_category = {c: summarise(rows, methods, key=lambda r, c=c: r["category"] == c) for c in cats}
        out.write_text(json.dumps({
            "config": {"model": args.model, "weights": model.weight_format, "prompts": os.path.basename(args.prompts or "prompts.jsonl"),
                       "batch": 1, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                       "exit_layers": exit_layers, "step_cost_s": cost.to_json()["table"],
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "summary": summary, "by_category": by_category, "runs": rows}, indent=1) + "\n")
    bar.close()
    for s in summary:
        print(f"{s['method']:24s} {s['tokens_per_s']:7.2f} tok/s  {s['speedup_vs_ar']:.2f}x AR (median "
              f"{s['median_speedup_vs_ar']:.2f})  MAL {s['mean_accepted_length']:.2f}  acceptance "
              f"{s['acceptance_rate']}  identical {s['identical']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
