"""Benchmark of specdec::skinny_linear on CPU against F.linear (issue 5).

  python bench/bench_linear.py            # full run (a few minutes)
  python bench/bench_linear.py --quick    # ~30 s smoke run

skinny_linear against F.linear for the SmolLM2 layer shapes [N, H] at M = 1..64, with the
weight hot in the caches and cold (a different weight copy per call); the largest M at
which skinny_linear wins on every shape is the measured threshold of ``ops.linear``
(SKINNY_LINEAR_MAX_ROWS). Effective bandwidth = weight bytes per second, as a fraction of
the copy bandwidth measured in the same run.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specdec_kernels  # noqa: E402,F401
from bench.common import copy_bandwidth_gbs, print_table, time_fn, write_results  # noqa: E402


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run (no cold-weight timings)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: torch's default); 1 gives stable numbers on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

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
    total = len(skinny_shapes) * len(ms) + (0 if args.quick else 2 * len(ms))
    with tqdm(total=total, desc="bench_linear") as pbar:
        skinny_rows = bench_skinny(skinny_shapes, ms, copy_bw, reps, pbar, cold_bytes=0 if args.quick else 384 * 2**20)
        if not args.quick:
            skinny_rows += bench_skinny([(1536, 576), (576, 1536)], ms, copy_bw, reps, pbar, torch.bfloat16)

    print("\nskinny_linear vs F.linear (median us; vs_M1 = ours / ours at M=1)")
    print_table(skinny_rows, ["N", "H", "dtype", "M", "ours_us", "F.linear_us", "x_F.linear", "vs_M1", "frac_copy",
                              "cold_ours_us", "cold_F.linear_us", "cold_x_F.linear", "cold_vs_M1", "cold_frac_copy"])

    # Threshold for ops.linear: largest M such that skinny_linear beats F.linear on every
    # fp32 shape for every M' <= M (hot and cold weights separately).
    fp32 = [r for r in skinny_rows if r["dtype"] == "float32"]

    def threshold(key):
        best = 0
        for M in ms:
            at_m = [r[key] for r in fp32 if r["M"] == M and key in r]
            if at_m and all(v > 1.0 for v in at_m):
                best = M
            else:
                break
        return best

    targets = {
        "skinny_M8_vs_M1": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r["vs_M1"], 3) for r in skinny_rows if r["M"] == 8},
        "skinny_M8_x_F.linear": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r["x_F.linear"], 3)
                                 for r in skinny_rows if r["M"] == 8},
        "skinny_M8_cold_vs_M1": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r.get("cold_vs_M1", float("nan")), 3)
                                 for r in skinny_rows if r["M"] == 8},
        "skinny_M8_cold_x_F.linear": {f"{r['N']}x{r['H']}:{r['dtype']}": round(r.get("cold_x_F.linear", float("nan")), 3)
                                      for r in skinny_rows if r["M"] == 8},
        "linear_threshold_hot": threshold("x_F.linear"),
        "linear_threshold_cold": threshold("cold_x_F.linear"),
    }
    print("\ntargets:", targets)
    path = write_results("linear", {
        "command": " ".join(["python", "bench/bench_linear.py"] + sys.argv[1:]),
        "copy_bandwidth_gbs": copy_bw, "skinny_linear": skinny_rows, "targets": targets,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
