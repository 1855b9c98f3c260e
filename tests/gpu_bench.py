"""Our Triton kernels on a GPU against plain PyTorch computing the same thing (one short run).

    python3 tests/gpu_bench.py                         # CUDA, realistic shapes (~1 min)
    python3 tests/gpu_bench.py --device cpu --small    # the plumbing, under the interpreter

Calls the Triton launchers (``specdec_kernels.triton.*``: what ``torch.ops.specdec.*`` runs
on CUDA tensors, minus the dispatcher) on Qwen2.5-1.5B shapes:

- tree_attention: 4 requests, a random 64-node tree each over a 2,048-token prefix, 12 query
  / 2 KV heads of 128, bf16, a paged cache (blocks of 16, shuffled block ids); against
  ``F.scaled_dot_product_attention`` (GQA) on the same keys already gathered contiguous, its
  bool mask the prefix plus the node's ancestors;
- chain_rejection_sample: 8 requests, K = 7 drafts, V = 151,936, fp32 logits and draft
  probabilities, T = 0.7; against the same arithmetic in torch ops (softmax, accept test,
  residual, multinomial); its result is also compared with the C++ op on the CPU (the same
  Philox streams: equal tokens expected);
- rms_norm [64, 1536] and silu_and_mul [64, 2 * 8960], bf16; against torch eager;
- quantized_linear and int8_activation_linear, a Q4_K weight [8960, 1536] (this package's
  quantiser), M = 1 and 16, fp32 x; against x @ W.T with W dequantised to bf16.

Times: CUDA events around each call, median of 50 after 10 warm-ups (CPU: wall clock, few
reps). GB/s: the bytes the op must move at least once (inputs read, outputs written) per
second, also as a fraction of the device-to-device copy bandwidth measured in the same run.
Writes a JSON to --out (default $OUT/gpu_bench.json, else /tmp/gpu_bench.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the Triton interpreter)")
    p.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 50; cpu 3)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_bench.json or /tmp/gpu_bench.json)")
    return p.parse_args()


args = parse_args()
if args.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec_kernels  # noqa: E402,F401
from specdec_kernels import gguf_blocks, tree  # noqa: E402

DEV = torch.device(args.device)
CUDA = DEV.type == "cuda"
REPS = args.reps or (50 if CUDA else 3)
WARMUP = 10 if CUDA else 1


def time_ms(fn) -> float:
    """Median milliseconds of one call of fn."""
    for _ in range(WARMUP):
        fn()
    times = []
    if CUDA:
        torch.cuda.synchronize()
        for _ in range(REPS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(REPS):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_gbs() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), GB/s."""
    n = (1 << 30) if CUDA and not args.small else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * n / (time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def row(op, shape, ours_ms, torch_ms, nbytes=None, **extra) -> dict:
    r = {"op": op, "shape": shape, "ours_ms": ours_ms, "torch_ms": torch_ms, "speedup": torch_ms / ours_ms}
    if nbytes is not None:
        r["bytes"] = nbytes
        r["ours_GB/s"] = nbytes / (ours_ms * 1e-3) / 1e9
    r.update(extra)
    return r


def bench_tree_attention() -> list[dict]:
    from specdec_kernels.triton.tree_attention import tree_attention

    B, N, P, Hq, Hkv, D, bs = (2, 8, 40, 4, 2, 32, 16) if args.small else (4, 64, 2048, 12, 2, 128, 16)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    L = P + N
    per = math.ceil(L / bs)
    k_cache = torch.randn(B * per + 3, bs, Hkv, D, generator=g).to(DEV, dtype)
    v_cache = torch.randn(B * per + 3, bs, Hkv, D, generator=g).to(DEV, dtype)
    block_table = torch.randperm(B * per + 3, generator=g)[:B * per].view(B, per).to(torch.int32).to(DEV)
    prefix_lens = torch.full((B,), P, dtype=torch.int32, device=DEV)
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
                            for _ in range(B)], dtype=torch.int32)
    num_nodes = torch.full((B,), N, dtype=torch.int32)
    qo_indptr = tree.qo_indptr_from_num_nodes(num_nodes).to(DEV)
    mask = tree.tree_mask(parents, num_nodes)  # [B, N, W]
    ragged = tree.tree_mask_ragged(mask, tree.qo_indptr_from_num_nodes(num_nodes), B * N).to(DEV)
    q = torch.randn(B * N, Hq, D, generator=g).to(DEV, dtype)
    out = torch.empty_like(q)
    lse = torch.empty(B * N, Hq, dtype=torch.float32, device=DEV)
    scale = D ** -0.5

    def ours():
        tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, ragged, scale, out, lse)

    # Baseline: the keys of each request gathered contiguous beforehand (not timed), a bool mask.
    idx = (block_table.long()[:, :, None] * bs + torch.arange(bs, device=DEV)).view(B, -1)[:, :L]
    K = k_cache.view(-1, Hkv, D)[idx].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, L, D]
    V = v_cache.view(-1, Hkv, D)[idx].permute(0, 2, 1, 3).contiguous()
    Q = q.view(B, N, Hq, D).permute(0, 2, 1, 3)
    anc = tree.unpack_tree_mask(mask, N).bool()  # [B, N, N]
    full = torch.cat([torch.ones(B, N, P, dtype=torch.bool), anc], -1)[:, None].to(DEV)  # [B, 1, N, L]
    try:
        F.scaled_dot_product_attention(Q[:, :, :1], K, V, attn_mask=full[:, :, :1], enable_gqa=True)
        gqa = dict(enable_gqa=True)
    except TypeError:  # an older torch: repeat the KV heads
        K, V, gqa = K.repeat_interleave(Hq // Hkv, 1), V.repeat_interleave(Hq // Hkv, 1), {}

    def base():
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=full, scale=scale, **gqa)

    ours()
    diff = (out.view(B, N, Hq, D).permute(0, 2, 1, 3).float() - base().float()).abs().max().item()
    e = q.element_size()
    nbytes = 2 * B * L * Hkv * D * e + 2 * q.numel() * e + lse.numel() * 4
    return [row("tree_attention", f"B={B} nodes={N} prefix={P} Hq={Hq} Hkv={Hkv} D={D} bf16 paged bs={bs}",
                time_ms(ours), time_ms(base), nbytes, max_abs_diff=diff)]


