"""Compile every Triton kernel of specdec_kernels/triton/ for sm_90 ahead of time (no GPU needed).

The tests run the kernels under TRITON_INTERPRET=1, and the interpreter accepts code that the
compiler rejects (a loop-carried variable that changes type, a scalar where a block is needed,
an API one Triton version lacks, too much shared memory, ...). This script compiles, with
``triton.compile(ASTSource(...))`` for ``GPUTarget("cuda", 90, 32)`` (ptxas ships with Triton),
each kernel in every constexpr variant and pointer dtype its launcher uses on a GPU, with its
launch options (Triton's defaults, num_warps=4 and num_stages=3, unless the launcher sets them,
as tree_attention's GPU_CONFIGS do) and 16-byte aligned pointers (what torch
allocations give). Each distinct (kernel, signature, constexprs) is compiled once; Triton's
on-disk cache makes re-runs of unchanged kernels fast.

It also fails when a ``@triton.jit`` function of specdec_kernels/triton/ is neither compiled
here nor called from another jit function (a new or renamed kernel must be added below), and
when a kernel needs more shared memory than an sm_90 block may have.

Run it without TRITON_INTERPRET (tests/test_triton_compile.py does, in a subprocess):
    python tests/triton_compile_check.py [-v] [--full]
(-v: one line per variant with its compile time and shared memory; --full: also the variants
that take long to compile, see ATTEND_VARIANTS_FULL.)
Exit status: 0 all compiled; 1 some kernel failed; 77 this Triton cannot compile for CUDA here.
"""
from __future__ import annotations

import os
import re
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    print("unset TRITON_INTERPRET: under the interpreter triton.jit gives no compilable kernels")
    sys.exit(2)

import torch  # noqa: E402  (loads libtorch before specdec_kernels._C)

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as e:
    print(f"this Triton cannot compile ahead of time: {e}")
    sys.exit(77)

try:
    from triton.backends import backends as _triton_backends
except ImportError:  # pragma: no cover
    _triton_backends = {}
if "nvidia" not in _triton_backends:
    print(f"this Triton has no CUDA backend (backends: {sorted(_triton_backends)})")
    sys.exit(77)

from specdec_kernels.triton import kv_compaction, linear, medusa, rejection_sampling, tree_attention  # noqa: E402
from specdec_kernels.triton import rms_norm, rng, silu_and_mul  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 232448  # sm_90: 227 KiB of shared memory per block (opt-in maximum)
MODULES = (rejection_sampling, tree_attention, kv_compaction, linear, medusa, rms_norm, silu_and_mul, rng)
FLOAT_DTYPES = ("fp32", "bf16", "fp16")
VERBOSE = "-v" in sys.argv[1:]
FULL = "--full" in sys.argv[1:]  # also the slow-to-compile variants (fp32 attention): minutes


class Case:
    def __init__(self, fn, types, constexprs, label, options=None):
        self.fn, self.constexprs, self.label = fn, dict(constexprs), label
        self.options = dict(options or {})  # num_warps / num_stages where the launcher sets them
        names = fn.arg_names
        const_names = {p.name for p in fn.params if p.is_constexpr}
        unknown = (set(types) | set(constexprs)) - set(names)
        missing = [n for n in names if n not in (constexprs if n in const_names else types)]
        if unknown or missing:
            raise AssertionError(f"{fn.__name__}: the check is out of date with the kernel's parameters "
                                 f"(unknown: {sorted(unknown)}, missing: {missing})")
        self.signature = {n: ("constexpr" if n in const_names else types[n]) for n in names}
        # Torch allocations are 16-byte aligned: the common specialisation of pointer arguments.
        self.attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                      if self.signature[n].startswith("*")}

    @property
    def key(self):
        return (self.fn, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                tuple(sorted(self.options.items())))

    def compile(self):
        return triton.compile(ASTSource(fn=self.fn, signature=self.signature, constexprs=self.constexprs,
                                        attrs=self.attrs), target=TARGET, options=self.options or None)


def i32(*names):
    return dict.fromkeys(names, "i32")


# ---------------------------------------------------------------------------------------
# Rejection sampling (chain/tree rejection sampling, apply_top_k_top_p): logits fp32/bf16/fp16,
# draft_probs fp32 (pmax, also fp32, stands in when there is none).
# ---------------------------------------------------------------------------------------


