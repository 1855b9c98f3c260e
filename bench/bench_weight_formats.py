"""Autoregressive decoding of one model in several weight formats, in the same process.

    python bench/bench_weight_formats.py --prompts PATH/TO/spec_bench_dev.jsonl

Loads the model once per format (default: native and native-int8act, the GGUF file's blocks
with fp32 and with int8 activations), then decodes the same prompts greedily with each
format in turn, ``--reps`` rounds alternating between the formats (so that a change in the
machine's load hits every format alike), and reports the median tokens/s per format
(prefill included), the ratio to the first format, and how many outputs equal the first
format's. Writes bench/results/<--out-name>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.common import machine_info, write_results  # noqa: E402
from specdec_kernels.models.registry import WEIGHT_FORMATS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=None, help="a Spec-Bench-style .jsonl (None: the package's prompts)")
    p.add_argument("--max-prompts", type=int, default=6, help="prompts, round-robin over categories")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--formats", nargs="+", default=["native", "native-int8act"], choices=WEIGHT_FORMATS)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=3, help="rounds over all formats")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    p.add_argument("--out-name", default="weight_formats")
    args = p.parse_args(argv)
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy

    from bench.bench_e2e import load_prompts
    from specdec_kernels.decoding import Generator
    from specdec_kernels.models import load_model

    models = {f: load_model(args.model, f) for f in tqdm(args.formats, desc="loading")}
    tok = models[args.formats[0]][1]
    prompts = [p["ids"] for p in load_prompts(args.prompts, args.max_prompts, tok)]
    for f in args.formats:  # warm-up
        Generator(models[f][0]).generate([prompts[0]], 4)
    rates = {f: [] for f in args.formats}
    outputs = {}
    with tqdm(total=args.reps * len(args.formats) * len(prompts), desc="bench_weight_formats") as bar:
        for _ in range(args.reps):
            for f in args.formats:
                gen = Generator(models[f][0])
                seconds, tokens = 0.0, 0
                for i, ids in enumerate(prompts):
                    t0 = time.perf_counter()
                    out = gen.generate([ids], args.max_new_tokens)[0].output
                    seconds += time.perf_counter() - t0
                    tokens += len(out)
                    outputs[(f, i)] = out
                    bar.update(1)
                rates[f].append(tokens / seconds)
    base = args.formats[0]
    rows = []
    for f in args.formats:
        same = sum(outputs[(f, i)] == outputs[(base, i)] for i in range(len(prompts)))
        rows.append({"weights": f, "tokens_per_s": round(statistics.median(rates[f]), 2),
                     "x_first": round(statistics.median(rates[f]) / statistics.median(rates[base]), 3),
                     "same_output_as_first": f"{same}/{len(prompts)}", "all_rates": rates[f]})
        print(f"{f:16s} {rows[-1]['tokens_per_s']:7.2f} tok/s  x{rows[-1]['x_first']:.2f} vs {base}  "
              f"same output {rows[-1]['same_output_as_first']}")
    path = write_results(args.out_name, {"command": " ".join(["python", "bench/bench_weight_formats.py"] + sys.argv[1:]),
                                         "machine": machine_info(), "model": args.model, "threads": args.threads,
                                         "max_new_tokens": args.max_new_tokens, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
