// The Philox4x32-10 uniforms of one exponential race (the generator of csrc/philox.h) for
// many vocabulary indices at a time, used by the CPU rejection samplers
// (rejection_sampling_race.cpp): PhiloxPlan (what is the same for every index of a race), its
// scalar twin philox_plan_uniform, and one SIMD kernel, philox_uniforms_simd, instantiated
// for AVX2 (8 lanes) and AVX-512 (16 lanes) and chosen at run time (cpu_has_avx512, cpu_features.h).
//
// One template over the vector width. GCC cannot make a function's target attribute depend
// on a template argument, and an AVX-512 intrinsic does not inline into a function compiled
// without AVX-512. So the template has no target of its own and is always_inline; the
// operations that differ per ISA are static members of a traits struct (PhiloxAvx512's
// carry the AVX-512 target attribute); each instantiation is inlined into a wrapper with
// its ISA's target (philox_uniforms_avx2 / philox_uniforms_avx512), where the traits'
// members are compatible with their caller and inline as well: no calls remain. (Compared
// with the two hand-written kernels this replaced, with GCC 12: the same instructions up
// to register names.) The AVX2 instantiation never sees the AVX-512 target, so it runs on
// CPUs without AVX-512, and the runtime choice between the two is unchanged.
#pragma once

#include <cstdint>
#include <cstdlib>

#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_X86_SIMD 1
#endif

#include "cpu_features.h"
#include "philox.h"

namespace specdec {

struct PhiloxKey {
  uint32_t k0, k1, c1, c2, c3;  // key words and the fixed counter words (purpose, position)
};

inline PhiloxKey make_philox_key(int64_t seed, int64_t offset, int64_t position, uint32_t purpose) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint64_t c = static_cast<uint64_t>(offset) + static_cast<uint64_t>(position);
  return {static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32), purpose, static_cast<uint32_t>(c),
          static_cast<uint32_t>(c >> 32)};
}

// Everything of Philox4x32-10 that is the same for all vocabulary indices of one race: the
// round keys and, as only counter word 0 (the index) varies, the parts of rounds 1 and 2
// that do not depend on it. Only word 0 of the output is used, so the last round computes
// one product.
struct PhiloxPlan {
  uint32_t k0[10], k1[10];
  uint32_t r1_x2;  // round 1: x2 = hi(M0 * index) ^ r1_x2
  uint32_t r2_x0;  // round 2: x0 = hi(M1 * x2) ^ r2_x0
  uint32_t r2_x2;  // round 2: x2 = x3 ^ r2_x2
  uint32_t r3_x2;  // round 3: x2 = hi(M0 * x0) ^ r3_x2 (x3 is constant after round 2)
  explicit PhiloxPlan(const PhiloxKey& key) {
    for (int r = 0; r < 10; ++r) {
      k0[r] = key.k0 + static_cast<uint32_t>(r) * kPhiloxW0;
      k1[r] = key.k1 + static_cast<uint32_t>(r) * kPhiloxW1;
    }
    uint32_t hi, lo;
    mulhilo32(kPhiloxM1, key.c2, hi, lo);  // round 1, word 2 is constant
    const uint32_t x0 = hi ^ key.c1 ^ k0[0], x1 = lo;
    r1_x2 = key.c3 ^ k1[0];
    r2_x0 = x1 ^ k0[1];
    mulhilo32(kPhiloxM0, x0, hi, lo);  // round 2, word 0 is constant
    r2_x2 = hi ^ k1[1];
    r3_x2 = lo ^ k1[2];
  }
};

