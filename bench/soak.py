"""Soak: long generations at batch 8 with every drafter, checked for exactness and leaks.

    python bench/soak.py                                   # 2,000 tokens x 8 requests per drafter
    python bench/soak.py --max-new-tokens 300 --drafters ngram eagle

For each drafter, one batch of ``--batch`` prompts (the package's prompts, chat template)
generates ``--max-new-tokens`` tokens per request, greedy, EOS ignored so that every request
runs the whole length. Checked, per drafter:

- every request's output equals the autoregressive output of the same batch (lossless);
- no request ended with an error;
- memory is stable: the process's resident size at the end exceeds its size after the
  warm-up (the first ``--warmup`` fraction of the steps) by at most ``--rss-growth-mb``;
- the KV cache is whole again: every block and every slot is free once generation ends
  (the target's cache, and the drafter's own when it has one).

Writes bench/results/soak.json (``--out-dir`` for another folder) and exits 1 when a check
fails. ``tests/test_soak.py`` runs the same checks on a tiny random model in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from specdec_kernels.decoding import Generator, SpecSchedule  # noqa: E402
from specdec_kernels.decoding.registry import DRAFTER_INFO, default_schedule, make_drafter  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return 0


def caches_of(gen: Generator, drafter) -> dict:
    """The paged caches to check after a run: the target's, and the drafter's own when it
    keeps one (``drafter.cache``: the EAGLE head's and a draft model's; self-speculation
    shares the target's)."""
    caches = {"target": gen.cache}
    own = getattr(drafter, "cache", None)
    if own is not None and own is not gen.cache:
        caches["drafter"] = own
    return caches


def soak_one(model, drafter, prompts: list, max_new_tokens: int, *, schedule: str = "constant",
             warmup: float = 0.1, progress=None) -> dict:
    """Generate for ``prompts`` (token id lists) with ``drafter`` (None: autoregressive) on
    ``schedule``, EOS ignored; returns outputs, errors, resident sizes per step and the
    caches' state."""
    gen = Generator(model, drafter, SpecSchedule(schedule))
    samples, steps = [], [0]
    total = len(prompts) * max_new_tokens

    def on_tokens(req, new_ids):
        if progress is not None:
            progress.update(len(new_ids))
        # One sample per emitted chunk of request 0 (~ one per step).
        if req.rid == 0:
            steps[0] += 1
            samples.append(rss_bytes())

    t0 = time.perf_counter()
    reqs = gen.generate(prompts, max_new_tokens, on_tokens=on_tokens, stop_at_eos=False)
    seconds = time.perf_counter() - t0
    after_warmup = samples[min(len(samples) - 1, int(len(samples) * warmup))] if samples else 0
    caches = {}
    for name, c in caches_of(gen, drafter).items():
        caches[name] = {"free_blocks": c.num_free_blocks, "scratch_blocks": c.num_scratch_blocks,
                        "num_blocks": c.num_blocks, "active_slots": len(c.active_slots)}
    return {
        "outputs": [r.output for r in reqs],
        "errors": [r.error for r in reqs if r.error is not None],
        "tokens": sum(len(r.output) for r in reqs), "seconds": seconds,
        "tokens_per_s": sum(len(r.output) for r in reqs) / seconds if seconds > 0 else 0.0,
        "mean_accepted_length": (sum(r.stats.emitted for r in reqs) / max(1, sum(r.stats.steps for r in reqs))),
        "steps": steps[0], "rss_after_warmup_mb": after_warmup / 2**20,
        "rss_end_mb": (samples[-1] if samples else 0) / 2**20,
        "rss_max_mb": (max(samples) if samples else 0) / 2**20, "caches": caches, "expected_tokens": total,
    }


def check(result: dict, reference: list | None, rss_growth_mb: float) -> list[str]:
    """The soak's failures for one drafter's result (empty: passed)."""
    failures = []
    if result["errors"]:
        failures.append(f"requests failed: {result['errors']}")
    if result["tokens"] != result["expected_tokens"]:
        failures.append(f"{result['tokens']} tokens generated, expected {result['expected_tokens']}")
    if reference is not None:
        bad = [i for i, (a, b) in enumerate(zip(result["outputs"], reference)) if a != b]
        if bad:
            failures.append(f"outputs differ from autoregressive for requests {bad}")
    growth = result["rss_end_mb"] - result["rss_after_warmup_mb"]
    if growth > rss_growth_mb:
        failures.append(f"resident size grew by {growth:.1f} MB after the warm-up (limit {rss_growth_mb} MB)")
    for name, c in result["caches"].items():
        if c["free_blocks"] + c["scratch_blocks"] != c["num_blocks"] or c["active_slots"]:
            failures.append(f"{name} cache not returned: {c['free_blocks']}/{c['num_blocks']} blocks free "
                            f"({c['scratch_blocks']} held as scratch), {c['active_slots']} slots active")
    return failures


def run_soak(model, names: list, prompts: list, max_new_tokens: int, *, rss_growth_mb: float, warmup: float = 0.1,
             self_spec_layers: int = 8, show_progress: bool = True) -> dict:
    """Autoregressive first (the reference), then each drafter in ``names``; returns
    {name: result with its "failures"}."""
    results = {}
    with tqdm(total=(len(names) + 1) * len(prompts) * max_new_tokens, desc="soak", unit="tok",
              disable=not show_progress) as bar:
        for name in ["none"] + [n for n in names if n != "none"]:
            bar.set_postfix_str(name)
            drafter = make_drafter(name, model, self_spec_layers=self_spec_layers)
            r = soak_one(model, drafter, prompts, max_new_tokens, schedule=default_schedule(name), warmup=warmup,
                         progress=bar)
            reference = results["none"]["outputs"] if "none" in results else None
            r["failures"] = check(r, reference, rss_growth_mb)
            results[name] = r
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint folder")
    p.add_argument("--weights", default="native", help="weight format (native, fp32, bf16, q8_0, q4_0)")
    p.add_argument("--drafters", nargs="+", default=[n for n in DRAFTER_INFO if n != "none"],
                   help="drafters to soak (autoregressive always runs first, as the reference)")
    p.add_argument("--batch", type=int, default=8, help="requests generated together")
    p.add_argument("--max-new-tokens", type=int, default=2000, help="tokens per request (EOS ignored)")
    p.add_argument("--rss-growth-mb", type=float, default=64.0,
                   help="largest allowed growth of the resident size after the warm-up")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps counted as warm-up")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="folder of soak.json")
    args = p.parse_args()
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy
    from specdec_kernels.models import load_model

    model, tok = load_model(args.model, weights=args.weights)
    lines = resources.files("specdec_kernels").joinpath("data/prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    prompts = [tok.chat_prompt(texts[i % len(texts)]) for i in range(args.batch)]
    results = run_soak(model, args.drafters, prompts, args.max_new_tokens, rss_growth_mb=args.rss_growth_mb,
                       warmup=args.warmup)
    failed = False
    print(f"\n{'drafter':<18}{'tokens/s':>10}{'MAL':>7}{'RSS warm MB':>13}{'RSS end MB':>12}  result")
    for name, r in results.items():
        failed |= bool(r["failures"])
        print(f"{name:<18}{r['tokens_per_s']:>10.1f}{r['mean_accepted_length']:>7.2f}{r['rss_after_warmup_mb']:>13.1f}"
              f"{r['rss_end_mb']:>12.1f}  {'; '.join(r['failures']) or 'ok'}")
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "soak.json")
    summary = {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()}
    with open(out, "w") as f:
        json.dump({"command": " ".join(["python", "bench/soak.py"] + sys.argv[1:]), "model": args.model,
                   "weights": args.weights, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
                   "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "results": summary}, f, indent=1)
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
