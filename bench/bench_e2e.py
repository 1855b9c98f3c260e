"""End-to-end benchmark: tokens/s of greedy generation with SmolLM2-135M on this machine.

In one process, for each prompt (chat template applied to the first turn): transformers
autoregressive, transformers assisted generation with prompt lookup, llama.cpp
autoregressive (llama-cpp-python on the same GGUF file, in a subprocess:
bench/llama_cpp_baseline.py), llama.cpp's own speculative loop with ``--llama-bin``
(``llama-speculative-simple``: autoregressive and its lookup drafts,
bench/llama_cpp_speculative.py), our autoregressive loop on fp32 weights (``fp32-ar``), our
autoregressive loop on ``--weights`` (default: the GGUF file's own blocks), and our loop with
each drafter; at batch 1 and at batch B (groups of B prompts, our
loop only: transformers' assisted generation is batch 1 only). Reports tokens/s per prompt
(total, and prefill / decode separately),
the speedup (mean over prompts of per-prompt tokens/s ratios against our autoregressive
run; and of the decode phase alone, what drafting changes), mean accepted length, a per-category table and whether each greedy output equals our
autoregressive output; writes JSON and a PNG chart. ``--continuous`` runs batch sizes B > 1
as one generation over all prompts with B slots (continuous batching: a prompt joins when a
request finishes) instead of groups of B; ``--rounds`` repeats every run, methods alternating.

Run from the repository root (needs the test extras: transformers, matplotlib):

    python bench/bench_e2e.py [--prompts FILE.jsonl] [--max-prompts N] [--max-new-tokens N] [--drafters ...]

writes bench/results/<name>.json and <name>_speedup.png (--out-name; default e2e, or
e2e_spec_bench for a spec_bench*.jsonl prompt file; --out-dir for another folder).
``specdec bench ...`` runs this script from a source checkout, writing to a per-user cache
folder unless given --out-dir.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402  (loads libtorch before the extension)

from bench.common import RESULTS_DIR, code_prompts, print_table, write_results  # noqa: E402
from specdec_kernels.cli import Parser  # noqa: E402
from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule, make_drafter  # noqa: E402
from specdec_kernels.decoding.registry import (DRAFT_MODEL_DRAFTERS, DRAFTER_INFO, WITH_DRAFT_WEIGHTS,  # noqa: E402
                                               default_schedule, load_draft)
from specdec_kernels.drafting.draft_model.model import DRAFT_VOCAB_SIZE, DRAFT_WEIGHTS  # noqa: E402
from specdec_kernels.models import load_model  # noqa: E402
from specdec_kernels.models.registry import WEIGHT_FORMATS  # noqa: E402
from specdec_kernels.models.skinny_rows import skinny_linear_rows  # noqa: E402

DEFAULT_DRAFTERS = ["ngram:constant", "ngram:heuristic", "ngram-tree:max", "self-spec", "medusa", "medusa+ngram", "draft-tree"]


def split_method(text: str) -> tuple[str, str, str | None]:
    """(drafter, schedule or "", draft weights or None) of a ``--drafters`` item
    ``DRAFTER[:SCHEDULE][@WEIGHTS]``."""
    spec, _, weights = text.partition("@")
    name, _, schedule = spec.partition(":")
    return name, schedule, weights or None


def drafter_spec(text: str) -> str:
    """``--drafters`` item check: a registered drafter, optionally ``:schedule``, optionally
    ``@weights`` (this method's ``--draft-weights``: two formats of one draft compared in the
    same run, alternating)."""
    name, schedule, weights = split_method(text)
    if weights is not None and weights not in DRAFT_WEIGHTS:
        raise argparse.ArgumentTypeError(f"unknown draft weights {weights!r} in {text!r}: choose from "
                                         f"{', '.join(DRAFT_WEIGHTS)}")
    if name not in DRAFTER_INFO or name == "none":
        raise argparse.ArgumentTypeError(f"unknown drafter {name!r}: choose from {', '.join(n for n in DRAFTER_INFO if n != 'none')} "
                                         "(ours-ar, the autoregressive baseline, always runs)")
    if weights is not None and name not in WITH_DRAFT_WEIGHTS:
        raise argparse.ArgumentTypeError(f"{name!r} runs no draft weights, so {text!r} has nothing to format: @WEIGHTS "
                                         f"applies to {', '.join(WITH_DRAFT_WEIGHTS)}")
    if schedule and schedule not in SpecSchedule.KINDS:
        raise argparse.ArgumentTypeError(f"unknown schedule {schedule!r} in {text!r}: choose from "
                                         f"{', '.join(SpecSchedule.KINDS)}")
    return text


def load_prompts(path: str | None, max_prompts: int, tokenizer, categories=None) -> list[dict]:
    """[{id, category, text, ids, row}] from the package's prompt file, a Spec-Bench jsonl
    (``turns``: the first turn is used) or a jsonl of code tasks ({task_id, prompt,
    canonical_solution, entry_point}: each row gives a "completion" and an "edit" prompt,
    :func:`bench.common.code_prompts`); ``row``: the prompt's row of the file (0-based, blank
    lines not counted); only those of ``categories`` when given."""
    if path is None:
        lines = resources.files("specdec_kernels").joinpath("data/prompts.jsonl").read_text().splitlines()
    else:
        lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(line for line in lines if line.strip()):
        row = json.loads(line)
        if "canonical_solution" in row:  # a HumanEval-format row: a completion and an edit prompt
            for category, text in code_prompts(row):
                out.append({"id": f"{row['task_id']}:{category}", "category": category, "text": text,
                            "ids": tokenizer.chat_prompt(text), "row": i})
            continue
        text = row["turns"][0] if "turns" in row else row["prompt"]
        out.append({"id": row.get("question_id", row.get("id")), "category": row.get("category", "all"),
                    "text": text, "ids": tokenizer.chat_prompt(text), "row": i})
    if categories:
        out = [p for p in out if p["category"] in categories]
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


class HFRunner:
    """transformers' LlamaForCausalLM with the same (dequantised) weights."""

    def __init__(self, model, tmpdir: str):
        from transformers import LlamaForCausalLM

        from specdec_kernels.models.hf_loader import save_hf_dir

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


