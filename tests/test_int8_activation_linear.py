"""specdec::int8_activation_linear (activations quantised to int8 per GGUF block; Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks repacked 16 rows at a time) on every backend against
python_ref, which computes from the plain GGUF blocks (so the packing is checked too), and
against gguf's own dequantisation within the activation rounding; the CPU paths' bits; batch
invariance; the int8 model format."""
import os

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from python_ref import linear as ref
from specdec_kernels import checks, gguf_blocks, ops
from specdec_kernels.gguf_blocks import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from tests.fuzzing import fuzz_settings
from tests.helpers import assert_cpu_paths_agree, assert_guard_intact, cpu_flags, guarded, requires_triton

TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K]
K_QUANTS = [Q4_K, Q5_K, Q6_K]
BACKENDS = ["cpu", pytest.param("triton", marks=requires_triton)]
# Where each format keeps its fp16 fields (d; m or dmin) in a GGUF block.
_F16_AT = {Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q5_1: [0, 2], Q8_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208]}


def block_size(block_type):
    return checks.INT8_ACTIVATION_FORMATS[block_type][1]


def random_blocks(N, H, block_type, g, scale=0.01):
    """uint8 [N, row bytes]: random GGUF blocks (random bytes are valid blocks once the fp16
    fields hold finite values; these are N(0, scale))."""
    _, size, nbytes, _ = checks.INT8_ACTIVATION_FORMATS[block_type]
    b = torch.randint(0, 256, (N, H // size, nbytes), dtype=torch.uint8, generator=g)
    for at in _F16_AT[block_type]:
        b[..., at:at + 2] = (torch.randn(N, H // size, 1, generator=g) * scale).half().view(torch.uint8)
    return b.reshape(N, -1)


def gguf_values(blocks, block_type):
    """fp64 [N, H]: the weights as gguf.quants.dequantize gives them (the outside reference)."""
    w = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(block_type))
    return torch.from_numpy(np.ascontiguousarray(w)).double()


def assert_matches(got, want, H):
    """got (fp32) against the float64 reference: fp32 accumulation of H / 32 block terms (the
    integer sums and the scales are exact on both sides), relative to the outputs' scale (the
    K-quants' terms cancel: their mins are subtracted). One activation integer off by one
    would move an output by ~d_x * d_w * |c| ~ 1e-2 of that scale, far outside this."""
    scale = max(1.0, float(want.abs().nan_to_num(0).max())) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, atol=2e-6 * (H / 32) ** 0.5 * scale, rtol=1e-5)


def packed_weight(N, H, block_type, g):
    """(GGUF blocks, their packing): Q4_0 / Q4_1 / Q8_0 quantised from Gaussian weights by
    gguf_blocks.quantize, the other formats random blocks."""
    if block_type in (Q4_0, Q4_1, Q8_0):
        blocks = gguf_blocks.quantize(torch.randn(N, H, generator=g), block_type).blocks
    else:
        blocks = random_blocks(N, H, block_type, g)
    return blocks, gguf_blocks.pack_int8_activation(blocks, block_type)


def run(backend, x, packed, block_type, N, bias=None, out=None):
    out = torch.full((x.shape[0], N), float("nan")) if out is None else out
    if backend == "cpu":
        torch.ops.specdec.int8_activation_linear(x, packed, int(block_type), bias, out)
    else:
        from specdec_kernels.triton import linear as triton_linear

        triton_linear.int8_activation_linear(x, packed, int(block_type), bias, out)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("M,N,blocks", [(1, 1, 1), (1, 16, 2), (2, 16, 2), (3, 33, 3), (4, 20, 1), (5, 17, 1),
                                        (9, 40, 5), (18, 3, 2)])
def test_matches_reference(backend, block_type, M, N, blocks):
    """M: the CPU tiles (up to 4 rows in registers with AVX-512 VNNI, 2 with AVX2; more rows
    through the accumulator scratch) and their tails; N: partial groups of 16 rows; H = blocks
    GGUF blocks (32 or 256 weights)."""
    if block_type in K_QUANTS and blocks > 3:
        blocks = 3  # python_ref is slow; 3 x 256 covers the sub-block walk
    H = blocks * block_size(block_type)
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + block_type)
    w, packed = packed_weight(N, H, block_type, g)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    assert_matches(run(backend, x, packed, block_type, N, b), ref.int8_activation_linear(x, w, block_type, b), H)
    assert_matches(run(backend, x, packed, block_type, N), ref.int8_activation_linear(x, w, block_type), H)


@pytest.mark.parametrize("block_type", TYPES)
def test_within_the_activation_rounding_of_the_gguf_product(block_type):
    """Against x @ W^T with W from gguf.quants.dequantize (not from this package): the error is
    within the activation rounding, |out - exact| <= sum_k |w_k| * d_x(k) / 2 (each q is x / d_x
    rounded to the nearest integer), plus fp32 slack; and it is that rounding: its RMS is the
    one of independent rounding errors, uniform in +-d_x / 2 (variance sum_k w_k^2 d_x(k)^2 / 12),
    within a factor 1.3 (a wrong weight or a misplaced block would be far outside)."""
    g = torch.Generator().manual_seed(block_type)
    N, H = 48, 512
    blocks, packed = packed_weight(N, H, block_type, g)
    w = gguf_values(blocks, block_type)
    x = torch.randn(6, H, generator=g)
    out = ops.int8_activation_linear(x, packed, block_type, N).double()
    exact = x.double() @ w.T
    A = ref.activation_block(block_type)  # activations per int8 scale
    d_x = (x.reshape(6, H // A, A).abs().amax(-1).double() / 127).repeat_interleave(A, 1)
    bound = (d_x / 2) @ w.abs().T
    slack = 1e-5 * (x.double().abs() @ w.abs().T)
    err = out - exact
    assert (err.abs() <= bound * 1.001 + slack).all(), (err.abs() - bound).max()
    expected_rms = ((d_x ** 2 / 12) @ (w ** 2).T).mean().sqrt()
    assert 1 / 1.3 < err.pow(2).mean().sqrt() / expected_rms < 1.3


@pytest.mark.parametrize("block_type", K_QUANTS)
def test_packed_bits_per_weight(block_type):
    """The packing stays close to the GGUF bytes: Q4_K 4.625 bits per weight (GGUF 4.5), Q5_K
    5.625 (5.5), Q6_K 6.5625 (the same as GGUF)."""
    g = torch.Generator().manual_seed(0)
    _, packed = packed_weight(32, 512, block_type, g)
    bits = packed.numel() * 8 / (32 * 512)
    assert bits == {Q4_K: 4.625, Q5_K: 5.625, Q6_K: 6.5625}[block_type]


@pytest.mark.parametrize("block_type", [Q4_0, Q4_1, Q8_0])
def test_close_to_the_fp32_activation_product(block_type):
    """The activation rounding moves an output by ~0.5% of the outputs' scale (Gaussian data),
    against quantized_linear on the same blocks."""
    g = torch.Generator().manual_seed(block_type)
    N, H = 64, 576
    blocks, packed = packed_weight(N, H, block_type, g)
    x = torch.randn(8, H, generator=g)
    exact = ops.quantized_linear(x, blocks, block_type)
    err = (ops.int8_activation_linear(x, packed, block_type, N) - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.02, err


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_activations_and_bias(backend, x_dtype):
    g = torch.Generator().manual_seed(3)
    blocks, packed = packed_weight(6, 64, Q4_1, g)
    x, b = torch.randn(4, 64, generator=g).to(x_dtype), torch.randn(6, generator=g).to(x_dtype)
    out = run(backend, x, packed, Q4_1, 6, b)
    assert out.dtype == torch.float32
    assert_matches(out, ref.int8_activation_linear(x.float(), blocks, Q4_1, b.float()), 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", TYPES)
def test_batch_invariant(backend, block_type):
    """A row's result is bit-identical whatever M is and whatever the other rows hold."""
    g = torch.Generator().manual_seed(21 + block_type)
    N, H = 19, 4 * block_size(block_type)
    _, packed = packed_weight(N, H, block_type, g)
    rows = torch.randn(40, H, generator=g)
    full = run(backend, rows, packed, block_type, N)
    for M in ([1, 2, 3, 4, 5, 7, 9, 16, 40] if backend == "cpu" else [1, 5, 17, 40]):
        pick = torch.randperm(40, generator=g)[:M]
        assert torch.equal(run(backend, rows[pick].clone(), packed, block_type, N), full[pick]), M
        others = torch.randn(M + 3, H, generator=g) * torch.tensor([1e30, 1e-30, 0.0, 1.0]).repeat(M + 3)[:M + 3, None]
        where = torch.randperm(M + 3, generator=g)[:M]
        others[where] = rows[pick]
        assert torch.equal(run(backend, others, packed, block_type, N)[where], full[pick]), M


@pytest.mark.parametrize("block_type", [Q4_0, Q4_K, Q6_K])
def test_thread_count_invariant(block_type):
    """The same bits on 1, 2 and 3 threads, with rows below and above the count from which
    threads share the groups out dynamically (16), and in several row chunks (130 rows)."""
    g = torch.Generator().manual_seed(31 + block_type)
    N, H = 16 * 37, 2 * block_size(block_type)
    _, packed = packed_weight(N, H, block_type, g)
    x = torch.randn(130, H, generator=g)
    saved = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results[threads] = [run("cpu", x[:M].clone(), packed, block_type, N) for M in (3, 16, 40, 130)]
    finally:
        torch.set_num_threads(saved)
    for threads in (2, 3):
        for want, got in zip(results[1], results[threads]):
            assert torch.equal(got, want), (threads, want.shape[0])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("fill", [0xFF, 0x00])
def test_largest_integer_sums(backend, block_type, fill):
    """Every weight byte 0xFF (the largest unsigned integers; 6-bit scales and mins 63; Q6_K's
    int8 scales -1) or 0x00 (Q6_K: q6 - 32 = -32, Q4_0 / Q5_0: the most negative weights) and
    activations at +-127 everywhere: the integer sums at their bounds (the int16 chains of the
    AVX2 path, the K-quants' scaled int32 sums) are still exact. 16 rows: the register and tile
    paths, both signs."""
    g = torch.Generator().manual_seed(7)
    N, H = 20, 512
    blocks = random_blocks(N, H, block_type, g)
    for at in range(blocks.shape[1]):  # every byte but the fp16 fields
        size, nbytes = checks.INT8_ACTIVATION_FORMATS[block_type][1:3]
        if not any(f <= at % nbytes < f + 2 for f in _F16_AT[block_type]):
            blocks[:, at] = fill
    if block_type == Q6_K and fill == 0x00:
        blocks.view(N, H // 256, 210)[:, :, 192:208] = 0x80  # int8 scales -128 with q6 - 32 = -32
    packed = gguf_blocks.pack_int8_activation(blocks, block_type)
    x = torch.ones(16, H)
    x[1::2] = -1
    x[2, ::3] = -1  # mixed signs in one row
    out = run(backend, x, packed, block_type, N)
    assert_matches(out, ref.int8_activation_linear(x, blocks, block_type), H)
    if backend == "cpu":
        for M in (1, 2, 3, 5):  # the register paths and the tails of the tile path
            assert torch.equal(run(backend, x[:M], packed, block_type, N), out[:M])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", [Q4_1, Q5_0, Q4_K, Q6_K])
def test_special_activation_blocks(backend, block_type):
    """Zero and tiny (< 2^-96) activation blocks count as zero; huge values scale; NaN or inf in
    a block makes that row's outputs NaN and leaves the other rows alone."""
    g = torch.Generator().manual_seed(5)
    A = ref.activation_block(block_type)  # activations per int8 scale
    N, H = 20, 2 * A
    blocks, packed = packed_weight(N, H, block_type, g)
    x = torch.randn(6, H, generator=g)
    x[0] = 0
    x[1, :A] = 1e-30  # tiny block: zero; the other block is ordinary
    x[2] *= 1e30
    x[3, 5] = float("nan")
    x[4, 40] = float("inf")
    out = run(backend, x, packed, block_type, N)
    want = ref.int8_activation_linear(x, blocks, block_type)
    assert torch.equal(out[0], torch.zeros(N))
    x1 = x[1:2].clone()
    x1[0, :A] = 0
    assert torch.equal(out[1:2], run(backend, x1, packed, block_type, N))
    assert_matches(out[2] / 1e30, want[2] / 1e30, H)
    assert out[3].isnan().all() and out[4].isnan().all()
    assert_matches(out[5], want[5], H)


@fuzz_settings(40)
@given(M=st.integers(0, 20), N=st.integers(1, 40), nb=st.integers(1, 5), type_index=st.integers(0, len(TYPES) - 1),
       with_bias=st.booleans(), values=st.sampled_from(["normal", "huge", "tiny", "non_finite", "mixed"]),
       seed=st.integers(0, 2**31))
def test_fuzz_matches_reference(M, N, nb, type_index, with_bias, values, seed):
    """Any shape, extreme and non-finite activations, every tensor in guarded storage: the
    CPU kernel against the reference (NaN where the reference has NaN)."""
    block_type = TYPES[type_index]
    g = torch.Generator().manual_seed(seed)
    if block_type in K_QUANTS:
        nb = 8 * (1 + nb % 2)  # 1 or 2 K-quant blocks (python_ref is slow)
    H = 32 * nb
    blocks, packed = packed_weight(N, H, block_type, g)
    x = torch.randn(M, H, generator=g)
    if values == "huge":
        x *= 1e30
    elif values == "tiny":
        x *= 1e-35
    elif values == "non_finite" and M > 0:
        x.view(-1)[torch.randint(0, M * H, (3,), generator=g)] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    elif values == "mixed":
        x *= torch.tensor([1e-35, 1.0, 1e20, 0.0])[torch.randint(0, 4, (M, nb), generator=g)].repeat_interleave(32, 1)
    b = torch.randn(N, generator=g) if with_bias else None
    out = guarded(torch.full((M, N), 7.0))
    run("cpu", guarded(x), guarded(packed), block_type, N, None if b is None else guarded(b), out)
    assert_guard_intact(out)
    want = ref.int8_activation_linear(x, blocks, block_type, b)
    # fp32 sums of terms that may cancel: the error is relative to the terms' magnitudes.
    mag = x.double().nan_to_num(0, 0, 0).abs() @ gguf_values(blocks, block_type).abs().T
    mag = mag + (0 if b is None else b.double().abs())
    got = out.double()
    both_nan = got.isnan() & want.isnan()
    assert (both_nan | ((got - want).abs() <= 1e-5 * mag + 1e-30)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type,M,N", [(Q4_0, 3, 7), (Q4_1, 13, 17), (Q8_0, 6, 33), (Q5_0, 2, 9), (Q5_1, 5, 18),
                                             (Q4_K, 7, 17), (Q5_K, 1, 3), (Q6_K, 6, 33)])
def test_nothing_outside_the_tensors_is_read_or_written(backend, block_type, M, N):
    g = torch.Generator().manual_seed(M * N)
    H = 3 * block_size(block_type)
    blocks, packed = packed_weight(N, H, block_type, g)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    out = guarded(torch.full((M, N), float("nan")))
    run(backend, guarded(x), guarded(packed), block_type, N, guarded(b), out)
    assert_guard_intact(out)
    assert_matches(out, ref.int8_activation_linear(x, blocks, block_type, b), H)


def test_empty_shapes_and_out():
    g = torch.Generator().manual_seed(0)
    _, packed = packed_weight(5, 32, Q4_0, g)
    assert ops.int8_activation_linear(torch.randn(0, 32), packed, Q4_0, 5).shape == (0, 5)
    assert ops.int8_activation_linear(torch.randn(3, 32), packed[:0], Q4_0, 0).shape == (3, 0)
    out = torch.full((2, 5), float("nan"))
    x = torch.randn(2, 32)
    assert ops.int8_activation_linear(x, packed, Q4_0, 5, out=out) is out
    assert not out.isnan().any()
    x_strided = torch.randn(32, 2).T  # non-contiguous x is copied
    assert torch.equal(ops.int8_activation_linear(x_strided, packed, Q4_0, 5),
                       ops.int8_activation_linear(x_strided.contiguous(), packed, Q4_0, 5))


def test_opcheck():
    _, packed = packed_weight(7, 64, Q4_1, torch.Generator().manual_seed(0))
    x, b = torch.randn(3, 64), torch.randn(7)
    op = torch.ops.specdec.int8_activation_linear.default
    torch.library.opcheck(op, (x, packed, Q4_1, b, torch.empty(3, 7)))
    torch.library.opcheck(op, (x, packed, Q4_1, None, torch.empty(3, 7)))


_P = gguf_blocks.pack_int8_activation(gguf_blocks.quantize(torch.randn(20, 64), "Q4_1").blocks, Q4_1)  # [2, 2, 320]
_PK = gguf_blocks.pack_int8_activation(random_blocks(20, 256, Q4_K, torch.Generator().manual_seed(0)),
                                       Q4_K)  # [2, 1, 2368]


@pytest.mark.parametrize("x,p,block_type,b,out,message", [
    (torch.randn(2, 64).double(), _P, 3, None, torch.empty(2, 20), "x must have dtype"),
    (torch.randn(2, 3, 64), _P, 3, None, torch.empty(2, 20), "x must have 2 dimensions"),
    (torch.randn(2, 64), _P.float(), 3, None, torch.empty(2, 20), "packed_weight must have dtype torch.uint8"),
    (torch.randn(2, 64), _P[:, :1].contiguous(), 3, None, torch.empty(2, 20), r"packed_weight must have shape \[ceil"),
    (torch.randn(2, 64), _P, 2, None, torch.empty(2, 20), r"packed_weight must have shape \[ceil\(N / 16\), 2, 288\]"),
    (torch.randn(2, 48), _P, 3, None, torch.empty(2, 20), "H a multiple of the Q4_1 block size 32"),
    (torch.randn(2, 64), _P, 12, None, torch.empty(2, 20), "H a multiple of the Q4_K block size 256"),
    (torch.randn(2, 256), _PK, 14, None, torch.empty(2, 20),
     r"packed_weight must have shape \[ceil\(N / 16\), 1, 3360\]"),
    (torch.randn(2, 64), _P, 0, None, torch.empty(2, 20), "block_type must be one of Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, "
     "Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14"),
    (torch.randn(2, 64), _P, True, None, torch.empty(2, 20), "block_type must be"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(2, 33), r"out must have shape \[2, N\] with ceil\(N / 16\) = 2"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(2, 16), r"out must have shape \[2, N\]"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(3, 20), r"out must have shape \[2, N\]"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(2, 20).double(), "out must have dtype torch.float32"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(20, 2).T, "out must be contiguous"),
    (torch.randn(2, 64), _P, 3, torch.randn(19), torch.empty(2, 20), r"bias must have shape \[20\]"),
    (torch.randn(2, 64), _P.to("meta"), 3, None, torch.empty(2, 20), "packed_weight must be on cpu"),
])
def test_bad_inputs_raise(x, p, block_type, b, out, message):
    with pytest.raises(ValueError, match=message):
        ops.int8_activation_linear(x, p, block_type, out.shape[-1], b, out=out)


@pytest.mark.parametrize("x,p,block_type,b,out,message", [
    (torch.randn(2, 64).double(), _P, 3, None, torch.empty(2, 20), "x must be float32, bfloat16 or float16"),
    (torch.randn(2, 64), _P.float(), 3, None, torch.empty(2, 20), "packed_weight must have dtype Byte"),
    (torch.randn(2, 64), _P[:, :1].contiguous(), 3, None, torch.empty(2, 20),
     r"packed_weight must have shape \[ceil\(N / 16\), 2, 320\]"),
    (torch.randn(2, 64), _P[:, :, :300].contiguous(), 3, None, torch.empty(2, 20), "packed_weight must have shape"),
    (torch.randn(2, 64), _P[:, ::2], 3, None, torch.empty(2, 20), "packed_weight must be contiguous"),
    (torch.randn(2, 64), _P, 1, None, torch.empty(2, 20), "block_type must be one of Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, "
     "Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14"),
    (torch.randn(2, 64), _P, 12, None, torch.empty(2, 20), "H a multiple of 256"),
    (torch.randn(2, 256), _PK, 13, None, torch.empty(2, 20),
     r"packed_weight must have shape \[ceil\(N / 16\), 1, 2880\]"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(2, 40), r"out must have shape \[2, N\] with ceil\(N / 16\) = 2"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(2, 20).double(), "out must have dtype Float"),
    (torch.randn(2, 64), _P, 3, None, torch.empty(20, 2).T, "out must be contiguous"),
    (torch.randn(2, 64), _P, 3, torch.randn(4), torch.empty(2, 20), r"bias must have shape \[20\]"),
])
def test_bad_inputs_raise_in_cpu_kernel(x, p, block_type, b, out, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.int8_activation_linear(x, p, block_type, b, out)


@requires_triton
def test_triton_launcher_checks_its_arguments():
    from specdec_kernels.triton import linear as triton_linear

    with pytest.raises(ValueError, match=r"packed_weight must have shape"):
        triton_linear.int8_activation_linear(torch.randn(2, 64), _P[:, :1].contiguous(), 3, None, torch.empty(2, 20))
    with pytest.raises(ValueError, match=r"out must have shape"):
        triton_linear.int8_activation_linear(torch.randn(2, 64), _P, 3, None, torch.empty(2, 40))


def test_pack_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match="reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks, got F16"):
        gguf_blocks.pack_int8_activation(gguf_blocks.quantize(torch.randn(4, 32), "F16").blocks, "F16")
    with pytest.raises(ValueError, match="multiple of the Q4_1 block bytes 20"):
        gguf_blocks.pack_int8_activation(torch.zeros(4, 30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="multiple of the Q6_K block bytes 210"):
        gguf_blocks.pack_int8_activation(torch.zeros(4, 200, dtype=torch.uint8), Q6_K)


def test_quantized_weight_with_int8_activations_goes_through_its_linear():
    g = torch.Generator().manual_seed(1)
    w = gguf_blocks.quantize(torch.randn(24, 64, generator=g), "Q4_1")
    w8 = w.with_int8_activations()
    assert w8.int8_packed is not None and w.int8_packed is None and w8.with_int8_activations() is w8
    x = torch.randn(2, 3, 64, generator=g)
    assert torch.equal(w8.linear(x), ops.int8_activation_linear(x.reshape(6, 64), w8.int8_packed, Q4_1, 24)
                       .reshape(2, 3, 24))
    assert torch.equal(w.linear(x), ops.quantized_linear(x.reshape(6, 64), w.blocks, Q4_1).reshape(2, 3, 24))
    assert w8.rows(torch.arange(4)).int8_packed is None  # row operations drop the packing
    f16 = gguf_blocks.quantize(torch.randn(4, 32), "F16")
    assert f16.with_int8_activations() is f16  # no int8 kernel for float blocks


@pytest.mark.parametrize("block_type", [Q5_0, Q5_1, Q4_K, Q5_K, Q6_K])
def test_quantized_weight_of_the_newer_formats_carries_the_packing(block_type):
    """QuantizedWeight.with_int8_activations for the Qwen files' formats. A QuantizedWeight
    holds only the formats quantized_linear reads (checks.GGUF_BLOCK_FORMATS); the branch that
    adds these formats there makes this test run."""
    if block_type not in ops.GGUF_BLOCK_FORMATS:
        pytest.skip(f"{checks.INT8_ACTIVATION_FORMATS[block_type][0]} is not yet a QuantizedWeight format")
    g = torch.Generator().manual_seed(block_type)
    H = 2 * block_size(block_type)
    w = gguf_blocks.QuantizedWeight(random_blocks(24, H, block_type, g), block_type, (24, H))
    w8 = w.with_int8_activations()
    assert torch.equal(w8.int8_packed, gguf_blocks.pack_int8_activation(w.blocks, block_type))
    x = torch.randn(5, H, generator=g)
    assert torch.equal(w8.linear(x), ops.int8_activation_linear(x, w8.int8_packed, block_type, 24))


# ---------------------------------------------------------------------------------------
# The CPU paths (AMX, AVX-512 VNNI, AVX2, portable) give the same bits.
# ---------------------------------------------------------------------------------------

def _os_grants_amx() -> bool:
    """Whether Linux grants this process the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM),
    asked independently of the extension."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64
    except (OSError, AttributeError):
        return False


_PATHS_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch
from specdec_kernels import checks, gguf_blocks, ops
from tests.test_int8_activation_linear import TYPES, packed_weight
outs = {{}}
g = torch.Generator().manual_seed(0)
for block_type in TYPES:
    size = checks.INT8_ACTIVATION_FORMATS[block_type][1]
    for M, N, blocks in [(1, 7, 2), (2, 20, 1), (3, 33, 3), (4, 16, 2), (5, 16, 5), (8, 70, 4), (17, 13, 18), (32, 33, 3), (70, 40, 2), (150, 9, 1)]:
        H = size * (blocks if size == 32 else 1 + blocks % 3)
        w, packed = packed_weight(N, H, block_type, g)
        x, b = torch.randn(M, H, generator=g) * 10, torch.randn(N, generator=g)
        outs[(block_type, M, N, H)] = ops.int8_activation_linear(x, packed, block_type, N, b)
    # Activation blocks where the quantiser's rounding and scaling edges decide: exact ties
    # (d = 1: x * (1 / d) = k + 0.5), tiny (< 2^-96), zero and huge blocks.
    H = size * (2 if size == 32 else 1) * 8
    w, packed = packed_weight(21, H, block_type, g)
    x = torch.randn(3, H, generator=g)
    x[0] = torch.arange(H) % 64 - 31.5
    x[0, ::32] = 127.0
    x[1, :32], x[1, 32:64], x[1, 64:96] = 1e-30, 0.0, 1e30
    outs[(block_type, "edges")] = ops.int8_activation_linear(x, packed, block_type, 21)
torch.save(outs, sys.argv[1])
"""


def test_cpu_paths_give_identical_bits(tmp_path):
    """The same cases in four processes: the default path (AMX tiles from 32 rows where the CPU
    has them, else AVX-512 VNNI where it has that), AMX off (SPECDEC_DISABLE_AMX=1), AVX2
    forced (SPECDEC_DISABLE_AVX512=1) and the portable loops (SPECDEC_QUANTIZED_LINEAR_PORTABLE=1)."""
    assert_cpu_paths_agree(_PATHS_SCRIPT, tmp_path)
    flags = cpu_flags()
    if flags and {"amx_tile", "amx_int8", "avx512_vnni"} <= flags:
        # The CPU has AMX: the default path must have used it, unless the OS refused the tiles.
        from specdec_kernels._C import cpu_paths
        assert cpu_paths()["amx_int8"] or os.environ.get("SPECDEC_DISABLE_AMX") == "1" or not _os_grants_amx(), \
            "the CPU and OS have AMX but the kernels did not take the AMX path"
    if not flags or not {"avx512f", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni"} <= flags:
        pytest.skip("this CPU has no AVX-512 VNNI (or it cannot be told): the AVX2 and portable paths were "
                    "compared; the VNNI and AMX paths run under emulation in test_vnni_and_amx_paths_emulated, "
                    "not on real instructions here")


SIMDE_HEADER = "/usr/include/simde/x86/avx512.h"  # Debian's libsimde-dev (.ci/run installs it)


def test_vnni_and_amx_paths_emulated(tmp_path):
    """The AVX-512 VNNI and AMX paths on any CPU with AVX2 (the test above runs them only where
    the CPU has them): tests/int8_activation_linear_emulated.cpp compiles them with SIMDe's
    portable AVX-512 intrinsics and emulated AMX tiles, and compares them with the portable path
    bit for bit (every format, 1-70 rows, bias, zero and NaN rows; random blocks and blocks at
    their largest integers with activations at +-127)."""
    import subprocess

    from torch.utils.cpp_extension import include_paths

    flags = cpu_flags()
    if flags is not None and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("the emulation is built for AVX2 + FMA + F16C, which this CPU lacks")
    if not os.path.exists(SIMDE_HEADER):
        if os.environ.get("CI"):
            pytest.fail(f"{SIMDE_HEADER} is missing: apt-get install libsimde-dev")
        pytest.skip(f"{SIMDE_HEADER} is missing (apt-get install libsimde-dev)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    exe = str(tmp_path / "emulated")
    cmd = ["g++", "-std=c++20", "-O1", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off",
           "-I", os.path.join(root, "csrc"), "-I", os.path.join(root, "csrc", "cpu"),
           *[f"-I{p}" for p in include_paths()], os.path.join(root, "tests", "int8_activation_linear_emulated.cpp"),
           "-o", exe, f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    # Under .ci/sanitizers.sh (libasan preloaded into this process) the harness is built with
    # ASan + UBSan itself; the preload stays out of the compiler and the harness.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        cmd += ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
    built = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([exe], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0 and "mismatches 0" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert "cases 384," in ran.stdout, ran.stdout  # every format, weight set and row count ran


@pytest.mark.parametrize("block_type", TYPES)
def test_amx_switch_gives_identical_bits(block_type):
    """In one process, ``set_amx_enabled`` off and on: the same bits at row counts below and
    above the AMX path's threshold and past a row chunk (on a CPU without AMX both runs take
    the VNNI / AVX2 path, and ``cpu_paths`` says AMX is off either way)."""
    from specdec_kernels._C import amx_pays, cpu_paths, set_amx_enabled

    g = torch.Generator().manual_seed(100 + block_type)
    size = checks.INT8_ACTIVATION_FORMATS[block_type][1]
    H = size * (4 if size == 32 else 1)
    w, packed = packed_weight(40, H, block_type, g)
    had = cpu_paths()["amx_int8"]
    for M in (8, 32, 64, 130):
        x = torch.randn(M, H, generator=g)
        set_amx_enabled(False)
        try:
            assert not cpu_paths()["amx_int8"]
            off = ops.int8_activation_linear(x, packed, block_type, 40)
        finally:
            set_amx_enabled(True)
        assert cpu_paths()["amx_int8"] == had
        on = ops.int8_activation_linear(x, packed, block_type, 40)
        assert torch.equal(on, off), (M, amx_pays(block_type, M), had)


# ---------------------------------------------------------------------------------------
# The model on int8 activations.
# ---------------------------------------------------------------------------------------

def test_model_with_int8_activations_decodes_speculatively_exactly():
    """A Q4_0 model on int8 activations: every block linear and the LM head carry the
    packing, logits stay close to the fp32-activation model's, and greedy speculative
    decoding (a tree drafter) gives exactly its own autoregressive output."""
    from specdec_kernels.decoding import Generator, make_drafter
    from specdec_kernels.models import Llama, tiny_config

    base = Llama.random(tiny_config(hidden_size=64, intermediate_size=128), seed=0).quantized("Q4_0")
    model = base.with_int8_activations()
    assert model.weight_format == "q4_0-int8act"
    assert all(L[k].int8_packed is not None for L in model.layers for k in Llama.LINEAR_KEYS)
    assert model.lm_head.int8_packed is not None and model.embed.int8_packed is None
    prompts = [[1, 5, 9, 5, 9, 5, 9, 2], [3, 4, 3, 4, 3, 4]]
    ar = Generator(model).generate(prompts, max_new_tokens=24)
    spec = Generator(model, make_drafter("ngram-tree", model)).generate(prompts, max_new_tokens=24)
    assert [o.output for o in spec] == [o.output for o in ar]
