"""Fuzzing skinny_linear and quantized_linear.

Valid inputs (M from 0 to 70, N and H from 1, odd sizes, fp32/bf16/fp16 in any mix, bias or
none, strided x, extreme and non-finite values, which propagate as in a plain matmul)
against python_ref on the C++ and Triton kernels, every tensor in guarded storage; invalid
ones (shapes, dtypes, devices, layouts, out aliasing x) raise a clear error or give the
documented result. Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels  # noqa: F401
from python_ref import linear as ref
from specdec_kernels import ops
from tests.helpers import backend_op, requires_triton, run_guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@st.composite
def linear_cases(draw, rows=st.integers(0, 17) | st.sampled_from([63, 64, 65, 70]), sizes=(1, 2, 7, 8, 33, 130)):
    M = draw(rows)
    N = draw(st.sampled_from(sizes))
    H = draw(st.sampled_from(sizes))
    x_dtype, w_dtype, b_dtype = (draw(st.sampled_from(DTYPES)) for _ in range(3))
    with_bias = draw(st.booleans())
    values = draw(st.sampled_from(["normal", "normal", "integers", "non_finite"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if values == "integers":  # exact in every dtype and in fp32 accumulation
        x = torch.randint(-3, 4, (M, H), generator=gen).float()
        w = torch.randint(-3, 4, (N, H), generator=gen).float()
    else:
        x = torch.randn(M, H, generator=gen)
        w = torch.randn(N, H, generator=gen) / H**0.5
        if values == "non_finite" and M * H > 0:
            x.view(-1)[int(torch.randint(0, M * H, (1,), generator=gen))] = draw(st.sampled_from(
                [math.nan, math.inf, -math.inf]))
    bias = torch.randn(N, generator=gen).to(b_dtype) if with_bias else None
    return dict(x=x.to(x_dtype), weight=w.to(w_dtype), bias=bias)


def run_backend(backend, case, *, strided_x=False):
    """The op ("wrapper": ops.skinny_linear) in guarded storage (run_guarded); ``strided_x``:
    x as rows of a wider buffer (e.g. a slice of a fused projection), not guarded."""
    x = case["x"]
    if strided_x:
        wide = torch.zeros(x.shape[0], x.shape[1] * 2 + 1, dtype=x.dtype)
        wide[:, :x.shape[1]] = x
        x = wide[:, :x.shape[1]]
    if backend == "wrapper":
        def launch(x, weight, bias, out):
            ops.skinny_linear(x, weight, bias, out=out)
    else:
        launch = backend_op(backend, "skinny_linear", "linear")
    out = torch.full((x.shape[0], case["weight"].shape[0]), 7.0, dtype=x.dtype)
    return run_guarded(launch, [x, case["weight"], case["bias"]], [out])[0]


def check(out, case):
    expected = ref.skinny_linear(case["x"], case["weight"], case["bias"])
    # The kernels round the fp32 result to x's dtype (and a bf16 bias/weight is exact in fp32).
    torch.testing.assert_close(out.double(), expected.to(out.dtype).double(), **TOL[out.dtype], equal_nan=True)


@pytest.mark.parametrize("backend", ["wrapper", "cpu"])
@fuzz_settings(30)
@given(case=linear_cases(), strided_x=st.booleans())
def test_cpu_matches_reference(case, strided_x, backend):
    check(run_backend(backend, case, strided_x=strided_x), case)


@requires_triton
@fuzz_settings(6)
@given(case=linear_cases(rows=st.integers(0, 5), sizes=(1, 7, 33)))
def test_triton_matches_reference(case):
    check(run_backend("triton", case), case)


def small_case(draw):
    return draw(linear_cases(rows=st.integers(1, 5), sizes=(3, 8)))


MUTATIONS = {
    "x:dtype": lambda c: {**c, "x": c["x"].double()},
    "x:1d": lambda c: {**c, "x": c["x"][0]},
    "x:meta": lambda c: {**c, "x": c["x"].to("meta")},
    "x:last_dim_strided": lambda c: {**c, "x": torch.stack([c["x"], c["x"]], -1)[..., 0]},
    "weight:dtype": lambda c: {**c, "weight": c["weight"].to(torch.int32)},
    "weight:inner_size": lambda c: {**c, "weight": torch.cat([c["weight"], c["weight"][:, :1]], 1)},
    "weight:strided": lambda c: {**c, "weight": torch.stack([c["weight"], c["weight"]], -1)[..., 0]},
    "weight:meta": lambda c: {**c, "weight": c["weight"].to("meta")},
    "bias:shape": lambda c: {**c, "bias": torch.zeros(c["weight"].shape[0] + 1)},
    "bias:dtype": lambda c: {**c, "bias": torch.zeros(c["weight"].shape[0], dtype=torch.int64)},
    "bias:2d": lambda c: {**c, "bias": torch.zeros(1, c["weight"].shape[0])},
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_inputs_raise(data, mutation, backend):
    case = MUTATIONS[mutation](small_case(data.draw))
    x, weight, bias = case["x"], case["weight"], case["bias"]
    M = x.shape[0] if x.dim() == 2 else 1
    out = torch.empty(M, weight.shape[0], dtype=x.dtype if x.dtype.is_floating_point else torch.float32)
    if backend == "wrapper":
        fn = lambda: ops.skinny_linear(x, weight, bias)  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.skinny_linear(x, weight, bias, out)  # noqa: E731
    else:
        from specdec_kernels.triton.linear import skinny_linear as launcher

        fn = lambda: launcher(x, weight, bias, out)  # noqa: E731
    _, error = call_or_clear_error(fn)
    if error is None and mutation in ("x:last_dim_strided", "weight:strided"):  # allowed if computed right
        check(out if backend != "wrapper" else fn(), {**case, "x": x.contiguous(), "weight": weight.contiguous()})
        return
    assert error is not None, f"{mutation} accepted by {backend}"
    assert any(n in str(error) for n in ["x", "weight", "bias", "out", "device"]), f"{mutation} on {backend}: {error}"


OUTPUTS = {
    "out:dtype": lambda x, n: torch.empty(x.shape[0], n, dtype=torch.float64),
    "out:shape": lambda x, n: torch.empty(x.shape[0], n + 1, dtype=x.dtype),
    "out:strided": lambda x, n: torch.empty(x.shape[0], n, 2, dtype=x.dtype)[..., 0],
    "out:aliases_x": lambda x, n: x if x.shape[1] == n else None,
    "out:aliases_weight": lambda x, n: None,
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(OUTPUTS))
@fuzz_settings(3)
@given(data=st.data())
def test_bad_outputs_raise_or_are_correct(data, mutation, backend):
    case = small_case(data.draw)
    x, weight, bias = case["x"].clone(), case["weight"], case["bias"]
    if mutation == "out:aliases_x":  # out written over x (a square layer, in place)
        weight = torch.randn(x.shape[1], x.shape[1]).to(weight.dtype)
        bias = None
        case = {**case, "weight": weight}
    if mutation == "out:aliases_weight":  # out written over the weight (M = N, same dtype)
        x = torch.randn(weight.shape[0], weight.shape[1]).to(weight.dtype)
        case = {**case, "x": x.clone()}
        out = weight = weight.clone()
    else:
        out = OUTPUTS[mutation](x, weight.shape[0])
    expected = ref.skinny_linear(case["x"], case["weight"], bias)
    if backend == "wrapper":
        fn = lambda: ops.skinny_linear(x, weight, bias, out=out)  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.skinny_linear(x, weight, bias, out)  # noqa: E731
    else:
        from specdec_kernels.triton.linear import skinny_linear as launcher

        fn = lambda: launcher(x, weight, bias, out)  # noqa: E731
    _, error = call_or_clear_error(fn)
    if error is None:  # (a NaN in x makes its row's outputs NaN, in the reference too)
        torch.testing.assert_close(out.double(), expected.to(out.dtype).double(), **TOL[out.dtype], equal_nan=True,
                                   msg=lambda m: f"{mutation} on {backend}: {m}")
    else:
        assert "out" in str(error), f"{mutation} on {backend}: {error}"


# =======================================================================================
# quantized_linear: every GGUF block format, blocks of random bytes (any bit pattern of the
# quants and sub-block scales, finite fp16 scales) or quantised random weights.
# =======================================================================================

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from specdec_kernels import gguf_blocks  # noqa: E402
from specdec_kernels.checks import GGUF_BLOCK_FORMATS  # noqa: E402

# Byte offsets of each block format's fp16 scales (masked so that they are finite).
_FP16_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


def _random_block_bytes(N, blocks_per_row, block_type, gen):
    """Valid blocks of random bytes: fp16 scales with biased exponents <= 15 (|scale| < 2)."""
    nbytes = GGUF_BLOCK_FORMATS[block_type][2]
    raw = torch.randint(0, 256, (N, blocks_per_row, nbytes), dtype=torch.uint8, generator=gen)
    for at in _FP16_FIELDS[block_type]:
        raw[..., at + 1] &= 0xBF  # exponent bits 14..10 of the fp16: the top one cleared
    return raw.reshape(N, -1)


@st.composite
def quantized_cases(draw, block_type, rows=st.integers(0, 17) | st.sampled_from([63, 64, 65, 70]),
                    ns=(1, 2, 7, 8, 33, 130)):
    _, size, _ = GGUF_BLOCK_FORMATS[block_type]
    M, N = draw(rows), draw(st.sampled_from(ns))
    H = draw(st.sampled_from((1, 7, 33, 130))) if size == 1 else size * draw(st.integers(1, 2 if size == 256 else 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if size == 1 or draw(st.booleans()):
        weight = gguf_blocks.quantize(torch.randn(N, H, generator=gen), block_type).blocks
    else:
        weight = _random_block_bytes(N, H // size, block_type, gen)
    x = torch.randn(M, H, generator=gen)
    if draw(st.sampled_from([False, False, False, True])) and M * H > 0:
        x.view(-1)[int(torch.randint(0, M * H, (1,), generator=gen))] = draw(st.sampled_from(
            [math.nan, math.inf, -math.inf]))
    bias = torch.randn(N, generator=gen).to(draw(st.sampled_from(DTYPES))) if draw(st.booleans()) else None
    return dict(x=x.to(draw(st.sampled_from(DTYPES))), weight=weight, block_type=block_type, bias=bias)


def run_quantized_backend(backend, case):
    """The op ("wrapper": ops.quantized_linear) in guarded storage (run_guarded)."""
    if backend == "wrapper":
        def launch(x, weight, block_type, bias, out):
            ops.quantized_linear(x, weight, block_type, bias, out=out)
    else:
        launch = backend_op(backend, "quantized_linear", "linear")
    out = torch.full((case["x"].shape[0], case["weight"].shape[0]), 7.0)
    return run_guarded(launch, [case["x"], case["weight"], case["block_type"], case["bias"]], [out])[0]


def check_quantized(out, case):
    """Against gguf.dequantize's weight values (the package's own decoder) in float64."""
    x, weight, block_type = case["x"], case["weight"], case["block_type"]
    H = x.shape[1]
    values = np.asarray(gguf.dequantize(weight.numpy(), gguf.GGMLQuantizationType(block_type)), dtype=np.float32)
    values = torch.from_numpy(values.reshape(weight.shape[0], H).copy())
    expected = ref.skinny_linear(x.float(), values, None if case["bias"] is None else case["bias"].float())
    finite_x = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).double()
    scale = float((finite_x.abs() @ values.double().abs().T).max()) if out.numel() else 0.0
    torch.testing.assert_close(out.double(), expected, atol=1e-6 * scale + 1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("backend", ["wrapper", "cpu"])
@pytest.mark.parametrize("block_type", sorted(GGUF_BLOCK_FORMATS))
@fuzz_settings(8)
@given(data=st.data())
def test_quantized_cpu_matches_reference(data, block_type, backend):
    case = data.draw(quantized_cases(block_type))
    check_quantized(run_quantized_backend(backend, case), case)


@requires_triton
@pytest.mark.parametrize("block_type", sorted(GGUF_BLOCK_FORMATS))
@fuzz_settings(2)
@given(data=st.data())
def test_quantized_triton_matches_reference(data, block_type):
    case = data.draw(quantized_cases(block_type, rows=st.integers(0, 5), ns=(1, 7, 33)))
    check_quantized(run_quantized_backend("triton", case), case)


QUANTIZED_MUTATIONS = {
    "block_type:unknown": lambda c: {**c, "block_type": 10},
    "block_type:negative": lambda c: {**c, "block_type": -1},
    "block_type:huge": lambda c: {**c, "block_type": 2**40},
    "x:dtype": lambda c: {**c, "x": c["x"].double()},
    "x:1d": lambda c: {**c, "x": c["x"][0]},
    "x:meta": lambda c: {**c, "x": c["x"].to("meta")},
    "x:h_not_a_whole_block": lambda c: {**c, "x": torch.randn(c["x"].shape[0], c["x"].shape[1] + 32)},
    "weight:dtype": lambda c: {**c, "weight": c["weight"].view(torch.int8)},
    "weight:inner_size": lambda c: {**c, "weight": c["weight"][:, :-1].contiguous()},
    "weight:strided": lambda c: {**c, "weight": torch.stack([c["weight"], c["weight"]], -1)[..., 0]},
    "weight:meta": lambda c: {**c, "weight": c["weight"].to("meta")},
    "bias:shape": lambda c: {**c, "bias": torch.zeros(c["weight"].shape[0] + 1)},
    "bias:dtype": lambda c: {**c, "bias": torch.zeros(c["weight"].shape[0], dtype=torch.int64)},
}


@st.composite
def small_block_case(draw):
    """A small valid case of a block format (not a float type), for the mutations above."""
    block_type = draw(st.sampled_from(sorted(_FP16_FIELDS)))
    size = GGUF_BLOCK_FORMATS[block_type][1]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    N, M = draw(st.sampled_from([3, 8])), draw(st.integers(1, 5))
    return dict(x=torch.randn(M, size, generator=gen), weight=_random_block_bytes(N, 1, block_type, gen),
                block_type=block_type, bias=torch.randn(N, generator=gen) if draw(st.booleans()) else None)


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(QUANTIZED_MUTATIONS))
@fuzz_settings(2)
@given(case=small_block_case())
def test_quantized_bad_inputs_raise(case, mutation, backend):
    case = QUANTIZED_MUTATIONS[mutation](case)
    x, weight, block_type, bias = case["x"], case["weight"], case["block_type"], case["bias"]
    out = torch.empty(x.shape[0] if x.dim() == 2 else 1, weight.shape[0])
    if backend == "wrapper":
        fn = lambda: ops.quantized_linear(x, weight, block_type, bias, out=out)  # noqa: E731
    elif backend == "cpu":
        fn = lambda: torch.ops.specdec.quantized_linear(x, weight, block_type, bias, out)  # noqa: E731
    else:
        from specdec_kernels.triton.linear import quantized_linear as launcher

        fn = lambda: launcher(x, weight, block_type, bias, out)  # noqa: E731
    _, error = call_or_clear_error(fn)
    assert error is not None, f"{mutation} accepted by {backend}"
    assert any(n in str(error) for n in ["x", "weight", "bias", "block_type", "device"]), f"{mutation}: {error}"