def _llama_cpp_runner(gguf_path: str, args, eos_ids):
    """A function ids -> [llama.cpp result] (bench/llama_cpp_baseline.py, one subprocess per
    call so that it runs between our methods like the others), or None with the reason
    printed when llama_cpp is not importable or the model is not a GGUF file."""
    import importlib.util

    if not gguf_path.endswith(".gguf"):
        print("llama.cpp baseline skipped: the model is not a GGUF file")
        return None
    here = Path(__file__).resolve().parent / "llama_cpp_baseline.py"
    spec = importlib.util.spec_from_file_location("llama_cpp_baseline", here)
    if spec is None or not here.exists():
        print(f"llama.cpp baseline skipped: {here} not found (run from a source checkout)")
        return None
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    try:
        version = baseline.probe(args.llama_python)
    except baseline.LlamaCppUnavailable as e:
        print(f"llama.cpp baseline skipped: {e}")
        return None

    def run(ids):
        return baseline.run(gguf_path, [ids], args.max_new_tokens, eos_ids, threads=args.threads,
                            python=args.llama_python)["runs"]

    run.version = version
    return run


def llama_spec_targets(runs: list, drafters: list) -> dict:
    """Per category, batch 1, decode-phase tokens/s (mean over its runs): our best drafter
    against our autoregressive run, and against llama.cpp's best lookup method
    (bench/llama_cpp_speculative.py) in the same run."""
    rate: dict = {}
    for r in runs:
        if r["batch"] == 1 and r.get("decode_tokens_per_s"):
            rate.setdefault(r["categories"][0], {}).setdefault(r["method"], []).append(r["decode_tokens_per_s"])
    out = {}
    for cat, by_method in sorted(rate.items()):
        mean = {m: statistics.mean(v) for m, v in by_method.items()}
        ours = max((m for m in drafters if m in mean), key=mean.get, default=None)
        theirs = max((m for m in mean if m.startswith("llama-spec-") and m != "llama-spec-ar"), key=mean.get,
                     default=None)
        if ours is None or theirs is None or "ours-ar" not in mean:
            continue
        out[cat] = {"best_drafter": ours, "best_drafter_decode_speedup": mean[ours] / mean["ours-ar"],
                    "best_llama_spec": theirs, "best_drafter_vs_best_llama_spec": mean[ours] / mean[theirs],
                    "best_llama_spec_vs_llama_ar": mean[theirs] / mean.get("llama-spec-ar", float("nan")),
                    "decode_tokens_per_s": mean}
    return out


