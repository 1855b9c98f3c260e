"""End-to-end benchmark: tokens/s of greedy generation with SmolLM2-135M on this machine.

In one process, for each prompt (chat template applied to the first turn): transformers
autoregressive, transformers assisted generation with prompt lookup, our autoregressive
loop, and our loop with each drafter; at batch 1 and at batch B (groups of B prompts, our
loop only: transformers' assisted generation is batch 1 only). Reports tokens/s per prompt,
the speedup (mean over prompts of per-prompt tokens/s ratios against our autoregressive
run), mean accepted length, a per-category table and whether each greedy output equals our
autoregressive output; writes JSON and a PNG chart.

Run as ``specdec bench ...`` or ``python bench/bench_e2e.py ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from importlib import resources
from pathlib import Path

import torch

DEFAULT_DRAFTERS = ["ngram", "ngram:heuristic", "ngram-tree:max", "self-spec", "medusa", "medusa+ngram", "draft-tree",
                    "eagle:max", "eagle+ngram:max"]


def load_prompts(path: str | None, max_prompts: int, tokenizer) -> list[dict]:
    """[{id, category, text, ids}] from the package's prompt file or a Spec-Bench jsonl
    (``turns``: the first turn is used)."""
    if path is None:
        lines = resources.files("specdec_kernels").joinpath("data/prompts.jsonl").read_text().splitlines()
    else:
        lines = Path(path).read_text().splitlines()
    out = []
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        text = row["turns"][0] if "turns" in row else row["prompt"]
        out.append({"id": row.get("question_id", row.get("id")), "category": row.get("category", "all"),
                    "text": text, "ids": tokenizer.chat_prompt(text)})
    if max_prompts:
        # Round-robin over categories so that a short run still covers them.
        by_cat: dict[str, list] = {}
        for p in out:
            by_cat.setdefault(p["category"], []).append(p)
        picked, i = [], 0
        while len(picked) < min(max_prompts, len(out)):
            for rows in by_cat.values():
                if i < len(rows) and len(picked) < max_prompts:
                    picked.append(rows[i])
            i += 1
        out = picked
    return out


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


class HFRunner:
    """transformers' LlamaForCausalLM with the same (dequantised) weights."""

    def __init__(self, model, tmpdir: str):
        from transformers import LlamaForCausalLM

        from ..models.hf_loader import save_hf_dir

        save_hf_dir(model, tmpdir)
        self.model = LlamaForCausalLM.from_pretrained(tmpdir, dtype=torch.float32).eval()
        self.eos = list(model.config.eos_token_ids)

    @torch.inference_mode()
    def generate(self, ids: list, max_new: int, prompt_lookup: int = 0) -> list:
        kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos[0])
        if prompt_lookup:
            kw["prompt_lookup_num_tokens"] = prompt_lookup
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()
        return out


