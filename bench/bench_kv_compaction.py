"""Benchmark of specdec::compact_kv (CPU) against the Medusa/EAGLE way of compacting.

Baseline: the slot indices of the accepted path are computed once from the block table
(vectorised torch ops), then for every layer's K and V an advanced-index gather of the
source rows and an index_put into the destinations (``flat[dst] = flat[src]``), which is
what Medusa and EAGLE do per layer (there on [.., max_len, D] caches, here on the paged
layout). Ours: one ``torch.ops.specdec.compact_kv`` call for every layer.

Shapes: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) and Llama-3-8B (32 layers,
8 KV heads, head_dim 128); B in {1, 8}; block size 16; each request has a 128-token
prefix, then a tree of 16 or 64 nodes with an accepted path of 1-8 random nodes, or a
chain of 8 nodes that is fully accepted (7 identity moves: nothing to move).

Reported: median microseconds of both (ours through ``torch.ops.specdec.compact_kv``, and
through the validating Python wrapper), the speedup, and ours' effective bandwidth (bytes
read + written by the non-identity moves, per second) as a fraction of the copy bandwidth
measured in the same run (``bench.common.copy_bandwidth_gbs``, a 256 MiB DRAM copy) and of
a warm copy of the same number of bytes (``frac_hot_copy``).

    python bench/bench_kv_compaction.py            # full run (~3-4 min)
    python bench/bench_kv_compaction.py --quick    # 30-second smoke run
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specdec_kernels  # noqa: E402,F401
from bench.common import add_out_name, copy_bandwidth_gbs, print_table, time_fn, write_results  # noqa: E402

MODELS = {
    "smollm2-135m": dict(num_layers=30, num_kv_heads=3, head_dim=64),
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
}
BLOCK_SIZE = 16
PREFIX = 128


def build_case(model: str, batch: int, tree_nodes: int, accepted: int, chain: bool, dtype, seed: int = 0):
    """Caches, block table and accepted paths for one benchmark case."""
    cfg = MODELS[model]
    rng = random.Random(seed)
    length = PREFIX + tree_nodes
    blocks_per_request = -(-length // BLOCK_SIZE)
    num_blocks = batch * blocks_per_request
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # a used cache: a request's blocks are scattered over the pool
    block_table = torch.tensor(
        [pool[b * blocks_per_request : (b + 1) * blocks_per_request] for b in range(batch)], dtype=torch.int32
    )
    shape = (num_blocks, BLOCK_SIZE, cfg["num_kv_heads"], cfg["head_dim"])
    numel = num_blocks * BLOCK_SIZE * cfg["num_kv_heads"] * cfg["head_dim"]
    pattern = (torch.arange(numel, dtype=torch.int32) % 251).to(dtype).view(shape)  # cheap, NaN-free, varied

    def layer(i):
        return pattern.roll(i) if i else pattern.clone()

    k_caches = [layer(2 * i) for i in range(cfg["num_layers"])]
    v_caches = [layer(2 * i + 1) for i in range(cfg["num_layers"])]
    prefix_lens = torch.tensor([PREFIX - rng.randrange(8) for _ in range(batch)], dtype=torch.int32)
    accepted_nodes = torch.full((batch, tree_nodes - 1), -1, dtype=torch.int32)
    for b in range(batch):
        # Any strictly increasing node list is the root path of some tree.
        path = list(range(1, accepted + 1)) if chain else sorted(rng.sample(range(1, tree_nodes), accepted))
        accepted_nodes[b, :accepted] = torch.tensor(path, dtype=torch.int32)
    num_accepted = torch.full((batch,), accepted, dtype=torch.int32)
    return k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted


def gather_copy(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
    """The Medusa/EAGLE way: slot indices once, then per layer gather + index_put."""
    block_size = k_caches[0].shape[1]
    width = accepted_nodes.shape[1]
    i = torch.arange(width, dtype=torch.int64)
    valid = i[None, :] < num_accepted[:, None]
    prefix = prefix_lens[:, None].long()
    src_pos = prefix + accepted_nodes.long().clamp(min=0)
    dst_pos = prefix + 1 + i[None, :]
    table = block_table.long()
    src = (table.gather(1, src_pos // block_size) * block_size + src_pos % block_size)[valid]
    dst = (table.gather(1, dst_pos // block_size) * block_size + dst_pos % block_size)[valid]
    for cache in (*k_caches, *v_caches):
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst] = flat[src]


def moved_bytes(case) -> int:
    """Bytes read + written by the non-identity moves of every layer's K and V."""
    k_caches, _, _, _, accepted_nodes, num_accepted = case
    row = k_caches[0][0, 0].numel() * k_caches[0].element_size()
    moves = 0
    for b in range(accepted_nodes.shape[0]):
        nodes = accepted_nodes[b, : int(num_accepted[b])].tolist()
        moves += sum(1 for i, node in enumerate(nodes) if node != i + 1)
    return 2 * moves * row * 2 * len(k_caches)