def build_parser(prog: str, default_out_dir: Path) -> Parser:
    """The command line: one flat list of flags (one-line errors, defaults in --help)."""
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint folder")
    p.add_argument("--prompts", default=None,
                   help="jsonl of {prompt} or Spec-Bench {turns, category} rows, given by path, e.g. a copy of "
                        "Spec-Bench's question.jsonl (Apache-2.0; not shipped), or of code tasks {task_id, prompt, "
                        "canonical_solution, entry_point} (a completion and an edit prompt each); default: the "
                        "package's prompts")
    p.add_argument("--max-prompts", type=int, default=10, help="prompts used (round-robin over categories); 0 = all")
    p.add_argument("--categories", nargs="+", default=None, help="only the prompts of these categories")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="batch sizes to run (transformers only at 1)")
    p.add_argument("--drafters", nargs="+", default=DEFAULT_DRAFTERS, type=drafter_spec,
                   metavar="DRAFTER[:SCHEDULE][@WEIGHTS]",
                   help="drafters to run, each with its default schedule unless one follows a colon, and with "
                        "--draft-weights unless one follows an @ (e.g. eagle@q8_0 eagle@q4_0); drafters: "
                        + ", ".join(f"{n} ({i.schedule})" for n, i in DRAFTER_INFO.items() if n != "none")
                        + f"; schedules: {', '.join(SpecSchedule.KINDS)}")
    p.add_argument("--continuous", action="store_true",
                   help="batch sizes B > 1: all prompts in one generation, at most B decoding at once and the next "
                        "prompt joining when one finishes (continuous batching, as serving engines batch), instead of "
                        "groups of B that run until their slowest request is done")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every (group, method) run this many times, methods alternating; ratios are per round")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens each warm-up generation makes (default: --max-new-tokens); a few suffice to "
                        "load caches and the step-cost curve on a slow machine")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every method (0 = greedy); T > 0: no top-k / top-p on either side, "
                        "our requests with fixed seeds (1000 + their index in the batch), llama.cpp's sampler at "
                        "--temp T --top-k 0 --top-p 1 --min-p 0; needs --no-hf and --no-llama-cpp (those baselines "
                        "decode greedily)")
    p.add_argument("--k", type=int, default=4, help="speculation length (initial, for the adaptive schedules)")
    p.add_argument("--self-spec-layers", type=int, default=8, help="layers of the target that self-spec / draft run")
    p.add_argument("--draft-model", default=None,
                   help="draft / draft-tree: a draft file or a model name of the target's vocabulary (as specdec "
                        "generate's flag; None: the draft the package ships for the model)")
    p.add_argument("--draft-weights", default="stored", choices=DRAFT_WEIGHTS, help="as specdec generate's flag")
    p.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB_SIZE, help="as specdec generate's flag")
    p.add_argument("--eagle-checkpoint", default=None,
                   help="eagle / eagle+ngram: an EAGLE head file (as specdec generate's flag; None: the shipped head)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--weights", default="native", choices=WEIGHT_FORMATS,
                   help="our model's weights (native: the GGUF file's own block formats)")
    p.add_argument("--no-fp32-ar", action="store_true", help="skip our autoregressive loop on fp32 weights")
    p.add_argument("--llama-python", default=sys.executable,
                   help="interpreter that runs llama-cpp-python for the llama.cpp baseline (default: this one)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    p.add_argument("--llama-bin", default=None,
                   help="a llama.cpp build's bin folder with llama-speculative-simple: also run llama.cpp's own "
                        "loop, autoregressive and with its lookup drafts (bench/llama_cpp_speculative.py), batch 1")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    p.add_argument("--out-dir", default=str(default_out_dir), help="folder of the results")
    p.add_argument("--out-name", default=None,
                   help="results name: OUT_DIR/NAME.json and NAME_speedup.png (default: e2e for the "
                        "package's prompts, e2e_spec_bench for a spec_bench*.jsonl, else e2e_<file stem>)")
    return p


def default_out_name(prompts: str | None) -> str:
    """e2e for the package's prompts, e2e_spec_bench for a spec_bench*.jsonl, else e2e_<file stem>."""
    stem = Path(prompts).stem if prompts else ""
    return "e2e" if not stem else ("e2e_spec_bench" if stem.startswith("spec_bench") else f"e2e_{stem}")


