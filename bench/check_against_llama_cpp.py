"""Next-token agreement with llama.cpp on the same GGUF file: teacher-forced, and greedy generation.

  LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin \\
      python bench/check_against_llama_cpp.py --model qwen2.5-coder-1.5b --tokens 2048 --threads 2 \\
      [--prompts FILE.jsonl --max-prompts 10 --new-tokens 64]

Teacher-forced: the text is real code and prose found on this machine (the Python standard
library's sources, PSF licence: ``textwrap``, ``json.decoder``, ``heapq`` and their
docstrings), tokenised once by our tokenizer; both sides run the same token ids in one causal
pass (ours: one prefill; llama.cpp: ``llama_cpp.Llama(logits_all=True).eval``) and their top-1
next tokens are compared at every position. Also reports the largest logit difference and how
often the disagreements fall where llama.cpp's own two best logits are within ``--close`` of
each other (a rounding tie, not an error). ``--no-teacher-forced`` skips it.

Greedy (with ``--prompts``, a jsonl read as bench/bench_e2e.py reads it: code-task rows give a
"completion" and an "edit" prompt each): every prompt goes through our tokenizer's chat
template and the same token ids go to both sides, each generating ``--new-tokens`` tokens
greedily with its own KV cache, stopping at EOS (ours: prefill, then one decode step a token,
no drafter; llama.cpp: ``eval`` of the prompt, then of each chosen token, argmax of its logits).
The outputs should agree until the first step where llama.cpp's two best logits are within
``--close``. Reports per prompt how many generated tokens match before the first divergence
and, there, both sides' gaps between their two best logits; and how many prompts match fully,
diverge at a llama.cpp tie (our pick within ``--close`` of its best logit there) or diverge
elsewhere (a real disagreement).

Needs ``llama-cpp-python`` (its library may be an own build of llama.cpp:
``LLAMA_CPP_LIB_PATH``). Results: bench/results/llama_cpp_agreement_<model>_<weights>.json
(greedy under "greedy", with its own "command"; a part not run this time is kept from that
file as it was).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import add_out_name, RESULTS_DIR, print_table, write_results  # noqa: E402


def corpus_text() -> str:
    import heapq
    import json.decoder
    import textwrap

    return "\n\n".join(inspect.getsource(m) for m in (textwrap, json.decoder, heapq))


def our_logits(model, ids: list[int]) -> np.ndarray:
    """fp32 [S, V] next-token logits of one causal pass over ``ids``."""
    cache = model.new_cache(1, len(ids) + 1)
    hidden = model.prefill(torch.tensor(ids, dtype=torch.int64), cache, cache.add_request(len(ids)))
    return torch.cat([model.logits(h) for h in hidden.split(256)]).numpy()


def llama_cpp_logits(path: str, ids: list[int], threads: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, logits_all=True,
                verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def top2_gap(row: np.ndarray) -> float:
    """The gap between the two largest values of ``row``."""
    a, b = np.partition(row, -2)[-2:]
    return float(abs(b - a))


def teacher_forced(ours: np.ndarray, theirs: np.ndarray, close: float) -> dict:
    """Top-1 agreement and logit differences of two [S, V] logit arrays over the same ids."""
    agree = ours.argmax(-1) == theirs.argmax(-1)
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    tie = (top2[:, 1] - top2[:, 0]) < close
    diff = np.abs(ours - theirs)
    return {"tokens": len(ours), "top1_agreement": float(agree.mean()), "disagreements": int((~agree).sum()),
            "disagreements_at_llama_cpp_ties": int((~agree & tie).sum()),
            "max_abs_logit_diff": float(diff.max()),
            "max_abs_logit_diff_position": int(diff.max(-1).argmax()),
            "max_abs_logit_diff_past_position_0": float(diff[1:].max()),
            "mean_abs_logit_diff": float(diff.mean())}


# ---- greedy generation -------------------------------------------------------------------
def our_greedy(model, ids: list[int], new_tokens: int, eos: set) -> np.ndarray:
    """fp32 [n, V] logits of each step of our greedy decoding of ``ids`` (the argmax of each row
    is the token generated; n < ``new_tokens`` when it stops at EOS). As the Generator runs
    it without a drafter: the prompt but its last token is prefilled, then one token a step."""
    from specdec_kernels.models.llama import Batch

    cache = model.new_cache(1, len(ids) + new_tokens + 1)
    slot = cache.add_request(len(ids) + new_tokens)
    model.prefill(torch.tensor(ids[:-1], dtype=torch.int64), cache, slot)
    rows, tok = [], ids[-1]
    with torch.inference_mode():
        while len(rows) < new_tokens:
            pos = cache.length(slot)
            new = cache.append_slots([slot], [1])
            block_table, prefix_lens = cache.batch_view([slot])
            batch = Batch(block_table, prefix_lens, new.qo_indptr, new.slot_mapping)
            hidden = model.forward(torch.tensor([tok]), torch.tensor([pos]), cache, batch)
            cache.commit([slot], [1])
            rows.append(model.logits(hidden)[0].numpy())
            tok = int(rows[-1].argmax())
            if tok in eos:
                break
    return np.stack(rows)


def llama_cpp_greedy(llm, ids: list[int], new_tokens: int, eos: set) -> np.ndarray:
    """[n, V] logits of each step of llama.cpp's greedy decoding of ``ids`` (as :func:`our_greedy`):
    the prompt in one ``eval``, then each chosen token, with its own KV cache."""
    llm.reset()
    llm.eval(ids)
    rows = []
    while True:
        rows.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
        tok = int(rows[-1].argmax())
        if tok in eos or len(rows) >= new_tokens:
            return np.stack(rows)
        llm.eval([tok])


def compare_greedy(ours: np.ndarray, theirs: np.ndarray, close: float) -> dict:
    """One prompt's two greedy runs (per-step logits): tokens matching before the first
    divergence and, there, each side's token and gap between its two best logits."""
    a, b = ours.argmax(-1), theirs.argmax(-1)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    matched = int(differ[0]) if len(differ) else n
    gaps = [top2_gap(r) for r in theirs[:matched]]  # llama.cpp's at the steps both agree on
    row = {"generated": [len(a), len(b)], "matched": matched, "full_match": not len(differ),
           "llama_cpp_ties_before": sum(g < close for g in gaps),
           # How near a tie the matched steps came: llama.cpp's smallest gap there, and where.
           "llama_cpp_min_gap": min(gaps, default=None),
           "llama_cpp_min_gap_step": int(np.argmin(gaps)) if gaps else None,
           "ours": a.tolist(), "llama_cpp": b.tolist()}
    if len(differ):
        i, ta, tb = int(differ[0]), int(a[differ[0]]), int(b[differ[0]])
        deficit = float(theirs[i, tb] - theirs[i, ta])  # how far below llama.cpp's best our pick is there
        row.update(our_token=ta, llama_cpp_token=tb, llama_cpp_gap=top2_gap(theirs[i]), our_gap=top2_gap(ours[i]),
                   llama_cpp_gap_within_close=top2_gap(theirs[i]) < close,
                   llama_cpp_deficit_of_our_token=deficit,
                   our_deficit_of_llama_cpp_token=float(ours[i, ta] - ours[i, tb]),
                   # A tie: llama.cpp's two best are within --close and our pick is one of them
                   # (not a third token below a close pair).
                   llama_cpp_tie=deficit < close)
    return row


