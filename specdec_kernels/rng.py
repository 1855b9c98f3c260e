"""The counter-based generator shared by every backend: Philox4x32-10.

One definition, implemented identically in C++ (``csrc/philox.h``), Triton
(``specdec_kernels/triton/rng.py``) and here (used by ``python_ref`` and the tests):

- key = (lo32(seed), hi32(seed)), seed an int64 per request;
- counter = (index, purpose, lo32(offset + position), hi32(offset + position)), where
  ``offset`` is the int64 per-request counter base, ``position`` the row or tree node the
  draw belongs to, ``purpose`` says what the draw is for (``PURPOSE_ACCEPT``: the
  acceptance test of a drafted token, ``index`` = 0; ``PURPOSE_SAMPLE``: the draw that
  picks the recovered or bonus token, one per vocabulary ``index``; ``PURPOSE_DRAFT``: a
  drafter's own draws for a step, at ``position`` 0, ``index`` = the draw's number in the
  step — never read by the kernels, so drafts are independent of the verification's draws);
- uniform = ((word0 >> 8) + 1) * 2**-24, which lies in (0, 1] and is exact in fp32.

Sampling a token from unnormalised weights w (``sample_from_weights``) is the exponential
race argmax_i w_i / E_i with E_i = -log(u_i): it needs no normalisation and no prefix sum,
so a kernel can do it in one pass over vocabulary tiles; ties go to the lower index and
entries with w_i = 0 never win.

Positions consumed: an op call for a request with K drafted tokens (chain) or N tree nodes
uses positions 0..K (chain) or 0..N-1 (tree), so the caller advances ``offset`` by K + 1
(chain: ``draft_token_ids.shape[1] + 1``) or N (tree: ``parents.shape[1]``). The
acceptance draw of drafted token k (tree node k + 1) uses position k + 1; the sample drawn
at row k (tree node k) uses position k. A chain and the tree parents = [-1, 0, 1, ...]
therefore consume the same numbers and give the same tokens.
"""
from __future__ import annotations

import math

import torch

PURPOSE_ACCEPT = 0
PURPOSE_SAMPLE = 1
PURPOSE_DRAFT = 2

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32 with 10 rounds on Python ints: counter 4 x uint32, key 2 x uint32."""
    c0, c1, c2, c3 = (x & MASK32 for x in counter)
    k0, k1 = (x & MASK32 for x in key)
    for round_ in range(10):
        if round_ > 0:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        hi0, lo0 = p0 >> 32, p0 & MASK32
        hi1, lo1 = p1 >> 32, p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniform_from_bits(word: int) -> float:
    """Map a uint32 to (0, 1] with 24 bits, exactly as the kernels do in fp32."""
    return ((word >> 8) + 1) * 2.0**-24


def philox_uniform(seed: int, offset: int, position: int, purpose: int, index: int) -> float:
    """The uniform in (0, 1] for one (request, position, purpose, vocabulary index)."""
    seed &= (1 << 64) - 1
    counter = (offset + position) & ((1 << 64) - 1)
    word0 = philox4x32_10((index, purpose, counter & MASK32, counter >> 32), (seed & MASK32, seed >> 32))[0]
    return uniform_from_bits(word0)


def philox_uniform_torch(seed: torch.Tensor, offset: torch.Tensor, position: int, purpose: int, num: int) -> torch.Tensor:
    """Vectorised twin of ``philox_uniform`` in plain torch (int64 arithmetic).

    seed, offset: int64 [B]. Returns fp32 [B, num]: the uniforms for indices 0..num-1.
    """
    mask = torch.tensor(MASK32, dtype=torch.int64, device=seed.device)
    seed = seed.to(torch.int64)
    counter = offset.to(torch.int64) + position
    k0 = (seed & mask).unsqueeze(1)
    k1 = ((seed >> 32) & mask).unsqueeze(1)
    c0 = torch.arange(num, dtype=torch.int64, device=seed.device).unsqueeze(0).expand(seed.shape[0], num)
    c1 = torch.full_like(c0, purpose)
    c2 = (counter & mask).unsqueeze(1).expand_as(c0)
    c3 = ((counter >> 32) & mask).unsqueeze(1).expand_as(c0)

    def mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 32 x 32 -> 64-bit product without overflowing int64: split x into 16-bit halves.
        x_lo, x_hi = x & 0xFFFF, x >> 16
        lo_part = m * x_lo
        hi_part = m * x_hi
        low = (lo_part + ((hi_part & 0xFFFF) << 16))
        hi = (hi_part >> 16) + (low >> 32)
        return hi & mask, low & mask

    for round_ in range(10):
        if round_ > 0:
            k0 = (k0 + PHILOX_W0) & mask
            k1 = (k1 + PHILOX_W1) & mask
        hi0, lo0 = mulhilo(PHILOX_M0, c0)
        hi1, lo1 = mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return ((c0 >> 8) + 1).to(torch.float32) * (2.0**-24)


def sample_from_weights(weights: list[float], uniforms: list[float]) -> int:
    """Exponential race: argmax_i w_i / (-log u_i) over w_i > 0, ties to the lower index.

    Returns -1 when every weight is zero.
    """
    best, best_score = -1, -1.0
    for i, (w, u) in enumerate(zip(weights, uniforms)):
        if w > 0.0:
            e = -math.log(u)
            score = math.inf if e == 0.0 else w / e
            if score > best_score:
                best, best_score = i, score
    return best
