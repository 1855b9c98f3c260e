"""specdec::skinny_linear against F.linear / python_ref, and the `linear` dispatcher."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from python_ref import linear as ref
from specdec_kernels import ops
from tests.helpers import assert_cpu_paths_agree, cpu_flags, require_real_model, requires_triton

# fp32 accumulation of H products: compare with a tolerance that grows with H.
def tol(H, out_dtype=torch.float32):
    if out_dtype == torch.float32:
        return dict(atol=1e-5 * max(H, 16) ** 0.5, rtol=1e-5)
    return dict(atol=1e-2, rtol=1e-2)  # one bf16/fp16 rounding of the output


def expected(x, weight, bias):
    """F.linear on the fp32 values of the inputs (the kernel widens bf16/fp16 to fp32)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 13, 16, 31, 64])
@pytest.mark.parametrize("N,H", [(1, 1), (7, 13), (33, 97), (130, 64)])
def test_fp32_matches_f_linear(M, N, H):
    x, w, b = torch.randn(M, H), torch.randn(N, H), torch.randn(N)
    torch.testing.assert_close(ops.skinny_linear(x, w, b), expected(x, w, b), **tol(H))
    torch.testing.assert_close(ops.skinny_linear(x, w), expected(x, w, None), **tol(H))


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,H", [(1, 37, 50), (6, 21, 129), (17, 64, 16)])
def test_low_precision_weights_and_activations(M, N, H, x_dtype, w_dtype):
    x, w, b = torch.randn(M, H).to(x_dtype), torch.randn(N, H).to(w_dtype), torch.randn(N).to(w_dtype)
    out = ops.skinny_linear(x, w, b)
    assert out.dtype == x_dtype
    torch.testing.assert_close(out.float(), expected(x, w, b).to(x_dtype).float(), **tol(H, x_dtype))


def test_matches_python_reference():
    x, w, b = torch.randn(3, 11), torch.randn(5, 11), torch.randn(5)
    torch.testing.assert_close(ops.skinny_linear(x, w, b).double(), ref.skinny_linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_large_m_is_still_correct():
    x, w = torch.randn(100, 40), torch.randn(9, 40)
    torch.testing.assert_close(ops.skinny_linear(x, w), expected(x, w, None), **tol(40))


def test_non_contiguous_x_and_out_tensor():
    x = torch.randn(40, 6).T  # [6, 40], strided
    w, b = torch.randn(11, 40), torch.randn(11)
    out = torch.full((6, 11), float("nan"))
    assert ops.skinny_linear(x, w, b, out=out) is out
    torch.testing.assert_close(out, expected(x, w, b), **tol(40))


def test_empty_shapes():
    assert ops.skinny_linear(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert ops.skinny_linear(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    torch.testing.assert_close(ops.skinny_linear(torch.randn(3, 0), torch.randn(4, 0), torch.ones(4)), torch.ones(3, 4))


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 64), N=st.integers(1, 70), H=st.integers(1, 70), with_bias=st.booleans(), seed=st.integers(0, 2**31))
def test_hypothesis(M, N, H, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, H, generator=g), torch.randn(N, H, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    torch.testing.assert_close(ops.skinny_linear(x, w, b), expected(x, w, b), **tol(H))


def test_opcheck():
    x, w, b = torch.randn(3, 10), torch.randn(7, 10), torch.randn(7)
    torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, w, b, torch.empty(3, 7)))
    torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, w, None, torch.empty(3, 7)))


@pytest.mark.parametrize(
    "x,w,b,out,message",
    [
        (torch.randn(2, 3, 4), torch.randn(5, 4), None, None, "x must have 2 dimensions"),
        (torch.randn(2, 4), torch.randn(5, 3), None, None, r"weight must have shape \[N, 4\]"),
        (torch.randn(2, 4).long(), torch.randn(5, 4), None, None, "x must have dtype"),
        (torch.randn(2, 4), torch.randn(5, 4).double(), None, None, "weight must have dtype"),
        (torch.randn(2, 4), torch.randn(4, 5).T, None, None, "weight must be contiguous"),
        (torch.randn(2, 4), torch.randn(5, 4), torch.randn(4), None, r"bias must have shape \[5\]"),
        (torch.randn(2, 4), torch.randn(5, 4), None, torch.empty(2, 6), r"out must have shape \[2, 5\]"),
        (torch.randn(2, 4), torch.randn(5, 4), None, torch.empty(2, 5, dtype=torch.bfloat16), "out must have dtype"),
    ],
)
def test_bad_inputs_raise(x, w, b, out, message):
    with pytest.raises(ValueError, match=message):
        ops.skinny_linear(x, w, b, out=out)


@pytest.mark.parametrize(
    "x,w,b,out,message",
    [
        (torch.randn(2, 4), torch.randn(5, 3), None, torch.empty(2, 5), r"weight must have shape \[N, 4\] \(x is \[2, 4\]\), got \[5, 3\]"),
        (torch.randn(2, 4), torch.randn(5, 4), torch.randn(3), torch.empty(2, 5), r"bias must have shape \[5\] \(weight is \[5, 4\]\), got \[3\]"),
        (torch.randn(2, 4), torch.randn(5, 4), None, torch.empty(5, 2), r"out must have shape \[2, 5\]"),
        (torch.randn(2, 4), torch.randn(5, 4), None, torch.empty(2, 5).double(), "out must have dtype Float"),
        (torch.randn(2, 4), torch.randn(4, 5).T, None, torch.empty(2, 5), "weight must be contiguous"),
        (torch.randn(2, 4).int(), torch.randn(5, 4), None, torch.empty(2, 5).int(), "x must be float32"),
    ],
)
def test_bad_inputs_raise_in_cpu_kernel(x, w, b, out, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.skinny_linear(x, w, b, out)


def test_linear_dispatcher_matches_f_linear():
    w, b = torch.randn(30, 20), torch.randn(30)
    for shape in [(1, 20), (4, 20), (2, 3, 20), (9, 20), (0, 20)]:
        x = torch.randn(*shape)
        for rows in (None, (1, 8)):
            torch.testing.assert_close(ops.linear(x, w, b, skinny_rows=rows), F.linear(x, w, b), **tol(20))
    wb, bb = w.bfloat16(), b.bfloat16()
    for n in (1, 3):
        x = torch.randn(n, 20).bfloat16()
        torch.testing.assert_close(ops.linear(x, wb, bb, skinny_rows=(1, 2)).float(), F.linear(x, wb, bb).float(),
                                   atol=2e-2, rtol=2e-2)
    # With gradients it must be F.linear (skinny_linear has no autograd formula).
    x = torch.randn(2, 20, requires_grad=True)
    ops.linear(x, w, b, skinny_rows=(1, 8)).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 20))


