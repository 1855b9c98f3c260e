"""Our Triton kernels on a CUDA GPU against plain PyTorch doing the same work, in one run.

  python bench/bench_gpu.py                 # on a machine with a CUDA GPU (not CI's)
  python bench/bench_gpu.py --small         # tiny shapes, a smoke run
  python bench/bench_gpu.py --no-sweep      # without the tree_attention configuration sweep

Shapes of Qwen2.5-Coder-1.5B verification (12 query heads, 2 KV heads, head dim 128):
``tree_attention`` (4 requests, a 64-node tree each over a 2,048-token paged prefix), in fp32
and in bf16, against ``F.scaled_dot_product_attention`` in the same dtype on the same keys
already gathered contiguous (its mask the same: the prefix and the node's ancestors): the op
as callers use it (its wrapper builds qo_indptr and the [T, W] mask each call), the Triton
launcher alone with its default launch (recorded), and a sweep of launch configurations
(TREE_SWEEP: ms and max abs diff each, within a time budget; a failing one records its
error); ``chain_rejection_sample`` (8 requests, 7 drafts, V = 151,936, sampled at T = 0.7
with draft probabilities) against the reference arithmetic in torch ops (softmax, accept
test, residual, multinomial); ``rms_norm`` [64, 1536] and ``silu_and_mul`` [64, 17920]
against torch eager. Times: CUDA events, medians of 50 after 10 warm-ups (the sweep: of 20
after 3); GB/s = the bytes each kernel must read and write once, per second, against the
device-to-device copy bandwidth measured in the same run. Results: bench/results/gpu.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec_kernels as sk  # noqa: E402


def cuda_time_ms(fn, reps=50, warmup=10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rounded(v):
    """v for printing: floats to 4 significant digits (a max abs diff of 4e-7 stays visible)."""
    return float(f"{v:.4g}") if isinstance(v, float) else v


def copy_gbs(dev) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (cuda_time_ms(lambda: dst.copy_(src), reps=20) * 1e-3) / 1e9


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def tree_problem(dev, small: bool, dtype: torch.dtype) -> dict:
    """The tree_attention work (see the module docstring) in ``dtype``: the op's arguments, the
    launcher's (qo_indptr, the mask as [T, W]) and the baseline's gathered Q, K, V and mask."""
    B, nodes, prefix, Hq, Hkv, D, bs = (2, 8, 64, 4, 2, 32, 16) if small else (4, 64, 2048, 12, 2, 128, 16)
    g = torch.Generator(device=dev).manual_seed(0)
    blocks_per = math.ceil((prefix + nodes) / bs)
    k_cache = torch.randn(B * blocks_per, bs, Hkv, D, device=dev, generator=g).to(dtype)
    v_cache = torch.randn(B * blocks_per, bs, Hkv, D, device=dev, generator=g).to(dtype)
    block_table = torch.arange(B * blocks_per, device=dev, dtype=torch.int32).view(B, blocks_per)
    prefix_lens = torch.full((B,), prefix, device=dev, dtype=torch.int32)
    q = torch.randn(B * nodes, Hq, D, device=dev, generator=g).to(dtype)
    parents = torch.arange(-1, nodes - 1, device="cpu")
    parents[1:] = torch.div(torch.arange(nodes - 1), 2, rounding_mode="floor")  # a binary tree
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = int(parents[j])
    from specdec_kernels.tree import tree_mask as packed_tree_mask

    tree_mask = packed_tree_mask(parents[None].repeat(B, 1).to(dev, torch.int32))  # int64 [B, nodes, words]
    # Baseline: the same attention on keys already gathered per request, a dense bool mask.
    L = prefix + nodes
    K = k_cache.view(B, blocks_per * bs, Hkv, D)[:, :L].permute(0, 2, 1, 3).repeat_interleave(Hq // Hkv, 1)
    V = v_cache.view(B, blocks_per * bs, Hkv, D)[:, :L].permute(0, 2, 1, 3).repeat_interleave(Hq // Hkv, 1)
    Q = q.view(B, nodes, Hq, D).permute(0, 2, 1, 3)
    full = torch.cat([torch.ones(nodes, prefix, dtype=torch.bool), mask], 1).to(dev)
    return dict(
        B=B, nodes=nodes, prefix=prefix, Hq=Hq, Hkv=Hkv, D=D, L=L, q=q, k_cache=k_cache, v_cache=v_cache,
        block_table=block_table, prefix_lens=prefix_lens, tree_mask=tree_mask,
        num_nodes=torch.full((B,), nodes, device=dev, dtype=torch.int32),
        qo_indptr=torch.arange(0, B * nodes + 1, nodes, device=dev, dtype=torch.int32),
        flat_mask=tree_mask.reshape(B * nodes, -1).contiguous(),  # [T, W]: request b's rows b * nodes ...
        base=lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=full),
        shape=f"B={B} nodes={nodes} prefix={prefix} Hq={Hq} Hkv={Hkv} D={D}",
    )


def launcher_call(pb: dict, **config):
    """The Triton launcher itself (no op wrapper) with launch overrides; returns out [T, Hq, D]."""
    from specdec_kernels.triton.tree_attention import tree_attention as launcher

    out = torch.empty_like(pb["q"])
    launcher(pb["q"], pb["k_cache"], pb["v_cache"], pb["block_table"], pb["prefix_lens"], pb["qo_indptr"],
             pb["flat_mask"], pb["D"] ** -0.5, out, None, **config)
    return out


def launch_plan(pb: dict, **config) -> dict:
    """The launch the launcher makes for this problem (its defaults where config is silent)."""
    from specdec_kernels.triton.tree_attention import plan_launch

    T = pb["q"].shape[0]
    capacity = pb["block_table"].shape[1] * pb["k_cache"].shape[1]
    return plan_launch(T, pb["B"], pb["Hq"], pb["Hkv"], pb["D"], capacity, pb["q"].dtype, pb["q"].device, **config)


def max_diff(pb: dict, out: torch.Tensor, base: torch.Tensor) -> float:
    B, nodes, Hq, D = pb["B"], pb["nodes"], pb["Hq"], pb["D"]
    return (out.view(B, nodes, Hq, D).permute(0, 2, 1, 3).float() - base.float()).abs().max().item()


def bench_tree_attention(dev, small: bool, dtype: torch.dtype) -> dict:
    """The op (its wrapper, as a caller uses it), the launcher alone with its defaults, and
    SDPA, all in ``dtype``."""
    pb = tree_problem(dev, small, dtype)
    ours = lambda: sk.tree_attention(pb["q"], pb["k_cache"], pb["v_cache"], pb["block_table"],  # noqa: E731
                                     pb["prefix_lens"], tree_mask=pb["tree_mask"], num_nodes=pb["num_nodes"])
    base = pb["base"]
    diff = max_diff(pb, ours(), base())
    t_ours, t_launcher, t_base = cuda_time_ms(ours), cuda_time_ms(lambda: launcher_call(pb)), cuda_time_ms(base)
    kv_bytes = 2 * pb["B"] * pb["L"] * pb["Hkv"] * pb["D"] * pb["k_cache"].element_size()
    return {"op": "tree_attention", "dtype": DTYPE_NAMES[dtype], "shape": pb["shape"],
            "ours_ms": t_ours, "torch_ms": t_base, "speedup": t_base / t_ours, "max_abs_diff": diff,
            "ours_GB/s": kv_bytes / (t_ours * 1e-3) / 1e9, "launcher_ms": t_launcher,
            "launcher_defaults": launch_plan(pb)}


# The tree_attention sweep: launch overrides (see specdec_kernels/triton/tree_attention.py,
# plan_launch), most telling first, since configurations past the time budget are skipped. {}
# is the launcher's defaults; "splits/2" and "splits*2" halve and double its num_splits.
TREE_SWEEP = (
    ("fp32", {}),
    ("bf16", {}),
    ("fp32", dict(block_m=16, block_n=32, num_warps=8)),
    ("fp32", dict(block_m=32, block_n=32, num_warps=8, num_stages=3)),
    ("fp32", dict(block_m=32, block_n=16, num_warps=8)),
    ("fp32", dict(block_m=16, block_n=16, num_warps=4)),
    ("bf16", dict(block_n=64, num_warps=8)),
    ("bf16", dict(block_n=64, num_warps=4)),
    ("bf16", dict(block_n=32, num_warps=4)),
    ("bf16", dict(block_n=32, num_warps=8, num_stages=3)),
    ("fp32", "splits/2"),
    ("fp32", "splits*2"),
    ("bf16", "splits/2"),
    ("bf16", "splits*2"),
    # Opt-in 3xTF32 tensor-core dots for fp32 (not IEEE: the contract's default stays "ieee").
    ("fp32", dict(fp32_precision="tf32x3")),
    ("fp32", dict(fp32_precision="tf32x3", block_n=64, num_warps=8)),
)


def sweep_tree_attention(dev, small: bool, budget_s: float = 60.0) -> list[dict]:
    """Each TREE_SWEEP configuration: ms (CUDA events, median of 20), max abs diff against
    SDPA in the same dtype, the launch it resolved to; a configuration that fails (compile or
    run) records its error, one past budget_s of wall time (compiles included) is skipped."""
    start = time.perf_counter()
    problems = {name: tree_problem(dev, small, dtype) for dtype, name in DTYPE_NAMES.items()}
    bases = {name: (pb["base"](), cuda_time_ms(pb["base"], reps=20, warmup=3)) for name, pb in problems.items()}
    results = []
    for name, config in TREE_SWEEP:
        pb = problems[name]
        base_out, base_ms = bases[name]
        if isinstance(config, str):  # the default num_splits, halved or doubled
            splits = launch_plan(pb)["num_splits"]
            config = {"num_splits": max(1, splits // 2) if config == "splits/2" else splits * 2}
        entry = {"dtype": name, "config": config}
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            entry["skipped"] = f"time budget ({budget_s:.0f} s) spent"
        else:
            try:
                entry["plan"] = launch_plan(pb, **config)
                entry["max_abs_diff"] = max_diff(pb, launcher_call(pb, **config), base_out)  # compiles
                entry["ms"] = cuda_time_ms(lambda: launcher_call(pb, **config), reps=20, warmup=3)
                entry["torch_ms"] = base_ms
                entry["speedup"] = base_ms / entry["ms"]
            except Exception as e:  # one configuration must not end the sweep
                entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            entry["wall_s"] = time.perf_counter() - start - elapsed
        results.append(entry)
        print("sweep", json.dumps({k: rounded(v) for k, v in entry.items() if k != "plan"}))
    return results


def bench_rejection(dev, small: bool) -> dict:
    B, K, V = (2, 3, 1000) if small else (8, 7, 151936)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(B, K + 1, V, device=dev, generator=g) * 3
    draft_probs = torch.softmax(torch.randn(B, K, V, device=dev, generator=g) * 3, -1)
    drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=g).view(B, K)
    n = torch.full((B,), K, device=dev, dtype=torch.int32)
    temp = torch.full((B,), 0.7, device=dev)
    seed = torch.arange(B, device=dev, dtype=torch.int64)
    ours = lambda: sk.chain_rejection_sample(drafts, n, logits, draft_probs, temp, seed, 0)  # noqa: E731

    def base():  # the same arithmetic in torch ops (its own random numbers)
        p = torch.softmax(logits / 0.7, -1)
        pd = p[:, :K].gather(-1, drafts[..., None])[..., 0]
        qd = draft_probs.gather(-1, drafts[..., None])[..., 0]
        accept = torch.rand(B, K, device=dev) * qd <= pd
        residual = (p[:, :K] - draft_probs).clamp_min(0)
        return accept, torch.multinomial(residual.view(-1, V) + 1e-20, 1)

    t_ours, t_base = cuda_time_ms(ours), cuda_time_ms(base)
    nbytes = logits.numel() * 4 + draft_probs.numel() * 4
    return {"op": "chain_rejection_sample", "shape": f"B={B} K={K} V={V} T=0.7", "ours_ms": t_ours, "torch_ms": t_base,
            "speedup": t_base / t_ours, "ours_GB/s": nbytes / (t_ours * 1e-3) / 1e9}


def bench_elementwise(dev, small: bool) -> list[dict]:
    rows = 4 if small else 64
    x, w = torch.randn(rows, 1536, device=dev), torch.randn(1536, device=dev)
    gu = torch.randn(rows, 17920, device=dev)
    out = []
    ours = lambda: sk.rms_norm(x, w, 1e-6)  # noqa: E731
    base = lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    t_o, t_b = cuda_time_ms(ours), cuda_time_ms(base)
    out.append({"op": "rms_norm", "shape": f"[{rows}, 1536]", "ours_ms": t_o, "torch_ms": t_b, "speedup": t_b / t_o,
                "max_abs_diff": (ours() - base()).abs().max().item(), "ours_GB/s": 2 * x.numel() * 4 / (t_o * 1e-3) / 1e9})
    ours = lambda: sk.silu_and_mul(gu)  # noqa: E731
    base = lambda: F.silu(gu[:, :8960]) * gu[:, 8960:]  # noqa: E731
    t_o, t_b = cuda_time_ms(ours), cuda_time_ms(base)
    out.append({"op": "silu_and_mul", "shape": f"[{rows}, 17920]", "ours_ms": t_o, "torch_ms": t_b, "speedup": t_b / t_o,
                "max_abs_diff": (ours() - base()).abs().max().item(),
                "ours_GB/s": 1.5 * gu.numel() * 4 / (t_o * 1e-3) / 1e9})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu.json)")
    p.add_argument("--no-sweep", action="store_true", help="skip the tree_attention launch-configuration sweep")
    p.add_argument("--sweep-budget", type=float, default=60.0,
                   help="seconds of wall time (compiles included) after which sweep configurations are skipped")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here", file=sys.stderr)
        return 2
    dev = "cuda"
    rows, errors = [], {}
    benches = (("bench_tree_attention_fp32", lambda: bench_tree_attention(dev, args.small, torch.float32)),
               ("bench_tree_attention_bf16", lambda: bench_tree_attention(dev, args.small, torch.bfloat16)),
               ("bench_rejection", lambda: bench_rejection(dev, args.small)),
               ("bench_elementwise", lambda: bench_elementwise(dev, args.small)))
    for name, fn in benches:
        try:
            r = fn()
            rows += r if isinstance(r, list) else [r]
        except Exception as e:  # one failing kernel must not hide the others' numbers
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {errors[name]}", file=sys.stderr)
    bw = copy_gbs(dev)
    for r in rows:
        r["frac_copy_bw"] = r["ours_GB/s"] / bw
        print(json.dumps({k: rounded(v) for k, v in r.items()}))
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # "rows" as before (tree_attention: fp32 first, then bf16, each with the launch its
    # defaults made, "launcher_defaults"); "sweep": tree_attention launch configurations.
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version,
              "copy_GB/s": bw, "rows": rows, "sweep": [], "errors": errors}
    path = Path(args.out or Path(__file__).resolve().parent / "results" / "gpu.json")
    # Written before the sweep too: a run cut short there (a time limit, a faulted context)
    # keeps the rows; the sweep prints each entry as it goes.
    path.write_text(json.dumps(result, indent=1))
    if not args.no_sweep:
        try:
            result["sweep"] = sweep_tree_attention(dev, args.small, args.sweep_budget)
        except Exception as e:
            errors["sweep_tree_attention"] = f"{type(e).__name__}: {e}"
            print(f"sweep_tree_attention failed: {errors['sweep_tree_attention']}", file=sys.stderr)
        path.write_text(json.dumps(result, indent=1))
    print(f"copy bandwidth {bw:.0f} GB/s; wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
