"""Shared settings and checks of the fuzz tests (tests/test_fuzz_<area>.py).

Every fuzz test runs a fixed, derandomized budget of examples in CI (so CI never flakes and
all of them together stay under ~2 minutes on 2 cores). A longer, random run:

    SPECDEC_FUZZ_EXAMPLES=5000 python -m pytest -q tests/test_fuzz_*.py

gives every fuzz test that many examples with a fresh random seed (hypothesis prints the
failing example and a ``@reproduce_failure`` line when one is found).
"""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

LONG_RUN_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(ci_examples: int):
    """hypothesis settings: ``ci_examples`` derandomized examples, or SPECDEC_FUZZ_EXAMPLES
    random ones. No deadline (the Triton interpreter and python_ref are slow and their speed
    varies with the machine's load) and no example database (nothing written to the tree)."""
    long_run = LONG_RUN_EXAMPLES > 0
    return settings(
        max_examples=LONG_RUN_EXAMPLES if long_run else ci_examples,
        derandomize=not long_run,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.large_base_example],
    )


# The errors a bad argument may raise: the wrappers' ValueError naming the argument, the C++
# kernels' RuntimeError (TORCH_CHECK; also torch's own errors for tensors it cannot handle).
CLEAR_ERRORS = (ValueError, RuntimeError)


def call_or_clear_error(fn, *args, **kwargs):
    """Calls ``fn``; returns (result, None), or (None, error) for a clear error (a
    ValueError/RuntimeError with a message). Anything else (TypeError, IndexError, a
    segfault, ...) propagates and fails the test."""
    try:
        return fn(*args, **kwargs), None
    except CLEAR_ERRORS as error:
        assert str(error).strip(), f"{type(error).__name__} without a message"
        return None, error


def int_tensor_values(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]
