"""Benchmark of the linear area on CPU: specdec::skinny_linear, specdec::quantized_linear and
specdec::int8_activation_linear.

  python bench/bench_linear.py            # full run (a few minutes)
  python bench/bench_linear.py --quick    # ~30 s smoke run
  python bench/bench_linear.py --qwen --threads 1              # int8_activation_linear, Qwen2.5-Coder-1.5B shapes
  python bench/bench_linear.py --qwen-quantized --threads 1 --types Q4_K,Q6_K   # quantized_linear, same shapes

quantized_linear (weights as GGUF blocks: Q4_1 and Q8_0 as the SmolLM2 file holds them, and
Q4_0) against F.linear and skinny_linear on the same weights dequantised to fp32, for the
SmolLM2 shapes and one 7B-class shape (11008 x 4096) at M = 1..32, the weights cold (a pool
of copies larger than the L3, as in a decode step). Effective bandwidth = quantised bytes per
second as a fraction of the copy bandwidth; vs_M1 = time at M / time at M = 1. In the same
rows, int8_activation_linear on the same blocks repacked (activations quantised to int8,
integer dot products): its time, x_quantized = quantized_linear's time / its time, its
fraction of the copy bandwidth and its vs_M1.

int8_activation_linear on the formats of the Qwen2.5-Coder GGUF files (``--qwen``: Q4_K, Q5_K,
Q6_K, Q5_0, Q5_1 on the 1.5B's shapes qkv 2048 x 1536, o 1536 x 1536, gate|up 17920 x 1536,
down 1536 x 8960, and Q6_K on the LM head 151936 x 1536), cold packed weights, at M = 1..64:
time, vs_M1 and GB/s of packed bytes against the copy bandwidth (where the CPU has AMX and the
kernel takes it, the same call with AMX off: no_amx_us, amx_speedup), for the --threads given (with
one thread also in CPU time, cpu_*: on a shared machine the wall time includes waiting for a core);
written to bench/results/linear_int8_qwen_t<threads>.json.

skinny_linear against F.linear for the SmolLM2 layer shapes [N, H] at M = 1..64, with the
weight hot in the caches and cold (a different weight copy per call); the largest M at
which skinny_linear wins on every shape is the model's measured threshold
(``models.skinny_rows.SKINNY_LINEAR_MAX_ROWS``). Effective bandwidth = weight bytes per
second, as a fraction of the copy bandwidth measured in the same run.
"""
import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specdec_kernels  # noqa: E402,F401
from bench.common import add_out_name, copy_bandwidth_gbs, print_table, time_fn, write_results  # noqa: E402