// Scalar twin of the SIMD kernel (the fallback without x86 SIMD).
inline float philox_plan_uniform(const PhiloxPlan& p, uint32_t index) {
  uint32_t hi0, lo0, hi1, lo1;
  mulhilo32(kPhiloxM0, index, hi0, lo0);
  uint32_t x2 = hi0 ^ p.r1_x2, x3 = lo0;
  mulhilo32(kPhiloxM1, x2, hi1, lo1);
  uint32_t x0 = hi1 ^ p.r2_x0, x1 = lo1;
  x2 = x3 ^ p.r2_x2;
  mulhilo32(kPhiloxM0, x0, hi0, lo0);
  mulhilo32(kPhiloxM1, x2, hi1, lo1);
  x0 = hi1 ^ x1 ^ p.k0[2], x1 = lo1, x2 = hi0 ^ p.r3_x2, x3 = lo0;
  for (int r = 3; r < 9; ++r) {
    mulhilo32(kPhiloxM0, x0, hi0, lo0);
    mulhilo32(kPhiloxM1, x2, hi1, lo1);
    x0 = hi1 ^ x1 ^ p.k0[r], x1 = lo1, x2 = hi0 ^ x3 ^ p.k1[r], x3 = lo0;
  }
  mulhilo32(kPhiloxM1, x2, hi1, lo1);
  return uniform_from_bits(hi1 ^ x1 ^ p.k0[9]);
}

#if defined(SPECDEC_X86_SIMD)

// The target of the AVX-512 code (also compact_positive_avx512 in rejection_sampling_race.cpp).
#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,popcnt")))

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (their _mm512_undefined_*), and
// -Wpsabi notes that internal helpers pass 512-bit vectors: both harmless here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"

// The SIMD kernels keep 32-bit words in the low halves of 64-bit lanes: a 32 x 32 -> 64-bit
// product (vpmuludq) then yields lo in place and hi one dword shuffle away, and the high
// halves (garbage) are never read by vpmuludq. The even lanes of 8 (16) indices form one
// such vector, the odd lanes (shifted down) the other. Per ISA: V, the integer vector;
// kLanes, indices per step; and the operations the kernel needs.
struct PhiloxAvx2 {
  using V = __m256i;
  static constexpr int kLanes = 8;
  static V set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static V set1_64(uint32_t x) { return _mm256_set1_epi64x(x); }  // x in the low half of each 64-bit lane
  static V iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static V load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static V mul(V a, V b) { return _mm256_mul_epu32(a, b); }  // 32 x 32 -> 64 bits, low halves
  static V hi(V v) { return _mm256_shuffle_epi32(v, 0xB1); }  // the high half of each product
  static V odd_down(V v) { return _mm256_srli_epi64(v, 32); }
  static V xor2(V a, V b) { return _mm256_xor_si256(a, b); }
  static V xor3(V a, V b, V c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  // Words of the even lanes of `even` and of the even lanes of `odd` moved up, interleaved.
  static V interleave(V even, V odd) { return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA); }
  // out = ((word >> 8) + 1) * 2^-24 (see uniform_from_bits): bits in [1, 2^24], exact.
  static void store_uniforms(float* out, V word) {
    const V bits = _mm256_add_epi32(_mm256_srli_epi32(word, 8), _mm256_set1_epi32(1));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(kPhiloxUniformScale)));
  }
};

// The same with 16 indices per step and three-way XORs in one instruction.
struct PhiloxAvx512 {
  using V = __m512i;
  static constexpr int kLanes = 16;
  SPECDEC_AVX512 static V set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  SPECDEC_AVX512 static V set1_64(uint32_t x) { return _mm512_set1_epi64(x); }
  SPECDEC_AVX512 static V iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  SPECDEC_AVX512 static V load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  SPECDEC_AVX512 static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  SPECDEC_AVX512 static V mul(V a, V b) { return _mm512_mul_epu32(a, b); }
  SPECDEC_AVX512 static V hi(V v) { return _mm512_shuffle_epi32(v, _MM_PERM_CDAB); }
  SPECDEC_AVX512 static V odd_down(V v) { return _mm512_srli_epi64(v, 32); }
  SPECDEC_AVX512 static V xor2(V a, V b) { return _mm512_xor_si512(a, b); }
  SPECDEC_AVX512 static V xor3(V a, V b, V c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
  SPECDEC_AVX512 static V interleave(V even, V odd) {
    return _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  }
  SPECDEC_AVX512 static void store_uniforms(float* out, V word) {
    const V bits = _mm512_add_epi32(_mm512_srli_epi32(word, 8), _mm512_set1_epi32(1));
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(kPhiloxUniformScale)));
  }
};

