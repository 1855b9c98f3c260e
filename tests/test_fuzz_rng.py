"""Fuzzing philox_uniform (the generator's uniforms, C++) against specdec_kernels.rng.

Any seed, offset and position (offset + position wraps modulo 2^64), purposes up to 2^32 - 1,
num from 0: the C++ op equals the Python definition bit for bit, every value in (0, 1].
Invalid arguments (negative num or purpose, purpose >= 2^32, wrong dtypes, shapes,
devices) raise a clear error. Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels  # noqa: F401
from specdec_kernels import ops, rng
from tests.helpers import assert_guard_intact, guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings

INT64 = st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**32 - 1, 2**32]) | st.integers(-(2**63), 2**63 - 1)


@fuzz_settings(40)
@given(seeds=st.lists(INT64, min_size=0, max_size=3), data=st.data(),
       position=st.sampled_from([0, 1, -1, 2**40, -(2**62)]) | st.integers(-(2**62), 2**62),
       purpose=st.sampled_from([0, 1, 2**32 - 1]) | st.integers(0, 2**32 - 1), num=st.integers(0, 20))
def test_cpu_matches_python_definition(seeds, data, position, purpose, num):
    offsets = data.draw(st.lists(INT64, min_size=len(seeds), max_size=len(seeds)))
    seed = guarded(torch.tensor(seeds, dtype=torch.int64))
    offset = guarded(torch.tensor(offsets, dtype=torch.int64))
    got = torch.ops.specdec.philox_uniform(seed, offset, position, purpose, num)
    assert_guard_intact(seed)
    assert_guard_intact(offset)
    expected = torch.tensor([[rng.philox_uniform(s, o, position, purpose, i) for i in range(num)]
                             for s, o in zip(seeds, offsets)], dtype=torch.float32).reshape(len(seeds), num)
    assert torch.equal(got, expected)
    assert ((got > 0) & (got <= 1)).all()
    # The vectorised torch twin used by tests agrees too.
    if seeds and num:
        assert torch.equal(rng.philox_uniform_torch(seed.clone(), offset.clone(), position, purpose, num), expected)


BAD = {
    "num:negative": dict(num=-1),
    "num:too_large": dict(num=2**32 + 1),
    "purpose:negative": dict(purpose=-1),
    "purpose:too_large": dict(purpose=2**32),
    "seed:dtype": dict(seed=torch.zeros(2, dtype=torch.int32)),
    "seed:2d": dict(seed=torch.zeros(1, 2, dtype=torch.int64)),
    "offset:shape": dict(offset=torch.zeros(3, dtype=torch.int64)),
    "offset:meta": dict(offset=torch.zeros(2, dtype=torch.int64, device="meta")),
    "offset:dtype": dict(offset=torch.zeros(2, dtype=torch.float64)),
}


@pytest.mark.parametrize("backend", ["wrapper", "cpu"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_arguments_raise(bad, backend):
    args = dict(seed=torch.zeros(2, dtype=torch.int64), offset=torch.zeros(2, dtype=torch.int64), position=0,
                purpose=0, num=4)
    args.update(BAD[bad])
    fn = ops.philox_uniform if backend == "wrapper" else torch.ops.specdec.philox_uniform
    _, error = call_or_clear_error(fn, args["seed"], args["offset"], args["position"], args["purpose"], args["num"])
    assert error is not None, f"{bad} accepted by {backend}"
    assert bad.split(":")[0] in str(error) or "device" in str(error), str(error)
