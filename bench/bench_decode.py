"""Autoregressive decode and prompt processing: ours against llama.cpp's ``llama-bench`` on the
same GGUF file, in the same run, at each thread count.

  python bench/bench_decode.py --model qwen2.5-coder-1.5b --llama-bench /path/to/llama-bench --threads 1 2

Ours: ``Generator`` with no drafter on a prompt of ``--prompt-tokens`` tokens (the prefill rate:
prompt tokens per second of the prefill forward) generating ``--new-tokens`` tokens (the decode
rate: tokens per second of the decode steps, prefill excluded, as llama.cpp reports ``tg``),
median over ``--rounds`` rounds, on each decode-step path (``fused``: the layer stack in one C++
call, ``python``: the Python layers, the reference; ``models.decoder_step``). llama.cpp:
``llama-bench -p P -n N -t T -r R -o json`` (``pp`` and ``tg`` averages). They alternate within
each round's thread count so that all see the same machine load.

The per-step breakdown (``step_ms``, per path): one decode step (one row, forward + LM head,
``--prompt-tokens`` in the cache), the time inside its weight products (``products_ms``) and
its attention (``attention_ms``: ``tree_attention``), measured within each fused step by the
C++ stack's timers; ``rest_ms`` = step - products - attention is the fixed cost (the Python
path runs the same kernels: its rest is its step minus the same products and attention).
Where the CPU has AMX, each round also runs ours with the AMX path off (AVX-512 VNNI, the same
bits: ``no_amx_*``, ``amx_prefill_speedup``).
Results: bench/results/decode_<model>.json (decode_<model>_p<P>.json for another --prompt-tokens).
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
from bench.common import add_out_name, print_table, time_fn, write_results  # noqa: E402


def ours(model, prompt_tokens: int, new_tokens: int, path: str) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one generation on a fixed pseudo-random prompt,
    with the decode step on ``path``."""
    from specdec_kernels.decoding import Generator

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (prompt_tokens + 1,), generator=g).tolist()
    saved, model.step_path = model.step_path, path
    try:
        req = Generator(model).generate([prompt], new_tokens, stop_at_eos=False)[0]
    finally:
        model.step_path = saved
    return req.stats.prefill_tokens_per_s, req.stats.decode_tokens_per_s


def step_breakdown(model, context: int, reps: int = 15) -> dict:
    """One decode step (one row, ``Llama.decode_logits``: the cache's bookkeeping, the layers,
    the final norm and the LM head) on each path, medians over ``reps`` steps (ms). On the
    fused path each step is split by the stack's own timers (the wall time inside its products,
    the LM head's included, and its attention kernel; the rest's own arithmetic — norms, RoPE
    with the K/V write, SiLU, residuals — timed too), so the rest is measured within the same
    step; the Python path runs the same kernels, so its rest is its step minus the fused path's
    products and attention."""
    import time

    cache = model.new_cache(1, context + 3 * reps + 16)
    slot = cache.add_request()
    model.prefill(torch.randint(100, 20000, (context,), generator=torch.Generator().manual_seed(0)), cache, slot)

    def step() -> float:
        """Seconds of one step as the generator runs an autoregressive one (``decode_logits``:
        the cache's bookkeeping, the layers, the final norm and the LM head)."""
        t0 = time.perf_counter()
        model.decode_logits([5], cache, [slot])
        return time.perf_counter() - t0

    saved = model.step_path
    parts = ("norms_ms", "rope_kv_ms", "silu_ms", "residuals_ms")  # the fused loop's own arithmetic
    columns: dict[str, list] = {"step_ms_fused": [], "products_ms": [], "attention_ms": [], "rest_ms_fused": [],
                                **{k: [] for k in parts}, "step_ms_python": []}
    try:
        model.step_path = "fused"
        stack = model.decoder_stack()
        stack.set_timing(True)
        for i in range(reps + 2):
            total = step()
            products, attention, *inside = stack.take_timings()
            if i >= 2:  # warm-up
                for key, v in (("step_ms_fused", total), ("products_ms", products), ("attention_ms", attention),
                               ("rest_ms_fused", total - products - attention), *zip(parts, inside)):
                    columns[key].append(v * 1e3)
        stack.set_timing(False)
        model.step_path = "python"
        columns["step_ms_python"] = [step() * 1e3 for _ in range(reps + 2)][2:]
    finally:
        model.step_path = saved
    row = {k: statistics.median(v) for k, v in columns.items()}
    row["rest_ms_python"] = row["step_ms_python"] - row["products_ms"] - row["attention_ms"]
    return row


