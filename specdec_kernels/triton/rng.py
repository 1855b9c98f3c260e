"""Philox4x32-10 device functions of the Triton samplers (no op of its own), as rng.py defines it.

The counter layout is that of ``specdec_kernels/rng.py``.

``philox_uniform(seed, counter, purpose, index)`` takes the int64 seed, the int64
``offset + position`` and the uint32 purpose and vocabulary index (tensors or scalars
that broadcast) and returns fp32 uniforms in (0, 1].
"""
import triton
import triton.language as tl

from .. import rng

# The generator's constants, from specdec_kernels/rng.py (tl.constexpr: jit code reads them).
PURPOSE_ACCEPT = tl.constexpr(rng.PURPOSE_ACCEPT)
PURPOSE_SAMPLE = tl.constexpr(rng.PURPOSE_SAMPLE)
PHILOX_M0 = tl.constexpr(rng.PHILOX_M0)
PHILOX_M1 = tl.constexpr(rng.PHILOX_M1)
PHILOX_W0 = tl.constexpr(rng.PHILOX_W0)
PHILOX_W1 = tl.constexpr(rng.PHILOX_W1)
MASK32 = tl.constexpr(rng.MASK32)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on uint32 tensors; returns the first output word (all we use)."""
    for round_ in tl.static_range(10):
        if round_ > 0:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        m0 = tl.full(c0.shape, PHILOX_M0, tl.uint32)
        m1 = tl.full(c2.shape, PHILOX_M1, tl.uint32)
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0


@triton.jit
def philox_uniform(seed, counter, purpose: tl.constexpr, index):
    """Uniform in (0, 1] for int64 ``seed``, int64 ``counter`` = offset + position."""
    seed = seed.to(tl.uint64, bitcast=True)
    counter = counter.to(tl.uint64, bitcast=True)
    index = index.to(tl.uint32)
    zero = index * 0
    k0 = (seed & MASK32).to(tl.uint32) + zero
    k1 = (seed >> 32).to(tl.uint32) + zero
    c1 = zero + purpose
    c2 = (counter & MASK32).to(tl.uint32) + zero
    c3 = (counter >> 32).to(tl.uint32) + zero
    word0 = philox4x32_10(index, c1, c2, c3, k0, k1)
    return ((word0 >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)  # 2^-24: exact, in (0, 1]
