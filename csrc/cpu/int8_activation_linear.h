// The CPU kernel of specdec::int8_activation_linear: GGUF-block weights (Q4_0 / Q4_1 / Q8_0)
// repacked 16 rows at a time, times activations quantised to int8 per block of 32 (llama.cpp's
// way: integer dot products instead of decoding every weight to fp32).
//
// Why: quantized_linear (gguf_blocks.h) decodes each weight to fp32 and multiplies with fused
// multiply-adds: decoding limits one activation row, and every further row costs 2 FMAs per
// 32 weights. Here a 32-weight block times a 32-int8 activation block is 8 integer dot-product
// instructions (AVX-512 VNNI vpdpbusd: 64 byte products each) for 16 weight rows, plus one
// scale FMA per row: the weights are never decoded to fp32, and a further row costs about a
// third of what it costs there.
//
// Packed weight, uint8 [G, nb, group_bytes]: G = ceil(N / 16) groups of 16 weight rows (rows past
// N are zero), nb = H / 32 blocks per row; group g, block b holds the blocks b of rows 16g..16g+15:
//   fp16 d[16]                       32 bytes, row l's scale at bytes 2l, 2l + 1
//   fp16 m[16] (Q4_1 only)           32 bytes
//   Q4_0 / Q4_1: 4 chunks of 64 bytes; chunk k, byte 4l + t = the block's qs[4k + t] of row l
//       (low nibble: weight 4k + t; high nibble: weight 16 + 4k + t);
//   Q8_0: 8 steps of 64 bytes; step k, byte 4l + t = q[4k + t] of row l plus 128 (as uint8).
// So 64 bytes give one 4-byte word per row (one int32 lane per row): the j-th unpacked word
// (j < 8: Q4 chunk j % 4, low nibbles for j < 4, high for j >= 4; Q8 step j) meets activation
// bytes 4j .. 4j + 3 of the block for every row.
//
// Activations (each row m, each block b of 32): amax = max |x|; d = amax / 127 (fp32);
// q = round_half_even(x * (1 / d)) clamped to [-127, 127]; sq = sum q; s = d * float(sq)
// (fp32). A block with amax < 2^-96 counts as zero (d = s = 0, q = 0: 1 / d would overflow
// for subnormal amax). A block holding NaN or +-inf gets q = 0, d = s = NaN (its row's
// outputs are NaN).
//
// Result, per output (m, n), in one fixed order (so a row's result is bit-identical whatever M,
// the other rows, the ISA path or the threads are):
//   acc = 0; for b = 0 .. nb - 1:
//     i = sum_j q_w[j] * q_x[j] (exact int32; Q4_0: nibbles minus 8, Q4_1: nibbles, Q8_0: q)
//     acc = fma(float(i), d_w * d_x, acc)          (d_w * d_x rounded to fp32)
//     Q4_1: acc = fma(m_w, s_x, acc)
//   out = acc (+ bias[n], one more rounding).
// The integer sums are exact in any order (|i| < 2^20), so the vector paths may split them.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"

namespace specdec {
namespace i8act {

constexpr int64_t kGroupRows = 16;  // weight rows per group: one output lane each
constexpr int64_t kBlock = 32;      // weights (and activations) per block
constexpr float kTinyBlock = 0x1p-96f;  // activation blocks with max |x| below this count as zero

// Bytes of one block of a group (16 rows), and where its weight bytes start; 0 for types the
// op does not read.
inline int64_t group_block_bytes(int64_t type) {
  switch (type) {
    case gguf::kQ4_0: return 32 + 256;
    case gguf::kQ4_1: return 64 + 256;
    case gguf::kQ8_0: return 32 + 512;
    default: return 0;
  }
}
inline int64_t weights_offset(int64_t type) { return type == gguf::kQ4_1 ? 64 : 32; }

struct Problem {
  const int8_t* q;     // [M, nb * 32] quantised activations
  const float* d;      // [M, nb] their scales
  const float* s;      // [M, nb] d * sum(q)
  const int32_t* sq;   // [M, nb] sum(q)
  int64_t M, nb;
  const uint8_t* w;    // [G, nb, bb]
  int64_t bb;          // group_block_bytes(type)
  int64_t N;
  const float* bias;   // [N] or nullptr
  float* out;          // [M, N]
};

// Quantises x [M, H] (fp32, contiguous, H = nb * 32) as the header says. Plain scalar code,
// the same for every path (its cost is M * H, small next to the weights').
inline void quantize_activations(const float* x, int64_t M, int64_t nb, int8_t* q, float* d, float* s,
                                 int32_t* sq) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + (m * nb + b) * kBlock;
      int8_t* qb = q + (m * nb + b) * kBlock;
      float amax = 0.f;
      bool finite = true;
      for (int64_t j = 0; j < kBlock; ++j) {
        finite = finite && std::isfinite(xb[j]);
        amax = std::max(amax, std::fabs(xb[j]));
      }
      int32_t sum = 0;
      if (!finite) {
        std::memset(qb, 0, kBlock);
        d[m * nb + b] = s[m * nb + b] = std::numeric_limits<float>::quiet_NaN();
        sq[m * nb + b] = 0;
        continue;
      }
      const float dm = amax < kTinyBlock ? 0.f : amax / 127.f;
      const float id = dm != 0.f ? 1.f / dm : 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float v = std::nearbyint(xb[j] * id);  // the default rounding mode: half to even
        const int32_t qi = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
        qb[j] = static_cast<int8_t>(qi);
        sum += qi;
      }
      d[m * nb + b] = dm;
      sq[m * nb + b] = sum;
      s[m * nb + b] = dm * static_cast<float>(sum);
    }
  }
}

