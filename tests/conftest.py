"""Test setup: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before
any test module imports specdec_kernels. Helpers shared by the tests are in tests/helpers.py.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import specdec_kernels  # noqa: E402,F401


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


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (modules opt in with ``pytestmark``): on a shared 2-core
    machine two OpenMP threads on tiny matrices wait for each other (a draft step took 100x
    longer)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def prompts():
    """Four token prompts of 1, 6, 25 (one repeated span, for prompt lookup) and 40 tokens
    for the tiny random models."""
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]
    ps[2] = ps[2] + ps[2][:8]  # something for prompt lookup to find
    return ps
