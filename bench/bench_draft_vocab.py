"""The draft vocabulary of a whole model drafting for its sibling (FR-Spec), chosen by measurement.

  python bench/bench_draft_vocab.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
      --prompts CODE_TASKS.jsonl --max-prompts 8 --threads 1

For each cut Vd (the draft drafts from the Vd tokens most frequent in the Python standard
library's sources, ``draft_model.frequency_ranked_vocab``; "full" = its whole vocabulary):
- ``draft_ms``: one draft token (forward + LM head, 64 cached positions), the cuts measured in
  turn for ``--rounds`` rounds, medians;
- ``agreement``: how often the draft's greedy token equals the target's, teacher-forced on the
  target's own greedy answers to the prompts (the draft's argmax over its cut at every answer
  position, from one pass over prompt + answer): the acceptance of a greedy chain's next token
  given the ones before were accepted;
- ``coverage``: the fraction of answer tokens inside the cut;
- ``chain`` and ``speedup``: the best chain length and its expected tokens per unit time
  against autoregressive decoding (``cost_model.best_chain_length``: the target's step-cost
  curve measured in the same run, the draft token's time over a target step, the agreement).
Results: bench/results/draft_vocab_<prompt file>_<draft>_<its weights>_t<threads>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.bench_e2e import load_prompts  # noqa: E402
from bench.common import add_out_name, print_table, write_results  # noqa: E402
from specdec_kernels.decoding import Generator  # noqa: E402
from specdec_kernels.decoding.cost_model import best_chain_length, draft_token_seconds, step_cost_for  # noqa: E402
from specdec_kernels.decoding.registry import draft_by_name  # noqa: E402
from specdec_kernels.drafting.draft_model.model import (DRAFT_WEIGHTS, corpus_token_counts, frequency_ranked_vocab,
                                                        with_draft_vocab)  # noqa: E402
from specdec_kernels.models import load_model  # noqa: E402
from specdec_kernels.threads import apply_threads  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--weights", default="native-int8act", help="the target's weight format")
    p.add_argument("--draft-weights", default="stored", choices=DRAFT_WEIGHTS,
                   help="the draft's: stored = the target's format, or requantised (as specdec generate's flag)")
    p.add_argument("--prompts", default=None, help="jsonl of prompts or code tasks (as bench_e2e.py reads them)")
    p.add_argument("--max-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64, help="the target's greedy answer per prompt")
    p.add_argument("--cuts", type=int, nargs="+", default=[65536, 32768, 16384])
    p.add_argument("--rounds", type=int, default=5, help="rounds of timing every cut in turn")
    p.add_argument("--max-chain", type=int, default=16)
    p.add_argument("--threads", type=int, required=True, help="torch threads")
    add_out_name(p, "draft_vocab_<prompts>_<draft>_<format>_t<threads>")
    return p.parse_args(argv)


def answers(target, prompts: list, new_tokens: int) -> list:
    """The target's greedy answers: [(prompt ids, answer ids)]."""
    reqs = Generator(target).generate([p["ids"] for p in prompts], new_tokens)
    return [(p["ids"], list(r.output)) for p, r in zip(prompts, reqs)]


def draft_logits(draft, pairs: list) -> list:
    """Per pair, the draft's fp32 logits [len(answer), V] predicting each answer token."""
    out = []
    with torch.inference_mode():
        for prompt, answer in pairs:
            ids = prompt + answer[:-1]
            cache = draft.new_cache(1, len(ids) + 1)
            hidden = draft.prefill(torch.tensor(ids, dtype=torch.int64), cache, cache.add_request(len(ids)))
            out.append(draft.logits(hidden[len(prompt) - 1:]))
    return out


def agreement(logits: list, pairs: list, vocab: torch.Tensor | None) -> tuple[float, float]:
    """(greedy agreement, coverage) of the draft restricted to ``vocab`` (None: all)."""
    hits = inside = total = 0
    for lg, (_, answer) in zip(logits, pairs):
        want = torch.tensor(answer)
        pick = lg.argmax(-1) if vocab is None else vocab[lg[:, vocab].argmax(-1)]
        hits += int((pick == want).sum())
        inside += len(answer) if vocab is None else int(torch.isin(want, vocab).sum())
        total += len(answer)
    return hits / total, inside / total


def time_drafts(drafts: dict, rounds: int) -> dict:
    """{cut: median seconds of one draft token}, the cuts timed in turn each round."""
    times = {k: [] for k in drafts}
    for _ in tqdm(range(rounds), desc="timing draft tokens"):
        for k, d in drafts.items():
            times[k].append(draft_token_seconds(d, repeats=5))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = apply_threads(args.threads)
    target, tok = load_model(args.target, weights=args.weights)
    draft = draft_by_name(target, args.draft, args.draft_weights, draft_vocab=0)  # as the CLI loads it
    prompts = load_prompts(args.prompts, args.max_prompts, tok)
    print(f"{len(prompts)} prompts; target answers ({args.new_tokens} tokens each) ...")
    pairs = answers(target, prompts, args.new_tokens)
    counts = corpus_token_counts(tok, draft.config.vocab_size)  # the draft shares the target's vocabulary
    vocabs = {"full": None}
    vocabs.update({n: frequency_ranked_vocab(counts, n, always=tok.eos_token_ids) for n in args.cuts
                   if n < draft.config.vocab_size})
    drafts = {k: draft if v is None else with_draft_vocab(draft, v) for k, v in vocabs.items()}
    logits = draft_logits(draft, pairs)
    seconds = time_drafts(drafts, args.rounds)
    cost = step_cost_for(target, recalibrate=True)  # measured in this run, as the draft tokens are
    t_step = cost.seconds(1)
    rows = []
    for k, v in vocabs.items():
        agree, cover = agreement(logits, pairs, v)
        rel = seconds[k] / t_step
        chain, value = best_chain_length(agree, args.max_chain, cost, draft_cost=rel)
        rows.append({"cut": k, "draft_ms": seconds[k] * 1e3, "draft_over_target_step": rel, "agreement": agree,
                     "coverage": cover, "chain": chain, "speedup": value})
    print(f"\ntarget step {t_step * 1e3:.1f} ms ({threads.describe()}); draft {args.draft} ({draft.weight_format})")
    print_table(rows, ["cut", "draft_ms", "draft_over_target_step", "agreement", "coverage", "chain", "speedup"])
    stem = Path(args.prompts).stem if args.prompts else "prompts"
    path = write_results(args.out_name or f"draft_vocab_{stem}_{args.draft}_{draft.weight_format}_t{threads.threads}", {
        "command": " ".join(["python", "bench/bench_draft_vocab.py"] + (argv or sys.argv[1:])),
        "target": args.target, "draft": args.draft, "weights": args.weights, "draft_weights": draft.weight_format,
        "prompts": [p["id"] for p in prompts],
        "answer_tokens": sum(len(a) for _, a in pairs), "target_step_ms": t_step * 1e3,
        "step_cost": {str(b): pts for b, pts in cost.table.items()}, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
