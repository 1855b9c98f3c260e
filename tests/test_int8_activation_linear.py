"""specdec::int8_activation_linear (activations quantised to int8 per block of 32, Q4_0 / Q4_1 /
Q8_0 blocks repacked 16 rows at a time) on every backend against python_ref, which computes
from the plain GGUF blocks (so the packing is checked too); the CPU paths' bits; batch
invariance; the int8 model format."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from python_ref import linear as ref
from specdec_kernels import gguf_blocks, ops
from specdec_kernels.gguf_blocks import Q4_0, Q4_1, Q8_0
from tests.fuzzing import fuzz_settings
from tests.helpers import assert_cpu_paths_agree, assert_guard_intact, cpu_flags, guarded, requires_triton

TYPES = [Q4_0, Q4_1, Q8_0]
BACKENDS = ["cpu", pytest.param("triton", marks=requires_triton)]


def tol(H):
    """fp32 accumulation of H / 32 block terms against the float64 reference (the integer
    sums and the scales are exact on both sides). One activation integer off by one would
    move an output by ~d_x * d_w * |q_w| ~ 1e-2 here, far outside this."""
    return dict(atol=2e-6 * (H / 32) ** 0.5, rtol=1e-5)


def packed_weight(N, H, block_type, g):
    blocks = gguf_blocks.quantize(torch.randn(N, H, generator=g), block_type).blocks
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
@pytest.mark.parametrize("M,N,H", [(1, 1, 32), (1, 16, 64), (3, 33, 96), (5, 17, 32), (9, 40, 160), (18, 3, 64)])
def test_matches_reference(backend, block_type, M, N, H):
    """M: the CPU tiles (4 rows with AVX-512 VNNI, 2 with AVX2) and their tails; N: partial
    groups of 16 rows."""
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + block_type)
    blocks, packed = packed_weight(N, H, block_type, g)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    torch.testing.assert_close(run(backend, x, packed, block_type, N, b).double(),
                               ref.int8_activation_linear(x, blocks, block_type, b), **tol(H))
    torch.testing.assert_close(run(backend, x, packed, block_type, N).double(),
                               ref.int8_activation_linear(x, blocks, block_type), **tol(H))


@pytest.mark.parametrize("block_type", TYPES)
def test_close_to_the_fp32_activation_product(block_type):
    """The activation rounding moves an output by ~0.5% of the outputs' scale (Gaussian data)."""
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
    torch.testing.assert_close(out.double(), ref.int8_activation_linear(x.float(), blocks, Q4_1, b.float()), **tol(64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", TYPES)
def test_batch_invariant(backend, block_type):
    """A row's result is bit-identical whatever M is and whatever the other rows hold."""
    g = torch.Generator().manual_seed(21 + block_type)
    N, H = 19, 128
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_activation_blocks(backend):
    """Zero and tiny (< 2^-96) blocks count as zero; huge values scale; NaN or inf in a
    block makes that row's outputs NaN and leaves the other rows alone."""
    g = torch.Generator().manual_seed(5)
    N, H = 20, 64
    blocks, packed = packed_weight(N, H, Q4_1, g)
    x = torch.randn(6, H, generator=g)
    x[0] = 0
    x[1, :32] = 1e-30  # tiny block: zero; the other block is ordinary
    x[2] *= 1e30
    x[3, 5] = float("nan")
    x[4, 40] = float("inf")
    out = run(backend, x, packed, Q4_1, N)
    want = ref.int8_activation_linear(x, blocks, Q4_1)
    assert torch.equal(out[0], torch.zeros(N))
    x1 = x[1:2].clone()
    x1[0, :32] = 0
    assert torch.equal(out[1:2], run(backend, x1, packed, Q4_1, N))
    torch.testing.assert_close(out[2].double(), want[2], atol=0, rtol=1e-5)
    assert out[3].isnan().all() and out[4].isnan().all()
    torch.testing.assert_close(out[5].double(), want[5], **tol(H))


@fuzz_settings(40)
@given(M=st.integers(0, 20), N=st.integers(1, 40), nb=st.integers(1, 5), type_index=st.integers(0, 2),
       with_bias=st.booleans(), values=st.sampled_from(["normal", "huge", "tiny", "non_finite", "mixed"]),
       seed=st.integers(0, 2**31))
def test_fuzz_matches_reference(M, N, nb, type_index, with_bias, values, seed):
    """Any shape, extreme and non-finite activations, every tensor in guarded storage: the
    CPU kernel against the reference (NaN where the reference has NaN)."""
    block_type = TYPES[type_index]
    g = torch.Generator().manual_seed(seed)
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
    mag = x.double().nan_to_num(0, 0, 0).abs() @ gguf_blocks.dequantize(blocks, block_type).double().abs().T
    mag = mag + (0 if b is None else b.double().abs())
    got = out.double()
    both_nan = got.isnan() & want.isnan()
    assert (both_nan | ((got - want).abs() <= 1e-5 * mag + 1e-30)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type,M,N", [(Q4_0, 3, 7), (Q4_1, 13, 17), (Q8_0, 6, 33)])
def test_nothing_outside_the_tensors_is_read_or_written(backend, block_type, M, N):
    g = torch.Generator().manual_seed(M * N)
    H = 96
    blocks, packed = packed_weight(N, H, block_type, g)
    x, b = torch.randn(M, H, generator=g), torch.randn(N, generator=g)
    out = guarded(torch.full((M, N), float("nan")))
    run(backend, guarded(x), guarded(packed), block_type, N, guarded(b), out)
    assert_guard_intact(out)
    torch.testing.assert_close(out.double(), ref.int8_activation_linear(x, blocks, block_type, b), **tol(H))


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


@pytest.mark.parametrize("x,p,block_type,b,out,message", [
    (torch.randn(2, 64).double(), _P, 3, None, torch.empty(2, 20), "x must have dtype"),
    (torch.randn(2, 3, 64), _P, 3, None, torch.empty(2, 20), "x must have 2 dimensions"),
    (torch.randn(2, 64), _P.float(), 3, None, torch.empty(2, 20), "packed_weight must have dtype torch.uint8"),
    (torch.randn(2, 64), _P[:, :1].contiguous(), 3, None, torch.empty(2, 20), r"packed_weight must have shape \[ceil"),
    (torch.randn(2, 64), _P, 2, None, torch.empty(2, 20), r"packed_weight must have shape \[ceil\(N / 16\), 2, 288\]"),
    (torch.randn(2, 48), _P, 3, None, torch.empty(2, 20), "H a multiple of 32"),
    (torch.randn(2, 64), _P, 0, None, torch.empty(2, 20), "block_type must be Q4_0 = 2, Q4_1 = 3 or Q8_0 = 8"),
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
    (torch.randn(2, 64), _P, 1, None, torch.empty(2, 20), "block_type must be Q4_0 = 2, Q4_1 = 3 or Q8_0 = 8"),
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
    with pytest.raises(ValueError, match="reads Q4_0, Q4_1 and Q8_0 blocks, got F16"):
        gguf_blocks.pack_int8_activation(gguf_blocks.quantize(torch.randn(4, 32), "F16").blocks, "F16")
    with pytest.raises(ValueError, match="multiple of the Q4_1 block bytes 20"):
        gguf_blocks.pack_int8_activation(torch.zeros(4, 30, dtype=torch.uint8), "Q4_1")


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


# ---------------------------------------------------------------------------------------
# The CPU paths (AVX-512 VNNI, AVX2, portable) give the same bits.
# ---------------------------------------------------------------------------------------

_PATHS_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch
from specdec_kernels import gguf_blocks, ops
outs = {{}}
g = torch.Generator().manual_seed(0)
for name in ("Q4_0", "Q4_1", "Q8_0"):
    for M, N, H in [(1, 7, 64), (3, 33, 96), (5, 16, 160), (8, 70, 128), (17, 13, 576)]:
        q = gguf_blocks.quantize(torch.randn(N, H, generator=g) * 3, name)
        x, b = torch.randn(M, H, generator=g) * 10, torch.randn(N, generator=g)
        outs[(name, M, N, H)] = ops.int8_activation_linear(x, gguf_blocks.pack_int8_activation(q.blocks, name),
                                                           q.block_type, N, b)
torch.save(outs, sys.argv[1])
"""


def test_cpu_paths_give_identical_bits(tmp_path):
    """The same cases in three processes: the default path (AVX-512 VNNI where the CPU has
    it), AVX2 forced (SPECDEC_DISABLE_AVX512=1) and the portable loops
    (SPECDEC_QUANTIZED_LINEAR_PORTABLE=1)."""
    assert_cpu_paths_agree(_PATHS_SCRIPT, tmp_path)
    flags = cpu_flags()
    if not flags or not {"avx512f", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni"} <= flags:
        pytest.skip("this CPU has no AVX-512 VNNI (or it cannot be told): the AVX2 and portable paths were "
                    "compared, the VNNI one did not run")


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
