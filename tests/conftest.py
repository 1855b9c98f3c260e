"""Test setup: Triton kernels run on CPU tensors through the interpreter (or, with
SPECDEC_TRITON_DEVICE=cuda, compiled on a GPU: tests/triton_device.py).

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before
any test module imports specdec_kernels. Helpers shared by the tests are in tests/helpers.py.
"""
import os

# SPECDEC_TRITON_DEVICE=cuda: the tests' Triton launchers run compiled on that device
# (tests/triton_device.py, .ci/gpu_check.sh; set TRITON_INTERPRET=0 there). =cpu: the same
# wrapping, on CPU copies, under the interpreter (a check of the wrapping itself).
TRITON_DEVICE = os.environ.get("SPECDEC_TRITON_DEVICE") or None
if TRITON_DEVICE is None or TRITON_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import specdec_kernels  # noqa: E402,F401
from tests.helpers import REAL_MODEL_SKIP  # noqa: E402

if TRITON_DEVICE:  # before pytest imports any test module (they import the launchers)
    from tests import triton_device

    triton_device.install(TRITON_DEVICE)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: runs on a real checkpoint (tests.helpers.require_real_model); "
                                       "skipped where it is not installed, a failure when skipped under CI=true")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped real-model test (marked ``real_model``, or skipped by
    ``require_real_model``) fails: CI must run every one of them, not pass without them."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or os.environ.get("CI", "").lower() != "true":
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if item.get_closest_marker("real_model") is not None or REAL_MODEL_SKIP in reason:
        report.outcome = "failed"
        report.longrepr = f"a real-model test was skipped under CI=true (CI must run it): {reason}"


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
