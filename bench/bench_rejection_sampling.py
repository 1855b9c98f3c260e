"""Benchmark of specdec::chain_rejection_sample on CPU (issue 2, item 6).

Ours (the C++ kernel) against (a) the plain vectorised PyTorch way engines verify without
a kernel (softmax over all rows, gather, compare, residual, multinomial) and (b) the
per-request algorithm of Hugging Face's assisted generation (speculative sampling),
written in torch. Reports median microseconds, the effective bandwidth of reading the
target logits once and its fraction of the copy bandwidth measured in the same run.

    python bench/bench_rejection_sampling.py          # full grid (<= 5 min)
    python bench/bench_rejection_sampling.py --quick  # smoke run (~30 s)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specdec_kernels  # noqa: E402,F401
from bench.common import add_out_name, copy_bandwidth_gbs, print_table, time_fn, write_results  # noqa: E402
from specdec_kernels import ops  # noqa: E402


def plain_torch(drafts, num, logits, q, temperature, gen):
    """(a) Vectorised PyTorch: softmax of every row, gather, compare, residual, multinomial."""
    batch, k = drafts.shape
    p = torch.softmax(logits / temperature[:, None, None], dim=-1)
    px = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(batch, k, generator=gen)
    accepted = (u <= px / qx) & (torch.arange(k) < num.unsqueeze(1))
    n_acc = accepted.int().cumprod(dim=1).sum(dim=1)
    residual = torch.clamp(p[:, :k] - q, min=0)
    rows = torch.arange(batch)
    rejected = n_acc < num
    dist = torch.where(rejected.unsqueeze(1), residual[rows, n_acc.clamp(max=k - 1)], p[rows, n_acc])
    last = torch.multinomial(dist, 1, generator=gen).squeeze(1)
    out = torch.where(torch.arange(k + 1) < n_acc.unsqueeze(1), torch.cat([drafts, drafts[:, :1]], 1), -1)
    out[rows, n_acc] = last
    return out, n_acc


def hf_assisted(drafts, num, logits, q, temperature, gen):
    """(b) Hugging Face assisted generation's speculative sampling, one request at a time."""
    outs = []
    for b in range(drafts.shape[0]):
        n = int(num[b])
        cand = drafts[b, :n]
        p = torch.softmax(logits[b, : n + 1] / temperature[b], dim=-1)
        q_i = q[b, torch.arange(n), cand]
        p_i = p[torch.arange(n), cand]
        ratio = p_i / q_i
        r = torch.rand_like(ratio)
        accepted = r <= ratio
        n_matches = int(((~accepted).cumsum(dim=-1) < 1).sum())
        if n_matches < n:
            dist = torch.clamp(p[n_matches] - q[b, n_matches], min=0)
            dist = dist / dist.sum()
        else:
            dist = p[n]
        t = torch.multinomial(dist, 1, generator=gen)
        outs.append(torch.cat([cand[:n_matches], t]))
    return outs


def make_inputs(batch, k, vocab, gen):
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, dim=-1)
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    num = torch.full((batch,), k, dtype=torch.int32)
    temperature = torch.ones(batch)
    seed = torch.arange(batch, dtype=torch.int64)
    offset = torch.zeros(batch, dtype=torch.int64)
    return drafts, num, logits, q, temperature, seed, offset


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few cases, few repetitions")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    add_out_name(parser, "rejection_sampling")
    args = parser.parse_args()
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy
    if args.quick:
        cases = [(1, 5, 32000), (8, 5, 49152), (32, 5, 128256)]
    else:
        cases = [(b, k, v) for b in (1, 8, 32, 64) for k in (1, 5, 8) for v in (32000, 49152, 128256)]
    copy_gbs = copy_bandwidth_gbs()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, k, vocab in tqdm(cases, desc="rejection sampling"):
        drafts, num, logits, q, temperature, seed, offset = make_inputs(batch, k, vocab, gen)
        nbytes = logits.numel() * logits.element_size()
        # Fewer repetitions for the big cases keep the default run within 5 minutes.
        reps = 3 if args.quick else max(3, min(20, int(3e8 / nbytes)))
        ours = time_fn(lambda: ops.chain_rejection_sample(drafts, num, logits, q, temperature, seed, offset),
                       warmup=1, reps=reps)
        plain = time_fn(lambda: plain_torch(drafts, num, logits, q, temperature, gen), warmup=1, reps=reps)
        # The per-request baseline is slow at large B: one warm-up-free run is enough there.
        big = nbytes > 5e7
        hf = time_fn(lambda: hf_assisted(drafts, num, logits, q, temperature, gen), warmup=0 if big else 1,
                     reps=1 if big else max(2, reps // 2))
        gbs = nbytes / (ours["median_us"] * 1e-6) / 1e9
        rows.append({
            "B": batch, "K": k, "V": vocab,
            "ours_us": ours["median_us"], "plain_torch_us": plain["median_us"], "hf_us": hf["median_us"],
            "speedup_vs_plain": plain["median_us"] / ours["median_us"],
            "speedup_vs_hf": hf["median_us"] / ours["median_us"],
            "GB/s": gbs, "frac_copy_bw": gbs / copy_gbs,
            "ours": ours, "plain_torch": plain, "hf": hf,
        })
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s, torch threads: {torch.get_num_threads()}")
    print_table(rows, ["B", "K", "V", "ours_us", "plain_torch_us", "hf_us", "speedup_vs_plain", "speedup_vs_hf",
                       "GB/s", "frac_copy_bw"])
    path = write_results(args.out_name or "rejection_sampling", {
        "command": "python bench/bench_rejection_sampling.py" + (" --quick" if args.quick else "")
        + (f" --threads {args.threads}" if args.threads else ""),
        "copy_bandwidth_gbs": copy_gbs, "dtype": "float32", "draft_probs": "full q", "rows": rows,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
