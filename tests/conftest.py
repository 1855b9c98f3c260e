"""Test setup: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before
any test module imports specdec_kernels.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import specdec_kernels  # noqa: E402,F401

requires_triton = pytest.mark.skipif(
    not specdec_kernels.HAS_TRITON, reason="triton is not installed (pip install triton)"
)


@pytest.fixture(autouse=True, scope="session")
def _cost_cache_in_temp_dir(tmp_path_factory):
    """Measured step-cost curves (decoding.cost_model) go to a temporary directory, never to
    the user's cache."""
    old = os.environ.get("SPECDEC_CACHE_DIR")
    os.environ["SPECDEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("specdec_cache"))
    yield
    if old is None:
        os.environ.pop("SPECDEC_CACHE_DIR", None)
    else:
        os.environ["SPECDEC_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------
# Guarded storage: catches reads and writes outside a tensor.
# ---------------------------------------------------------------------------------------

GUARD_ELEMENTS = 4096


def _poison(dtype, count):
    """Values a kernel must never see: for floats NaN, +-inf, huge and ordinary numbers mixed
    (a uniform fill can be hidden by a fallback path, a mix changes results); for integers
    ids far out of range, -1 and 0 mixed."""
    gen = torch.Generator().manual_seed(1234)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=gen).bool()
    if dtype.is_floating_point:
        pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.5, -3.0, 7.0])
        return pool[torch.randint(0, len(pool), (count,), generator=gen)].to(dtype)
    info = torch.iinfo(dtype)
    pool = torch.tensor([info.max, info.min, -1, 0, 1, 3, info.max // 2], dtype=torch.int64)
    return pool[torch.randint(0, len(pool), (count,), generator=gen)].to(dtype)


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in the middle of a larger buffer filled with poison
    (GUARD_ELEMENTS on each side). A kernel that reads outside ``t`` sees the poison and
    (with the right inputs) gives a different result; one that writes outside changes the
    guard, which ``assert_guard_intact`` checks."""
    t = t.contiguous()
    n = t.numel()
    buf = _poison(t.dtype, n + 2 * GUARD_ELEMENTS)
    view = buf[GUARD_ELEMENTS:GUARD_ELEMENTS + n].view(t.shape)
    view.copy_(t)
    return view


def assert_guard_intact(view: torch.Tensor) -> None:
    """The poison around a tensor made by ``guarded`` is unchanged (nothing wrote outside it)."""
    buf = view._base
    assert buf is not None, "not a guarded tensor"
    n = view.numel()
    expected = _poison(view.dtype, n + 2 * GUARD_ELEMENTS)
    for name, sl in (("before", slice(0, GUARD_ELEMENTS)), ("after", slice(GUARD_ELEMENTS + n, None))):
        got, want = buf[sl], expected[sl]
        same = (got == want) | (got.isnan() & want.isnan()) if got.is_floating_point() else got == want
        assert bool(same.all()), f"the kernel wrote {name} the tensor (outside its storage)"
