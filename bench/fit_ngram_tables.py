"""Measure the prompt-lookup acceptance tables of ``NgramTreeDrafter`` for one model.

The tree drafter rates a lookup continuation's i-th token as accepted with probability
``FIRST[m] * RANK[rank] * NEXT[m] ** (i - 1)`` (m: how many tokens the match agrees on
backwards, rank: its place among the matches of that length, 0 = the most recent). Those
rates depend on the model — how much of its input it copies, how it loops — so they are
measured per model, on its own greedy outputs:

1. greedy outputs of the model (our autoregressive loop) on a few prompts of ``--prompts``
   (rows after ``--skip-rows``, so that the benchmark's first rows stay held out), kept in
   ``bench/results/ngram_outputs_<model>.json`` (``--reuse`` refits from them; not committed:
   they copy the prompts, and the prompt files stay out of the project);
2. at every output position, the drafter's own matches (``NgramTreeDrafter.matches``) of
   the tokens so far, each scored against the tokens the model went on to emit: FIRST[m]
   the rate at which the most recent match of length m predicts the next token, NEXT[m]
   the rate at which a continuation's next token is right given the ones before it were,
   RANK[r] the first-token rate of the r-th match over the most recent one's (pooled over
   m); each rate a Beta-smoothed count (``--prior`` pseudo-counts of the current tables);
3. weak matches' rates are then shrunk (one factor for the lengths below ``--long``)
   by simulating the drafter on the same outputs with the model's measured step-cost
   curve: several short matches agreeing are one piece of evidence, not independent ones,
   so their noisy-or overrates the node. The factor that maximises the simulated
   tokens per unit of step cost is kept (the raw and shrunk simulations are both recorded).

Writes the model's entry of ``specdec_kernels/data/ngram_tables.json`` (other models'
entries are kept), with the counts, the prompts file's hash and the simulation.

4. ``--openings-only``, a run of its own: the answers' openings (their first
   ``--opening-tokens`` tokens, keyed by the prompt's last ``--opening-key`` tokens: the chat
   template's assistant header and the user's last token), counted into the entry's
   ``openings``, which the drafter drafts at an answer's start, where nothing in the prompt
   matches yet (``NgramTreeDrafter.opening_tries``). It measures them from outputs that long,
   each prompt as it is and with a newline after its text (the two end in different tokens),
   and keeps the entry's tables; a fit of the tables keeps the entry's openings.

    python bench/fit_ngram_tables.py --model qwen2.5-coder-1.5b --prompts CODE_TASKS.jsonl --threads 1
    python bench/fit_ngram_tables.py --model qwen2.5-coder-1.5b --prompts CODE_TASKS.jsonl --openings-only \
        --max-prompts 40 --max-new-tokens 8 --threads 2 --overwrite
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402  (loads libtorch before the extension)

from bench.common import RESULTS_DIR  # noqa: E402
from specdec_kernels.decoding.cost_model import StepCost  # noqa: E402
from specdec_kernels.models.registry import WEIGHT_FORMATS  # noqa: E402
from specdec_kernels.drafting.ngram import NGRAM_TABLES_PATH, NgramTables, NgramTreeDrafter, ngram_tables_for

RANKS = 4  # RANK entries: ranks 0..RANKS-1 (the last pools the rest)
SHRINKS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)


def held_out_prompts(prompts: list, skip_rows: int, max_prompts: int) -> list:
    """The first ``max_prompts`` of ``prompts`` (``load_prompts``'s, in file order) from rows
    ``skip_rows`` on: rows of the file, whether a row gives one prompt (Spec-Bench) or two (a
    code task's completion and edit)."""
    return [p for p in prompts if p["row"] >= skip_rows][:max_prompts]


def greedy_outputs(args, path: Path) -> dict:
    """{"model", "threads", "step_cost", "prompts_sha256", "sequences": [{id, category, prompt, output}]},
    written to ``path`` after each prompt (a slow run can be refit with --reuse before it ends)."""
    from bench.bench_e2e import load_prompts
    from specdec_kernels.decoding import Generator, SpecSchedule, make_drafter
    from specdec_kernels.decoding.cost_model import step_cost_for
    from specdec_kernels.models import load_model
    from specdec_kernels.threads import apply_threads

    threads = apply_threads(args.threads).threads
    model, tok = load_model(args.model, weights=args.weights)
    prompts = held_out_prompts(load_prompts(args.prompts, 0, tok), args.skip_rows, args.max_prompts)
    if args.openings_only:  # a prompt's text ends as typed, with or without a newline: both keys
        prompts += [dict(p, id=f"{p['id']}+newline", ids=tok.chat_prompt(p["text"] + "\n")) for p in prompts]
    cost = step_cost_for(model)
    seqs = []
    data = {"model": model.name, "registry_name": args.model, "weights": model.weight_format, "threads": threads,
            "max_new_tokens": args.max_new_tokens, "prompts": Path(args.prompts).name,
            "prompts_sha256": hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest(),
            "skip_rows": args.skip_rows, "step_cost": cost.to_json(), "sequences": seqs}
    for p in prompts:
        t = time.perf_counter()
        # Greedy speculative output is the autoregressive output (tests/test_decoding.py), only sooner.
        gen = Generator(model, make_drafter("ngram-tree", model), SpecSchedule("max"))
        out = gen.generate([p["ids"]], args.max_new_tokens)[0].output
        print(f"{p['id']}: {len(out)} tokens in {time.perf_counter() - t:.1f} s", flush=True)
        seqs.append({"id": p["id"], "category": p["category"], "prompt": p["ids"], "output": out})
        path.write_text(json.dumps(data) + "\n")
    return data


def count_matches(seqs: list, max_ngram: int, depth: int) -> dict:
    """Counts over every output position of every sequence: first[m] = [hits, tries] of the
    most recent match of length m (1..max_ngram), next[m] = [hits, tries] of a continuation
    token given the ones before it were right (up to ``depth`` tokens), rank[r] = [hits,
    tries, expected hits at the rank-0 rate of its m]."""
    probe = NgramTreeDrafter(max_ngram=max_ngram, max_matches=64)
    first = np.zeros((max_ngram + 1, 2))
    nxt = np.zeros((max_ngram + 1, 2))
    rank_obs = []  # (m, rank, hit)
    for s in seqs:
        tokens = np.asarray(s["prompt"] + s["output"], dtype=np.int64)
        for t in range(len(s["prompt"]) - 1, len(tokens) - 1):  # the root is tokens[t]
            ends, lengths = probe.matches(tokens[: t + 1])
            future = tokens[t + 1:]
            prev_m, rank = 0, 0
            for e, m in zip(ends.tolist(), lengths.tolist()):
                rank = rank + 1 if m == prev_m else 0
                prev_m = m
                cont = tokens[e + 1: min(e + 1 + depth, t + 1)]
                hit = bool(cont[0] == future[0])
                rank_obs.append((m, min(rank, RANKS - 1), hit))
                if rank == 0:
                    first[m] += (hit, 1)
                    for i in range(1, min(len(cont), len(future))):
                        if cont[i - 1] != future[i - 1]:
                            break
                        nxt[m] += (cont[i] == future[i], 1)
    rate0 = (first[:, 0] + 0.5) / (first[:, 1] + 1.0)
    rank = np.zeros((RANKS, 3))
    for m, r, hit in rank_obs:
        rank[r] += (hit, 1, rate0[m])
    return {"first": first[1:].tolist(), "next": nxt[1:].tolist(), "rank": rank.tolist()}


def tables_from_counts(counts: dict, prior: NgramTables, strength: float) -> NgramTables:
    """Beta-smoothed rates: (hits + strength * prior rate) / (tries + strength), the prior the
    current tables' entry for the same bin (the drafter's rule: past its end, its last one)."""
    def rate(hits, tries, table, i):
        p = table[min(i, len(table) - 1)]
        return (hits + strength * p) / (tries + strength) if tries + strength > 0 else p

    first = [rate(h, n, prior.first, i) for i, (h, n) in enumerate(counts["first"])]
    nxt = [rate(h, n, prior.next, i) for i, (h, n) in enumerate(counts["next"])]
    rank = [1.0] + [min(1.0, rate(h, e, prior.rank, r)) for r, (h, _, e) in enumerate(counts["rank"]) if r > 0]
    return NgramTables(tuple(round(x, 3) for x in first), tuple(round(x, 3) for x in nxt),
                       tuple(round(x, 3) for x in rank))


def simulate(tables: NgramTables, seqs: list, cost: StepCost, max_k: int = 16, max_nodes: int = 16) -> dict:
    """The drafter with ``tables`` run over the recorded greedy outputs (the target's answer
    to any draft is known: the next recorded tokens): emitted tokens per unit of step cost
    (cost 1 = a one-row step; autoregressive decoding scores 1.0), and the mean accepted
    length (tokens per step)."""
    drafter = NgramTreeDrafter(max_ngram=len(tables.first), max_k=max_k, max_nodes=max_nodes, step_cost=cost,
                               tables=tables)
    tokens = steps = 0
    total_cost = 0.0
    for rid, s in enumerate(seqs):
        req = SimpleNamespace(rid=rid, tokens=list(s["prompt"]))
        drafter.admit(None, [req])
        target = s["prompt"] + s["output"]
        while len(req.tokens) < len(target):
            (draft,) = drafter.propose(None, [req], [max_k])
            future = target[len(req.tokens):]
            children: dict = {}
            for i in range(1, len(draft.parents)):
                children.setdefault(draft.parents[i], {})[draft.tokens[i]] = i
            node, acc = 0, 0
            while acc < len(future) - 1 and future[acc] in children.get(node, {}):
                node = children[node][future[acc]]
                acc += 1
            req.tokens += future[: acc + 1]
            drafter.verified(None, [req], [acc])
            total_cost += cost(len(draft.tokens), 1)
            tokens += acc + 1
            steps += 1
        drafter.finish(None, req)
    return {"tokens_per_cost": tokens / total_cost, "mean_accepted_length": tokens / steps, "steps": steps}


def shrink(tables: NgramTables, factor: float, long: int) -> NgramTables:
    first = tuple(round(f * factor, 3) if m < long else f for m, f in enumerate(tables.first, 1))
    return NgramTables(first, tables.next, tables.rank)


def openings_from(seqs: list, key_tokens: int, opening_tokens: int, min_count: int = 3) -> list:
    """[[key, opening, count]]: how many outputs after a prompt ending in ``key`` (its last
    ``key_tokens``) began with ``opening``: each output's first ``opening_tokens`` tokens, cut
    where fewer than ``min_count`` outputs after the same key share them (an answer's own
    words — a function's name — are no opening, and stay out of the tables), most common first."""
    answers = [(tuple(s["prompt"][-key_tokens:]), tuple(s["output"][:opening_tokens]))
               for s in seqs if len(s["prompt"]) >= key_tokens and s["output"]]
    shared: dict = {}
    for key, opening in answers:
        for d in range(1, len(opening) + 1):
            shared[key, opening[:d]] = shared.get((key, opening[:d]), 0) + 1
    counts: dict = {}
    for key, opening in answers:
        d = len(opening)
        while d > 0 and shared[key, opening[:d]] < min_count:
            d -= 1
        if d:
            counts[key, opening[:d]] = counts.get((key, opening[:d]), 0) + 1
    return [[list(key), list(opening), n] for (key, opening), n in sorted(counts.items(), key=lambda kv: -kv[1])]


def update_openings(entry: dict, data: dict, args) -> dict:
    """``entry`` with the openings of ``data``'s outputs and where they came from."""
    seqs = data["sequences"]
    entry = dict(entry, openings=openings_from(seqs, args.opening_key, args.opening_tokens, args.opening_min_count))
    entry["openings_source"] = (f"bench/fit_ngram_tables.py: the first {args.opening_tokens} tokens of the greedy "
                                f"outputs of {data['model']} ({data['weights']} weights) to {len(seqs)} prompts of "
                                f"{data['prompts']} after row {data['skip_rows']}, keyed by the prompt's last "
                                f"{args.opening_key} tokens, cut where fewer than {args.opening_min_count} "
                                "outputs share them")
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="registered name, .gguf file or HF checkpoint folder")
    p.add_argument("--prompts", required=True, help="jsonl of prompts (bench_e2e's --prompts formats)")
    p.add_argument("--skip-rows", type=int, default=40, help="rows of the file left for the benchmark")
    p.add_argument("--max-prompts", type=int, default=12, help="prompts whose greedy outputs are measured")
    p.add_argument("--weights", default="native", choices=WEIGHT_FORMATS,
                   help="the model's weight format, as for specdec generate: the step-cost curve the shrink is "
                        "fitted against is this format's (native-int8act for the benchmarks' runs)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the cores not busy)")
    p.add_argument("--max-ngram", type=int, default=8, help="match lengths measured (the table's bins)")
    p.add_argument("--long", type=int, default=6, help="matches shorter than this get the fitted shrink")
    p.add_argument("--prior", type=float, default=4.0, help="pseudo-counts of the current tables per rate")
    p.add_argument("--key", default=None, help="the tables' key (default: --model)")
    p.add_argument("--reuse", action="store_true", help="refit from the saved greedy outputs")
    p.add_argument("--out", default=str(NGRAM_TABLES_PATH), help="tables file to update")
    p.add_argument("--overwrite", action="store_true", help="replace the key's entry if the file has one")
    p.add_argument("--opening-tokens", type=int, default=8, help="tokens of each answer's opening counted")
    p.add_argument("--opening-key", type=int, default=6,
                   help="the prompt's last tokens an opening is keyed by (the chat template's assistant header, "
                        "5 tokens for Qwen2.5's, and the user's last token)")
    p.add_argument("--opening-min-count", type=int, default=3,
                   help="an opening is cut where fewer outputs than this share it")
    p.add_argument("--openings-only", action="store_true",
                   help="measure the answer openings alone and keep the entry's tables")
    args = p.parse_args(argv)
    key = args.key or args.model
    out = Path(args.out)
    tables = json.loads(out.read_text()) if out.exists() else {}
    if not args.overwrite and key in tables:
        p.error(f"{out} already has tables for {key!r}: pass --overwrite to replace them, or --out / --key")
    if args.openings_only and key not in tables:
        p.error(f"--openings-only keeps the tables of {key!r}, which {out} does not have: fit them first")
    outputs_path = RESULTS_DIR / f"ngram_{'openings' if args.openings_only else 'outputs'}_{key}.json"
    if args.reuse:
        data = json.loads(outputs_path.read_text())
    else:
        data = greedy_outputs(args, outputs_path)
        print(f"wrote {outputs_path}")
    if args.openings_only:
        tables[key] = update_openings(tables[key], data, args)
        out.write_text(json.dumps(tables, indent=1) + "\n")
        print(f"{len(tables[key]['openings'])} openings; wrote {out}")
        return 0
    seqs, cost = data["sequences"], StepCost.from_json(data["step_cost"])
    prior = ngram_tables_for(key) or NgramTables(NgramTreeDrafter.FIRST, NgramTreeDrafter.NEXT, NgramTreeDrafter.RANK)
    counts = count_matches(seqs, args.max_ngram, depth=16)
    raw = tables_from_counts(counts, prior, args.prior)
    trials = {str(f): simulate(shrink(raw, f, args.long), seqs, cost) for f in SHRINKS}
    best = max(SHRINKS, key=lambda f: trials[str(f)]["tokens_per_cost"])
    fitted = shrink(raw, best, args.long)
    by_category = {c: {"raw": simulate(raw, [s for s in seqs if s["category"] == c], cost),
                       "fitted": simulate(fitted, [s for s in seqs if s["category"] == c], cost)}
                   for c in sorted({s["category"] for s in seqs})}
    entry = {"first": list(fitted.first), "next": list(fitted.next), "rank": list(fitted.rank),
             "source": (f"bench/fit_ngram_tables.py: greedy outputs of {data['model']} ({data['weights']} weights), "
                        f"{len(seqs)} prompts of {data['prompts']} after row {data['skip_rows']}, "
                        f"{data['max_new_tokens']} new tokens; short matches (m < {args.long}) shrunk x{best} by "
                        "simulation against the model's step-cost curve"),
             "prompts_sha256": data["prompts_sha256"], "counts": counts,
             "raw": {"first": list(raw.first), "next": list(raw.next), "rank": list(raw.rank)},
             "shrink": best, "simulated": trials, "simulated_by_category": by_category,
             "step_cost": data["step_cost"], "made": time.strftime("%Y-%m-%d", time.gmtime())}
    kept = {k: tables[key][k] for k in ("openings", "openings_source") if k in tables.get(key, {})}
    tables[key] = dict(entry, **kept)
    out.write_text(json.dumps(tables, indent=1) + "\n")
    print(json.dumps({k: entry[k] for k in ("first", "next", "rank", "shrink")}))
    for f, r in trials.items():
        print(f"shrink {f}: {r['tokens_per_cost']:.3f} tokens per step cost, mean accepted {r['mean_accepted_length']:.2f}")
    print(json.dumps(by_category, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
