// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11),
// the one counter-based generator of the package. The counter layout is defined in
// specdec_kernels/rng.py and must stay identical here, in the Triton kernels
// (specdec_kernels/triton/rng.py) and in python_ref.
//
//   key     = (lo32(seed), hi32(seed))
//   counter = (index, purpose, lo32(offset + position), hi32(offset + position))
//   uniform = ((word0 >> 8) + 1) * 2^-24, in (0, 1], exact in fp32
#pragma once
#include <cstdint>

namespace specdec {

constexpr uint32_t kPurposeAccept = 0;  // acceptance draw of a drafted token / tree node
constexpr uint32_t kPurposeSample = 1;  // draw of the recovered or bonus token (per vocab index)

// The Philox4x32 multipliers and Weyl key increments (PHILOX_M0.. in specdec_kernels/rng.py).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr float kPhiloxUniformScale = 1.0f / 16777216.0f;  // 2^-24: 24 random bits -> (0, 1]

struct Philox4x32 {
  uint32_t v[4];
};

inline void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

inline Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxM0, c0, hi0, lo0);
    mulhilo32(kPhiloxM1, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

inline float uniform_from_bits(uint32_t x) {
  return static_cast<float>((x >> 8) + 1u) * kPhiloxUniformScale;
}

// The uniform for (seed, offset + position, purpose, index).
inline float philox_uniform(int64_t seed, int64_t offset, int64_t position, uint32_t purpose, uint32_t index) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint64_t c = static_cast<uint64_t>(offset) + static_cast<uint64_t>(position);
  Philox4x32 r = philox4x32_10(index, purpose, static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32),
                               static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return uniform_from_bits(r.v[0]);
}

}  // namespace specdec
