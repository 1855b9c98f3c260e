"""Autoregressive decode and prompt processing: ours against llama.cpp's ``llama-bench`` on the
same GGUF file, in the same run, at each thread count.

  python bench/bench_decode.py --model qwen2.5-coder-1.5b --llama-bench /path/to/llama-bench --threads 1 2

Ours: ``Generator`` with no drafter on a prompt of ``--prompt-tokens`` tokens (the prefill rate:
prompt tokens per second of the prefill forward) generating ``--new-tokens`` tokens (the decode
rate: tokens per second of the decode steps, prefill excluded, as llama.cpp reports ``tg``),
median over ``--rounds`` rounds. llama.cpp: ``llama-bench -p P -n N -t T -r R -o json`` (``pp``
and ``tg`` averages). The two alternate within each round's thread count so both see the same
machine load. Results: bench/results/decode_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import print_table, write_results  # noqa: E402


def ours(model, prompt_tokens: int, new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one generation on a fixed pseudo-random prompt."""
    from specdec_kernels.decoding import Generator

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (prompt_tokens + 1,), generator=g).tolist()
    req = Generator(model).generate([prompt], new_tokens, stop_at_eos=False)[0]
    return req.stats.prefill_tokens_per_s, req.stats.decode_tokens_per_s


def llama_bench(binary: str, path: str, prompt_tokens: int, new_tokens: int, threads: int) -> tuple[float, float]:
    """(pp tokens/s, tg tokens/s) of one ``llama-bench`` run (one repetition each)."""
    out = subprocess.run([binary, "-m", path, "-p", str(prompt_tokens), "-n", str(new_tokens), "-t", str(threads),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=1800, check=True).stdout
    rows = json.loads(out)
    rate = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    return rate["pp"], rate["tg"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="registered name or .gguf file")
    p.add_argument("--weights", default="native-int8act", help="our weight format (default: native-int8act)")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (omit: ours only)")
    p.add_argument("--threads", type=int, nargs="+", required=True, help="thread counts to run, e.g. 1 2")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from specdec_kernels.models import load_model
    from specdec_kernels.models.registry import resolve

    path = resolve(args.model)
    print(f"loading {args.model} ({args.weights}) ...", file=sys.stderr)
    model, _ = load_model(path, weights=args.weights)
    rows = []
    with tqdm(total=len(args.threads) * args.rounds, desc="bench_decode") as bar:
        for threads in args.threads:
            torch.set_num_threads(threads)
            ours(model, 8, 2)  # warm-up: first-call allocations and the rope tables
            mine, theirs = [], []
            for _ in range(args.rounds):
                mine.append(ours(model, args.prompt_tokens, args.new_tokens))
                if args.llama_bench:
                    theirs.append(llama_bench(args.llama_bench, path, args.prompt_tokens, args.new_tokens, threads))
                bar.update(1)
            row = {"threads": threads, "ours_prefill_tok_s": statistics.median(m[0] for m in mine),
                   "ours_decode_tok_s": statistics.median(m[1] for m in mine)}
            if theirs:
                row.update({"llama_cpp_pp_tok_s": statistics.median(t[0] for t in theirs),
                            "llama_cpp_tg_tok_s": statistics.median(t[1] for t in theirs)})
                row["decode_ratio"] = row["ours_decode_tok_s"] / row["llama_cpp_tg_tok_s"]
                row["prefill_ratio"] = row["ours_prefill_tok_s"] / row["llama_cpp_pp_tok_s"]
            rows.append(row)
    print_table(rows, list(rows[0]))
    out = write_results(f"decode_{Path(str(args.model)).name.removesuffix('.gguf')}", {
        "command": " ".join(["python", "bench/bench_decode.py"] + sys.argv[1:]), "model": args.model,
        "weights": args.weights, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
