"""Philox4x32-10 in Triton, with the counter layout of ``specdec_kernels/rng.py``.

``philox_uniform(seed, counter, purpose, index)`` takes the int64 seed, the int64
``offset + position`` and the uint32 purpose and vocabulary index (tensors or scalars
that broadcast) and returns fp32 uniforms in (0, 1].
"""
import triton
import triton.language as tl


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on uint32 tensors; returns the first output word (all we use)."""
    for round_ in tl.static_range(10):
        if round_ > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
        m1 = tl.full(c2.shape, 0xCD9E8D57, tl.uint32)
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
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32) + zero
    k1 = (seed >> 32).to(tl.uint32) + zero
    c1 = zero + purpose
    c2 = (counter & 0xFFFFFFFF).to(tl.uint32) + zero
    c3 = (counter >> 32).to(tl.uint32) + zero
    word0 = philox4x32_10(index, c1, c2, c3, k0, k1)
    return ((word0 >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)