class Session:
    """What every run of one benchmark shares: the flags, our model (and its fp32 copy), the
    prompts and the baselines' runners (None when skipped); ``methods`` in run order.
    (A plain class: cli.py loads this file without a sys.modules entry, which dataclass needs.)"""

    def __init__(self, args: argparse.Namespace, model, tok, load_s: float):
        self.args, self.model, self.tok, self.load_s = args, model, tok, load_s
        self.fp32_model = None
        self.llama = None  # ids -> [llama.cpp result], see _llama_cpp_runner
        self.prompts: list = []
        self.methods: list = []
        self.llama_spec = None  # the bench.llama_cpp_speculative module with --llama-bin
        self.spec_binary = self.gguf = self.draft_gguf = None
        self.hf: HFRunner | None = None
        self.drafts: dict = {}  # (target id, draft weights) -> the draft model of the draft drafters, loaded once

    def ours(self, drafter: str | None, batch_ids: list, target=None, max_batch=None, new_tokens=None):
        """Our generation of ``batch_ids`` with ``drafter`` (``name[:schedule]``, None: autoregressive)
        on ``target`` (default: our model): (requests, seconds)."""
        target = target or self.model
        new_tokens = self.args.max_new_tokens if new_tokens is None else new_tokens
        name, schedule, weights = split_method(drafter or "none")
        weights = weights or self.args.draft_weights
        draft = self.args.draft_model
        if name in DRAFT_MODEL_DRAFTERS:  # its draft model loaded once (seconds), not every run
            key = (id(target), weights)
            if key not in self.drafts:
                self.drafts[key] = load_draft(target, draft, weights, self.args.draft_vocab)
            draft = self.drafts[key]
        made = make_drafter(name, target, self_spec_layers=self.args.self_spec_layers, max_k=16, draft_model=draft,
                            draft_weights=weights, draft_vocab=self.args.draft_vocab,
                            eagle_checkpoint=self.args.eagle_checkpoint)
        gen = Generator(target, made, SpecSchedule(schedule or default_schedule(name), self.args.k))
        t = time.perf_counter()
        sampling = [SamplingParams(temperature=self.args.temperature, seed=1000 + i) for i in range(len(batch_ids))]
        reqs = gen.generate(batch_ids, new_tokens, sampling, max_batch=max_batch)
        return reqs, time.perf_counter() - t

    def groups_of(self, bs: int) -> list:
        """The prompt groups run at batch size ``bs``."""
        if bs > 1 and self.args.continuous:  # one generation over every prompt, bs slots
            return [self.prompts]
        return [self.prompts[i: i + bs] for i in range(0, len(self.prompts), bs)]


def load_session(args) -> Session:
    """Threads, our model(s), the llama.cpp runner and the prompts."""
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy
    t0 = time.perf_counter()
    model, tok = load_model(args.model, weights=args.weights)
    s = Session(args, model, tok, time.perf_counter() - t0)
    if not args.no_fp32_ar:
        s.fp32_model = model if args.weights == "fp32" else load_model(args.model, weights="fp32")[0]
    if not args.no_llama_cpp:
        from specdec_kernels.models.registry import resolve

        s.llama = _llama_cpp_runner(resolve(args.model), args, model.config.eos_token_ids)
    s.prompts = load_prompts(args.prompts, args.max_prompts, tok, args.categories)
    return s


def warm_up(s: Session) -> None:
    """Warm-up generations of every method, which also sets ``s.methods`` (and loads the
    transformers and llama.cpp speculative runners)."""
    args, first = s.args, s.prompts[0]["ids"]
    warm = args.warmup_tokens if args.warmup_tokens is not None else args.max_new_tokens
    s.ours(None, [first], new_tokens=warm)
    for spec in args.drafters:  # the first generation measures the step cost once (cached per machine)
        s.ours(spec, [first[:8]], new_tokens=warm)
    s.methods = ["ours-ar"] + list(args.drafters)
    if s.fp32_model is not None and s.fp32_model is not s.model:
        s.ours(None, [first], s.fp32_model, new_tokens=warm)
        s.methods = ["fp32-ar"] + s.methods
    if s.llama is not None:
        s.methods = ["llama-cpp-ar"] + s.methods
    if args.llama_bin:
        from bench import llama_cpp_speculative as llama_spec
        from specdec_kernels.models.registry import resolve

        s.llama_spec = llama_spec
        s.spec_binary, s.gguf = llama_spec.binary_path(args.llama_bin), resolve(args.model)
        draft = resolve(args.draft_model) if args.draft_model else None  # its draft-simple runs with this file
        s.draft_gguf = draft if draft and draft.endswith(".gguf") else None
        s.methods = list(llama_spec.methods(s.draft_gguf)) + s.methods
    if not args.no_hf:
        with tempfile.TemporaryDirectory() as d:
            s.hf = HFRunner(s.model, d)
        s.hf.generate(first, 4)
        s.methods = ["hf-ar", "hf-prompt-lookup"] + s.methods


