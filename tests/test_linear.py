"""specdec::skinny_linear against F.linear / python_ref, and the `linear` dispatcher."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from python_ref import linear as ref
from specdec_kernels import ops
from tests.conftest import requires_triton

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
    for shape in [(1, 20), (4, 20), (2, 3, 20), (ops.SKINNY_LINEAR_MAX_ROWS + 1, 20), (0, 20)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b), **tol(20))
    wb, bb = w.bfloat16(), b.bfloat16()
    for rows in (1, ops.SKINNY_LINEAR_MAX_ROWS_BF16 + 1):
        x = torch.randn(rows, 20).bfloat16()
        torch.testing.assert_close(ops.linear(x, wb, bb).float(), F.linear(x, wb, bb).float(), atol=2e-2, rtol=2e-2)
    # With gradients it must be F.linear (skinny_linear has no autograd formula).
    x = torch.randn(2, 20, requires_grad=True)
    ops.linear(x, w, b).sum().backward()
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
    from tests.conftest import assert_guard_intact, guarded

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