def bench_rejection() -> list[dict]:
    from specdec_kernels.triton.rejection_sampling import chain_rejection_sample

    B, K, V = (2, 3, 1000) if args.small else (8, 7, 151936)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    probs = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    probs = 0.5 * probs + 0.5 * torch.softmax(logits[:, :K] / 0.7, -1)  # drafts often accepted
    drafts = torch.multinomial(probs.view(-1, V), 1, generator=g).view(B, K)
    n = torch.full((B,), K, dtype=torch.int32)
    temp = torch.full((B,), 0.7)
    seed = torch.arange(1, B + 1, dtype=torch.int64) * 7919
    offset = torch.zeros(B, dtype=torch.int64)
    cpu_args = (drafts, n, logits, probs, temp, seed, offset)
    want = (torch.empty(B, K + 1, dtype=torch.int64), torch.empty(B, dtype=torch.int32))
    torch.ops.specdec.chain_rejection_sample(*cpu_args, *want)  # the C++ kernel: same Philox streams
    d_args = tuple(t.to(DEV) for t in cpu_args)
    out_ids = torch.empty(B, K + 1, dtype=torch.int64, device=DEV)
    num_acc = torch.empty(B, dtype=torch.int32, device=DEV)

    def ours():
        chain_rejection_sample(*d_args, out_ids, num_acc)

    dl, dq, dd = d_args[2], d_args[3], d_args[0]
    bidx = torch.arange(B, device=DEV)

    def base():  # the same arithmetic in torch ops (torch's own random numbers)
        p = torch.softmax(dl / 0.7, -1)
        pd = p[:, :K].gather(-1, dd[..., None])[..., 0]
        qd = dq.gather(-1, dd[..., None])[..., 0]
        accept = torch.rand(B, K, device=DEV) * qd <= pd
        n_acc = torch.cumprod(accept.int(), -1).sum(-1)
        residual = (p[:, :K] - dq).clamp_min(0)
        rows = torch.cat([residual, p[:, K:]], 1)[bidx, n_acc]
        return n_acc, torch.multinomial(rows, 1)

    ours()
    same = bool(torch.equal(out_ids.cpu(), want[0]) and torch.equal(num_acc.cpu(), want[1]))
    nbytes = logits.numel() * 4 + probs.numel() * 4
    return [row("chain_rejection_sample", f"B={B} K={K} V={V} fp32 T=0.7 with draft probs", time_ms(ours),
                time_ms(base), nbytes, matches_cpu_op=same, mean_accepted=float(want[1].float().mean()))]


