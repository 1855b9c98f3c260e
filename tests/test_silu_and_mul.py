"""specdec::silu_and_mul on every backend (the C++ CPU kernel through ``ops.silu_and_mul`` and
``torch.ops``, the Triton kernel on CPU tensors under TRITON_INTERPRET=1, the fake) against the
float64 reference; one value's result depends on that value only (position in the row, the
row, the thread count), bit for bit; extreme values and NaN; bad arguments."""
import platform

import pytest
import torch
import torch.nn.functional as F

import specdec_kernels
from python_ref.silu_and_mul import silu_and_mul as ref
from specdec_kernels import ops
from tests.helpers import assert_cpu_paths_agree, cpu_flags, requires_triton

if specdec_kernels.HAS_TRITON:
    from specdec_kernels.triton.silu_and_mul import silu_and_mul as silu_and_mul_triton
else:  # pragma: no cover
    silu_and_mul_triton = None

# fp32 arithmetic (a few ulp from exp and the division), one rounding to the output dtype.
TOL = {torch.float32: dict(atol=1e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=1e-3, rtol=1e-3)}


def cpu(x):
    return ops.silu_and_mul(x)


def triton(x):
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    silu_and_mul_triton(x, out)
    return out


BACKENDS = [pytest.param(cpu, id="cpu"), pytest.param(triton, id="triton", marks=requires_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", sorted(TOL, key=str))
@pytest.mark.parametrize("shape", [(1, 2), (1, 18), (3, 64), (2, 5, 100), (7, 1152), (1, 2 * 8960)])
def test_matches_the_reference(backend, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    got = backend(x)
    assert got.dtype == dtype and got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got.double(), ref(x).to(dtype).double(), **TOL[dtype])


def test_close_to_torch_silu_times_up():
    x = torch.randn(4, 2 * 896) * 6
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, atol=1e-6, rtol=2e-6)


def test_extreme_gates_and_nan():
    gate = torch.tensor([-1e30, -200.0, -90.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.0, 88.5, 90.0, 1e30,
                         float("inf"), float("nan")])
    up = torch.full_like(gate, 2.0)
    got = ops.silu_and_mul(torch.cat([gate, up])[None])[0]
    want = ref(torch.cat([gate, up])[None])[0].float()
    finite = want.isfinite() & gate.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-30, rtol=2e-6)
    assert got[-2] == float("inf") and got[-1].isnan()
    assert (got[:4] == 0).all()  # silu of a gate past exp's range: -0 (the reference: a tiny negative or -0)


@pytest.mark.parametrize("I", [1, 7, 8, 9, 33, 8960])
def test_a_value_does_not_depend_on_its_place_row_or_threads(I):
    g = torch.Generator().manual_seed(I)
    x = torch.randn(64, 2 * I, generator=g) * 5
    whole = ops.silu_and_mul(x)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = torch.cat([ops.silu_and_mul(x[i: i + 1]) for i in range(64)])
    finally:
        torch.set_num_threads(n)
    assert torch.equal(whole, rows)
    # the same gate|up pairs one at a time (the scalar loop) and 8 at a time (the vector loop)
    gate, up = x[:, :I].reshape(-1), x[:, I:].reshape(-1)
    singles = torch.stack([ops.silu_and_mul(torch.stack([gate[j], up[j]])[None])[0, 0] for j in range(0, gate.numel(), 97)])
    assert torch.equal(singles, whole.reshape(-1)[::97])


def test_zero_rows_and_non_contiguous_gate_up():
    assert ops.silu_and_mul(torch.zeros(0, 8)).shape == (0, 4)
    xt = torch.randn(8, 5).T  # [5, 8], strided
    assert torch.equal(ops.silu_and_mul(xt), ops.silu_and_mul(xt.contiguous()))


def test_the_fake_gives_the_shape():
    x = torch.empty(3, 16, device="meta")
    out = torch.empty(3, 8, device="meta")
    torch.ops.specdec.silu_and_mul(x, out)
    assert out.shape == (3, 8)


@pytest.mark.parametrize("x,out,match", [
    (lambda: torch.randn(2, 7), lambda: torch.empty(2, 3), "even last dim"),
    (lambda: torch.randint(0, 3, (2, 8)), lambda: torch.empty(2, 4), "gate_up must have dtype"),
    (lambda: torch.randn(2, 8), lambda: torch.empty(2, 3), "out must have shape"),
    (lambda: torch.randn(2, 8), lambda: torch.empty(2, 4, dtype=torch.float64), "out must have dtype"),
    (lambda: torch.randn(2, 8), lambda: torch.empty(4, 2).T, "out must be contiguous"),
])
def test_bad_arguments_are_named(x, out, match):
    with pytest.raises(ValueError, match=match):
        ops.silu_and_mul(x(), out=out())
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        torch.ops.specdec.silu_and_mul(x(), out())


def test_out_over_gate_up_is_refused():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="share memory"):
        ops.silu_and_mul(x, out=x.view(-1)[:8].view(2, 4))
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.specdec.silu_and_mul(x, x.view(-1)[:8].view(2, 4))


_PATHS_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch
from specdec_kernels import ops
g = torch.Generator().manual_seed(0)
outs = {{}}
for rows, I in [(1, 8960), (3, 37), (2, 15), (4, 16), (1, 1)]:
    x = torch.randn(rows, 2 * I, generator=g) * 8
    edges = torch.tensor([100.0, -100.0, 88.9, -87.3, 1e-30, -6e4])  # past exp's range, at its clamps, tiny, large (finite in fp16)
    x.view(-1)[: min(6, x.numel())] = edges[: x.numel()]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        outs[(rows, I, str(dtype))] = ops.silu_and_mul(x.to(dtype))
torch.save(outs, sys.argv[1])
"""


def test_cpu_paths_give_identical_bits(tmp_path):
    """The AVX-512 loop (16 values), the AVX2 loop (SPECDEC_DISABLE_AVX512=1) and the scalar
    tail run the same operations: the same bits, in separate processes (the switch is read once)."""
    assert_cpu_paths_agree(_PATHS_SCRIPT, tmp_path)
    flags = cpu_flags() if platform.machine() == "x86_64" else None
    if not flags or not {"avx512f", "avx512vl", "avx512dq", "avx512bw"} <= flags:
        pytest.skip("this CPU has no AVX-512 (or it cannot be told): the AVX2 and scalar loops were compared, "
                    "the AVX-512 one did not run")