def _run_hf(s: Session, method: str, ids: list, row: dict):
    t = time.perf_counter()
    outs = [s.hf.generate(ids[0], s.args.max_new_tokens,
                          s.args.prompt_lookup_tokens if method == "hf-prompt-lookup" else 0)]
    row["mean_accepted_length"] = None
    return outs, time.perf_counter() - t


def _run_llama_spec(s: Session, method: str, group: list, ids: list, row: dict):
    text = s.tok.apply_chat_template([{"role": "user", "content": group[0]["text"]}])
    res = s.llama_spec.run(s.spec_binary, s.gguf, text, s.args.max_new_tokens, method, threads=s.args.threads,
                           draft_path=s.draft_gguf, temperature=s.args.temperature)
    outs, dt = [s.tok.encode(res["text"])], res["prefill_seconds"] + res["decode_seconds"]
    steps = max(res["tokens"] - res["accepted"], 1)  # each step emits its accepted drafts + 1
    row.update(prefill_tokens=res["prompt_tokens"], prefill_seconds=res["prefill_seconds"],
               decode_forwards=steps, decode_seconds=res["decode_seconds"],
               decode_tokens_per_s=res["tokens"] / max(res["decode_seconds"], 1e-9),
               mean_accepted_length=res["tokens"] / steps, drafted=res["drafted"],
               accepted=res["accepted"], llama_tokens=res["tokens"],
               prompt_tokens_match=res["prompt_tokens"] == len(ids[0]))
    return outs, dt


def _run_llama_ar(s: Session, ids: list, row: dict):
    (res,) = s.llama(ids[0])
    row["mean_accepted_length"] = None
    # llama.cpp's prefill evaluates the whole prompt and yields the first token.
    row.update(prefill_tokens=res["prompt_tokens"], prefill_seconds=res["prefill_seconds"],
               decode_forwards=len(res["output"]) - 1, decode_seconds=res["decode_seconds"])
    return [res["output"]], res["seconds"]


def _run_ours(s: Session, method: str, ids: list, max_batch, row: dict):
    if method == "fp32-ar":
        reqs, dt = s.ours(None, ids, s.fp32_model, max_batch)
    else:
        reqs, dt = s.ours(None if method == "ours-ar" else method, ids, max_batch=max_batch)
    outs = [r.output for r in reqs]
    # Our prefill caches the prompt but its last token, which the first step processes; its
    # time includes the drafter's own prompt work (a draft model's prefill).
    pre = sum(r.stats.time_prefill for r in reqs)
    row.update(prefill_tokens=sum(len(i) - 1 for i in ids), prefill_seconds=pre,
               decode_forwards=sum(len(o) for o in outs), decode_seconds=dt - pre)
    row["mean_accepted_length"] = statistics.mean(r.stats.mean_accepted_length for r in reqs)
    row["stats"] = [r.stats.summary() for r in reqs]
    # Prefill and decode rates apart (tokens_per_s below spans both): the requests'
    # prefills run one after another, their decode steps together.
    row["prefill_tokens_per_s"] = (sum(r.stats.prefill_tokens for r in reqs)
                                   / max(sum(r.stats.time_prefill for r in reqs), 1e-9))
    # Under continuous batching requests decode over different spans: the run's own.
    decode_s = row["decode_seconds"] if max_batch else max(r.stats.total_time for r in reqs)
    row["decode_tokens_per_s"] = sum(len(r.output) for r in reqs) / max(decode_s, 1e-9)
    return outs, dt


