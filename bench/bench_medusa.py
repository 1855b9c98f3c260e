"""Benchmark of specdec::medusa_topk on CPU (issue 5).

  python bench/bench_medusa.py            # full run (<= 5 minutes)
  python bench/bench_medusa.py --quick    # ~30 s smoke run

medusa_topk (K heads of one ResBlock, top-10) against
  - torch eager: heads in a loop, F.linear ResBlock, F.linear LM head, log_softmax, topk;
  - torch batched: one bmm for all ResBlocks, one GEMM of all K*M rows against the LM head,
    log_softmax, topk;
at SmolLM2-135M shapes (H 576, V 49152, K 4, M 1/4/16) and Vicuna-7B shapes (H 4096,
V 32000, K 5, M 1/4). The LM head is shared by the heads (SmolLM2 ties it to the
embeddings; for Vicuna per-head LM heads would be 5 x 32000 x 4096 fp32 = 2.6 GB, too much
for this machine's RAM next to five other engineers), and one SmolLM2 row uses per-head LM
heads. Effective bandwidth = weight bytes the op must read (ResBlocks + LM head(s), once)
per second, as a fraction of the copy bandwidth measured in the same run.

The GEMM under it, skinny_linear, has its own benchmark: bench/bench_linear.py.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specdec_kernels  # noqa: E402,F401
from bench.common import add_out_name, copy_bandwidth_gbs, print_table, time_fn, write_results  # noqa: E402

TOP_K = 10


def medusa_weights(K, L, H, V, shared, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    res_weight = (torch.randn(K, L, H, H, generator=g) / H**0.5).to(dtype)
    res_bias = (torch.randn(K, L, H, generator=g) * 0.1).to(dtype)
    lm_head = (torch.randn(*(() if shared else (K,)), V, H, generator=g) / H**0.5).to(dtype)
    return res_weight, res_bias, lm_head


def eager(hidden, res_weight, res_bias, lm_head, top_k):
    """The reference implementation's way: a Python loop over heads, full logits."""
    K, L = res_weight.shape[:2]
    ids, lps = [], []
    for k in range(K):
        x = hidden
        for j in range(L):
            x = x + F.silu(F.linear(x, res_weight[k, j], res_bias[k, j]))
        logits = F.linear(x, lm_head if lm_head.dim() == 2 else lm_head[k])
        lp, idx = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids.append(idx)
        lps.append(lp)
    return torch.stack(ids, dim=1), torch.stack(lps, dim=1)


def batched(hidden, res_weight, res_bias, lm_head, top_k):
    """All heads at once: one bmm per ResBlock layer, one GEMM (shared) or bmm (per head)."""
    K, L = res_weight.shape[:2]
    M = hidden.shape[0]
    x = hidden.unsqueeze(0).expand(K, M, -1)
    for j in range(L):
        x = x + F.silu(torch.baddbmm(res_bias[:, j].unsqueeze(1), x, res_weight[:, j].transpose(1, 2)))
    if lm_head.dim() == 2:
        logits = F.linear(x.reshape(K * M, -1), lm_head).view(K, M, -1)
    else:
        logits = torch.bmm(x, lm_head.transpose(1, 2))
    lp, idx = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
    return idx.transpose(0, 1), lp.transpose(0, 1)