def bench_elementwise() -> list[dict]:
    from specdec_kernels.triton.rms_norm import rms_norm
    from specdec_kernels.triton.silu_and_mul import silu_and_mul

    M, H, I = (4, 256, 512) if args.small else (64, 1536, 8960)
    dt = torch.bfloat16
    x, w = torch.randn(M, H, device=DEV, dtype=dt), torch.randn(H, device=DEV, dtype=dt)
    out = torch.empty_like(x)

    def base_rms():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dt)

    rms_norm(x, w, 1e-6, out)
    rows = [row("rms_norm", f"[{M}, {H}] bf16", time_ms(lambda: rms_norm(x, w, 1e-6, out)), time_ms(base_rms),
                2 * x.numel() * 2 + H * 2, max_abs_diff=(out.float() - base_rms().float()).abs().max().item())]
    gu = torch.randn(M, 2 * I, device=DEV, dtype=dt)
    o2 = torch.empty(M, I, device=DEV, dtype=dt)

    def base_silu():
        return F.silu(gu[:, :I]) * gu[:, I:]

    silu_and_mul(gu, o2)
    rows.append(row("silu_and_mul", f"[{M}, 2*{I}] bf16", time_ms(lambda: silu_and_mul(gu, o2)), time_ms(base_silu),
                    (gu.numel() + o2.numel()) * 2,
                    max_abs_diff=(o2.float() - base_silu().float()).abs().max().item()))
    return rows


def bench_linear() -> list[dict]:
    from specdec_kernels.triton.linear import int8_activation_linear, quantized_linear

    N, H = (64, 256) if args.small else (8960, 1536)
    g = torch.Generator().manual_seed(0)
    weight = gguf_blocks.quantize(torch.randn(N, H, generator=g) * 0.02, "Q4_K")
    blocks = weight.blocks.to(DEV)
    packed = gguf_blocks.pack_int8_activation(weight.blocks, "Q4_K").to(DEV)
    w32 = gguf_blocks.dequantize(weight.blocks, "Q4_K").to(DEV)  # [N, H], the weights' exact values
    w16 = w32.to(torch.bfloat16)
    rows = []
    for M in (1, 16):
        x = torch.randn(M, H, generator=g).to(DEV)
        x16 = x.to(torch.bfloat16)
        out = torch.empty(M, N, device=DEV)
        ref = x.double() @ w32.double().T
        quantized_linear(x, blocks, 12, None, out)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        t_base = time_ms(lambda: x16 @ w16.T)
        base_err = (((x16 @ w16.T).double() - ref).abs().max() / ref.abs().max()).item()
        io = x.numel() * 4 + out.numel() * 4
        rows.append(row("quantized_linear", f"M={M} [{N}, {H}] Q4_K, fp32 x", time_ms(
            lambda: quantized_linear(x, blocks, 12, None, out)), t_base, blocks.numel() + io, max_rel_err=err,
            torch_bf16_max_rel_err=base_err, torch_GB_per_s=(w16.numel() * 2 + io) / (t_base * 1e-3) / 1e9))
        int8_activation_linear(x, packed, 12, None, out)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        rows.append(row("int8_activation_linear", f"M={M} [{N}, {H}] Q4_K packed, fp32 x", time_ms(
            lambda: int8_activation_linear(x, packed, 12, None, out)), t_base, packed.numel() + io, max_rel_err=err,
            torch_bf16_max_rel_err=base_err))
    return rows


def main() -> int:
    if CUDA and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here (use --device cpu --small for the plumbing)", file=sys.stderr)
        return 2
    import triton

    name = torch.cuda.get_device_name(DEV) if CUDA else "cpu (Triton interpreter)"
    print(f"gpu_bench: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{'small' if args.small else 'full'} shapes, median of {REPS}", flush=True)
    rows, errors = [], {}
    for fn in (bench_tree_attention, bench_rejection, bench_elementwise, bench_linear):
        start = time.perf_counter()
        try:
            rows += fn()
        except Exception as e:  # one failing kernel must not hide the others' numbers
            errors[fn.__name__] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"  {fn.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
    bw = copy_gbs()
    head = f"{'op':<24}{'shape':<52}{'ours ms':>9}{'torch ms':>10}{'speedup':>9}{'GB/s':>8}{'of copy':>9}  check"
    print(f"\ndevice-to-device copy: {bw:.0f} GB/s\n{head}\n{'-' * len(head)}")
    for r in rows:
        if "ours_GB/s" in r:
            r["frac_of_copy_bw"] = r["ours_GB/s"] / bw
        check = {k: r[k] for k in ("max_abs_diff", "max_rel_err", "matches_cpu_op") if k in r}
        check = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in check.items())
        print(f"{r['op']:<24}{r['shape'][:51]:<52}{r['ours_ms']:>9.4f}{r['torch_ms']:>10.4f}{r['speedup']:>9.2f}"
              f"{r.get('ours_GB/s', float('nan')):>8.0f}{r.get('frac_of_copy_bw', float('nan')):>9.1%}  {check}")
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "small": args.small,
              "reps": REPS, "copy_GB/s": bw, "rows": rows, "errors": errors}
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT") else
                            "/tmp/gpu_bench.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}" + (f"; FAILED: {sorted(errors)}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
