"""Print the benchmark tables of docs/benchmarks.md (markdown) from the JSON under bench/results/.

    python bench/report.py            # every area that has results
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(d) -> str:
    m = d["machine"]
    return f"({m['cpu_count']} cores, {m['torch_threads']} torch threads, torch {m['torch']}, {m['time']})"


def rejection_sampling(d) -> str:
    rows = [r for r in d["rows"] if r["B"] >= 8 and r["K"] == 5] + [r for r in d["rows"] if r["B"] == 1 and r["K"] == 5]
    out = [f"Copy bandwidth measured in the same run: {d['copy_bandwidth_gbs']:.1f} GB/s {machine_line(d)}.", ""]
    out.append(table(["B", "K", "V", "ours µs", "plain torch µs", "HF assisted µs", "× plain", "× HF", "fraction of copy BW"],
                     [[r["B"], r["K"], r["V"], r["ours_us"], r["plain_torch_us"], r["hf_us"], r["speedup_vs_plain"],
                       r["speedup_vs_hf"], r["frac_copy_bw"]] for r in rows]))
    return "\n".join(out)


def tree_attention(d) -> str:
    rows = [r for r in d["rows"] if r["prefix"] == 2048 or r["N"] == 1 and r["prefix"] == 8192]
    out = [f"Copy bandwidth {d['copy_bandwidth_gbs']:.1f} GB/s, fp32 matmul {d['matmul_gflops']:.0f} GFLOP/s "
           f"measured in the same run {machine_line(d)}; {d['dtype']}, block size {d['block_size']}.", ""]
    out.append(table(["model", "B", "prefix", "N", "ours µs", "SDPA+mask µs", "× SDPA", "× SDPA after repeat_kv",
                      "GFLOP/s", "fraction of copy BW"],
                     [[r["model"], r["B"], r["prefix"], r["N"], r["ours_us"], r["sdpa_mask_us"], r["speedup"],
                       r["speedup_vs_repeat_kv"], r["GFLOP/s"], r["frac_copy_bw"] if r["N"] == 1 else ""] for r in rows]))
    return "\n".join(out)


def kv_compaction(d) -> str:
    out = [f"Copy bandwidth {d['copy_bandwidth_gbs']:.1f} GB/s {machine_line(d)}; {d['dtype']}, block size "
           f"{d['block_size']}, prefix {d['prefix']}.", ""]
    out.append(table(["model", "B", "case", "accepted", "KiB moved", "per-layer gather/copy µs", "ours µs", "speedup",
                      "fraction of copy BW"],
                     [[r["model"], r["B"], r["tree"], r["accepted"], r["moved_KiB"], r["gather_copy_us"], r["ours_us"],
                       r["speedup"], r["frac_copy_bw"]] for r in d["rows"]]))
    return "\n".join(out)


def medusa(d) -> str:
    out = [f"Copy bandwidth {d['copy_bandwidth_gbs']:.1f} GB/s {machine_line(d)}; `{d['command']}`.", ""]
    out.append(table(["case", "M", "heads", "LM head", "dtype", "ours µs", "eager µs", "× eager", "× one batched GEMM",
                      "fraction of copy BW"],
                     [[r["case"], r["M"], r["K"], r["lm_head"], r["dtype"], r["ours_us"], r["eager_us"], r["x_eager"],
                       r["x_batched"], r["frac_copy"]] for r in d["medusa_topk"]]))
    return "\n".join(out)


def linear(d) -> str:
    out = [f"Copy bandwidth {d['copy_bandwidth_gbs']:.1f} GB/s {machine_line(d)}; `{d['command']}`.", ""]
    out += ["skinny_linear at M = 8 (cold weights: a different weight copy per call, as in a decode step):", ""]
    t = d["targets"]
    out.append(table(["weight [N, H]:dtype", "M=8 time / M=1 time", "× F.linear"],
                     [[k, t["skinny_M8_cold_vs_M1"][k], t["skinny_M8_cold_x_F.linear"][k]]
                      for k in t["skinny_M8_cold_vs_M1"]]))
    if d.get("quantized_linear"):
        out += ["", "quantized_linear on cold GGUF blocks against F.linear and skinny_linear on the same weight "
                "dequantised to fp32 (cold too); fraction of copy bandwidth on the quantised bytes:", ""]
        out.append(table(["weight [N, H]", "blocks", "M", "MB", "ours µs", "F.linear fp32 µs", "skinny fp32 µs",
                          "× F.linear", "× skinny", "time / M=1 time", "fraction of copy BW"],
                         [[f"{r['N']}x{r['H']}", r["block_type"], r["M"], r["weight_MB"], r["ours_us"],
                           r["F.linear_fp32_us"], r["skinny_fp32_us"], r["x_F.linear"], r["x_skinny"], r["vs_M1"],
                           r["frac_copy"]] for r in d["quantized_linear"] if r["M"] in (1, 8, 16)]))
        if any("int8act_us" in r for r in d["quantized_linear"]):
            out += ["", "int8_activation_linear on the same blocks repacked (cold), against quantized_linear above; "
                    "fraction of copy bandwidth on the packed bytes:", ""]
            out.append(table(["weight [N, H]", "blocks", "M", "int8 µs", "quantized µs", "× quantized",
                              "time / M=1 time", "fraction of copy BW"],
                             [[f"{r['N']}x{r['H']}", r["block_type"], r["M"], r["int8act_us"], r["ours_us"],
                               r["x_quantized"], r["int8act_vs_M1"], r["int8act_frac_copy"]]
                              for r in d["quantized_linear"] if r["M"] in (1, 4, 8, 16) and "int8act_us" in r]))
    return "\n".join(out)


def e2e(d) -> str:
    out = [f"{machine_line(d)}; weights {d.get('weights', 'fp32')}; model load {d.get('load_seconds', 0):.1f} s.", ""]
    rows = d["summary"]
    if rows and "decode_tokens_per_s" in rows[0]:
        out.append(table(["batch", "method", "tokens/s", "median", "decode tokens/s", "prefill tokens/s", "× ours AR",
                          "mean accepted length", "greedy = ours AR"],
                         [[r["batch"], r["method"], r["tokens_per_s"], r.get("median_tokens_per_s", ""),
                           r["decode_tokens_per_s"], r["prefill_tokens_per_s"], r["speedup_vs_ours_ar"],
                           r.get("mean_accepted_length", ""), r["identical"]] for r in rows]))
    else:
        out.append(table(["batch", "method", "tokens/s", "× ours AR", "mean accepted length", "greedy output identical"],
                         [[r["batch"], r["method"], r["tokens_per_s"], r["speedup_vs_ours_ar"],
                           r["mean_accepted_length"], r["identical"]] for r in rows]))
    return "\n".join(out)


def step_profile(d) -> str:
    ms = d["ms_per_step"]
    total = sum(ms.values())
    out = [f"{d['weights']} weights, {d['threads']} thread(s), {d['decode_steps']} decode steps profiled; "
           f"{d['weight_bytes_per_step'] / 1e6:.1f} MB of weights per step; step {d['step_ms_unprofiled']:.1f} ms "
           f"unprofiled; weight products at {d['weight_products_gbs']:.1f} GB/s against {d['copy_bandwidth_gbs']:.1f} "
           f"GB/s copy bandwidth (roofline step {d['roofline_step_ms']:.1f} ms).", ""]
    out.append(table(["part of the step", "ms (profiled)", "share"], [[k, v, f"{v / total:.0%}"] for k, v in ms.items()]))
    return "\n".join(out)


def vllm(d) -> str:
    m = d["machine"]
    out = [f"({m['cpu_count']} cores, {m['threads']} thread(s) for vLLM and for our loop, vLLM {m['vllm']}, torch "
           f"{m['torch']}, {m['time']}, load average {m['load_average'][0]:.1f}).", ""]
    out.append(table(["T", "batch", "method", "tokens/s", "× vLLM AR", "mean accepted length",
                      "rejection sampler ms/step", "greedy = vLLM AR"],
                     [[r["temperature"], r["batch"], r["method"], r["tokens_per_s"], r["x_vllm_ar"] or "",
                       r.get("mean_accepted_length", ""), r.get("rs_ms_per_step", ""),
                       r.get("greedy_identical_to_vllm_ar", "")]
                      for r in sorted(d["summary"], key=lambda r: (r["temperature"], r["batch"]))]))
    if d.get("rejection_sampler_micro"):
        out += ["", "The rejection sampler's `forward` alone on a synthetic step (V = 49152, every request with k "
                "drafts), medians of 30 calls:", ""]
        out.append(table(["T", "batch", "k", "vLLM's ms", "ours ms", "× vLLM's"],
                         [[r["temperature"], r["batch"], r["k"], r["vllm_ms"], r["specdec_ms"], r["speedup"]]
                          for r in d["rejection_sampler_micro"]]))
    return "\n".join(out)


def main(argv=None) -> int:
    for name, fn in [("rejection_sampling", rejection_sampling), ("tree_attention", tree_attention),
                     ("kv_compaction", kv_compaction), ("medusa", medusa), ("linear", linear), ("e2e", e2e), ("e2e_spec_bench", e2e),
                     ("e2e_spec_bench_native", e2e), ("step_profile_native", step_profile),
                     ("step_profile_fp32", step_profile), ("vllm", vllm)]:
        d = load(name)
        if d is not None:
            print(f"### {name}\n\n{fn(d)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
