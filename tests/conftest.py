"""Test setup: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before
any test module imports specdec_kernels. Helpers shared by the tests are in tests/helpers.py.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import specdec_kernels  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