def run_one(s: Session, bs: int, rnd: int, group: list, method: str) -> dict:
    """One (batch size, round, prompt group, method) run: its row, ``outputs`` included."""
    ids = [p["ids"] for p in group]
    max_batch = bs if bs > 1 and s.args.continuous else None
    row = {"batch": bs, "method": method, "round": rnd, "continuous": max_batch is not None,
           "ids": [p["id"] for p in group],
           "categories": [p["category"] for p in group]}
    if method.startswith("hf"):
        outs, dt = _run_hf(s, method, ids, row)
    elif s.llama_spec is not None and method in s.llama_spec.methods(s.draft_gguf):
        outs, dt = _run_llama_spec(s, method, group, ids, row)
    elif method == "llama-cpp-ar":
        outs, dt = _run_llama_ar(s, ids, row)
    else:
        outs, dt = _run_ours(s, method, ids, max_batch, row)
    tokens = row.get("llama_tokens", sum(len(o) for o in outs))
    row.update(tokens=tokens, seconds=dt, tokens_per_s=tokens / dt)
    row["outputs"] = outs
    return row


def run_all(s: Session) -> tuple[list, dict]:
    """Every run: (rows, {prompt id: our autoregressive output at the smallest batch})."""
    from tqdm import tqdm

    args, methods = s.args, s.methods
    runs = []  # one row per (batch size, method, group, round)
    total = args.rounds * sum(len(methods if bs == 1 else [m for m in methods if not m.startswith("hf")])
                              * len(s.groups_of(bs)) for bs in args.batch_sizes)
    bar = tqdm(total=total, desc="e2e", unit="run")
    ar_out = {}
    for bs in args.batch_sizes:
        # Methods run back to back on each group, so that the machine's load drifts affect
        # every method of a ratio alike.
        for rnd, group, method in [(rd, g, m) for g in s.groups_of(bs) for rd in range(args.rounds) for m in methods]:
            if bs > 1 and (method.startswith("hf") or method.startswith("llama")):
                continue
            row = run_one(s, bs, rnd, group, method)
            if method == "ours-ar" and bs == min(args.batch_sizes):  # the reference: our AR at the smallest batch
                ar_out.update(zip(row["ids"], row["outputs"]))
            runs.append(row)
            bar.update(1)
    bar.close()
    return runs, ar_out


def _method_summary(bs: int, method: str, rows: list) -> dict:
    """The summary row of one method's runs at batch size ``bs`` (speedups already set)."""
    mal = [r["mean_accepted_length"] for r in rows if r["mean_accepted_length"] is not None]
    timed = [r for r in rows if "decode_seconds" in r]
    phases = {}
    if timed:
        # Generated tokens per second of the decode phase, prompt tokens per second of the prefill.
        phases = {"decode_tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["decode_seconds"] for r in timed),
                  "prefill_tokens_per_s": sum(r["prefill_tokens"] for r in timed)
                  / max(sum(r["prefill_seconds"] for r in timed), 1e-9)}
    decode_ratios = [r["decode_speedup"] for r in rows if "decode_speedup" in r]
    if decode_ratios:
        phases["decode_speedup_vs_ours_ar"] = statistics.mean(decode_ratios)
    return {"batch": bs, "method": method, "continuous": rows[0]["continuous"],
            "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rows),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows), **phases,
            "speedup_vs_ours_ar": statistics.mean(r["speedup"] for r in rows),
            "median_speedup_vs_ours_ar": statistics.median(r["speedup"] for r in rows),
            "mean_accepted_length": statistics.mean(mal) if mal else "",
            "identical": f"{sum(sum(r['identical']) for r in rows)}/{sum(len(r['identical']) for r in rows)}"}