@requires_triton
@pytest.mark.parametrize("M,N,H", [(1, 5, 7), (6, 33, 40), (17, 16, 64)])
def test_triton_matches_f_linear(M, N, H):
    from specdec_kernels.triton import linear as triton_linear

    x, w, b = torch.randn(M, H), torch.randn(N, H), torch.randn(N)
    out = torch.empty(M, N)
    triton_linear.skinny_linear(x, w, b, out)
    torch.testing.assert_close(out, expected(x, w, b), **tol(H))
    triton_linear.skinny_linear(x, w, None, out)
    torch.testing.assert_close(out, expected(x, w, None), **tol(H))


# ---------------------------------------------------------------------------------------
# Nothing is read or written outside the tensors (every tensor in guarded storage).
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("M,N,H,w_dtype,with_bias", [
    # CPU: M = 5 and 17 -> 3-row micro-tiles plus 2 rows; N = 7 and 70 -> groups of 4 weight
    # rows plus a partial group; H = 19 and 37 -> an 8-wide (16-wide bf16) vector tail.
    # Triton: partial BLOCK_M = 16 / BLOCK_N = 64 / BLOCK_K = 32 tiles (M = 17, N = 70, H = 37).
    (5, 7, 19, torch.float32, True),
    (17, 70, 37, torch.float32, False),
    (5, 7, 37, torch.bfloat16, True),
])
def test_nothing_outside_the_tensors_is_read_or_written(backend, M, N, H, w_dtype, with_bias):
    from tests.helpers import assert_guard_intact, guarded

    g = torch.Generator().manual_seed(M * N + H)
    x, w = torch.randn(M, H, generator=g), torch.randn(N, H, generator=g).to(w_dtype)
    b = torch.randn(N, generator=g).to(w_dtype) if with_bias else None
    args = [None if t is None else guarded(t) for t in (x, w, b)]
    out = guarded(torch.full((M, N), float("nan")))
    if backend == "cpu":
        torch.ops.specdec.skinny_linear(*args, out)
    else:
        from specdec_kernels.triton import linear as triton_linear

        triton_linear.skinny_linear(*args, out)
    assert_guard_intact(out)
    torch.testing.assert_close(out.double(), ref.skinny_linear(x, w, b), **tol(H))


@requires_triton
@pytest.mark.parametrize("w,b,out,message", [
    (torch.randn(7, 9), None, torch.empty(5, 7), r"weight must have shape \[N, 8\]"),
    (torch.randn(7, 8), torch.randn(6), torch.empty(5, 7), r"bias must have shape \[7\]"),
    (torch.randn(7, 8), None, torch.empty(5, 8), r"out must have shape \[5, 7\]"),
])
def test_triton_launcher_checks_shapes_it_indexes_with(w, b, out, message):
    # Through torch.ops on a CUDA tensor the launcher is the kernel: no wrapper checks first.
    from specdec_kernels.triton import linear as triton_linear

    with pytest.raises(ValueError, match=message):
        triton_linear.skinny_linear(torch.randn(5, 8), w, b, out)


# =======================================================================================
# quantized_linear: the weight as raw GGUF blocks (specdec_kernels.gguf_blocks).
# =======================================================================================

import platform  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from specdec_kernels import gguf_blocks  # noqa: E402
from specdec_kernels.gguf_blocks import QuantizedWeight  # noqa: E402

GGML = gguf.GGMLQuantizationType
K_QUANT_TYPES = [GGML.Q4_K, GGML.Q5_K, GGML.Q6_K]  # super-blocks of 256; gguf-py has no quantiser for them
QUANT_TYPES = [GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0] + K_QUANT_TYPES
BLOCK_TYPES = QUANT_TYPES + [GGML.BF16, GGML.F16, GGML.F32]
# Where each block format keeps its fp16 scales (byte offsets in a block).
FP16_FIELDS = {GGML.Q4_0: [0], GGML.Q4_1: [0, 2], GGML.Q5_0: [0], GGML.Q5_1: [0, 2], GGML.Q8_0: [0],
               GGML.Q4_K: [0, 2], GGML.Q5_K: [0, 2], GGML.Q6_K: [208]}


def h_for(block_type, H: int) -> int:
    """H rounded up to a whole number of the type's blocks (the K-quants need 256s)."""
    size = gguf.GGML_QUANT_SIZES[GGML(block_type)][0]
    return -(-H // size) * size


def gguf_blocks_of(w: torch.Tensor, block_type) -> torch.Tensor:
    """uint8 [N, row_bytes]: gguf.quantize's bytes of the fp32 matrix w [N, H] (for the
    K-quants, which gguf-py cannot quantise, gguf_blocks.quantize's)."""
    if block_type in K_QUANT_TYPES:
        return gguf_blocks.quantize(w, int(block_type)).blocks
    raw = np.ascontiguousarray(gguf.quantize(w.float().numpy(), block_type)).view(np.uint8)
    return torch.from_numpy(raw.reshape(w.shape[0], -1).copy())


def random_blocks(N, blocks_per_row, block_type, generator, max_scale_exponent=30):
    """uint8 [N, blocks_per_row * block bytes] of random bytes: valid blocks of any bit pattern
    whose fp16 scales are finite, with biased exponents at most ``max_scale_exponent``
    (15: |scale| < 2)."""
    nbytes = gguf.GGML_QUANT_SIZES[GGML(block_type)][1]
    raw = torch.randint(0, 256, (N, blocks_per_row, nbytes), dtype=torch.uint8, generator=generator)
    for at in FP16_FIELDS[GGML(block_type)]:
        bits = raw[..., at:at + 2].contiguous().view(torch.int16)
        exponent = ((bits >> 10) & 31).clamp(max=max_scale_exponent)
        raw[..., at:at + 2] = ((bits & ~(31 << 10)) | (exponent << 10)).view(torch.uint8)
    return raw.reshape(N, -1)


def gguf_values_of(blocks: torch.Tensor, block_type, H: int) -> torch.Tensor:
    """fp32 [N, H]: gguf.dequantize of the blocks (the values the op must use)."""
    values = gguf.dequantize(blocks.numpy(), block_type)
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(blocks.shape[0], H).copy())


