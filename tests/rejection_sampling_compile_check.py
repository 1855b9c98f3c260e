"""Compile every rejection-sampling Triton kernel for a CUDA target (no GPU needed).

The interpreter accepts code that the compiler rejects (e.g. a loop-carried variable that
changes type), so tests/test_rejection_sampling.py runs this script in a process without
TRITON_INTERPRET. Exit 0: all compiled; 77: this Triton cannot compile for CUDA here.
"""
import sys

import torch  # noqa: F401  (loads libtorch before specdec_kernels._C)

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(f"this Triton cannot compile ahead of time: {e}")
    sys.exit(77)

from specdec_kernels.triton import rejection_sampling as tr

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, signature, constexprs):
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e):
            print(f"no CUDA toolchain: {e}")
            sys.exit(77)
        raise


def main():
    compile_kernel(tr._row_stats_kernel, dict(logits_ptr="*bf16", temp_ptr="*fp32", rows_ptr="*i32", pmax_ptr="*fp32",
                                              psum_ptr="*fp32", parg_ptr="*i32", pbad_ptr="*i32", R="i32", V="i32",
                                              T="i32", BLOCK="constexpr"), dict(BLOCK=1024))
    for has_q in (True, False):
        compile_kernel(tr._walk_kernel, dict(
            parents_ptr="*i32", tokens_ptr="*i64", num_nodes_ptr="*i32", logits_ptr="*fp32", q_ptr="*fp32",
            temp_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64", pmax_ptr="*fp32", psum_ptr="*fp32",
            parg_ptr="*i32", pbad_ptr="*i32", path_ptr="*i32", num_acc_ptr="*i32", final_ptr="*i32",
            spec_row_ptr="*i64", spec_max_ptr="*fp32", spec_coef_ptr="*fp32", excl_ptr="*i64", N="i32", V="i32",
            T="i32", q_batch_stride="i64", HAS_Q="constexpr", BLOCK_N="constexpr", BLOCK_T="constexpr",
            BLOCK_V="constexpr"), dict(HAS_Q=has_q, BLOCK_N=8, BLOCK_T=128, BLOCK_V=1024))
        compile_kernel(tr._race_kernel, dict(
            logits_ptr="*fp16", q_ptr="*fp32", temp_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64",
            spec_row_ptr="*i64", spec_max_ptr="*fp32", spec_coef_ptr="*fp32", excl_ptr="*i64", pscore_ptr="*fp32",
            pidx_ptr="*i32", fscore_ptr="*fp32", fidx_ptr="*i32", N="i32", V="i32", T="i32", q_batch_stride="i64",
            HAS_Q="constexpr", BLOCK="constexpr"), dict(HAS_Q=has_q, BLOCK=1024))
    compile_kernel(tr._race_reduce_kernel, dict(spec_row_ptr="*i64", pscore_ptr="*fp32", pidx_ptr="*i32",
                                                fscore_ptr="*fp32", fidx_ptr="*i32", final_ptr="*i32", T="i32",
                                                BLOCK_T="constexpr"), dict(BLOCK_T=128))
    compile_kernel(tr._top_k_top_p_kernel, dict(logits_ptr="*bf16", top_k_ptr="*i32", top_p_ptr="*fp32",
                                                 min_p_ptr="*fp32", V="i32", BLOCK="constexpr"), dict(BLOCK=1024))
    print("all rejection-sampling kernels compiled")


if __name__ == "__main__":
    main()
