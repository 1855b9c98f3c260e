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
BLOCK_TYPES = [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0, GGML.BF16, GGML.F16, GGML.F32]
QUANT_TYPES = [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0]


def gguf_blocks_of(w: torch.Tensor, block_type) -> torch.Tensor:
    """uint8 [N, row_bytes]: gguf.quantize's bytes of the fp32 matrix w [N, H]."""
    raw = np.ascontiguousarray(gguf.quantize(w.float().numpy(), block_type)).view(np.uint8)
    return torch.from_numpy(raw.reshape(w.shape[0], -1).copy())


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
    blocks = gguf_blocks_of(w, block_type)
    return blocks, gguf_values_of(blocks, block_type, H)


def quantized_tol(H):
    """The weights are exact (the gguf values), so only the fp32 accumulation differs from
    the float64 reference: the same tolerance for every block type."""
    return dict(atol=2e-5 * max(H, 16) ** 0.5, rtol=2e-5)


# ---------------------------------------------------------------------------------------
# gguf_blocks: quantize / dequantize against the gguf package, the reference decoder.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
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


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_dequantize_gives_the_values_gguf_dequantize_gives(block_type):
    g = torch.Generator().manual_seed(100 + int(block_type))
    blocks, values = random_weight(9, 96, block_type, g)
    got = gguf_blocks.dequantize(blocks, int(block_type))
    assert torch.equal(got.view(torch.int32), values.view(torch.int32))  # bit for bit, signed zeros included
    # Arbitrary bytes too (every nibble and int8 value, fp16 scales of any finite value).
    if block_type in QUANT_TYPES:
        size, nbytes = gguf_blocks.block_size(block_type), gguf_blocks.block_bytes(block_type)
        raw = torch.randint(0, 256, (5, 3 * nbytes), dtype=torch.uint8, generator=g)
        raw.view(5, 3, nbytes)[..., 1] &= 0x7B  # fp16 scales' exponent below 31: finite
        if block_type == GGML.Q4_1:
            raw.view(5, 3, nbytes)[..., 3] &= 0x7B
        want = gguf_values_of(raw, block_type, 3 * size)
        assert torch.equal(gguf_blocks.dequantize(raw, int(block_type)).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_reference_decoder_gives_the_gguf_values(block_type):
    g = torch.Generator().manual_seed(200 + int(block_type))
    blocks, values = random_weight(3, 64, block_type, g)
    got = ref.dequantize(blocks, int(block_type), 64)
    assert torch.equal(got.view(torch.int32), values.view(torch.int32))


def test_block_type_helpers():
    assert gguf_blocks.type_id("q4_1") == 3 == gguf_blocks.type_id(GGML.Q4_1)
    assert (gguf_blocks.block_size("Q8_0"), gguf_blocks.block_bytes("Q8_0")) == (32, 34)
    assert gguf_blocks.row_bytes("Q4_0", 576) == 18 * 18
    assert gguf_blocks.row_bytes("BF16", 7) == 14
    for tid, (name, size, nbytes) in ops.GGUF_BLOCK_FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[GGML(tid)] == (size, nbytes) and GGML(tid).name == name
    with pytest.raises(ValueError, match="block type must be one of"):
        gguf_blocks.type_id("Q5_0")
    with pytest.raises(ValueError, match="block type must be one of"):
        gguf_blocks.type_id(GGML.Q5_0)
    with pytest.raises(ValueError, match="multiple of 32 weights, got H = 40"):
        gguf_blocks.row_bytes("Q4_1", 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_blocks.quantize(torch.randn(2, 40), "Q8_0")


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
    blocks, _ = random_weight(N, H, block_type, g)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    want = ref.quantized_linear(x, blocks, int(block_type), b)
    torch.testing.assert_close(run_quantized(backend, x, blocks, block_type, b).double(), want, **quantized_tol(H))
    want = ref.quantized_linear(x, blocks, int(block_type))
    torch.testing.assert_close(run_quantized(backend, x, blocks, block_type).double(), want, **quantized_tol(H))


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
    N, H = 19, 128
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
    H = 32 * blocks_per_row
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


@pytest.mark.parametrize("x,w,block_type,b,out,message", [
    (torch.randn(2, 64).double(), _Q41, 3, None, None, "x must have dtype"),
    (torch.randn(2, 3, 64), _Q41, 3, None, None, "x must have 2 dimensions"),
    (torch.randn(2, 64), _Q41.float(), 3, None, None, "weight must have dtype torch.uint8"),
    (torch.randn(2, 64), _Q41[:, :38], 3, None, None, r"weight must have shape \[N, 40\] \(2 Q4_1 blocks of 20"),
    (torch.randn(2, 64), _Q41, 2, None, None, r"weight must have shape \[N, 36\]"),
    (torch.randn(2, 48), _Q41, 3, None, None, r"x.shape\[1\] \(H = 48\) must be a multiple of the Q4_1 block size 32"),
    (torch.randn(2, 64), _Q41, 6, None, None, "block_type must be a GGML type id among F32 = 0"),
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
    (torch.randn(2, 64), _Q41, 6, None, torch.empty(2, 5), "block_type must be a GGML type id among F32 = 0"),
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
        triton_linear.quantized_linear(torch.randn(2, 64), _Q41, 7, None, torch.empty(2, 5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type,M,N,H,with_bias", [
    # CPU: M = 3 (direct tile), 13 (scratch tiles of 4 plus 1); N = 7 (a partial group of
    # 4 rows); F32/F16/BF16 with H = 37: a partial last chunk. Triton: partial 16 x 16 tiles.
    (GGML.Q4_0, 3, 7, 64, True),
    (GGML.Q4_1, 13, 7, 96, False),
    (GGML.Q8_0, 17, 18, 32, True),
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
for name in ("Q4_0", "Q4_1", "Q8_0", "BF16", "F16", "F32"):
    for M, N, H in [(1, 7, 64), (5, 33, 96), (8, 9, 160), (17, 70, 128), (64, 13, 64)]:
        q = gguf_blocks.quantize(torch.randn(N, H, generator=g), name)
        x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
        outs[(name, M, N, H)] = ops.quantized_linear(x, q.blocks, q.block_type, b)
    if name in ("BF16", "F16", "F32"):
        q = gguf_blocks.quantize(torch.randn(6, 45, generator=g), name)
        outs[(name, "H45")] = ops.quantized_linear(torch.randn(11, 45, generator=g), q.blocks, q.block_type)
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