def random_weight(N, H, block_type, generator=None):
    """(blocks, fp32 values) of a random [N, H] weight with a few all-zero and constant blocks
    (scale 0, min = max) among the ordinary ones."""
    w = torch.randn(N, H, generator=generator)
    if H >= 64 and N >= 2:
        w[0, :32] = 0.0
        w[N - 1, 32:64] = 0.75
    if H >= 256 and N >= 2:
        w[1, :256] = 0.0  # a K-quant super-block of zeros (d = dmin = 0)
    blocks = gguf_blocks_of(w, block_type)
    return blocks, gguf_values_of(blocks, block_type, H)


def quantized_tol(H):
    """The weights are exact (the gguf values), so only the fp32 accumulation differs from
    the float64 reference: the same tolerance for every block type."""
    return dict(atol=2e-5 * max(H, 16) ** 0.5, rtol=2e-5)


def scaled_tol(x, values):
    """The tolerance of an fp32 product x @ values^T of any magnitude (random blocks can hold
    weights up to ~1e3): fp32 rounding relative to the largest |x| @ |w|^T."""
    scale = float((x.abs().reshape(-1, x.shape[-1]).double() @ values.abs().double().T).max()) + 1.0
    return dict(atol=1e-6 * scale, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# gguf_blocks: quantize / dequantize against the gguf package, the reference decoder.
# ---------------------------------------------------------------------------------------


def test_random_blocks_have_finite_scales_of_every_kind():
    g = torch.Generator().manual_seed(0)
    for block_type in QUANT_TYPES:
        raw = random_blocks(64, 4, block_type, g).view(64, 4, -1)
        for at in FP16_FIELDS[block_type]:
            scales = raw[..., at:at + 2].contiguous().view(torch.float16)
            assert bool(torch.isfinite(scales).all()) and bool((scales < 0).any()) and bool((scales.abs() > 1).any())
            assert bool((scales.abs() < 2**-14).any())  # subnormal fp16 scales too


@pytest.mark.parametrize("block_type", [t for t in BLOCK_TYPES if t not in K_QUANT_TYPES])
def test_quantize_gives_the_bytes_gguf_quantize_gives(block_type):
    g = torch.Generator().manual_seed(int(block_type))
    w = torch.randn(37, 128, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    w[3, :32] = 0.0        # scale 0
    w[4, 32:64] = -1.5     # constant block (Q4_1: max == min)
    w[5, 64:96] = torch.linspace(-1, 1, 32)  # ties at the rounding points
    w[6, :32] *= -1e-6     # tiny values (subnormal fp16 scales)
    q = gguf_blocks.quantize(w, int(block_type))
    assert q.shape == (37, 128) and q.block_type == int(block_type)
    assert torch.equal(q.blocks, gguf_blocks_of(w, block_type))


# Relative error (Frobenius, per row) of our K-quant quantiser on Gaussian weights: about
# what the 32-weight formats with as many bits give (Q4_1 ~0.08, Q5_1 ~0.04 here).
K_QUANT_MAX_ERROR = {GGML.Q4_K: 0.09, GGML.Q5_K: 0.045, GGML.Q6_K: 0.025}


@pytest.mark.parametrize("block_type", K_QUANT_TYPES)
def test_k_quant_quantize_is_read_by_gguf_dequantize_with_a_small_error(block_type):
    """gguf-py has no K-quant quantiser: ours must write blocks that gguf.dequantize reads as
    the values ours dequantises to, close to the weights."""
    g = torch.Generator().manual_seed(int(block_type))
    w = torch.randn(24, 512, generator=g) * torch.logspace(-3, 2, 24)[:, None]
    w[0, :256] = 0.0                     # a zero super-block: d = dmin = 0
    w[1, 32:64] = -1.5                   # a constant sub-block
    w[2, :256] = w[2, :256].abs() + 1.0  # all positive (sub-block mins above 0)
    w[3, 256:] *= 1e-6                   # tiny values (subnormal fp16 scales)
    q = gguf_blocks.quantize(w, int(block_type))
    assert q.shape == (24, 512) and q.blocks.shape == (24, 2 * gguf_blocks.block_bytes(block_type))
    values = gguf_values_of(q.blocks, block_type, 512)
    assert torch.equal(q.dequantize().view(torch.int32), values.view(torch.int32))
    assert torch.equal(values[0, :256], torch.zeros(256))
    error = (values - w).norm(dim=1) / w.norm(dim=1)
    assert float(error[4:].max()) < K_QUANT_MAX_ERROR[block_type], error
    assert float((values[1, 32:64] + 1.5).abs().max()) < 0.05
    assert float(error[2]) < 2 * K_QUANT_MAX_ERROR[block_type]


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_dequantize_gives_the_values_gguf_dequantize_gives(block_type):
    g = torch.Generator().manual_seed(100 + int(block_type))
    H = h_for(block_type, 96)
    blocks, values = random_weight(9, H, block_type, g)
    got = gguf_blocks.dequantize(blocks, int(block_type))
    assert torch.equal(got.view(torch.int32), values.view(torch.int32))  # bit for bit, signed zeros included
    # Arbitrary bytes too (every nibble, high bit, 6-bit scale and int8 value, fp16 scales of
    # any finite value, subnormals included).
    if block_type in QUANT_TYPES:
        raw = random_blocks(40, 3, block_type, g)
        want = gguf_values_of(raw, block_type, 3 * gguf_blocks.block_size(block_type))
        assert torch.equal(gguf_blocks.dequantize(raw, int(block_type)).view(torch.int32), want.view(torch.int32))
        # Any leading shape (e.g. [rows, ...] of an embedding lookup).
        got = gguf_blocks.dequantize(raw.reshape(5, 8, -1), int(block_type))
        assert torch.equal(got.reshape(40, -1).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_quantize_and_dequantize_in_chunks_give_the_same_bytes_and_values(block_type, monkeypatch):
    """Big weights are (de)quantised CHUNK_VALUES weights at a time: chunks that end inside a
    row, and a short last chunk, must give gguf's bytes and values all the same."""
    g = torch.Generator().manual_seed(200 + int(block_type))
    H = h_for(block_type, 96)
    w = torch.randn(7, H, generator=g) * torch.logspace(-2, 1, 7)[:, None]
    monkeypatch.setattr(gguf_blocks, "CHUNK_VALUES", 3 * gguf_blocks.block_size(block_type))
    q = gguf_blocks.quantize(w, int(block_type))
    if block_type not in K_QUANT_TYPES:  # gguf-py has no K-quant quantiser
        assert torch.equal(q.blocks, gguf_blocks_of(w, block_type))
    monkeypatch.setattr(gguf_blocks, "CHUNK_VALUES", 1 << 30)  # one chunk: the whole weight
    assert torch.equal(q.blocks, gguf_blocks.quantize(w, int(block_type)).blocks)
    monkeypatch.setattr(gguf_blocks, "CHUNK_VALUES", 3 * gguf_blocks.block_size(block_type))
    got = gguf_blocks.dequantize(q.blocks, int(block_type))
    want = gguf_values_of(q.blocks, block_type, H)
    assert got.shape == (7, H) and torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_reference_decoder_gives_the_gguf_values(block_type):
    g = torch.Generator().manual_seed(200 + int(block_type))
    H = h_for(block_type, 64)
    blocks, values = random_weight(3, H, block_type, g)
    got = ref.dequantize(blocks, int(block_type), H)
    assert torch.equal(got.view(torch.int32), values.view(torch.int32))
    if block_type in QUANT_TYPES:
        raw = random_blocks(4, 2, block_type, g)
        H = 2 * gguf_blocks.block_size(block_type)
        got = ref.dequantize(raw, int(block_type), H)
        assert torch.equal(got.view(torch.int32), gguf_values_of(raw, block_type, H).view(torch.int32))


def test_block_type_helpers():
    assert gguf_blocks.type_id("q4_1") == 3 == gguf_blocks.type_id(GGML.Q4_1)
    assert (gguf_blocks.block_size("Q8_0"), gguf_blocks.block_bytes("Q8_0")) == (32, 34)
    assert gguf_blocks.row_bytes("Q4_0", 576) == 18 * 18
    assert gguf_blocks.row_bytes("BF16", 7) == 14
    for tid, (name, size, nbytes) in ops.GGUF_BLOCK_FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[GGML(tid)] == (size, nbytes) and GGML(tid).name == name
    assert gguf_blocks.type_id("q6_k") == 14 and gguf_blocks.type_id(GGML.Q5_0) == 6
    assert (gguf_blocks.block_size("Q4_K"), gguf_blocks.block_bytes("Q4_K")) == (256, 144)
    assert gguf_blocks.row_bytes("Q6_K", 1536) == 6 * 210 and gguf_blocks.row_bytes("Q5_1", 64) == 48
    with pytest.raises(ValueError, match="block type must be one of"):
        gguf_blocks.type_id("Q2_K")
    with pytest.raises(ValueError, match="block type must be one of"):
        gguf_blocks.type_id(GGML.Q8_1)
    with pytest.raises(ValueError, match="multiple of 32 weights, got H = 40"):
        gguf_blocks.row_bytes("Q4_1", 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_blocks.quantize(torch.randn(2, 40), "Q8_0")
    with pytest.raises(ValueError, match="a Q4_K row must hold a multiple of 256 weights, got H = 288"):
        gguf_blocks.quantize(torch.randn(2, 288), "Q4_K")


def test_quantized_weight_rows_cat_embedding():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(10, 64, generator=g)
    q = gguf_blocks.quantize(w, "Q4_1")
    values = q.dequantize()
    perm = torch.randperm(10, generator=g)
    assert torch.equal(q.rows(perm).dequantize(), values[perm])
    assert torch.equal(q.rows(slice(2, 5)).dequantize(), values[2:5])
    k = gguf_blocks.quantize(torch.randn(3, 64, generator=g), "Q4_1")
    fused = QuantizedWeight.cat([q, k])
    assert fused.shape == (13, 64) and torch.equal(fused.dequantize(), torch.cat([values, k.dequantize()]))
    ids = torch.tensor([[3, 3], [0, 9]])
    assert torch.equal(q.embedding(ids), values[ids])
    x = torch.randn(2, 3, 64, generator=g)
    torch.testing.assert_close(q.linear(x), F.linear(x, values), **quantized_tol(64))
    assert q.nbytes == 10 * 40 and "Q4_1" in repr(q)
    with pytest.raises(ValueError, match="cat needs one block type and H"):
        QuantizedWeight.cat([q, gguf_blocks.quantize(torch.randn(3, 64), "Q8_0")])
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 64\]"):
        q.linear(torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"blocks must have shape \[10, 40\]"):
        QuantizedWeight(q.blocks[:, :20].contiguous(), 3, (10, 64))


@pytest.mark.parametrize("block_type", [GGML.Q5_0, GGML.Q5_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K])
def test_quantized_weight_of_the_qwen_formats(block_type):
    """rows / cat / embedding / linear on the formats of the Qwen2.5-Coder files, from random
    blocks as a file would hold them."""
    g = torch.Generator().manual_seed(int(block_type))
    H = 2 * gguf_blocks.block_size(block_type)
    raw = random_blocks(10, 2, block_type, g, max_scale_exponent=15)
    q = QuantizedWeight(raw, int(block_type), (10, H))
    values = gguf_values_of(raw, block_type, H)
    assert torch.equal(q.dequantize().view(torch.int32), values.view(torch.int32))
    perm = torch.randperm(10, generator=g)
    assert torch.equal(q.rows(perm).dequantize(), values[perm])
    ids = torch.tensor([[3, 3], [0, 9]])
    assert torch.equal(q.embedding(ids), values[ids])
    assert torch.equal(q.embedding(ids.int()), values[ids])
    fused = QuantizedWeight.cat([q.rows(slice(0, 4)), q.rows(slice(4, 10))])
    assert torch.equal(fused.blocks, q.blocks)
    x = torch.randn(2, 3, H, generator=g)
    torch.testing.assert_close(q.linear(x), F.linear(x, values), **scaled_tol(x, values))
    size, nbytes = gguf_blocks.block_size(block_type), gguf_blocks.block_bytes(block_type)
    with pytest.raises(ValueError, match=rf"blocks must have shape \[10, {3 * nbytes}\], got \[10, {2 * nbytes}\]"):
        QuantizedWeight(raw, int(block_type), (10, H + size))


def test_block_weight_linear_is_quantized_linear():
    """QuantizedWeight.linear (the model's hot path) calls the kernel without the wrapper's
    Python checks: same bits as ops.quantized_linear, bad x still refused."""
    g = torch.Generator().manual_seed(6)
    q = gguf_blocks.quantize(torch.randn(10, 64, generator=g), "Q4_1")
    b = torch.randn(10, generator=g)
    x = torch.randn(2, 3, 64, generator=g)
    ref = ops.quantized_linear(x.reshape(6, 64), q.blocks, q.block_type, b).reshape(2, 3, 10)
    assert torch.equal(q.linear(x, b), ref)
    assert torch.equal(q.linear(x.transpose(0, 1), b), ref.transpose(0, 1))  # non-contiguous rows
    assert q.linear(torch.randn(0, 64)).shape == (0, 10)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 64\]"):
        q.linear(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        q.linear(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="bias must have shape"):
        q.linear(x, torch.randn(9))


# ---------------------------------------------------------------------------------------
# The op on every backend against the reference.
# ---------------------------------------------------------------------------------------

BACKENDS = ["cpu", pytest.param("triton", marks=requires_triton)]


def run_quantized(backend, x, blocks, block_type, bias=None, out=None):
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan")) if out is None else out
    if backend == "cpu":
        torch.ops.specdec.quantized_linear(x, blocks, int(block_type), bias, out)
    else:
        from specdec_kernels.triton import linear as triton_linear

        triton_linear.quantized_linear(x, blocks, int(block_type), bias, out)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", BLOCK_TYPES)
@pytest.mark.parametrize("M,N,H", [(1, 1, 32), (1, 7, 64), (3, 33, 96), (8, 5, 32), (9, 17, 64), (64, 3, 32)])
def test_quantized_matches_reference(backend, block_type, M, N, H):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + int(block_type))
    H = h_for(block_type, H)
    blocks, _ = random_weight(N, H, block_type, g)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    want = ref.quantized_linear(x, blocks, int(block_type), b)
    torch.testing.assert_close(run_quantized(backend, x, blocks, block_type, b).double(), want, **quantized_tol(H))
    want = ref.quantized_linear(x, blocks, int(block_type))
    torch.testing.assert_close(run_quantized(backend, x, blocks, block_type).double(), want, **quantized_tol(H))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", QUANT_TYPES)
@pytest.mark.parametrize("M,N,blocks_per_row", [(1, 7, 1), (5, 9, 2), (9, 4, 3)])
def test_quantized_on_random_blocks_matches_reference(backend, block_type, M, N, blocks_per_row):
    """Blocks of random bytes (every bit pattern of the quants, high bits and 6-bit scales;
    fp16 scales of either sign, subnormal ones included) against python_ref."""
    g = torch.Generator().manual_seed(M * 100 + N + int(block_type))
    blocks = random_blocks(N, blocks_per_row, block_type, g, max_scale_exponent=15)
    H = blocks_per_row * gguf_blocks.block_size(block_type)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    values = gguf_values_of(blocks, block_type, H)
    want = ref.quantized_linear(x, blocks, int(block_type), b)
    got = run_quantized(backend, x, blocks, block_type, b).double()
    torch.testing.assert_close(got, want, **scaled_tol(x, values))


@pytest.mark.parametrize("block_type", [GGML.BF16, GGML.F16, GGML.F32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float_types_any_h(backend, block_type):
    """Block size 1: H need not be a multiple of 32 (the last chunk is zero-padded)."""
    g = torch.Generator().manual_seed(7)
    for M, N, H in [(2, 5, 1), (3, 9, 37), (5, 4, 95)]:
        blocks, values = random_weight(N, H, block_type, g)
        x = torch.randn(M, H, generator=g)
        torch.testing.assert_close(run_quantized(backend, x, blocks, block_type), F.linear(x, values),
                                   **quantized_tol(H))


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 31, 33, 48, 64])
def test_quantized_matches_f_linear_on_the_gguf_values(block_type, M):
    """Every row count 1..64 the CPU kernel tiles differently (direct tiles up to 8 rows, then
    decoded once into a scratch, tiles of 4), larger shapes than the reference can afford."""
    g = torch.Generator().manual_seed(M + int(block_type))
    N, H = 37, 256
    blocks, values = random_weight(N, H, block_type, g)
    x = torch.randn(M, H, generator=g)
    torch.testing.assert_close(ops.quantized_linear(x, blocks, int(block_type)), F.linear(x, values),
                               **quantized_tol(H))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_activations_and_bias(backend, x_dtype):
    g = torch.Generator().manual_seed(11)
    blocks, values = random_weight(6, 64, GGML.Q8_0, g)
    x, b = torch.randn(4, 64, generator=g).to(x_dtype), torch.randn(6, generator=g).to(x_dtype)
    out = run_quantized(backend, x, blocks, GGML.Q8_0, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.float(), values, b.float()), **quantized_tol(64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_quantized_is_batch_invariant(backend, block_type):
    """A row's result is bit-identical whatever M is and whatever the other rows hold."""
    g = torch.Generator().manual_seed(21 + int(block_type))
    N, H = 19, h_for(block_type, 128)
    blocks, _ = random_weight(N, H, block_type, g)
    rows = torch.randn(64, H, generator=g)
    full = run_quantized(backend, rows, blocks, block_type)
    sizes = [1, 2, 3, 5, 8, 9, 13, 16, 17, 33, 64] if backend == "cpu" else [1, 5, 17, 64]
    for M in sizes:
        pick = torch.randperm(64, generator=g)[:M]
        assert torch.equal(run_quantized(backend, rows[pick].clone(), blocks, block_type), full[pick]), M
        # The same rows among other values (huge, tiny, zero) at other positions.
        others = torch.randn(M + 3, H, generator=g) * torch.tensor([1e30, 1e-30, 0.0, 1.0]).repeat(M + 3)[:M + 3, None]
        where = torch.randperm(M + 3, generator=g)[:M]
        others[where] = rows[pick]
        assert torch.equal(run_quantized(backend, others, blocks, block_type)[where], full[pick]), M


@settings(max_examples=20, deadline=None)
@given(M=st.integers(1, 64), N=st.integers(1, 41), blocks_per_row=st.integers(1, 5),
       type_index=st.integers(0, len(BLOCK_TYPES) - 1), with_bias=st.booleans(), seed=st.integers(0, 2**31))
def test_quantized_hypothesis(M, N, blocks_per_row, type_index, with_bias, seed):
    block_type = BLOCK_TYPES[type_index]
    g = torch.Generator().manual_seed(seed)
    H = max(32, gguf_blocks.block_size(block_type)) * blocks_per_row
    blocks, values = random_weight(N, H, block_type, g)
    x = torch.randn(M, H, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    torch.testing.assert_close(ops.quantized_linear(x, blocks, int(block_type), b), F.linear(x, values, b),
                               **quantized_tol(H))


def test_quantized_empty_shapes_and_out():
    blocks = gguf_blocks.quantize(torch.randn(5, 32), "Q4_0").blocks
    assert ops.quantized_linear(torch.randn(0, 32), blocks, 2).shape == (0, 5)
    assert ops.quantized_linear(torch.randn(3, 32), blocks[:0], 2).shape == (3, 0)
    out = torch.full((2, 5), float("nan"))
    x = torch.randn(2, 32)
    assert ops.quantized_linear(x, blocks, 2, out=out) is out
    torch.testing.assert_close(out, F.linear(x, gguf_blocks.dequantize(blocks, 2)), **quantized_tol(32))
    x_strided = torch.randn(32, 2).T  # non-contiguous x is fine (it is copied)
    torch.testing.assert_close(ops.quantized_linear(x_strided, blocks, 2),
                               F.linear(x_strided, gguf_blocks.dequantize(blocks, 2)), **quantized_tol(32))


def test_quantized_opcheck():
    blocks = gguf_blocks.quantize(torch.randn(7, 64), "Q4_1").blocks
    x, b = torch.randn(3, 64), torch.randn(7)
    torch.library.opcheck(torch.ops.specdec.quantized_linear.default, (x, blocks, 3, b, torch.empty(3, 7)))
    torch.library.opcheck(torch.ops.specdec.quantized_linear.default, (x, blocks, 3, None, torch.empty(3, 7)))


_Q41 = gguf_blocks.quantize(torch.randn(5, 64), "Q4_1").blocks  # uint8 [5, 40]
_Q4K = gguf_blocks.quantize(torch.randn(5, 256), "Q4_K").blocks  # uint8 [5, 144]


@pytest.mark.parametrize("x,w,block_type,b,out,message", [
    (torch.randn(2, 64).double(), _Q41, 3, None, None, "x must have dtype"),
    (torch.randn(2, 3, 64), _Q41, 3, None, None, "x must have 2 dimensions"),
    (torch.randn(2, 64), _Q41.float(), 3, None, None, "weight must have dtype torch.uint8"),
    (torch.randn(2, 64), _Q41[:, :38], 3, None, None, r"weight must have shape \[N, 40\] \(2 Q4_1 blocks of 20"),
    (torch.randn(2, 64), _Q41, 2, None, None, r"weight must have shape \[N, 36\]"),
    (torch.randn(2, 48), _Q41, 3, None, None, r"x.shape\[1\] \(H = 48\) must be a multiple of the Q4_1 block size 32"),
    (torch.randn(2, 64), _Q41, 10, None, None, "block_type must be a GGML type id among F32 = 0"),
    (torch.randn(2, 288), _Q4K, 12, None, None,
     r"x.shape\[1\] \(H = 288\) must be a multiple of the Q4_K block size 256"),
    (torch.randn(2, 512), _Q4K, 12, None, None, r"weight must have shape \[N, 288\] \(2 Q4_K blocks of 144"),
    (torch.randn(2, 64), _Q41, True, None, None, "block_type must be a GGML type id"),
    (torch.randn(2, 64), _Q41, "Q4_1", None, None, "block_type must be a GGML type id"),
    (torch.randn(2, 64), torch.cat([_Q41, _Q41], 1)[:, ::2], 3, None, None, "weight must be contiguous"),
    (torch.randn(2, 64), _Q41, 3, torch.randn(4), None, r"bias must have shape \[5\]"),
    (torch.randn(2, 64), _Q41, 3, torch.randn(5).long(), None, "bias must have dtype"),
    (torch.randn(2, 64), _Q41, 3, None, torch.empty(2, 4), r"out must have shape \[2, 5\]"),
    (torch.randn(2, 64), _Q41, 3, None, torch.empty(2, 5).bfloat16(), "out must have dtype torch.float32"),
    (torch.randn(2, 64), _Q41, 3, None, torch.empty(5, 2).T, "out must be contiguous"),
    (torch.randn(2, 64), _Q41.to("meta"), 3, None, None, "weight must be on cpu"),
])
def test_quantized_bad_inputs_raise(x, w, block_type, b, out, message):
    with pytest.raises(ValueError, match=message):
        ops.quantized_linear(x, w, block_type, b, out=out)


@pytest.mark.parametrize("x,w,block_type,b,out,message", [
    (torch.randn(2, 64).double(), _Q41, 3, None, torch.empty(2, 5), "x must be float32, bfloat16 or float16"),
    (torch.randn(2, 64), _Q41.float(), 3, None, torch.empty(2, 5), "weight must have dtype Byte"),
    (torch.randn(2, 64), _Q41[:, :38].contiguous(), 3, None, torch.empty(2, 5),
     r"weight must have shape \[N, 40\] \(2 Q4_1 blocks of 20 bytes per row, x is \[2, 64\]\), got \[5, 38\]"),
    (torch.randn(2, 48), _Q41, 3, None, torch.empty(2, 5),
     r"x.size\(1\) \(H = 48\) must be a multiple of the Q4_1 block size 32"),
    (torch.randn(2, 64), _Q41, 10, None, torch.empty(2, 5), "block_type must be a GGML type id among F32 = 0"),
    (torch.randn(2, 64), _Q41, 9, None, torch.empty(2, 5), "block_type must be a GGML type id among F32 = 0"),
    (torch.randn(2, 288), _Q4K, 12, None, torch.empty(2, 5),
     r"x.size\(1\) \(H = 288\) must be a multiple of the Q4_K block size 256"),
    (torch.randn(2, 512), _Q4K, 12, None, torch.empty(2, 5),
     r"weight must have shape \[N, 288\] \(2 Q4_K blocks of 144 bytes per row, x is \[2, 512\]\), got \[5, 144\]"),
    (torch.randn(2, 64), _Q41, -1, None, torch.empty(2, 5), "block_type must be a GGML type id"),
    (torch.randn(2, 64), torch.cat([_Q41, _Q41], 1)[:, ::2], 3, None, torch.empty(2, 5), "weight must be contiguous"),
    (torch.randn(2, 64), _Q41, 3, torch.randn(4), torch.empty(2, 5), r"bias must have shape \[5\]"),
    (torch.randn(2, 64), _Q41, 3, None, torch.empty(2, 4), r"out.size\(1\) must be 5"),
    (torch.randn(2, 64), _Q41, 3, None, torch.empty(2, 5).double(), "out must have dtype Float"),
    (torch.randn(2, 64), _Q41, 3, None, torch.empty(5, 2).T, "out must be contiguous"),
])
def test_quantized_bad_inputs_raise_in_cpu_kernel(x, w, block_type, b, out, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.quantized_linear(x, w, block_type, b, out)


@requires_triton
def test_quantized_triton_launcher_checks_its_arguments():
    # Through torch.ops on a CUDA tensor the launcher is the kernel: no wrapper checks first.
    from specdec_kernels.triton import linear as triton_linear

    with pytest.raises(ValueError, match=r"weight must have shape \[N, 40\]"):
        triton_linear.quantized_linear(torch.randn(2, 64), _Q41[:, :38].contiguous(), 3, None, torch.empty(2, 5))
    with pytest.raises(ValueError, match=r"out must have shape \[2, 5\]"):
        triton_linear.quantized_linear(torch.randn(2, 64), _Q41, 3, None, torch.empty(2, 6))
    with pytest.raises(ValueError, match="block_type must be a GGML type id"):
        triton_linear.quantized_linear(torch.randn(2, 64), _Q41, 10, None, torch.empty(2, 5))
    with pytest.raises(ValueError, match=r"must be a multiple of the Q6_K block size 256"):
        triton_linear.quantized_linear(torch.randn(2, 320), _Q4K, 14, None, torch.empty(2, 5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type,M,N,H,with_bias", [
    # CPU: M = 3 (direct tile), 13 (scratch tiles of 4 plus 1); N = 7 (a partial group of
    # 4 rows); F32/F16/BF16 with H = 37: a partial last chunk. Triton: partial 16 x 16 tiles.
    (GGML.Q4_0, 3, 7, 64, True),
    (GGML.Q4_1, 13, 7, 96, False),
    (GGML.Q8_0, 17, 18, 32, True),
    (GGML.Q5_0, 3, 7, 64, True),
    (GGML.Q5_1, 13, 5, 96, False),
    (GGML.Q4_K, 3, 7, 256, True),
    (GGML.Q5_K, 13, 5, 512, False),
    (GGML.Q6_K, 9, 7, 256, True),
    (GGML.BF16, 3, 7, 37, True),
    (GGML.F16, 13, 5, 37, False),
    (GGML.F32, 9, 7, 37, True),
])
def test_quantized_nothing_outside_the_tensors_is_read_or_written(backend, block_type, M, N, H, with_bias):
    from tests.helpers import assert_guard_intact, guarded

    g = torch.Generator().manual_seed(M * N + H)
    blocks, values = random_weight(N, H, block_type, g)
    x = torch.randn(M, H, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    args = [None if t is None else guarded(t) for t in (x, blocks, b)]
    out = guarded(torch.full((M, N), float("nan")))
    run_quantized(backend, args[0], args[1], block_type, args[2], out)
    assert_guard_intact(out)
    torch.testing.assert_close(out.double(), ref.skinny_linear(x, values, b), **quantized_tol(H))


# ---------------------------------------------------------------------------------------
# The CPU paths (AVX-512, AVX2, portable) give the same bits.
# ---------------------------------------------------------------------------------------

_PATHS_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch
from specdec_kernels import gguf_blocks, ops
outs = {{}}
g = torch.Generator().manual_seed(0)
for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16", "F32"):
    for M, N, H in [(1, 7, 64), (5, 33, 96), (8, 9, 160), (17, 70, 128), (64, 13, 64)]:
        H = H if gguf_blocks.block_size(name) < 256 else 256 * (H // 64)  # K-quants: 256, 512 or 768
        q = gguf_blocks.quantize(torch.randn(N, H, generator=g), name)
        x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
        outs[(name, M, N, H)] = ops.quantized_linear(x, q.blocks, q.block_type, b)
    if name in ("BF16", "F16", "F32"):
        q = gguf_blocks.quantize(torch.randn(6, 45, generator=g), name)
        outs[(name, "H45")] = ops.quantized_linear(torch.randn(11, 45, generator=g), q.blocks, q.block_type)
    else:  # blocks of random bytes: every bit pattern of the quants and sub-block scales
        tid, nbytes = gguf_blocks.type_id(name), gguf_blocks.block_bytes(name)
        raw = torch.randint(0, 256, (9, 2, nbytes), dtype=torch.uint8, generator=g)
        for at in {{6: [0], 12: [0, 2], 13: [0, 2], 14: [208]}}.get(tid, [0, 2] if tid in (3, 7) else [0]):
            raw[..., at + 1] &= 0xBF  # finite fp16 scales, |scale| < 2
        x = torch.randn(5, 2 * gguf_blocks.block_size(name), generator=g)
        outs[(name, "random bytes")] = ops.quantized_linear(x, raw.reshape(9, -1), tid)
torch.save(outs, sys.argv[1])
"""


def test_quantized_cpu_paths_give_identical_bits(tmp_path):
    """The same cases in three processes: the default path (AVX-512 here), AVX2 forced
    (SPECDEC_DISABLE_AVX512=1) and the portable loops (SPECDEC_QUANTIZED_LINEAR_PORTABLE=1)."""
    assert_cpu_paths_agree(_PATHS_SCRIPT, tmp_path)
    flags = cpu_flags() if platform.machine() == "x86_64" else None
    if not flags or not {"avx512f", "avx512vl", "avx512dq", "avx512bw"} <= flags:
        pytest.skip("this CPU has no AVX-512 (or it cannot be told): the AVX2 and portable paths were compared, "
                    "the AVX-512 one did not run")


# ---------------------------------------------------------------------------------------
# The real checkpoint: SmolLM2-135M-Instruct's GGUF (Q4_1 linears, Q8_0 embedding).
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_reader():
    return gguf.GGUFReader(require_real_model())


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.3.ffn_gate.weight", "blk.0.attn_v.weight"])
def test_real_gguf_linears(smollm2_reader, name):
    t = _tensor(smollm2_reader, name)
    q = QuantizedWeight.from_gguf(t)
    assert q.block_type == int(GGML.Q4_1)
    values = torch.from_numpy(np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
    assert q.shape == tuple(values.shape) == tuple(int(d) for d in reversed(t.shape))
    assert torch.equal(q.dequantize(), values)
    x = torch.randn(9, q.shape[1])
    torch.testing.assert_close(q.linear(x), F.linear(x, values), **quantized_tol(q.shape[1]))
    torch.testing.assert_close(run_quantized("cpu", x[:1], q.blocks, q.block_type), F.linear(x[:1], values),
                               **quantized_tol(q.shape[1]))


def test_real_gguf_rope_rows_permute_as_blocks(smollm2_reader):
    """llama.cpp's attn_q/attn_k row permutation undone on the blocks (a row gather of the
    uint8 matrix) equals it undone on the dequantised matrix (the fp32 loader's way)."""
    from specdec_kernels.models.gguf_loader import read_config, unpermute_rope_rows

    config = read_config(smollm2_reader)
    for name, heads in [("blk.1.attn_q.weight", config.num_heads), ("blk.1.attn_k.weight", config.num_kv_heads)]:
        t = _tensor(smollm2_reader, name)
        q = QuantizedWeight.from_gguf(t)
        perm = torch.from_numpy(unpermute_rope_rows(np.arange(q.shape[0]), heads).copy())
        values = unpermute_rope_rows(np.asarray(gguf.dequantize(t.data, t.tensor_type)).reshape(q.shape), heads)
        values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        unpermuted = q.rows(perm)
        assert torch.equal(unpermuted.dequantize(), values)
        x = torch.randn(4, q.shape[1])
        torch.testing.assert_close(unpermuted.linear(x), F.linear(x, values), **quantized_tol(q.shape[1]))


def test_real_gguf_embedding_and_lm_head(smollm2_reader):
    t = _tensor(smollm2_reader, "token_embd.weight")
    q = QuantizedWeight.from_gguf(t)
    assert q.block_type == int(GGML.Q8_0) and q.shape == (49152, 576)
    ids = torch.tensor([0, 1, 576, 49151, 12345])
    values = torch.from_numpy(np.asarray(gguf.dequantize(t.data[ids.numpy()], t.tensor_type), dtype=np.float32))
    assert torch.equal(q.embedding(ids), values)
    # The tied LM head: a slice of 2000 vocabulary rows (all 49152 would be slow to compare).
    head = q.rows(slice(1000, 3000))
    head_values = torch.from_numpy(
        np.asarray(gguf.dequantize(t.data[1000:3000], t.tensor_type), dtype=np.float32).copy())
    x = torch.randn(5, 576)
    torch.testing.assert_close(head.linear(x), F.linear(x, head_values), **quantized_tol(576))


# ---------------------------------------------------------------------------------------
# The Qwen2.5-Coder GGUF files (1.5B: Q4_K + Q6_K; 0.5B: Q5_0, Q8_0, Q6_K, Q4_K), from the
# registry (the [qwen] extra's parts; a real-model test: under CI=true a skip fails).
# ---------------------------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_real_qwen_gguf_blocks_dequantize_as_gguf_does(model):
    """Every block type of the file: a layer's weight of each type dequantised whole, the
    embedding's and the LM head's rows (a slice: 151936 rows would be slow), all bit for bit
    equal to gguf.dequantize; quantized_linear on them equal to F.linear on those values."""
    path = require_real_model(model)
    reader = gguf.GGUFReader(path)
    two_d = [t for t in reader.tensors if len(t.shape) == 2]
    first_of_type = {}
    for t in two_d:
        if t.name.startswith("blk."):
            first_of_type.setdefault(int(t.tensor_type), t)
    assert set(first_of_type) <= set(ops.GGUF_BLOCK_FORMATS), "a block type quantized_linear does not read"
    g = torch.Generator().manual_seed(0)
    for t in first_of_type.values():
        q = QuantizedWeight.from_gguf(t)
        values = torch.from_numpy(np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
        values = values.reshape(q.shape)
        assert torch.equal(q.dequantize().view(torch.int32), values.view(torch.int32)), t.name
        x = torch.randn(3, q.shape[1], generator=g)
        torch.testing.assert_close(q.linear(x), F.linear(x, values), **quantized_tol(q.shape[1]))
    for name in ("token_embd.weight", "output.weight"):
        t = next((t for t in two_d if t.name == name), None)
        if t is None:
            continue
        H, N = (int(d) for d in t.shape)
        ids = torch.tensor([0, 1, 1000, N // 2, N - 1])
        rows = QuantizedWeight(torch.from_numpy(np.array(t.data[ids.numpy()], copy=True)).reshape(len(ids), -1),
                               int(t.tensor_type), (len(ids), H))
        values = torch.from_numpy(np.asarray(gguf.dequantize(t.data[ids.numpy()], t.tensor_type),
                                             dtype=np.float32).copy()).reshape(len(ids), H)
        assert torch.equal(rows.embedding(torch.arange(len(ids))).view(torch.int32), values.view(torch.int32)), name
        x = torch.randn(2, H, generator=g)
        torch.testing.assert_close(rows.linear(x), F.linear(x, values), **quantized_tol(H))