def summarize(batch_sizes: list, methods: list, runs: list, ar_out: dict) -> tuple[list, dict, dict]:
    """Exactness against our autoregressive output at the smallest batch run (batch 1 by
    default; the kernels are batch-invariant, so batch 4 must match it too), speedups per
    prompt/group (set on each run row): (summary rows, {category: {method: [speedup]}},
    the same of decode-phase speedups), categories at batch 1."""
    summary, by_cat, by_cat_decode = [], {}, {}
    for bs in batch_sizes:
        base = {(tuple(r["ids"]), r["round"]): r["tokens_per_s"] for r in runs
                if r["batch"] == bs and r["method"] == "ours-ar"}
        base_decode = {(tuple(r["ids"]), r["round"]): r.get("decode_tokens_per_s") for r in runs
                       if r["batch"] == bs and r["method"] == "ours-ar"}
        for method in methods:
            rows = [r for r in runs if r["batch"] == bs and r["method"] == method]
            if not rows:
                continue
            for r in rows:
                r["identical"] = [o == ar_out.get(i) for o, i in zip(r["outputs"], r["ids"])]
                r["speedup"] = r["tokens_per_s"] / base[(tuple(r["ids"]), r["round"])]
                ar_decode = base_decode[(tuple(r["ids"]), r["round"])]
                if r.get("decode_tokens_per_s") and ar_decode:  # the decode phase alone: what drafts change
                    r["decode_speedup"] = r["decode_tokens_per_s"] / ar_decode
                    if bs == 1:
                        by_cat_decode.setdefault(r["categories"][0], {}).setdefault(method, []).append(
                            r["decode_speedup"])
                if bs == 1:
                    by_cat.setdefault(r["categories"][0], {}).setdefault(method, []).append(r["speedup"])
            summary.append(_method_summary(bs, method, rows))
    return summary, by_cat, by_cat_decode


def print_tables(s: Session, summary: list, by_cat: dict, by_cat_decode: dict) -> tuple[list, list]:
    """The summary and per-category tables: (category rows, decode-phase category rows)."""
    print(f"\nmodel {s.model.name} ({s.model.weight_format} weights, loaded in {s.load_s:.1f}s), {len(s.prompts)} "
          f"prompts, {s.args.max_new_tokens} new tokens, "
          f"{s.args.threads} thread(s); the model uses skinny_linear for "
          f"{skinny_linear_rows(torch.float32)} rows (fp32)")
    print_table(summary, ["batch", "method", "tokens_per_s", "median_tokens_per_s", "decode_tokens_per_s",
                          "prefill_tokens_per_s", "speedup_vs_ours_ar", "median_speedup_vs_ours_ar",
                          "decode_speedup_vs_ours_ar",
                          "mean_accepted_length", "identical"])
    shown = ["category"] + [m for m in s.methods if m != "ours-ar"]
    cat_rows = [{"category": c, **{m: statistics.mean(v) for m, v in ms.items()}} for c, ms in sorted(by_cat.items())]
    print("\nspeedup vs our autoregressive by category (batch 1):")
    print_table(cat_rows, shown)
    cat_decode_rows = [{"category": c, **{m: statistics.mean(v) for m, v in ms.items()}}
                       for c, ms in sorted(by_cat_decode.items())]
    print("\ndecode-phase speedup vs our autoregressive by category (batch 1):")
    print_table(cat_decode_rows, shown)
    return cat_rows, cat_decode_rows


