"""specdec::rms_norm on every backend (the C++ CPU kernel through ``ops.rms_norm`` and
``torch.ops``, the Triton kernel on CPU tensors under TRITON_INTERPRET=1, the fake) against the
float64 reference; batch invariance and thread invariance bit for bit; bad arguments."""
import pytest
import torch
import torch.nn.functional as F

import specdec_kernels
from python_ref.rms_norm import rms_norm as ref
from specdec_kernels import ops
from tests.helpers import requires_triton

if specdec_kernels.HAS_TRITON:
    from specdec_kernels.triton.rms_norm import rms_norm as rms_norm_triton
else:  # pragma: no cover
    rms_norm_triton = None

# fp32 arithmetic, one rounding to the output dtype.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=1e-3)}


def cpu(x, w, eps):
    return ops.rms_norm(x, w, eps)


def triton(x, w, eps):
    out = torch.empty_like(x)
    rms_norm_triton(x, w, eps, out)
    return out


BACKENDS = [pytest.param(cpu, id="cpu"), pytest.param(triton, id="triton", marks=requires_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", sorted(TOL, key=str))
@pytest.mark.parametrize("shape", [(1, 1), (1, 17), (3, 64), (2, 5, 100), (7, 576), (1, 1536)])
def test_matches_the_reference(backend, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(dtype)
    got = backend(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), ref(x, w, 1e-6).to(dtype).double(), **TOL[dtype])


def test_close_to_torch_rms_norm():
    x, w = torch.randn(4, 896), torch.randn(896)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (896,), w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H", [1, 15, 16, 33, 576, 1536])
def test_a_row_does_not_depend_on_the_others_or_on_threads(H):
    g = torch.Generator().manual_seed(H)
    x, w = torch.randn(64, H, generator=g), torch.randn(H, generator=g)
    whole = ops.rms_norm(x, w, 1e-5)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = torch.cat([ops.rms_norm(x[i: i + 1], w, 1e-5) for i in range(64)])
    finally:
        torch.set_num_threads(n)
    assert torch.equal(whole, rows)


def test_zero_rows_eps_and_non_contiguous_x():
    x = torch.zeros(3, 8)
    torch.testing.assert_close(ops.rms_norm(x, torch.ones(8), 1e-6), x)  # 0 * rsqrt(eps)
    assert ops.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    xt = torch.randn(8, 5).T  # [5, 8], strided
    assert torch.equal(ops.rms_norm(xt, torch.ones(8), 1e-6), ops.rms_norm(xt.contiguous(), torch.ones(8), 1e-6))


def test_the_fake_gives_the_shape():
    x = torch.empty(3, 16, device="meta")
    out = torch.empty_like(x)
    torch.ops.specdec.rms_norm(x, torch.empty(16, device="meta"), 1e-6, out)
    assert out.shape == (3, 16)


@pytest.mark.parametrize("args,match", [
    (lambda: (torch.randn(2, 8), torch.randn(7), 1e-6), r"weight must have shape \[8\]"),
    (lambda: (torch.randn(2, 8), torch.randn(8).double(), 1e-6), "weight must have dtype"),
    (lambda: (torch.randint(0, 3, (2, 8)), torch.randn(8), 1e-6), "x must have dtype"),
    (lambda: (torch.randn(2, 8), torch.randn(8), float("nan")), "eps must be"),
    (lambda: (torch.randn(2, 8), torch.randn(8), -1.0), "eps must be"),
])
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        ops.rms_norm(*args())
    x, w, eps = args()
    with pytest.raises(RuntimeError, match="rms_norm"):
        torch.ops.specdec.rms_norm(x, w, eps, torch.empty(x.shape, dtype=x.dtype if x.is_floating_point() else torch.float32))


def test_out_over_x_is_refused():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="share memory"):
        ops.rms_norm(x, torch.ones(8), 1e-6, out=x)
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.specdec.rms_norm(x, torch.ones(8), 1e-6, x)