def bench_medusa(cases, copy_bw, reps, pbar):
    rows = []
    for name, K, L, H, V, shared, M, dtype in cases:
        res_weight, res_bias, lm_head = medusa_weights(K, L, H, V, shared, dtype)
        hidden = torch.randn(M, H)
        ids = torch.empty(M, K, TOP_K, dtype=torch.int64)
        lps = torch.empty(M, K, TOP_K)
        big = V * H >= 10**8
        r = 3 if big else reps

        def ours():
            torch.ops.specdec.medusa_topk(hidden, res_weight, res_bias, lm_head, TOP_K, ids, lps)

        t_ours = time_fn(ours, warmup=1 if big else 2, reps=r)
        # Same answers as the eager way (log-probs of the top-10; ids may differ only on
        # near-ties, which random weights do not produce at this scale).
        e_ids, e_lp = eager(hidden, res_weight.float(), res_bias.float(), lm_head.float(), TOP_K)
        assert torch.allclose(e_lp, lps, atol=1e-3, rtol=1e-4), f"{name}: log-probs differ from eager"
        # The baselines run in the weights' dtype (torch needs one dtype per matmul).
        hidden_w = hidden.to(dtype)
        t_eager = time_fn(lambda: eager(hidden_w, res_weight, res_bias, lm_head, TOP_K), warmup=1, reps=r)
        t_batched = time_fn(lambda: batched(hidden_w, res_weight, res_bias, lm_head, TOP_K), warmup=1, reps=r)
        nbytes = (res_weight.numel() + res_bias.numel() + lm_head.numel()) * res_weight.element_size()
        gbs = nbytes / (t_ours["median_us"] * 1e-6) / 1e9
        rows.append({
            "case": name, "M": M, "K": K, "H": H, "V": V, "lm_head": "shared" if shared else "per-head",
            "dtype": str(dtype).replace("torch.", ""),
            "ours_us": t_ours["median_us"], "eager_us": t_eager["median_us"], "batched_us": t_batched["median_us"],
            "x_eager": t_eager["median_us"] / t_ours["median_us"],
            "x_batched": t_batched["median_us"] / t_ours["median_us"],
            "GB/s": gbs, "frac_copy": gbs / copy_bw, "weight_MB": nbytes / 1e6,
            "ours": t_ours, "eager": t_eager, "batched": t_batched,
        })
        pbar.update(1)
        del res_weight, res_bias, lm_head
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    parser.add_argument("--no-vicuna", action="store_true", help="skip the Vicuna-7B shapes (0.9 GB of weights)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads); 1 gives stable numbers on a busy machine")
    add_out_name(parser, "medusa")
    args = parser.parse_args()
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy

    smol = dict(K=4, L=1, H=576, V=49152)
    vic = dict(K=5, L=1, H=4096, V=32000)
    if args.quick:
        medusa_cases = [("smollm2", smol["K"], 1, smol["H"], smol["V"], True, M, torch.float32) for M in (1, 4)]
        reps = 5
    else:
        medusa_cases = [("smollm2", smol["K"], 1, smol["H"], smol["V"], True, M, torch.float32) for M in (1, 4, 16)]
        medusa_cases.append(("smollm2", smol["K"], 1, smol["H"], smol["V"], True, 1, torch.bfloat16))
        medusa_cases.append(("smollm2", smol["K"], 1, smol["H"], smol["V"], False, 1, torch.float32))
        if not args.no_vicuna:
            medusa_cases += [("vicuna-7b", vic["K"], 1, vic["H"], vic["V"], True, M, torch.float32) for M in (1, 4)]
        reps = 10

    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.1f} GB/s, torch threads: {torch.get_num_threads()}")
    with tqdm(total=len(medusa_cases), desc="bench_medusa") as pbar:
        medusa_rows = bench_medusa(medusa_cases, copy_bw, reps, pbar)

    print("\nmedusa_topk (top-10, 1 ResBlock per head; median us)")
    print_table(medusa_rows, ["case", "lm_head", "dtype", "M", "ours_us", "eager_us", "batched_us", "x_eager",
                              "x_batched", "GB/s", "frac_copy"])
    targets = {
        "medusa_x_eager_min_M_le_4": min(r["x_eager"] for r in medusa_rows if r["M"] <= 4),
        "medusa_frac_copy_M1_fp32": [round(r["frac_copy"], 3) for r in medusa_rows
                                     if r["M"] == 1 and r["dtype"] == "float32"],
    }
    print("\ntargets:", targets)
    path = write_results(args.out_name or "medusa", {
        "command": " ".join(["python", "bench/bench_medusa.py"] + sys.argv[1:]),
        "copy_bandwidth_gbs": copy_bw, "top_k": TOP_K, "medusa_topk": medusa_rows, "targets": targets,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
