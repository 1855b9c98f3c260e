"""Every op of the specdec library has a CPU (C++), a CUDA (Triton) and a Meta (fake) kernel;
the import refuses a CPU the kernels were not compiled for."""
import platform

import pytest
import torch

import specdec_kernels

OPS = [
    "chain_rejection_sample",
    "chain_rejection_sample_flat",
    "tree_rejection_sample",
    "apply_top_k_top_p",
    "tree_attention",
    "compact_kv",
    "medusa_topk",
    "skinny_linear",
    "quantized_linear",
    "int8_activation_linear",
    "rms_norm",
    "silu_and_mul",
]


def test_op_list_is_complete():
    defined = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("specdec::")}
    assert defined == set(OPS) | {"philox_uniform"}


@pytest.mark.parametrize("op", OPS)
def test_cpu_kernel_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", "CPU")


@pytest.mark.parametrize("op", OPS + ["philox_uniform"])
def test_fake_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", "Meta")


@pytest.mark.skipif(not specdec_kernels.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("op", OPS)
def test_triton_kernel_registered_for_cuda(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", "CUDA")


def test_cpu_feature_check_names_what_is_missing(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx fma\n")
    expected = ["avx2", "f16c"] if platform.machine() == "x86_64" else []
    assert specdec_kernels.missing_cpu_features(str(cpuinfo)) == expected
    cpuinfo.write_text("flags\t\t: fpu avx avx2 fma f16c\n")
    assert specdec_kernels.missing_cpu_features(str(cpuinfo)) == []
    assert specdec_kernels.missing_cpu_features() == []  # this machine runs the suite