def write_chart(summary: list, cat_rows: list, methods: list, title: str, path: str) -> None:
    """Grouped bars: speedup vs our autoregressive run, per category and overall (batch 1)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    cats = [c["category"] for c in cat_rows] + ["mean"]
    shown = [m for m in methods if m != "ours-ar"]
    fig, ax = plt.subplots(figsize=(min(16, max(7, 0.22 * len(cats) * len(shown))), 4.5))
    width = 0.8 / len(shown)
    for j, m in enumerate(shown):
        overall = next(s["speedup_vs_ours_ar"] for s in summary if s["batch"] == 1 and s["method"] == m)
        vals = [c.get(m, 0) for c in cat_rows] + [overall]
        ax.bar([i + j * width for i in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs our autoregressive")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default=None, help="jsonl (default: the package's prompts; e.g. ../shared/data/spec_bench_dev.jsonl)")
    p.add_argument("--max-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--drafters", nargs="+", default=DEFAULT_DRAFTERS,
                   help="drafter[:schedule] names (ngram, ngram-tree, self-spec, medusa, medusa+ngram, draft, draft-tree, "
                        "eagle, eagle+ngram; ':max' lets tree drafters size their own trees)")
    p.add_argument("--k", type=int, default=4, help="speculation length (initial, for the adaptive schedules)")
    p.add_argument("--self-spec-layers", type=int, default=8)
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine more threads stall in barriers)")
    p.add_argument("--out-name", default=None,
                   help="results name: bench/results/NAME.json and NAME_speedup.png (default: e2e for the "
                        "package's prompts, e2e_spec_bench for a spec_bench*.jsonl, else e2e_<file stem>)")
    args = p.parse_args(argv)
    if args.out_name is None:
        stem = Path(args.prompts).stem if args.prompts else ""
        args.out_name = "e2e" if not stem else ("e2e_spec_bench" if stem.startswith("spec_bench") else f"e2e_{stem}")
    out_path = Path("bench/results") / f"{args.out_name}.json"
    chart_path = Path("bench/results") / f"{args.out_name}_speedup.png"

    import tempfile

    from tqdm import tqdm

    from ..cli import make_drafter
    from .. import ops
    from ..models import load_model
    from . import Generator, SpecSchedule

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    load_s = time.perf_counter() - t0
    prompts = load_prompts(args.prompts, args.max_prompts, tok)
    N = args.max_new_tokens

    def ours(drafter_spec: str | None, batch_ids: list):
        name, _, schedule = (drafter_spec or "none").partition(":")
        drafter = make_drafter(name, model, self_spec_layers=args.self_spec_layers, max_k=16)
        gen = Generator(model, drafter, SpecSchedule(schedule or "constant", args.k))
        t = time.perf_counter()
        reqs = gen.generate(batch_ids, N)
        return reqs, time.perf_counter() - t

    ours([None][0], [prompts[0]["ids"]])  # warm-up
    methods = ["ours-ar"] + list(args.drafters)
    hf = None
    if not args.no_hf:
        with tempfile.TemporaryDirectory() as d:
            hf = HFRunner(model, d)
        hf.generate(prompts[0]["ids"], 4)
        methods = ["hf-ar", "hf-prompt-lookup"] + methods
    runs = []  # one row per (batch size, method, group)
    total = sum(len(methods if bs == 1 else [m for m in methods if not m.startswith("hf")]) * -(-len(prompts) // bs)
                for bs in args.batch_sizes)
    bar = tqdm(total=total, desc="e2e", unit="run")
    ar_out = {}
    for bs in args.batch_sizes:
        groups = [prompts[i: i + bs] for i in range(0, len(prompts), bs)]
        # Methods run back to back on each group, so that the machine's load drifts affect
        # every method of a ratio alike.
        for group, method in [(g, m) for g in groups for m in methods]:
            if bs > 1 and method.startswith("hf"):
                continue
            ids = [p["ids"] for p in group]
            row = {"batch": bs, "method": method, "ids": [p["id"] for p in group],
                   "categories": [p["category"] for p in group]}
            if method.startswith("hf"):
                t = time.perf_counter()
                outs = [hf.generate(ids[0], N, args.prompt_lookup_tokens if method == "hf-prompt-lookup" else 0)]
                dt = time.perf_counter() - t
                row["mean_accepted_length"] = None
            else:
                reqs, dt = ours(None if method == "ours-ar" else method, ids)
                outs = [r.output for r in reqs]
                row["mean_accepted_length"] = statistics.mean(r.stats.mean_accepted_length for r in reqs)
                row["stats"] = [r.stats.summary() for r in reqs]
            tokens = sum(len(o) for o in outs)
            row.update(tokens=tokens, seconds=dt, tokens_per_s=tokens / dt)
            if method == "ours-ar" and bs == 1:
                ar_out[group[0]["id"]] = outs[0]
            row["outputs"] = outs
            runs.append(row)
            bar.update(1)
    bar.close()

    # Exactness against our batch-1 autoregressive output, speedups per prompt/group.
    summary, by_cat = [], {}
    for bs in args.batch_sizes:
        base = {tuple(r["ids"]): r["tokens_per_s"] for r in runs if r["batch"] == bs and r["method"] == "ours-ar"}
        for method in methods:
            rows = [r for r in runs if r["batch"] == bs and r["method"] == method]
            if not rows:
                continue
            for r in rows:
                r["identical"] = [o == ar_out.get(i) for o, i in zip(r["outputs"], r["ids"])]
                r["speedup"] = r["tokens_per_s"] / base[tuple(r["ids"])]
                if bs == 1:
                    by_cat.setdefault(r["categories"][0], {}).setdefault(method, []).append(r["speedup"])
            mal = [r["mean_accepted_length"] for r in rows if r["mean_accepted_length"] is not None]
            summary.append({"batch": bs, "method": method,
                            "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rows),
                            "speedup_vs_ours_ar": statistics.mean(r["speedup"] for r in rows),
                            "mean_accepted_length": statistics.mean(mal) if mal else "",
                            "identical": f"{sum(sum(r['identical']) for r in rows)}/{sum(len(r['identical']) for r in rows)}"})
    print(f"\nmodel {model.name} (loaded in {load_s:.1f}s), {len(prompts)} prompts, {N} new tokens, "
          f"{args.threads} thread(s); ops.linear uses skinny_linear for "
          f"{ops.skinny_linear_rows(torch.float32)} rows (fp32)")
    print(_table(summary, ["batch", "method", "tokens_per_s", "speedup_vs_ours_ar", "mean_accepted_length", "identical"]))
    cat_rows = [{"category": c, **{m: statistics.mean(v) for m, v in ms.items()}} for c, ms in sorted(by_cat.items())]
    print("\nspeedup vs our autoregressive by category (batch 1):")
    print(_table(cat_rows, ["category"] + [m for m in methods if m != "ours-ar"]))
    hf_ar = next((s for s in summary if s["method"] == "hf-ar"), None)
    targets = {}
    if hf_ar:
        ours_ar = next(s for s in summary if s["method"] == "ours-ar" and s["batch"] == 1)
        targets["ours_ar_vs_hf_ar"] = ours_ar["tokens_per_s"] / hf_ar["tokens_per_s"]
        print(f"\nours autoregressive / transformers autoregressive: {targets['ours_ar_vs_hf_ar']:.2f}x (target >= 1.5x)")
    best = max((s for s in summary if s["batch"] == 1 and s["method"] in args.drafters),
               key=lambda s: s["speedup_vs_ours_ar"], default=None)
    if best:
        targets["best_drafter"] = best["method"]
        targets["best_drafter_speedup"] = best["speedup_vs_ours_ar"]
        print(f"best drafter at batch 1: {best['method']} {best['speedup_vs_ours_ar']:.2f}x our autoregressive (target >= 1.5x)")
    mismatches = [(r["batch"], r["method"], i) for r in runs for i, ok in zip(r["ids"], r["identical"]) if not ok]
    targets["all_greedy_identical"] = not mismatches
    print(f"greedy outputs identical to ours-ar: {'all' if not mismatches else f'{len(mismatches)} mismatches: {mismatches[:10]}'}")

    out = out_path
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r.pop("outputs")
    out.write_text(json.dumps({"machine": _machine(), "model": model.name, "load_seconds": load_s,
                               "config": vars(args),
                               "skinny_linear_rows": ops.skinny_linear_rows(torch.float32), "summary": summary,
                               "by_category": cat_rows, "targets": targets, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")
    write_chart(summary, cat_rows, methods, f"{model.name}: greedy, batch 1, {N} new tokens", str(chart_path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
