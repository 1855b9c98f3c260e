"""The counter-based generator: known-answer vectors and identical output on every backend."""
import pytest
import torch

import specdec_kernels
from specdec_kernels import rng
from tests.helpers import requires_triton

# Known-answer vectors of Philox4x32-10 from Random123's kat_vectors.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

SEEDS = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**40)], dtype=torch.int64)
OFFSETS = torch.tensor([0, 7, 2**32 - 1, 2**33 + 5, -3], dtype=torch.int64)


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers(counter, key, expected):
    assert rng.philox4x32_10(counter, key) == expected


@pytest.mark.parametrize("position,purpose", [(0, rng.PURPOSE_ACCEPT), (3, rng.PURPOSE_SAMPLE), (2**32, 1)])
def test_torch_and_cpu_kernel_match_scalar_definition(position, purpose):
    num = 37
    expected = torch.tensor(
        [[rng.philox_uniform(int(s), int(o), position, purpose, i) for i in range(num)] for s, o in zip(SEEDS, OFFSETS)],
        dtype=torch.float32,
    )
    assert torch.equal(rng.philox_uniform_torch(SEEDS, OFFSETS, position, purpose, num), expected)
    assert torch.equal(torch.ops.specdec.philox_uniform(SEEDS, OFFSETS, position, purpose, num), expected)


def test_uniforms_lie_in_half_open_unit_interval():
    u = rng.philox_uniform_torch(torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 0, 1, 4096)
    assert u.min() > 0 and u.max() <= 1
    # Mean and variance of U(0, 1): a coarse check that the bits are not degenerate.
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.01


def test_uniform_bit_mapping_boundaries():
    assert rng.uniform_from_bits(0) == 2.0**-24
    assert rng.uniform_from_bits(0xFFFFFFFF) == 1.0


if specdec_kernels.HAS_TRITON:
    import triton
    import triton.language as tl

    from specdec_kernels.triton.rng import philox_uniform

    @triton.jit
    def _uniform_kernel(seed_ptr, offset_ptr, out_ptr, position, num, PURPOSE: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        idx = tl.arange(0, BLOCK)
        seed = tl.load(seed_ptr + b)
        counter = tl.load(offset_ptr + b) + position
        u = philox_uniform(seed, counter, PURPOSE, idx)
        tl.store(out_ptr + b * num + idx, u, mask=idx < num)


@requires_triton
@pytest.mark.parametrize("position,purpose", [(0, 0), (5, 1), (2**32 + 3, 1)])
def test_triton_matches_definition(position, purpose):
    from tests import triton_device

    num, dev = 37, triton_device.device()
    out = torch.empty(len(SEEDS), num, device=dev)
    _uniform_kernel[(len(SEEDS),)](SEEDS.to(dev), OFFSETS.to(dev), out, position, num, PURPOSE=purpose, BLOCK=64)
    expected = rng.philox_uniform_torch(SEEDS, OFFSETS, position, purpose, num)
    assert torch.equal(out.cpu(), expected)