def greedy_summary(prompts: list[dict], rows: list[dict], args) -> dict:
    """The "greedy" part of the results: settings, per-prompt rows and counts."""
    diverged = [r for r in rows if not r["full_match"]]
    return {"prompts_file": os.path.basename(args.prompts), "prompts": len(rows), "new_tokens": args.new_tokens,
            "close": args.close,
            "full_matches": len(rows) - len(diverged),
            "diverged_at_llama_cpp_tie": sum(r["llama_cpp_tie"] for r in diverged),
            "diverged_not_at_tie": sum(not r["llama_cpp_tie"] for r in diverged),
            "matched_tokens": sum(r["matched"] for r in rows),
            "llama_cpp_min_gap": min((r["llama_cpp_min_gap"] for r in rows if r["matched"]), default=None),
            "command": command(sys.argv[1:]),
            "per_prompt": [{"id": p["id"], "prompt_tokens": len(p["ids"]), **r} for p, r in zip(prompts, rows)]}


def print_greedy(greedy: dict) -> None:
    table = [{"prompt": r["id"], "prompt_tok": r["prompt_tokens"], "generated": "/".join(map(str, r["generated"])),
              "matched": r["matched"], "min_llama_gap_matched": r["llama_cpp_min_gap"],
              "llama_gap": r.get("llama_cpp_gap", "-"), "tie": r.get("llama_cpp_tie", "-"),
              "our_gap": r.get("our_gap", "-")} for r in greedy["per_prompt"]]
    print_table(table, ["prompt", "prompt_tok", "generated", "matched", "min_llama_gap_matched", "llama_gap", "tie",
                        "our_gap"])
    print(f"full matches {greedy['full_matches']}/{greedy['prompts']}, diverged at a llama.cpp tie "
          f"{greedy['diverged_at_llama_cpp_tie']}, diverged elsewhere {greedy['diverged_not_at_tie']}; "
          f"llama.cpp's smallest gap on matched steps {greedy['llama_cpp_min_gap']}")