def rejection_sampling_cases():
    m = rejection_sampling
    block_n = 8  # next_power_of_2(nodes): 2.. ; a tree of up to 8 nodes / a chain of up to 7 drafts
    block_t = 128  # next_power_of_2(vocabulary tiles of BLOCK_V): vocabularies up to 128K
    for dt in FLOAT_DTYPES:
        yield Case(m._row_stats_kernel, dict(
            logits_ptr=f"*{dt}", row0_ptr="*i64", temp_ptr="*fp32", rows_ptr="*i32", pmax_ptr="*fp32", psum_ptr="*fp32",
            parg_ptr="*i32", pbad_ptr="*i32", **i32("R", "V", "T")), dict(BLOCK=m.BLOCK_V), f"logits {dt}")
        for has_q in (True, False):
            yield Case(m._walk_kernel, dict(
                parents_ptr="*i32", tokens_ptr="*i64", num_nodes_ptr="*i32", logits_ptr=f"*{dt}", q_ptr="*fp32",
                row0_ptr="*i64", q_row0_ptr="*i64", temp_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64",
                pmax_ptr="*fp32", psum_ptr="*fp32", parg_ptr="*i32", pbad_ptr="*i32", path_ptr="*i32",
                num_acc_ptr="*i32", final_ptr="*i32", spec_node_ptr="*i64", spec_max_ptr="*fp32",
                spec_coef_ptr="*fp32", excl_ptr="*i64", **i32("N", "V", "T")),
                dict(HAS_Q=has_q, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_V=m.BLOCK_V), f"logits {dt}, HAS_Q={has_q}")
            yield Case(m._race_kernel, dict(
                logits_ptr=f"*{dt}", q_ptr="*fp32", row0_ptr="*i64", q_row0_ptr="*i64", temp_ptr="*fp32",
                seed_ptr="*i64", offset_ptr="*i64", spec_node_ptr="*i64", spec_max_ptr="*fp32",
                spec_coef_ptr="*fp32", excl_ptr="*i64", pscore_ptr="*fp32", pidx_ptr="*i32", fscore_ptr="*fp32",
                fidx_ptr="*i32", **i32("N", "V", "T")), dict(HAS_Q=has_q, BLOCK=m.BLOCK_V),
                f"logits {dt}, HAS_Q={has_q}")
        yield Case(m._top_k_top_p_kernel, dict(logits_ptr=f"*{dt}", top_k_ptr="*i32", top_p_ptr="*fp32",
                                               min_p_ptr="*fp32", V="i32"), dict(BLOCK=m.BLOCK_V), f"logits {dt}")
    yield Case(m._race_reduce_kernel, dict(spec_node_ptr="*i64", pscore_ptr="*fp32", pidx_ptr="*i32",
                                           fscore_ptr="*fp32", fidx_ptr="*i32", final_ptr="*i32", T="i32"),
               dict(BLOCK_T=block_t), "")


# ---------------------------------------------------------------------------------------
# Tree attention: q/k/v/out fp32/bf16/fp16; the constexprs as tree_attention() derives them
# on a CUDA device (DOT_FP32/DOT_PRECISION: fp32 -> ieee dots; bf16/fp16 -> native dots).
# ---------------------------------------------------------------------------------------

# (dtype, Hq, Hkv, head_dim, tokens per request, IS_TREE, HAS_MASK). fp32 (IEEE fp32 dots)
# compiles ~5-10x slower than bf16/fp16, so by default every pass is compiled in bf16 and the
# other dtypes get the tree pass with a mask (the most code) or the prefix pass; --full adds
# the rest.
ATTEND_VARIANTS = (
    # Llama-style GQA, 16-node trees (BLOCK_M 64; BLOCK_N 32 in bf16 / fp16, 16 x 16 in fp32): every pass.
    *(("bf16", 32, 8, 128, 16, is_tree, has_mask) for is_tree in (False, True) for has_mask in (False, True)),
    ("fp16", 32, 8, 128, 16, True, True),
    ("fp32", 32, 8, 128, 16, True, True),
    # MQA, head_dim 256, 8-node trees: BLOCK_M 64, BLOCK_N 32, 8 warps.
    ("bf16", 8, 1, 256, 8, True, True),
    # SmolLM2-135M decode (Hq 9, Hkv 3, one token per request): BLOCK_M 16, BLOCK_H 16 > Hq.
    ("fp16", 9, 3, 64, 1, False, False),
)
ATTEND_VARIANTS_FULL = (
    *((dt, 32, 8, 128, 16, is_tree, has_mask) for dt in ("fp16", "fp32") for is_tree in (False, True)
      for has_mask in (False, True)),
    ("fp32", 8, 1, 256, 8, True, True),  # the most shared memory: 156 KB of sm_90's 227 KB (20+ s)
    ("fp32", 9, 3, 64, 1, False, False),
)
# (dtype of out, Hq, head_dim, HAS_LSE)
MERGE_VARIANTS = (
    *((dt, 32, 128, has_lse) for dt in FLOAT_DTYPES for has_lse in (True, False)),
    ("bf16", 9, 64, True),
)


