"""Our Triton kernels on a CUDA GPU against plain PyTorch doing the same work, in one run.

  python bench/bench_gpu.py                 # on a machine with a CUDA GPU (not CI's)
  python bench/bench_gpu.py --small         # tiny shapes, a smoke run

Shapes of Qwen2.5-Coder-1.5B verification (12 query heads, 2 KV heads, head dim 128):
``tree_attention`` (4 requests, a 64-node tree each over a 2,048-token paged prefix) against
``F.scaled_dot_product_attention`` on the same keys already gathered contiguous (its mask
the same: the prefix and the node's ancestors); ``chain_rejection_sample`` (8 requests, 7
drafts, V = 151,936, sampled at T = 0.7 with draft probabilities) against the reference
arithmetic in torch ops (softmax, accept test, residual, multinomial); ``rms_norm`` [64, 1536]
and ``silu_and_mul`` [64, 17920] against torch eager. Times: CUDA events, medians of 50 after
10 warm-ups; GB/s = the bytes each kernel must read and write once, per second, against the
device-to-device copy bandwidth measured in the same run. Results: bench/results/gpu.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
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


def copy_gbs(dev) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (cuda_time_ms(lambda: dst.copy_(src), reps=20) * 1e-3) / 1e9


def bench_tree_attention(dev, small: bool) -> dict:
    B, nodes, prefix, Hq, Hkv, D, bs = (2, 8, 64, 4, 2, 32, 16) if small else (4, 64, 2048, 12, 2, 128, 16)
    g = torch.Generator(device=dev).manual_seed(0)
    blocks_per = math.ceil((prefix + nodes) / bs)
    k_cache = torch.randn(B * blocks_per, bs, Hkv, D, device=dev, generator=g)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.arange(B * blocks_per, device=dev, dtype=torch.int32).view(B, blocks_per)
    prefix_lens = torch.full((B,), prefix, device=dev, dtype=torch.int32)
    q = torch.randn(B * nodes, Hq, D, device=dev, generator=g)
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
    num_nodes = torch.full((B,), nodes, device=dev, dtype=torch.int32)
    ours = lambda: sk.tree_attention(q, k_cache, v_cache, block_table, prefix_lens, tree_mask=tree_mask,  # noqa: E731
                                     num_nodes=num_nodes)
    # Baseline: the same attention on keys already gathered per request, a dense bool mask.
    L = prefix + nodes
    K = k_cache.view(B, blocks_per * bs, Hkv, D)[:, :L].permute(0, 2, 1, 3).repeat_interleave(Hq // Hkv, 1)
    V = v_cache.view(B, blocks_per * bs, Hkv, D)[:, :L].permute(0, 2, 1, 3).repeat_interleave(Hq // Hkv, 1)
    Q = q.view(B, nodes, Hq, D).permute(0, 2, 1, 3)
    full = torch.cat([torch.ones(nodes, prefix, dtype=torch.bool), mask], 1).to(dev)
    base = lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=full)  # noqa: E731
    diff = (ours().view(B, nodes, Hq, D).permute(0, 2, 1, 3) - base()).abs().max().item()
    t_ours, t_base = cuda_time_ms(ours), cuda_time_ms(base)
    kv_bytes = 2 * B * L * Hkv * D * 4
    return {"op": "tree_attention", "shape": f"B={B} nodes={nodes} prefix={prefix} Hq={Hq} Hkv={Hkv} D={D}",
            "ours_ms": t_ours, "torch_ms": t_base, "speedup": t_base / t_ours, "max_abs_diff": diff,
            "ours_GB/s": kv_bytes / (t_ours * 1e-3) / 1e9}


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
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here", file=sys.stderr)
        return 2
    dev = "cuda"
    rows, errors = [], {}
    for fn in (bench_tree_attention, bench_rejection, bench_elementwise):
        try:
            r = fn(dev, args.small)
            rows += r if isinstance(r, list) else [r]
        except Exception as e:  # one failing kernel must not hide the others' numbers
            errors[fn.__name__] = f"{type(e).__name__}: {e}"
            print(f"{fn.__name__} failed: {errors[fn.__name__]}", file=sys.stderr)
    bw = copy_gbs(dev)
    for r in rows:
        r["frac_copy_bw"] = r["ours_GB/s"] / bw
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GB/s": bw, "rows": rows,
              "errors": errors}
    path = Path(args.out or Path(__file__).resolve().parent / "results" / "gpu.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"copy bandwidth {bw:.0f} GB/s; wrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