# ---- main --------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weights", default="native-int8act")
    p.add_argument("--tokens", type=int, default=2048, help="teacher-forced tokens (default 2048)")
    p.add_argument("--no-teacher-forced", action="store_true", help="skip the teacher-forced comparison")
    p.add_argument("--prompts", default=None,
                   help="jsonl of prompts for the greedy comparison ({prompt}, Spec-Bench {turns} or code-task "
                        "{task_id, prompt, canonical_solution, entry_point} rows, as bench_e2e.py reads them); "
                        "default: no greedy comparison")
    p.add_argument("--max-prompts", type=int, default=10, help="greedy: prompts used (default 10)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy: tokens generated per prompt (default 64)")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--close", type=float, default=0.05, help="logit gap counted as a tie (default 0.05)")
    add_out_name(p, "llama_cpp_agreement_<model>_<weights>")
    return p.parse_args(argv)


def command(argv: list[str]) -> str:
    """The command line, the prompts file by its name only (not where it lies on this machine)."""
    argv = [os.path.basename(a) if i and argv[i - 1] == "--prompts" else a for i, a in enumerate(argv)]
    return " ".join(["python", "bench/check_against_llama_cpp.py"] + argv)


def greedy_against_llama_cpp(path: str, prompts: list[dict], ours: list[np.ndarray], eos: set, args) -> dict:
    """llama.cpp's greedy runs of ``prompts`` compared with ours (:func:`compare_greedy`)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=max(len(p["ids"]) for p in prompts) + args.new_tokens + 8, n_batch=512,
                n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
    rows = []
    for i, (p, mine) in enumerate(zip(prompts, ours)):
        print(f"greedy, prompt {i + 1}/{len(prompts)}: llama.cpp ...", file=sys.stderr)
        rows.append(compare_greedy(mine, llama_cpp_greedy(llm, p["ids"], args.new_tokens, eos), args.close))
    return greedy_summary(prompts, rows, args)


def previous_results(name: str) -> dict:
    """bench/results/<name>.json as it is (its machine info left out), or {}."""
    path = RESULTS_DIR / f"{name}.json"
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "machine"} if path.exists() else {}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)

    import llama_cpp

    from bench.bench_e2e import load_prompts
    from specdec_kernels.models import load_model
    from specdec_kernels.models.registry import resolve

    path = resolve(args.model)
    print(f"loading {args.model} ({args.weights}) ...", file=sys.stderr)
    model, tok = load_model(path, weights=args.weights)
    eos = set(model.config.eos_token_ids)
    if not args.no_teacher_forced:
        ids = tok.encode(corpus_text())[:args.tokens]
        print(f"teacher-forced, {len(ids)} tokens: ours ...", file=sys.stderr)
        ours_tf = our_logits(model, ids)
    prompts = load_prompts(args.prompts, args.max_prompts, tok) if args.prompts else []
    ours_greedy = []
    for i, p in enumerate(prompts):
        print(f"greedy, prompt {i + 1}/{len(prompts)} ({len(p['ids'])} tokens): ours ...", file=sys.stderr)
        ours_greedy.append(our_greedy(model, p["ids"], args.new_tokens, eos))
    del model

    name = f"llama_cpp_agreement_{Path(str(args.model)).name.removesuffix('.gguf')}_{args.weights}"
    result = previous_results(name)
    result.update(model=args.model, weights=args.weights, llama_cpp_version=llama_cpp.__version__)
    if not args.no_teacher_forced:
        print("teacher-forced: llama.cpp ...", file=sys.stderr)
        result.update(teacher_forced(ours_tf, llama_cpp_logits(path, ids, args.threads), args.close))
        result["command"] = command(sys.argv[1:])
        print({k: v for k, v in result.items() if k != "greedy"})
    if prompts:
        result["greedy"] = greedy_against_llama_cpp(path, prompts, ours_greedy, eos, args)
        print_greedy(result["greedy"])
    print(f"wrote {write_results(args.out_name or name, result)}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
