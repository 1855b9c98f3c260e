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