// out[i] = uniform(base + (idx ? idx[i] : i)) for i < n, n a multiple of S::kLanes: the
// rounds of philox_plan_uniform, on the even and the odd lanes of S::kLanes indices.
template <typename S>
__attribute__((always_inline)) inline void philox_uniforms_simd(const PhiloxPlan& p, uint32_t base,
                                                                const uint32_t* idx, int64_t n, float* out) {
  using V = typename S::V;
  const V m0 = S::set1_64(kPhiloxM0), m1 = S::set1_64(kPhiloxM1);
  V k0[10], k1[10];
  for (int r = 0; r < 10; ++r) k0[r] = S::set1(p.k0[r]), k1[r] = S::set1(p.k1[r]);
  const V r1_x2 = S::set1(p.r1_x2), r2_x0 = S::set1(p.r2_x0), r2_x2 = S::set1(p.r2_x2), r3_x2 = S::set1(p.r3_x2);
  const V iota = S::iota(), vbase = S::set1(base);
  for (int64_t i = 0; i < n; i += S::kLanes) {
    const V index = S::add(vbase, idx ? S::load(idx + i) : S::add(iota, S::set1(static_cast<uint32_t>(i))));
    V x0[2], x1[2], x2[2], x3[2];
    for (int h = 0; h < 2; ++h) {
      const V c0 = h == 0 ? index : S::odd_down(index);
      const V q0 = S::mul(m0, c0);  // round 1
      x2[h] = S::xor2(S::hi(q0), r1_x2);
      x3[h] = q0;
      const V q1 = S::mul(m1, x2[h]);  // round 2
      x0[h] = S::xor2(S::hi(q1), r2_x0);
      x1[h] = q1;
      x2[h] = S::xor2(x3[h], r2_x2);
    }
    for (int h = 0; h < 2; ++h) {  // round 3
      const V q0 = S::mul(m0, x0[h]), q1 = S::mul(m1, x2[h]);
      x0[h] = S::xor3(S::hi(q1), x1[h], k0[2]);
      x1[h] = q1;
      x2[h] = S::xor2(S::hi(q0), r3_x2);
      x3[h] = q0;
    }
    for (int r = 3; r < 9; ++r)
      for (int h = 0; h < 2; ++h) {
        const V q0 = S::mul(m0, x0[h]), q1 = S::mul(m1, x2[h]);
        x0[h] = S::xor3(S::hi(q1), x1[h], k0[r]);
        x1[h] = q1;
        x2[h] = S::xor3(S::hi(q0), x3[h], k1[r]);
        x3[h] = q0;
      }
    for (int h = 0; h < 2; ++h) x0[h] = S::xor3(S::hi(S::mul(m1, x2[h])), x1[h], k0[9]);  // round 10
    S::store_uniforms(out + i, S::interleave(x0[0], x0[1]));
  }
}

inline void philox_uniforms_avx2(const PhiloxPlan& p, uint32_t base, const uint32_t* idx, int64_t n, float* out) {
  philox_uniforms_simd<PhiloxAvx2>(p, base, idx, n, out);
}

SPECDEC_AVX512 inline void philox_uniforms_avx512(const PhiloxPlan& p, uint32_t base, const uint32_t* idx,
                                                  int64_t n, float* out) {
  philox_uniforms_simd<PhiloxAvx512>(p, base, idx, n, out);
}

#pragma GCC diagnostic pop

#endif

// out[i] = philox uniform of index base + (idx ? idx[i] : i), i < n (n a multiple of 16).
inline void philox_uniforms(const PhiloxPlan& p, uint32_t base, const uint32_t* idx, int64_t n, float* out) {
#if defined(SPECDEC_X86_SIMD)
  if (cpu_has_avx512()) return philox_uniforms_avx512(p, base, idx, n, out);
  return philox_uniforms_avx2(p, base, idx, n, out);
#else
  for (int64_t i = 0; i < n; ++i) out[i] = philox_plan_uniform(p, base + (idx ? idx[i] : static_cast<uint32_t>(i)));
#endif
}

}  // namespace specdec