inline void store_lanes(const Problem& p, int64_t m, int64_t n0, const float* lanes) {
  const int64_t nr = std::min<int64_t>(kGroupRows, p.N - n0);
  float* o = p.out + m * p.N + n0;
  for (int64_t l = 0; l < nr; ++l) o[l] = p.bias ? lanes[l] + p.bias[n0 + l] : lanes[l];
}

inline float f16_at(const uint8_t* p) { return static_cast<float>(c10::Half(gguf::load_u16(p), c10::Half::from_bits())); }

// ---------------------------------------------------------------------------------------
// Portable path (the reference of the vector paths' arithmetic).
// ---------------------------------------------------------------------------------------
template <int64_t Type>
inline void group_generic(const Problem& p, int64_t g) {
  const int64_t wo = weights_offset(Type);
  for (int64_t m = 0; m < p.M; ++m) {
    float acc[kGroupRows] = {};
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = p.w + (g * p.nb + b) * p.bb;
      const int8_t* xq = p.q + (m * p.nb + b) * kBlock;
      const float dx = p.d[m * p.nb + b];
      const int32_t sq = p.sq[m * p.nb + b];
      for (int64_t l = 0; l < kGroupRows; ++l) {
        int32_t isum = 0;
        for (int64_t j = 0; j < 8; ++j) {
          for (int64_t t = 0; t < 4; ++t) {
            int32_t wv;
            if constexpr (Type == gguf::kQ8_0) {
              wv = blk[wo + 64 * j + 4 * l + t];
            } else {
              const uint8_t byte = blk[wo + 64 * (j % 4) + 4 * l + t];
              wv = j < 4 ? (byte & 15) : (byte >> 4);
            }
            isum += wv * xq[4 * j + t];
          }
        }
        if constexpr (Type == gguf::kQ4_0) isum -= 8 * sq;
        if constexpr (Type == gguf::kQ8_0) isum -= 128 * sq;
        const float scale = f16_at(blk + 2 * l) * dx;
        acc[l] = std::fma(static_cast<float>(isum), scale, acc[l]);
        if constexpr (Type == gguf::kQ4_1) acc[l] = std::fma(f16_at(blk + 32 + 2 * l), p.s[m * p.nb + b], acc[l]);
      }
    }
    store_lanes(p, m, g * kGroupRows, acc);
  }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(SPECDEC_GGUF_X86)
// ---------------------------------------------------------------------------------------
// AVX-512 VNNI: one zmm holds the 16 rows' int32 lanes; vpdpbusd multiplies the 64 weight
// bytes (unsigned) with the row's 4 activation bytes broadcast (signed) and adds 4 products
// per lane. Tiles of MR activation rows share the unpacked weight words of a block.
// ---------------------------------------------------------------------------------------
#define SPECDEC_I8_VNNI __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512vnni,f16c,fma,avx2")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
template <int64_t Type, int MR>
SPECDEC_I8_VNNI inline void tile_vnni(const Problem& p, int64_t g, int64_t m0) {
  const int64_t wo = weights_offset(Type);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk = p.w + (g * p.nb + b) * p.bb;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512i w[8];
    if constexpr (Type == gguf::kQ8_0) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(blk + wo + 64 * j);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i c = _mm512_loadu_si512(blk + wo + 64 * j);
        w[j] = _mm512_and_si512(c, low4);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t mb = (m0 + i) * p.nb + b;
      const int8_t* xq = p.q + mb * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(load_i32(xq + 4 * j + 4)));
      }
      __m512i isum = _mm512_add_epi32(s0, s1);
      if constexpr (Type == gguf::kQ4_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * p.sq[mb]));
      if constexpr (Type == gguf::kQ8_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * p.sq[mb]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(p.d[mb]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[i]);
      if constexpr (Type == gguf::kQ4_1) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
        acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(p.s[mb]), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float lanes[kGroupRows];
    _mm512_store_ps(lanes, acc[i]);
    store_lanes(p, m0 + i, g * kGroupRows, lanes);
  }
}