def _attention_launch(hq, hkv, head_dim, tokens_per_request, dtype):
    """(constexprs, options) as tree_attention() derives them on a CUDA device (its plan_launch,
    for one request; the token count and the number of query tiles are runtime arguments)."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    # num_splits given: the planner then asks the (absent) GPU nothing.
    plan = tree_attention.plan_launch(tokens_per_request, 1, hq, hkv, head_dim, 4096, torch_dtype,
                                      torch.device("cuda"), num_splits=1)
    constexprs = dict(HQ=hq, HKV=hkv, GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_M=plan["block_m"],
                      BLOCK_N=plan["block_n"], BLOCK_D=plan["block_d"], DOT_PRECISION=plan["precision"],
                      DOT_FP32=plan["dot_fp32"])
    return constexprs, dict(num_warps=plan["num_warps"], num_stages=plan["num_stages"])


def tree_attention_cases():
    m = tree_attention
    for dt, hq, hkv, head_dim, tokens, is_tree, has_mask in ATTEND_VARIANTS + (ATTEND_VARIANTS_FULL if FULL else ()):
        types = dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", block_table_ptr="*i32",
                     prefix_lens_ptr="*i32", qo_indptr_ptr="*i32",
                     mask_ptr="*i64" if has_mask else "*i32",  # qo_indptr stands in for no mask
                     part_out_ptr="*fp32", part_lse_ptr="*fp32", sm_scale="fp32",
                     **i32("T", "num_blocks", "max_blocks", "block_size", "mask_words", "split_len", "part_index0",
                           "num_q_tiles", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                           "stride_vh", "stride_bt"))
        constexprs, options = _attention_launch(hq, hkv, head_dim, tokens, dt)
        constexprs.update(IS_TREE=is_tree, HAS_MASK=has_mask)
        yield Case(m._attend_kernel, types, constexprs,
                   f"{dt}, Hq={hq} Hkv={hkv} D={head_dim}, BLOCK_M={constexprs['BLOCK_M']} "
                   f"BLOCK_N={constexprs['BLOCK_N']} warps={options['num_warps']}, IS_TREE={is_tree} HAS_MASK={has_mask}",
                   options)
    for dt, hq, head_dim, has_lse in MERGE_VARIANTS:
        yield Case(m._merge_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=f"*{dt}",
                                         lse_ptr="*fp32", **i32("T", "num_parts", "stride_ot", "stride_oh")),
                   dict(HQ=hq, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(hq),
                        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HAS_LSE=has_lse),
                   f"out {dt}, Hq={hq} D={head_dim}, HAS_LSE={has_lse}")


# ---------------------------------------------------------------------------------------
# KV compaction: data moved as raw bits, one variant per element size (fp8/uint8, bf16/fp16,
# fp32, 8-byte types).
# ---------------------------------------------------------------------------------------


def kv_compaction_cases():
    m = kv_compaction
    for elem_bytes in (1, 2, 4, 8):
        yield Case(m._compact_kv_kernel, dict(
            k_ptrs="*i64", v_ptrs="*i64", block_table="*i32", prefix_lens="*i32", accepted_nodes="*i32",
            num_accepted="*i32", **i32("num_layers", "layers_per_program", "stride_bt_b", "stride_bt_j", "stride_an_b",
                                       "stride_an_i", "stride_block", "stride_pos", "stride_head", "num_blocks",
                                       "block_size", "max_blocks", "max_accepted")),
            dict(HEAD_DIM=128, ELEM_BYTES=elem_bytes, BLOCK_A=8, BLOCK_D=128), f"{elem_bytes}-byte elements")


# ---------------------------------------------------------------------------------------
# Linear (skinny_linear, also medusa_topk's ResBlocks and its lm_head fallback for top_k > 64;
# quantized_linear; int8_activation_linear).
# ---------------------------------------------------------------------------------------


def linear_cases():
    m = linear
    blocks = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)  # launch_linear()
    for dt in FLOAT_DTYPES:  # weights (and bias) of any float dtype; x and out are fp32
        types = dict(x_ptr="*fp32", w_ptr=f"*{dt}", b_ptr=f"*{dt}", out_ptr="*fp32",
                     **i32("M", "N", "H", "stride_xh", "stride_wh", "stride_bh", "stride_oh"))
        # skinny_linear without / with bias (also the lm_head fallback for top_k > 64), ResBlocks.
        for has_bias, silu in ((False, False), (True, False), (True, True)):
            yield Case(m._linear_kernel, types, dict(blocks, HAS_BIAS=has_bias, RESIDUAL_SILU=silu),
                       f"weight {dt}, HAS_BIAS={has_bias} RESIDUAL_SILU={silu}")
    # quantized_linear: one variant per GGUF block type (the float types read a typed view of
    # the bytes), without and with bias; x, bias and out are fp32 (the launcher widens them).
    weight_dtypes = {0: "fp32", 1: "fp16", 30: "bf16", 2: "u8", 3: "u8", 6: "u8", 7: "u8", 8: "u8", 12: "u8",
                     13: "u8", 14: "u8"}
    for block_type, wdt in weight_dtypes.items():
        for has_bias in (False, True):
            yield Case(m._quantized_linear_kernel,
                       dict(x_ptr="*fp32", w_ptr=f"*{wdt}", b_ptr="*fp32", out_ptr="*fp32",
                            **i32("M", "N", "H", "row_bytes")),
                       dict(BLOCK_TYPE=block_type, BLOCK_BYTES=m.GGUF_BLOCK_FORMATS[block_type][2],
                            HAS_BIAS=has_bias, BLOCK_M=m.QUANTIZED_BLOCK_M, BLOCK_N=m.QUANTIZED_BLOCK_N),
                       f"quantized {m.GGUF_BLOCK_FORMATS[block_type][0]}, HAS_BIAS={has_bias}")
    # int8_activation_linear: one variant per block type it reads, without and with bias.
    for block_type, group_bytes in m.INT8_ACTIVATION_GROUP_BYTES.items():
        for has_bias in (False, True):
            yield Case(m._int8_activation_linear_kernel,
                       dict(q_ptr="*i8", d_ptr="*fp32", s_ptr="*fp32", w_ptr="*u8", b_ptr="*fp32", out_ptr="*fp32",
                            **i32("M", "N", "NB")),
                       dict(BLOCK_TYPE=block_type, GROUP_BYTES=group_bytes, HAS_BIAS=has_bias,
                            BLOCK_M=m.INT8_ACTIVATION_BLOCK_M),
                       f"int8 activations {m.INT8_ACTIVATION_FORMATS[block_type][0]}, HAS_BIAS={has_bias}")


# ---------------------------------------------------------------------------------------
# Medusa (medusa_topk): the lm_head top-k and merge kernels.
# ---------------------------------------------------------------------------------------


def medusa_cases():
    m = medusa
    block_v, block_t, block_c = 128, 128, 512  # medusa_topk() defaults
    # top_k is a runtime argument: one lm_head kernel per weight dtype, one merge kernel per
    # power-of-two bound TOP_K_P2 = 1 .. 64 (MAX_FUSED_TOP_K); each compiles in about a second.
    for dt in FLOAT_DTYPES:
        yield Case(m._lm_head_topk_kernel, dict(
            x_ptr="*fp32", w_ptr=f"*{dt}", part_val_ptr="*fp32", part_id_ptr="*i32", part_max_ptr="*fp32",
            part_sum_ptr="*fp32", **i32("M", "V", "H", "num_tiles", "stride_wh", "top_k")),
            dict(BLOCK_M=16, BLOCK_V=block_v, BLOCK_K=32), f"lm_head {dt}")
    bounds = [triton.next_power_of_2(k) for k in range(1, m.MAX_FUSED_TOP_K + 1)]
    for top_k_p2 in sorted(set(bounds)):
        yield Case(m._merge_kernel, dict(
            part_val_ptr="*fp32", part_id_ptr="*i32", part_max_ptr="*fp32", part_sum_ptr="*fp32", ids_ptr="*i64",
            logprobs_ptr="*fp32", **i32("M", "K", "V", "num_tiles", "top_k")),
            dict(TOP_K_P2=top_k_p2, BLOCK_T=block_t, BLOCK_C=block_c), f"TOP_K_P2={top_k_p2}")


# ---------------------------------------------------------------------------------------
# The layer's elementwise ops (rms_norm, silu_and_mul): x and out of each float dtype.
# ---------------------------------------------------------------------------------------


def elementwise_cases():
    for dt in FLOAT_DTYPES:
        for block in (64, 1024, 2048, 8192):  # next_power_of_2(H): tiny, SmolLM2 (576), 1.5B (1536), 8192
            yield Case(rms_norm._rms_norm_kernel, dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}", H="i32",
                                                      eps="fp32"), dict(BLOCK=block), f"x {dt}, BLOCK={block}")
        yield Case(silu_and_mul._silu_and_mul_kernel, dict(x_ptr=f"*{dt}", out_ptr=f"*{dt}", I="i32"),
                   dict(BLOCK=silu_and_mul.BLOCK), f"x {dt}")


AREAS = (rejection_sampling_cases, tree_attention_cases, kv_compaction_cases, linear_cases, medusa_cases,
         elementwise_cases)


def jit_functions():
    """Every @triton.jit function defined (not just imported) in the modules, by module."""
    for mod in MODULES:
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__:
                yield mod, name, obj


def uncovered_kernels(compiled_fns):
    """Jit functions that are neither compiled here nor called from another jit function."""
    all_fns = list(jit_functions())
    sources = {id(obj): obj.src for _, _, obj in all_fns}
    missing = []
    for mod, name, obj in all_fns:
        if obj in compiled_fns:
            continue
        call = re.compile(rf"(?<!def )\b{re.escape(obj.__name__)}\s*\(")  # a call, not a same-named def
        if not any(call.search(src) for key, src in sources.items() if key != id(obj)):
            missing.append(f"{mod.__name__}.{name}")
    return missing


def main():
    print(f"triton {triton.__version__}, target {TARGET}")
    start = time.perf_counter()
    seen, failures, timings, compiled_fns = set(), [], [], set()
    for area in AREAS:
        for case in area():
            if case.key in seen:
                continue
            seen.add(case.key)
            compiled_fns.add(case.fn)
            name = f"{case.fn.fn.__module__.rsplit('.', 1)[-1]}.{case.fn.__name__} [{case.label}]"
            t0 = time.perf_counter()
            try:
                kernel = case.compile()
            except (RuntimeError, FileNotFoundError) as e:
                if "ptxas" in str(e) and ("not found" in str(e) or isinstance(e, FileNotFoundError)):
                    print(f"no CUDA toolchain (ptxas) for this Triton: {e}")
                    sys.exit(77)
                failures.append((name, e))
                print(f"FAIL {name}\n{traceback.format_exc(limit=0) if not VERBOSE else traceback.format_exc()}")
                continue
            except Exception as e:  # CompilationError and friends: report them all, then fail
                failures.append((name, e))
                print(f"FAIL {name}\n{traceback.format_exc(limit=0) if not VERBOSE else traceback.format_exc()}")
                continue
            dt = time.perf_counter() - t0
            timings.append((dt, name))
            shared = kernel.metadata.shared
            if shared > MAX_SHARED_BYTES:
                failures.append((name, f"needs {shared} bytes of shared memory, sm_90 allows {MAX_SHARED_BYTES}"))
                print(f"FAIL {name}: needs {shared} bytes of shared memory (> {MAX_SHARED_BYTES})")
            elif VERBOSE:
                print(f"ok   {name}: {dt:.1f} s, {shared} B shared")
    missing = uncovered_kernels(compiled_fns)
    for name in missing:
        failures.append((name, "not covered"))
        print(f"FAIL {name}: a @triton.jit kernel this check does not compile; add its launch variants to "
              f"{os.path.basename(__file__)}")
    total = time.perf_counter() - start
    slowest = ", ".join(f"{n} {t:.1f} s" for t, n in sorted(timings, reverse=True)[:3])
    print(f"{len(timings)} kernel variants compiled for sm_90 (Triton cache hits included) in {total:.1f} s (slowest: {slowest})")
    if failures:
        print(f"{len(failures)} failure(s): " + "; ".join(n for n, _ in failures))
        sys.exit(1)
    print("all Triton kernels compiled")


if __name__ == "__main__":
    main()
