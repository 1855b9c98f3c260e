"""``specdec`` command line.

    specdec generate --model smollm2-135m --drafter ngram --prompt "Tell me about Paris."
    specdec bench [--prompts FILE] [--max-prompts N] [--max-new-tokens N] [--batch-sizes 1 4]
    specdec train-medusa --model smollm2-135m [--out FILE]   (regenerates the shipped Medusa heads)
    specdec export-hf --model smollm2-135m --out DIR   (a Hugging Face checkpoint dir, e.g. for vLLM)
"""
from __future__ import annotations

import argparse
import sys
import time

DRAFTERS = ("none", "ngram", "ngram-tree", "self-spec", "medusa", "medusa+ngram", "medusa-untrained", "draft",
            "draft-tree")


def make_drafter(name: str, model, *, self_spec_layers: int = 8, draft_model: str | None = None,
                 medusa_checkpoint: str | None = None, max_k: int = 16):
    """A drafter by name for ``model`` (None for plain autoregressive decoding)."""
    from .decoding import (MedusaDrafter, ModelDrafter, NgramDrafter, NgramTreeDrafter, SelfSpecDrafter,
                           medusa_heads_for)

    if name in ("none", "ar", None):
        return None
    if name == "ngram":
        return NgramDrafter(max_k=max_k)
    if name == "ngram-tree":
        return NgramTreeDrafter(max_k=max_k)
    if name == "self-spec":
        return SelfSpecDrafter(model, self_spec_layers, max_k=max_k)
    if name == "medusa":  # the package's trained heads for the model unless a checkpoint is given
        return MedusaDrafter(model, medusa_heads_for(model, medusa_checkpoint))
    if name == "medusa+ngram":  # the trained heads' tree plus the prompt-lookup chain as one more branch
        return MedusaDrafter(model, medusa_heads_for(model, medusa_checkpoint), ngram=NgramDrafter(max_k=max_k))
    if name == "medusa-untrained":  # for comparison: zero ResBlocks, the static small tree
        from .decoding.drafters import MEDUSA_SMALL_CHOICES

        drafter = MedusaDrafter(model, medusa_heads_for(model, "untrained"), MEDUSA_SMALL_CHOICES)
        drafter.name = "medusa-untrained"
        return drafter
    if name in ("draft", "draft-tree"):
        if draft_model:
            from .models import load_model

            dm, _ = load_model(draft_model)
            if dm.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"draft model vocabulary ({dm.config.vocab_size}) differs from the target's "
                                 f"({model.config.vocab_size})")
        else:  # no second checkpoint ships with the package: a layer-truncated copy of the target
            dm = model.truncated(self_spec_layers)
        return ModelDrafter(dm, tree_width=3 if name == "draft-tree" else 1, max_k=max_k, name=name)
    raise ValueError(f"unknown drafter {name!r}; choose from {DRAFTERS}")


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


def cmd_export_hf(args) -> int:
    from .models import load_model
    from .models.hf_loader import save_hf_dir

    model, tok = load_model(args.model)
    save_hf_dir(model, args.out, tok)
    print(f"[wrote {model.name} ({model.dtype}) and its tokenizer to {args.out}]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument belongs to the benchmark's own parser
        from .decoding.benchmark import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["train-medusa"]:
        from .medusa_training import main as train_main

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
    e = sub.add_parser("export-hf", help="write a model (weights as loaded, fp32 for GGUF) and its tokenizer as a "
                       "Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json, ...)")
    e.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint dir")
    e.add_argument("--out", required=True, help="output directory")
    e.set_defaults(func=cmd_export_hf)
    sub.add_parser("bench", help="end-to-end benchmark (specdec bench --help)")
    sub.add_parser("train-medusa", help="train Medusa heads by self-distillation (specdec train-medusa --help)")
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