def bench_skinny(shapes, ms, copy_bw, reps, pbar, dtype=torch.float32, cold_bytes=384 * 2**20):
    """hot: the same weight every call (it stays in L2/L3: this machine has a 300 MB L3);
    cold: each call takes the next of a pool of weight copies larger than the L3, as in a
    decode step where the model's other layers have evicted this one (SmolLM2-135M is
    540 MB in fp32)."""
    rows = []
    for N, H in shapes:
        weight = torch.randn(N, H).to(dtype)
        nbytes = weight.numel() * weight.element_size()
        pool = [weight.clone() for _ in range(max(2, -(-cold_bytes // nbytes)))] if cold_bytes else []
        turn = itertools.count()
        big = N * H >= 10**7
        r = 3 if big else reps
        for M in ms:
            x = torch.randn(M, H)
            xb = x.to(dtype)  # F.linear needs one dtype: for bf16 weights the baseline runs in bf16
            out = torch.empty(M, N)
            t_ours = time_fn(lambda: torch.ops.specdec.skinny_linear(x, weight, None, out), warmup=2, reps=r)
            t_ref = time_fn(lambda: F.linear(xb, weight), warmup=2, reps=r)
            assert torch.allclose(out, F.linear(x, weight.float()), atol=1e-3 * H**0.5, rtol=1e-3)
            gbs = nbytes / (t_ours["median_us"] * 1e-6) / 1e9
            row = {
                "N": N, "H": H, "M": M, "dtype": str(dtype).replace("torch.", ""),
                "ours_us": t_ours["median_us"], "F.linear_us": t_ref["median_us"],
                "x_F.linear": t_ref["median_us"] / t_ours["median_us"],
                "GB/s": gbs, "frac_copy": gbs / copy_bw, "ours": t_ours, "F.linear": t_ref,
            }
            if pool:
                # One rotation per shape: every call takes the copy used longest ago, which
                # the > 300 MB of other copies touched since have evicted from the caches.
                t_ours_c = time_fn(lambda: torch.ops.specdec.skinny_linear(x, pool[next(turn) % len(pool)], None, out),
                                   warmup=2, reps=r)
                t_ref_c = time_fn(lambda: F.linear(xb, pool[next(turn) % len(pool)]), warmup=2, reps=r)
                row.update({
                    "cold_ours_us": t_ours_c["median_us"], "cold_F.linear_us": t_ref_c["median_us"],
                    "cold_x_F.linear": t_ref_c["median_us"] / t_ours_c["median_us"],
                    "cold_frac_copy": nbytes / (t_ours_c["median_us"] * 1e-6) / 1e9 / copy_bw,
                    "cold_ours": t_ours_c, "cold_F.linear": t_ref_c,
                })
            rows.append(row)
            pbar.update(1)
        del pool
    # Relative cost of M rows vs one row, per shape.
    for row in rows:
        base = next(r for r in rows if r["N"] == row["N"] and r["H"] == row["H"] and r["dtype"] == row["dtype"]
                    and r["M"] == ms[0])
        row["vs_M1"] = row["ours_us"] / base["ours_us"]
        if "cold_ours_us" in row:
            row["cold_vs_M1"] = row["cold_ours_us"] / base["cold_ours_us"]
    return rows


def bench_quantized(shapes, block_types, ms, copy_bw, reps, pbar, cold_bytes=384 * 2**20, baselines=True):
    """quantized_linear vs F.linear / skinny_linear on the dequantised fp32 weight (when
    ``baselines``), and int8_activation_linear on the repacked blocks (for the types it reads),
    all cold: each call takes the least recently used of a pool of copies (> L3 in all, per kind)."""
    from specdec_kernels.gguf_blocks import INT8_ACTIVATION_TYPES, block_size, pack_int8_activation, quantize

    rows = []
    for (N, H), block_type in itertools.product(shapes, block_types):
        if H % block_size(block_type) != 0:  # e.g. the K-quants (256) on SmolLM2's H = 576
            continue
        torch.manual_seed(0)
        qw = quantize(torch.randn(N, H) * 0.05, block_type)
        qbytes = qw.nbytes
        q_pool = [qw.blocks.clone() for _ in range(max(2, -(-cold_bytes // qbytes)))]
        p_pool = f_pool = []
        if qw.block_type in INT8_ACTIVATION_TYPES:
            packed = pack_int8_activation(qw.blocks, qw.block_type)
            pbytes = packed.numel()
            p_pool = [packed.clone() for _ in range(max(2, -(-cold_bytes // pbytes)))]
        if baselines:
            dense = qw.dequantize()
            f_pool = [dense.clone() for _ in range(max(2, -(-cold_bytes // (dense.numel() * 4))))]
            del dense
        turn = itertools.count()
        r = 5 if N * H >= 10**7 else reps
        base = {}
        for M in ms:
            x = torch.randn(M, H)
            out = torch.empty(M, N)

            def ours():
                torch.ops.specdec.quantized_linear(x, q_pool[next(turn) % len(q_pool)], qw.block_type, None, out)

            t_ours = time_fn(ours, warmup=2, reps=r)
            base.setdefault("us", t_ours["median_us"])
            gbs = qbytes / (t_ours["median_us"] * 1e-6) / 1e9
            row = {"N": N, "H": H, "block_type": qw.type_name, "M": M, "weight_MB": qbytes / 1e6,
                   "ours_us": t_ours["median_us"], "vs_M1": t_ours["median_us"] / base["us"], "GB/s": gbs,
                   "frac_copy": gbs / copy_bw, "ours": t_ours}
            torch.ops.specdec.quantized_linear(x, qw.blocks, qw.block_type, None, out)
            if p_pool:
                out8 = torch.empty(M, N)

                def int8act():
                    torch.ops.specdec.int8_activation_linear(x, p_pool[next(turn) % len(p_pool)], qw.block_type, None,
                                                             out8)

                t_i8 = time_fn(int8act, warmup=2, reps=r)
                base.setdefault("i8_us", t_i8["median_us"])
                row.update({"int8act_us": t_i8["median_us"], "x_quantized": t_ours["median_us"] / t_i8["median_us"],
                            "int8act_frac_copy": pbytes / (t_i8["median_us"] * 1e-6) / 1e9 / copy_bw,
                            "int8act_vs_M1": t_i8["median_us"] / base["i8_us"], "int8act": t_i8})
            if f_pool:
                t_ref = time_fn(lambda: F.linear(x, f_pool[next(turn) % len(f_pool)]), warmup=2, reps=r)
                t_skinny = time_fn(lambda: torch.ops.specdec.skinny_linear(x, f_pool[next(turn) % len(f_pool)], None,
                                                                           out), warmup=2, reps=r)
                torch.ops.specdec.quantized_linear(x, qw.blocks, qw.block_type, None, out)
                assert torch.allclose(out, F.linear(x, f_pool[0]), atol=1e-3 * H**0.5, rtol=1e-3)
                row.update({"F.linear_fp32_us": t_ref["median_us"], "skinny_fp32_us": t_skinny["median_us"],
                            "x_F.linear": t_ref["median_us"] / t_ours["median_us"],
                            "x_skinny": t_skinny["median_us"] / t_ours["median_us"],
                            "F.linear_fp32": t_ref, "skinny_fp32": t_skinny})
            rows.append(row)
            pbar.update(1)
        del q_pool, f_pool, p_pool
    return rows


QWEN_SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate|up": (17920, 1536), "down": (1536, 8960),
               "lm_head": (151936, 1536)}


def random_gguf_blocks(N, H, block_type, seed=0):
    """uint8 [N, row bytes] of random GGUF blocks with finite fp16 scales (valid blocks; the
    kernel's speed does not depend on the values)."""
    from specdec_kernels.checks import INT8_ACTIVATION_FORMATS

    _, size, nbytes, _ = INT8_ACTIVATION_FORMATS[block_type]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (N, H // size, nbytes), dtype=torch.uint8, generator=g)
    fp16_at = {6: [0], 7: [0, 2], 12: [0, 2], 13: [0, 2], 14: [208]}[block_type]
    for at in fp16_at:
        b[..., at:at + 2] = (torch.rand(N, H // size, 1, generator=g) * 0.01).half().view(torch.uint8)
    return b.reshape(N, -1)


def cpu_time_us(fn, reps):
    """Median CPU time of this thread per call of fn() (us): on a machine shared with other
    jobs, unlike the wall time, it leaves out the time the thread waits for a core (one
    torch thread only: the work of other threads is not counted)."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth_cpu_gbs(nbytes=256 * 2**20, reps=15):
    """copy_bandwidth_gbs measured in this thread's CPU time (one torch thread)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (cpu_time_us(lambda: dst.copy_(src), reps) * 1e-6) / 1e9


def bench_int8_qwen(formats, ms, copy_bw, reps, pbar, cold_bytes=128 * 2**20):
    """int8_activation_linear on the Qwen 1.5B's shapes, each call on the least recently used
    of a pool of packed copies (> 4x this machine's 32 MB L3)."""
    from specdec_kernels.gguf_blocks import pack_int8_activation

    from specdec_kernels._C import amx_pays, cpu_paths, set_amx_enabled

    amx = cpu_paths()["amx_int8"]
    rows = []
    for (name, (N, H)), block_type in formats:
        packed = pack_int8_activation(random_gguf_blocks(N, H, block_type), block_type)
        pbytes = packed.numel()
        pool = [packed] + [packed.clone() for _ in range(max(2, -(-cold_bytes // pbytes)) - 1)]
        turn = itertools.count()
        r = 5 if pbytes >= 50 * 2**20 else reps
        base = None
        for M in ms:
            x = torch.randn(M, H)
            out = torch.empty(M, N)
            def call():
                torch.ops.specdec.int8_activation_linear(x, pool[next(turn) % len(pool)], block_type, None, out)

            t = time_fn(call, warmup=2, reps=r)
            cpu = cpu_time_us(call, r) if torch.get_num_threads() == 1 else None
            no_amx = None
            if amx and amx_pays(block_type, M):  # the same call on AVX-512 VNNI (the same bits)
                set_amx_enabled(False)
                no_amx = time_fn(call, warmup=2, reps=r)["median_us"]
                set_amx_enabled(True)
            base = base or (t["median_us"], cpu)
            gbs = pbytes / (t["median_us"] * 1e-6) / 1e9
            rows.append({"layer": name, "N": N, "H": H, "block_type": {6: "Q5_0", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K",
                                                                         14: "Q6_K"}[block_type],
                         "M": M, "packed_MB": pbytes / 1e6, "bits_per_weight": pbytes * 8 / (N * H),
                         "us": t["median_us"], "vs_M1": t["median_us"] / base[0], "GB/s": gbs,
                         "frac_copy": gbs / copy_bw[0], "timing": t})
            if no_amx is not None:
                rows[-1].update({"no_amx_us": no_amx, "amx_speedup": no_amx / t["median_us"]})
            if cpu is not None:
                cpu_gbs = pbytes / (cpu * 1e-6) / 1e9
                rows[-1].update({"cpu_us": cpu, "cpu_vs_M1": cpu / base[1], "cpu_GB/s": cpu_gbs,
                                 "cpu_frac_copy": cpu_gbs / copy_bw[1]})
            pbar.update(1)
        del pool, packed
    return rows


def main_qwen(args):
    from specdec_kernels._C import cpu_paths

    threads = torch.get_num_threads()
    copy_bw = (copy_bandwidth_gbs(), copy_bandwidth_cpu_gbs() if threads == 1 else None)
    print(f"copy bandwidth: {copy_bw[0]:.1f} GB/s (wall time), {copy_bw[1] or float('nan'):.1f} GB/s (CPU time), "
          f"torch threads: {threads}")
    ms = [int(m) for m in args.ms.split(",")] if args.ms else [1, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    names = ["qkv", "o"] if args.quick else ["qkv", "o", "gate|up", "down"]
    types = [12, 14] if args.quick else [12, 14, 13, 6, 7]
    formats = [((n, QWEN_SHAPES[n]), t) for t in types for n in names]
    if not args.quick:
        formats.append((("lm_head", QWEN_SHAPES["lm_head"]), 14))
    with tqdm(total=len(formats) * len(ms), desc="bench_linear --qwen") as pbar:
        rows = bench_int8_qwen(formats, ms, copy_bw, 5 if args.quick else 20, pbar)
    print("\nint8_activation_linear, cold packed weights (median us; vs_M1 = time / time at M=1; frac_copy = packed "
          "bytes per second / copy bandwidth)")
    print_table(rows, ["layer", "N", "H", "block_type", "M", "packed_MB", "bits_per_weight", "us", "vs_M1", "GB/s",
                       "frac_copy", "cpu_us", "cpu_vs_M1", "cpu_GB/s", "cpu_frac_copy", "no_amx_us", "amx_speedup"])
    path = write_results(args.out_name or f"linear_int8_qwen_t{threads}", {
        "command": " ".join(["python", "bench/bench_linear.py"] + sys.argv[1:]), "copy_bandwidth_gbs": copy_bw[0],
        "copy_bandwidth_cpu_time_gbs": copy_bw[1], "cpu_paths": cpu_paths(), "int8_activation_linear": rows,
        "M1_frac_copy": {f"{r['layer']}:{r['block_type']}": round(r["frac_copy"], 3) for r in rows if r["M"] == 1},
    })
    print(f"wrote {path}")


# Qwen2.5-Coder-1.5B's linear layers [N, H] (out features, in features): q|k|v (1536 + 2 * 256
# rows, GQA), o, gate|up (2 * 8960), down, the LM head.
QWEN_1_5B_SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]


def bench_qwen(block_types, ms, threads, out_name=None):
    """quantized_linear on the 1.5B's shapes (cold blocks, no fp32 baselines): its M = 1
    bandwidth against the copy bandwidth; results in bench/results/linear_qwen_threads<T>.json."""
    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.1f} GB/s, torch threads: {torch.get_num_threads()}")
    with tqdm(total=len(QWEN_1_5B_SHAPES) * len(block_types) * len(ms), desc="bench_linear --qwen") as pbar:
        rows = bench_quantized(QWEN_1_5B_SHAPES, block_types, ms, copy_bw, 10, pbar, baselines=False)
    print("\nquantized_linear (cold GGUF blocks) on Qwen2.5-Coder-1.5B's shapes")
    print_table(rows, ["N", "H", "block_type", "M", "weight_MB", "ours_us", "vs_M1", "GB/s", "frac_copy",
                       "int8act_us", "x_quantized"])
    total = {}
    for r in rows:  # a decode step's linears: every shape once (LM head included)
        total.setdefault((r["block_type"], r["M"]), [0.0, 0.0])
        total[(r["block_type"], r["M"])][0] += r["weight_MB"] * 1e6
        total[(r["block_type"], r["M"])][1] += r["ours_us"] * 1e-6
    targets = {f"{bt}:M{M}_frac_copy_all_shapes": round(b / t / 1e9 / copy_bw, 3) for (bt, M), (b, t) in total.items()}
    print("\ntargets:", targets)
    path = write_results(out_name or f"linear_qwen_threads{threads}", {
        "command": " ".join(["python", "bench/bench_linear.py"] + sys.argv[1:]),
        "copy_bandwidth_gbs": copy_bw, "quantized_linear": rows, "targets": targets})
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run (no cold-weight timings)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads); 1 gives stable numbers on a busy machine")
    parser.add_argument("--qwen", action="store_true",
                        help="only int8_activation_linear on the Qwen2.5-Coder formats and 1.5B shapes")
    parser.add_argument("--qwen-quantized", action="store_true",
                        help="only quantized_linear (fp32 activations) on Qwen2.5-Coder-1.5B's shapes (cold blocks), for --types")
    parser.add_argument("--types", default="Q4_K,Q6_K", help="block types of --qwen-quantized (comma-separated)")
    parser.add_argument("--ms", default=None,
                        help="row counts M of --qwen-quantized (default 1,2,4,8) or --qwen (default 1..64), comma-separated")
    add_out_name(parser, "linear; --qwen: linear_int8_qwen_t<threads>; --qwen-quantized: linear_qwen_threads<threads>")
    return parser.parse_args(argv)


def skinny_threshold(skinny_rows: list, ms: list, key: str) -> int:
    """Threshold for ops.linear: the largest M such that skinny_linear beats F.linear
    (``key``: the hot or the cold ratio) on every fp32 shape for every M' <= M."""
    fp32 = [r for r in skinny_rows if r["dtype"] == "float32"]
    best = 0
    for M in ms:
        at_m = [r[key] for r in fp32 if r["M"] == M and key in r]
        if at_m and all(v > 1.0 for v in at_m):
            best = M
        else:
            break
    return best


def linear_targets(skinny_rows: list, quant_rows: list, ms: list) -> dict:
    """The ratios the default run reports as its targets, per shape (and block type or dtype)."""
    return {
        "skinny_M8_vs_M1": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r["vs_M1"], 3) for r in skinny_rows if r["M"] == 8},
        "skinny_M8_x_F.linear": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r["x_F.linear"], 3)
                                 for r in skinny_rows if r["M"] == 8},
        "skinny_M8_cold_vs_M1": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r.get("cold_vs_M1", float("nan")), 3)
                                 for r in skinny_rows if r["M"] == 8},
        "skinny_M8_cold_x_F.linear": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r.get("cold_x_F.linear", float("nan")), 3)
                                      for r in skinny_rows if r["M"] == 8},
        "quantized_M1_frac_copy": {f"{r['N']}x{r['H']}:{r['block_type']}": round(r["frac_copy"], 3)
                                   for r in quant_rows if r["M"] == 1},
        "quantized_M8_vs_M1": {f"{r['N']}x{r['H']}:{r['block_type']}": round(r["vs_M1"], 3)
                               for r in quant_rows if r["M"] == 8},
        "quantized_M16_vs_M1": {f"{r['N']}x{r['H']}:{r['block_type']}": round(r["vs_M1"], 3)
                                for r in quant_rows if r["M"] == 16},
        "int8act_M1_x_quantized": {f"{r['N']}x{r['H']}:{r['block_type']}": round(r["x_quantized"], 3)
                                   for r in quant_rows if r["M"] == 1 and "x_quantized" in r},
        "int8act_M8_x_quantized": {f"{r['N']}x{r['H']}:{r['block_type']}": round(r["x_quantized"], 3)
                                   for r in quant_rows if r["M"] == 8 and "x_quantized" in r},
        "int8act_M1_frac_copy": {f"{r['N']}x{r['H']}:{r['block_type']}": round(r["int8act_frac_copy"], 3)
                                 for r in quant_rows if r["M"] == 1 and "int8act_frac_copy" in r},
        "linear_threshold_hot": skinny_threshold(skinny_rows, ms, "x_F.linear"),
        "linear_threshold_cold": skinny_threshold(skinny_rows, ms, "cold_x_F.linear"),
    }


def run_default(args) -> None:
    """The default run: skinny_linear on the SmolLM2 shapes, quantized_linear and
    int8_activation_linear on the SmolLM2 and a 7B-class shape; tables, targets, results file."""
    if args.quick:
        skinny_shapes = [(1536, 576), (576, 1536)]
        ms = [1, 8]
        reps = 5
    else:
        skinny_shapes = [(1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)]
        ms = [1, 2, 4, 8, 16, 32, 64]
        reps = 10

    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.1f} GB/s, torch threads: {torch.get_num_threads()}")
    if args.quick:
        q_shapes, q_types, q_ms = [(1536, 576)], ["Q4_1"], [1, 8]
    else:
        q_shapes = [(1536, 576), (576, 1536), (49152, 576), (11008, 4096)]
        q_types, q_ms = ["Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"], [1, 4, 8, 16, 32]
    total = len(skinny_shapes) * len(ms) + (0 if args.quick else 2 * len(ms)) + len(q_shapes) * len(q_types) * len(q_ms)
    with tqdm(total=total, desc="bench_linear") as pbar:
        skinny_rows = bench_skinny(skinny_shapes, ms, copy_bw, reps, pbar, cold_bytes=0 if args.quick else 384 * 2**20)
        if not args.quick:
            skinny_rows += bench_skinny([(1536, 576), (576, 1536)], ms, copy_bw, reps, pbar, torch.bfloat16)
        quant_rows = bench_quantized(q_shapes, q_types, q_ms, copy_bw, reps, pbar,
                                     cold_bytes=64 * 2**20 if args.quick else 384 * 2**20)

    print("\nskinny_linear vs F.linear (median us; vs_M1 = ours / ours at M=1)")
    print_table(skinny_rows, ["N", "H", "dtype", "M", "ours_us", "F.linear_us", "x_F.linear", "vs_M1", "frac_copy",
                              "cold_ours_us", "cold_F.linear_us", "cold_x_F.linear", "cold_vs_M1", "cold_frac_copy"])

    print("\nquantized_linear (cold GGUF blocks) vs F.linear / skinny_linear on the dequantised fp32 weight (cold); "
          "int8_activation_linear (cold repacked blocks)")
    print_table(quant_rows, ["N", "H", "block_type", "M", "weight_MB", "ours_us", "F.linear_fp32_us", "skinny_fp32_us",
                             "x_F.linear", "x_skinny", "vs_M1", "GB/s", "frac_copy", "int8act_us", "x_quantized",
                             "int8act_vs_M1", "int8act_frac_copy"])
    targets = linear_targets(skinny_rows, quant_rows, ms)
    print("\ntargets:", targets)
    path = write_results(args.out_name or "linear", {
        "command": " ".join(["python", "bench/bench_linear.py"] + sys.argv[1:]),
        "copy_bandwidth_gbs": copy_bw, "skinny_linear": skinny_rows, "quantized_linear": quant_rows,
        "targets": targets,
    })
    print(f"wrote {path}")


def main():
    args = parse_args()
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy
    if args.qwen:
        return main_qwen(args)
    if args.qwen_quantized:
        return bench_qwen(args.types.split(","), [int(m) for m in (args.ms or "1,2,4,8").split(",")],
                          torch.get_num_threads(), args.out_name)
    return run_default(args)


if __name__ == "__main__":
    main()
