"""``specdec`` command line.

    specdec generate --model smollm2-135m --drafter ngram --prompt "Tell me about Paris."
    specdec bench [--prompts FILE] [--max-prompts N] [--max-new-tokens N] [--out-dir DIR]
        (bench/bench_e2e.py of a source checkout; results in ~/.cache/specdec_kernels/bench by default)
    specdec train-medusa --model smollm2-135m [--out FILE]   (regenerates the shipped Medusa heads)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from .decoding.registry import DRAFTERS, make_drafter


def cmd_generate(args) -> int:
    import torch

    from .decoding import Generator, SamplingParams, SpecSchedule
    from .models import load_model

    torch.set_num_threads(args.threads) if args.threads else None
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    print(f"[loaded {model.name} in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    drafter = make_drafter(args.drafter, model, self_spec_layers=args.self_spec_layers, draft_model=args.draft_model,
                           medusa_checkpoint=args.medusa_checkpoint)
    if args.drafter == "medusa" and not args.medusa_checkpoint:
        from .medusa import default_medusa_checkpoint

        if default_medusa_checkpoint(model.name) is None:
            print("[medusa heads are untrained (no --medusa-checkpoint and none ships for this model): expect low "
                  "acceptance]", file=sys.stderr)
    ids = tok.encode(args.prompt) if args.raw else tok.chat_prompt(args.prompt)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    gen = Generator(model, drafter, SpecSchedule(args.schedule, args.k))
    pieces = []

    def stream(req, new_ids):
        # Decode the whole output and print what is new, so multi-token characters come out whole.
        before = tok.decode(pieces, skip_special_tokens=True)
        pieces.extend(new_ids)
        text = tok.decode(pieces, skip_special_tokens=True)
        sys.stdout.write(text[len(before):])
        sys.stdout.flush()

    t0 = time.perf_counter()
    (req,) = gen.generate([ids], args.max_new_tokens, sampling, on_tokens=stream)
    dt = time.perf_counter() - t0
    print()
    print(f"[{args.drafter}, schedule {args.schedule}] {len(req.output)} tokens in {dt:.2f}s "
          f"({len(req.output) / dt:.1f} tokens/s); {req.stats.format()}", file=sys.stderr)
    return 0


def user_cache_dir() -> Path:
    """Where ``specdec`` writes what nobody asked to keep elsewhere: $XDG_CACHE_HOME/specdec_kernels
    (default ~/.cache/specdec_kernels)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec_kernels"


def cmd_bench(argv: list) -> int:
    """Run the end-to-end benchmark, bench/bench_e2e.py of the source checkout this package
    is imported from. It is not part of the installed package (it needs the test extras and
    compares against transformers). Results go to the per-user cache folder unless
    ``--out-dir`` says otherwise (``--out-dir bench/results`` updates the committed ones)."""
    script = Path(__file__).resolve().parent.parent / "bench" / "bench_e2e.py"
    if not script.exists():
        print("specdec bench runs bench/bench_e2e.py of a source checkout of specdec_kernels, and this install has "
              "none: in a clone of the repository, with the test extras installed (pip install -e '.[test]'), run\n"
              "    python bench/bench_e2e.py --help", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("bench_e2e", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, prog="specdec bench", default_out_dir=user_cache_dir() / "bench")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument belongs to the benchmark's own parser
        return cmd_bench(argv[1:])
    if argv[:1] == ["train-medusa"]:
        from .training.medusa_training import main as train_main

        return train_main(argv[1:])
    p = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding on CPU/GPU.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streaming, then print stats")
    g.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint dir")
    g.add_argument("--drafter", default="ngram", choices=DRAFTERS)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--schedule", default="constant", choices=("constant", "heuristic", "adaptive", "max"))
    g.add_argument("--k", type=int, default=4, help="(initial) speculation length")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--self-spec-layers", type=int, default=8)
    g.add_argument("--draft-model", default=None, help="draft checkpoint (default: the target's first layers)")
    g.add_argument("--medusa-checkpoint", default=None, help="Medusa heads (.safetensors/.pt with the Medusa keys, e.g. medusa_lm_head.safetensors; "
                   "default: the heads the package ships for the model, 'untrained' for untrained heads)")
    g.add_argument("--threads", type=int, default=0)
    g.set_defaults(func=cmd_generate)
    sub.add_parser("bench", help="end-to-end benchmark, bench/bench_e2e.py of a source checkout (specdec bench --help)")
    sub.add_parser("train-medusa", help="train Medusa heads by self-distillation (specdec train-medusa --help)")
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