def eagle_step_breakdown(model, context: int = 64, rows: int = 8, reps: int = 30) -> dict:
    """One EAGLE draft depth (the package's head for ``model``) as the drafter runs it: ``rows``
    beam nodes through the head's fc (``decode_inputs``), then ``decode_layer`` (its layer, the
    final norm and the draft LM head; one C++ call on the fused path), each node a query of its
    own over ``context`` committed entries of the head's paged cache plus itself (here the
    nodes' own K/V share one cache slot: a timing, not a draft) — medians in ms, with the time
    inside its products (the stack's timers, the fc timed around its call) and the ratio
    step / products (target <= 1.5)."""
    import time

    from specdec_kernels.drafting.eagle.head import eagle_head_for
    from specdec_kernels.kv_cache import PagedKVCache
    from specdec_kernels.models.block import linear

    head = eagle_head_for(model)
    c, g = model.config, torch.Generator().manual_seed(0)
    feat = torch.randn(rows, c.hidden_size, generator=g)
    tok = torch.randint(100, 2000, (rows,), generator=g)
    cache = PagedKVCache(1, head.num_kv_heads, head.head_dim, num_blocks=4, block_size=64, max_batch=1,
                         max_blocks_per_seq=4)
    slot = cache.add_request()
    new = cache.append_slots([slot], [context])
    kv = torch.randn(context, head.num_kv_heads, head.head_dim, generator=g)
    cache.write(0, new.slot_mapping, kv, kv)
    cache.commit([slot], [context])
    prefix = torch.full((rows,), context, dtype=torch.int32)
    pos, indptr = prefix.long(), torch.arange(rows + 1, dtype=torch.int32)
    own = cache.append_slots([slot], [1]).slot_mapping.expand(rows).contiguous()
    table = cache.batch_view([slot])[0].expand(rows, -1).contiguous()
    w = head.decode_weights(torch.float32)
    x_fc = torch.cat([feat, head.embed(tok).float()], -1)

    def depth():
        x = head.decode_inputs(feat, tok)
        head.decode_layer(x, pos, cache, table, prefix, indptr, own)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    stack = head.decode_stack(torch.float32)
    steps, products = [], []
    stack.set_timing(True)
    for i in range(reps + 3):
        step = timed(depth)
        inside = stack.take_timings()[0]
        fc = timed(lambda: linear(x_fc, w["fc"]))
        if i >= 3:
            steps.append(step * 1e3)
            products.append((inside + fc) * 1e3)
    stack.set_timing(False)
    step_ms, products_ms = statistics.median(steps), statistics.median(products)
    return {"rows": rows, "step_ms": step_ms, "products_ms": products_ms, "step_over_products": step_ms / products_ms}


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
    p.add_argument("--eagle", action="store_true", help="also time one EAGLE draft depth (models with a shipped head)")
    add_out_name(p, "decode_<model>[_p<prompt tokens>]")
    args = p.parse_args()

    from specdec_kernels.models import load_model
    from specdec_kernels.models.registry import resolve

    from specdec_kernels._C import cpu_paths, set_amx_enabled

    amx = cpu_paths()["amx_int8"]  # where the CPU has AMX, our runs are timed with it on and off
    path = resolve(args.model)
    print(f"loading {args.model} ({args.weights}) ...", file=sys.stderr)
    model, _ = load_model(path, weights=args.weights)
    rows = []
    with tqdm(total=len(args.threads) * args.rounds, desc="bench_decode") as bar:
        for threads in args.threads:
            torch.set_num_threads(threads)
            ours(model, 8, 2, "fused")  # warm-up: first-call allocations and the rope tables
            mine, reference, theirs, no_amx = [], [], [], []
            for _ in range(args.rounds):
                mine.append(ours(model, args.prompt_tokens, args.new_tokens, "fused"))
                if amx:  # the same on AVX-512 VNNI (the same bits), alternating with the AMX run
                    set_amx_enabled(False)
                    no_amx.append(ours(model, args.prompt_tokens, args.new_tokens, "fused"))
                    set_amx_enabled(True)
                reference.append(ours(model, args.prompt_tokens, args.new_tokens, "python"))
                if args.llama_bench:
                    theirs.append(llama_bench(args.llama_bench, path, args.prompt_tokens, args.new_tokens, threads))
                bar.update(1)
            row = {"threads": threads, "ours_prefill_tok_s": statistics.median(m[0] for m in mine),
                   "ours_decode_tok_s": statistics.median(m[1] for m in mine),
                   "python_step_decode_tok_s": statistics.median(m[1] for m in reference)}
            if no_amx:
                row.update({"no_amx_prefill_tok_s": statistics.median(m[0] for m in no_amx),
                            "no_amx_decode_tok_s": statistics.median(m[1] for m in no_amx)})
                row["amx_prefill_speedup"] = row["ours_prefill_tok_s"] / row["no_amx_prefill_tok_s"]
            row.update(step_breakdown(model, args.prompt_tokens))
            if theirs:
                row.update({"llama_cpp_pp_tok_s": statistics.median(t[0] for t in theirs),
                            "llama_cpp_tg_tok_s": statistics.median(t[1] for t in theirs)})
                row["decode_ratio"] = row["ours_decode_tok_s"] / row["llama_cpp_tg_tok_s"]
                row["prefill_ratio"] = row["ours_prefill_tok_s"] / row["llama_cpp_pp_tok_s"]
            if args.eagle:
                row.update({f"eagle_{k}": v for k, v in eagle_step_breakdown(model, args.prompt_tokens).items()})
            rows.append(row)
    print_table(rows, list(rows[0]))
    name = args.out_name or f"decode_{Path(str(args.model)).name.removesuffix('.gguf')}"
    if args.out_name is None and args.prompt_tokens != 64:
        name += f"_p{args.prompt_tokens}"
    out = write_results(name, {
        "command": " ".join(["python", "bench/bench_decode.py"] + sys.argv[1:]), "model": args.model,
        "weights": args.weights, "cpu_paths": cpu_paths(), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