def report_targets(s: Session, summary: list, runs: list) -> dict:
    """The ratios the project aims at (printed with their targets), and whether every greedy
    output equals our autoregressive one."""
    targets = {}
    hf_ar = next((r for r in summary if r["method"] == "hf-ar"), None)
    if hf_ar:
        ours_ar = next(r for r in summary if r["method"] == "ours-ar" and r["batch"] == 1)
        targets["ours_ar_vs_hf_ar"] = ours_ar["tokens_per_s"] / hf_ar["tokens_per_s"]
        print(f"\nours autoregressive / transformers autoregressive: {targets['ours_ar_vs_hf_ar']:.2f}x (target >= 1.5x)")
    best = max((r for r in summary if r["batch"] == 1 and r["method"] in s.args.drafters),
               key=lambda r: r["speedup_vs_ours_ar"], default=None)
    if best:
        targets["best_drafter"] = best["method"]
        targets["best_drafter_speedup"] = best["speedup_vs_ours_ar"]
        # No target printed: the issues' targets depend on the model and the prompts (docs/benchmarks.md).
        decode = best.get("decode_speedup_vs_ours_ar")
        print(f"best drafter at batch 1: {best['method']} {best['speedup_vs_ours_ar']:.2f}x our autoregressive with the "
              "prefills" + (f", {decode:.2f}x in the decode phase" if decode is not None else ""))
    b1 = {r["method"]: r for r in summary if r["batch"] == 1}
    if "fp32-ar" in b1:
        targets["ours_ar_vs_fp32_ar"] = b1["ours-ar"]["tokens_per_s"] / b1["fp32-ar"]["tokens_per_s"]
        print(f"ours autoregressive ({s.model.weight_format}) / ours fp32 autoregressive: "
              f"{targets['ours_ar_vs_fp32_ar']:.2f}x (target >= 3x)")
    if "llama-cpp-ar" in b1:
        targets["ours_ar_vs_llama_cpp_ar"] = b1["ours-ar"]["tokens_per_s"] / b1["llama-cpp-ar"]["tokens_per_s"]
        print(f"ours autoregressive / llama.cpp autoregressive: {targets['ours_ar_vs_llama_cpp_ar']:.2f}x")
        if best:
            targets["best_drafter_vs_llama_cpp_ar"] = b1[best["method"]]["tokens_per_s"] / b1["llama-cpp-ar"]["tokens_per_s"]
            print(f"best drafter / llama.cpp autoregressive: {targets['best_drafter_vs_llama_cpp_ar']:.2f}x (target > 1x)")
    if s.llama_spec is not None:
        targets["llama_spec_by_category"] = llama_spec_targets(runs, s.args.drafters)
        for c, t in targets["llama_spec_by_category"].items():
            print(f"{c}: best drafter {t['best_drafter']} decodes {t['best_drafter_decode_speedup']:.2f}x our "
                  f"autoregressive; {t['best_drafter_vs_best_llama_spec']:.2f}x llama.cpp's best lookup "
                  f"({t['best_llama_spec']}, {t['best_llama_spec_vs_llama_ar']:.2f}x its autoregressive)")
    # fp32 and llama.cpp may differ from ours in a last bit of a near-tie; reported, not counted.
    mismatches = [(r["batch"], r["method"], i) for r in runs for i, ok in zip(r["ids"], r["identical"])
                  if not ok and not r["method"].startswith(("fp32-ar", "llama-"))]
    if s.args.temperature > 0:  # sampled: each method's draws differ; exactness is the sampling tests' (chi-square)
        same = sum(ok for r in runs for ok in r["identical"])
        print(f"sampled at T = {s.args.temperature:g}: {same}/{sum(len(r['identical']) for r in runs)} outputs equal "
              "to ours-ar's (not expected: the methods draw differently)")
        return targets
    targets["all_greedy_identical"] = not mismatches
    print(f"greedy outputs identical to ours-ar: {'all' if not mismatches else f'{len(mismatches)} mismatches: {mismatches[:10]}'}")
    return targets


def main(argv=None, *, prog: str = "bench_e2e.py", default_out_dir: Path = RESULTS_DIR) -> int:
    parser = build_parser(prog, default_out_dir)
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.temperature > 0 and not (args.no_hf and args.no_llama_cpp):
        parser.error("--temperature > 0 needs --no-hf and --no-llama-cpp: those baselines decode greedily "
                     "(llama.cpp's sampled runs come from --llama-bin)")
    if args.out_name is None:
        args.out_name = default_out_name(args.prompts)
    chart_path = Path(args.out_dir) / f"{args.out_name}_speedup.png"

    s = load_session(args)
    warm_up(s)
    runs, ar_out = run_all(s)
    summary, by_cat, by_cat_decode = summarize(args.batch_sizes, s.methods, runs, ar_out)
    cat_rows, cat_decode_rows = print_tables(s, summary, by_cat, by_cat_decode)
    targets = report_targets(s, summary, runs)

    for r in runs:
        r.pop("outputs")
    # The prompt file by name and content hash: a path would name a folder of this machine.
    config = dict(vars(args), prompts=Path(args.prompts).name if args.prompts else None,
                  prompts_sha256=hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest() if args.prompts else None)
    model = s.model
    out = write_results(args.out_name, {"model": model.name, "weights": model.weight_format, "load_seconds": s.load_s,
                                        "load_average": os.getloadavg(), "llama_cpp": getattr(s.llama, "version", None),
                                        "config": config,
                                        "skinny_linear_rows": skinny_linear_rows(torch.float32),
                                        "summary": summary, "by_category": cat_rows, "decode_by_category": cat_decode_rows,
                                        "targets": targets, "runs": runs},
                        out_dir=args.out_dir)
    print(f"wrote {out}")
    if 1 in args.batch_sizes:  # the chart shows batch-1 speedups
        mode = "greedy" if args.temperature == 0 else f"T = {args.temperature:g}"
        write_chart(summary, cat_rows, s.methods, f"{model.name}: {mode}, batch 1, {args.max_new_tokens} new tokens",
                    str(chart_path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