template <int64_t Type>
SPECDEC_I8_VNNI __attribute__((flatten)) inline void group_vnni(const Problem& p, int64_t g) {
  constexpr int MR = 4;
  int64_t m0 = 0;
  for (; m0 + MR <= p.M; m0 += MR) tile_vnni<Type, MR>(p, g, m0);
  switch (p.M - m0) {
    case 3: tile_vnni<Type, 3>(p, g, m0); break;
    case 2: tile_vnni<Type, 2>(p, g, m0); break;
    case 1: tile_vnni<Type, 1>(p, g, m0); break;
    default: break;
  }
}

SPECDEC_I8_VNNI __attribute__((noinline)) inline void run_vnni(const Problem& p, int64_t type, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    if (type == gguf::kQ4_0) group_vnni<gguf::kQ4_0>(p, g);
    else if (type == gguf::kQ4_1) group_vnni<gguf::kQ4_1>(p, g);
    else group_vnni<gguf::kQ8_0>(p, g);
  }
}
#pragma GCC diagnostic pop

// ---------------------------------------------------------------------------------------
// AVX2: the 16 rows as two halves of 8 int32 lanes; vpmaddubsw (unsigned x signed bytes ->
// saturating int16 pairs) then vpmaddwd with ones. No pair can saturate: Q4 pairs are at most
// 2 * 15 * 127 (and 8 of them summed in int16, 30480, still fit); Q8_0 uses |w| with the sign
// moved onto x (at most 2 * 128 * 127 per pair) instead of the unsigned offset bytes.
// ---------------------------------------------------------------------------------------
template <int64_t Type, int MR>
inline void half_tile_avx2(const Problem& p, int64_t g, int half, int64_t m0, __m256* acc) {
  const int64_t wo = weights_offset(Type);
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk = p.w + (g * p.nb + b) * p.bb;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half)));
    __m256i w[8];
    for (int j = 0; j < (Type == gguf::kQ8_0 ? 8 : 4); ++j) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + wo + 64 * j + 32 * half));
      if constexpr (Type == gguf::kQ8_0) {
        w[j] = _mm256_xor_si256(c, flip);  // back to the signed q
      } else {
        w[j] = _mm256_and_si256(c, low4);
        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t mb = (m0 + i) * p.nb + b;
      const int8_t* xq = p.q + mb * kBlock;
      __m256i isum;
      if constexpr (Type == gguf::kQ8_0) {
        isum = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i xb = _mm256_set1_epi32(load_i32(xq + 4 * j));
          const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(xb, w[j]));
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(prod, ones));
        }
      } else {
        __m256i pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load_i32(xq)));
        for (int j = 1; j < 8; ++j)
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(load_i32(xq + 4 * j))));
        isum = _mm256_madd_epi16(pairs, ones);
        if constexpr (Type == gguf::kQ4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * p.sq[mb]));
      }
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(p.d[mb]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[i]);
      if constexpr (Type == gguf::kQ4_1) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * half)));
        acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(p.s[mb]), acc[i]);
      }
    }
  }
}

template <int64_t Type, int MR>
inline void tile_avx2(const Problem& p, int64_t g, int64_t m0) {
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < MR; ++i) acc[h][i] = _mm256_setzero_ps();
    half_tile_avx2<Type, MR>(p, g, h, m0, acc[h]);
  }
  for (int i = 0; i < MR; ++i) {
    float lanes[kGroupRows];
    _mm256_storeu_ps(lanes, acc[0][i]);
    _mm256_storeu_ps(lanes + 8, acc[1][i]);
    store_lanes(p, m0 + i, g * kGroupRows, lanes);
  }
}

template <int64_t Type>
inline void group_avx2(const Problem& p, int64_t g) {
  constexpr int MR = 2;
  int64_t m0 = 0;
  for (; m0 + MR <= p.M; m0 += MR) tile_avx2<Type, MR>(p, g, m0);
  if (p.M - m0 == 1) tile_avx2<Type, 1>(p, g, m0);
}

__attribute__((flatten, noinline)) inline void run_avx2(const Problem& p, int64_t type, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    if (type == gguf::kQ4_0) group_avx2<gguf::kQ4_0>(p, g);
    else if (type == gguf::kQ4_1) group_avx2<gguf::kQ4_1>(p, g);
    else group_avx2<gguf::kQ8_0>(p, g);
  }
}
#endif  // SPECDEC_GGUF_X86

inline void run_generic(const Problem& p, int64_t type, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    if (type == gguf::kQ4_0) group_generic<gguf::kQ4_0>(p, g);
    else if (type == gguf::kQ4_1) group_generic<gguf::kQ4_1>(p, g);
    else group_generic<gguf::kQ8_0>(p, g);
  }
}

}  // namespace i8act
}  // namespace specdec