def hot_copy_bandwidth_gbs(nbytes: int, reps: int) -> float:
    """Copy bandwidth (read + write) of one contiguous ``copy_`` of nbytes / 2 bytes, timed
    like the kernels, i.e. with warm caches: the fair yardstick for small moves (the big
    copy of ``copy_bandwidth_gbs`` streams from DRAM, the moves mostly hit cache, as in
    decoding, where the tree's K/V were just written)."""
    src = torch.ones(max(nbytes // 2, 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), reps=reps)
    return nbytes / (t["median_us"] * 1e-6) / 1e9


def check_same_result(case):
    k, v, *rest = case
    k1, v1 = [t.clone() for t in k], [t.clone() for t in v]
    k2, v2 = [t.clone() for t in k], [t.clone() for t in v]
    gather_copy(k1, v1, *rest)
    torch.ops.specdec.compact_kv(k2, v2, *rest)
    assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k2 + v2)), "compact_kv disagrees with gather/copy"


def time_case(model: str, batch: int, nodes: int, accepted: int, chain: bool, dtype, copy_gbs: float,
              reps: int, min_time: float) -> dict:
    """One case's row: the baseline, ours and the wrapper timed on the same caches (checked
    to agree first), the moved bytes and ours' bandwidth."""
    case = build_case(model, batch, nodes, accepted, chain, dtype)
    check_same_result(case)
    k, v, *rest = case
    base = time_fn(lambda: gather_copy(k, v, *rest), reps=reps, min_time_s=min_time)
    ours = time_fn(lambda: torch.ops.specdec.compact_kv(k, v, *rest), reps=reps, min_time_s=min_time)
    wrapper = time_fn(lambda: specdec_kernels.compact_kv(k, v, *rest), reps=reps, min_time_s=min_time)
    nbytes = moved_bytes(case)
    gbs = nbytes / (ours["median_us"] * 1e-6) / 1e9
    hot_gbs = hot_copy_bandwidth_gbs(nbytes, reps=reps) if nbytes else float("nan")
    return dict(
        model=model,
        B=batch,
        tree="chain" if chain else f"tree{nodes}",
        accepted=accepted,
        moved_KiB=nbytes / 1024,
        gather_copy_us=base["median_us"],
        ours_us=ours["median_us"],
        wrapper_us=wrapper["median_us"],
        speedup=base["median_us"] / ours["median_us"],
        GBps=gbs,
        frac_copy_bw=gbs / copy_gbs,
        frac_hot_copy=gbs / hot_gbs if nbytes else float("nan"),
        baseline=base,
        ours=ours,
        ours_wrapper=wrapper,
    )


def summarize(rows: list) -> dict:
    """The run's worst speedups of trees and chains and median tree bandwidth, with the targets."""
    trees = [r for r in rows if r["tree"] != "chain"]
    chains = [r for r in rows if r["tree"] == "chain"]
    return {
        "min_tree_speedup": min(r["speedup"] for r in trees),
        "min_chain_speedup": min(r["speedup"] for r in chains),
        "median_tree_frac_copy_bw": sorted(r["frac_copy_bw"] for r in trees)[len(trees) // 2],
        "targets": {"tree_speedup": 3.0, "frac_copy_bw": 0.5, "chain_speedup": 50.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30-second smoke run")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "uint8"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the cores not busy with other work (specdec_kernels.threads)")
    add_out_name(parser, "kv_compaction")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    from specdec_kernels.threads import apply_threads

    args.threads = apply_threads(args.threads).threads  # the one default: the cores not busy

    # (tree nodes, accepted, chain)
    shapes = [(16, 1, False), (16, 4, False), (64, 4, False), (64, 8, False), (8, 7, True)]
    batches = [1, 8]
    cases = [(m, b, *s) for m in MODELS for b in batches for s in shapes]
    reps, min_time = 50, 0.8
    if args.quick:
        cases = [("smollm2-135m", 8, 16, 4, False), ("smollm2-135m", 8, 8, 7, True), ("llama3-8b", 1, 64, 8, False)]
        reps, min_time = 10, 0.05

    copy_gbs = copy_bandwidth_gbs(nbytes=(64 if args.quick else 256) * 2**20)
    rows = [time_case(*c, dtype, copy_gbs, reps, min_time) for c in tqdm(cases, desc="compact_kv")]

    print(f"\ncopy bandwidth (read + write): {copy_gbs:.1f} GB/s; torch threads: {torch.get_num_threads()}; "
          f"dtype {args.dtype}; block_size {BLOCK_SIZE}; prefix {PREFIX}")
    columns = ["model", "B", "tree", "accepted", "moved_KiB", "gather_copy_us", "ours_us", "wrapper_us", "speedup",
               "GBps", "frac_copy_bw", "frac_hot_copy"]
    print_table(rows, columns)
    summary = summarize(rows)
    print(
        f"trees: speedup >= {summary['min_tree_speedup']:.1f}x (target 3x), median fraction of copy bandwidth "
        f"{summary['median_tree_frac_copy_bw']:.2f} (target 0.5); chains: speedup >= "
        f"{summary['min_chain_speedup']:.0f}x (target 50x)"
    )
    path = write_results(
        args.out_name or "kv_compaction",
        {
            "quick": args.quick,
            "dtype": args.dtype,
            "block_size": BLOCK_SIZE,
            "prefix": PREFIX,
            "copy_bandwidth_gbs": copy_gbs,
            "rows": rows,
            "summary": summary,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
