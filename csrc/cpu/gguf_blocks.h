// GGUF weight blocks (llama.cpp's formats) and the CPU kernel of specdec::quantized_linear.
//
// A weight [N, H] is stored as its GGUF bytes, uint8 [N, H / block_size * block_bytes]:
// each row is a run of blocks, decoded exactly as gguf.dequantize (gguf-py's quants.py)
// does, in fp32:
//   Q4_0 (18 bytes / 32 weights): fp16 d, 16 bytes qs; weight j = d * ((qs[j % 16] >> 4 * (j / 16) & 15) - 8)
//   Q4_1 (20 bytes / 32 weights): fp16 d, fp16 m, 16 bytes qs; weight j = d * nibble_j + m
//   Q8_0 (34 bytes / 32 weights): fp16 d, 32 int8 qs; weight j = qs[j] * d
//   Q5_0 (22 bytes / 32 weights): fp16 d, uint32 qh, 16 bytes qs; q_j = nibble_j | bit j of qh << 4;
//     weight j = d * (q_j - 16)
//   Q5_1 (24 bytes / 32 weights): fp16 d, fp16 m, uint32 qh, 16 bytes qs; weight j = d * q_j + m
//   Q4_K (144 bytes / 256 weights, 8 sub-blocks of 32): fp16 d, fp16 dmin, 12 bytes of 6-bit
//     scales sc[s] and mins m[s] (k_scale_min), 128 bytes qs (bytes 32t..32t+32: sub-block 2t
//     in the low, 2t + 1 in the high nibbles); weight = (d * sc[s]) * nibble - (dmin * m[s])
//   Q5_K (176 bytes / 256 weights): as Q4_K with 32 bytes qh between the scales and qs: the
//     fifth bit of weight l of sub-block s is bit s of qh[l]
//   Q6_K (210 bytes / 256 weights, 16 scales of 16 weights): 128 bytes ql (low 4 bits), 64
//     bytes qh (high 2 bits), 16 int8 scales, fp16 d; weight e = (d * scale[e / 16]) * (q_e - 32)
//     with, for e = 128 i + 32 t + l (l < 32): the low bits in ql[64 i + 32 (t % 2) + l] >> 4 (t / 2),
//     the high bits in qh[32 i + l] >> 2 t
//   F32 / F16 / BF16 (4 / 2 / 2 bytes per weight): the value, widened to fp32.
// (d * q and q * d are exact in fp32: 11 + 8 significant bits at most; so are the K-quants'
// d * sc, dmin * m (11 + 6 bits), d * scale (11 + 8) and their products with q (at most 23
// bits). So one rounding is left where gguf rounds once: fma(d, q, m) for Q4_1 / Q5_1's
// (d * q) + m, fma(d * sc, q, -(dmin * m)) for Q4_K / Q5_K's (d * sc) * q - dmin * m.)
//
// The kernel computes out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) in fp32 in one fixed
// order that depends on H only (never on M, on the other rows, on the ISA path or on the
// threads), so a row's result is bit-identical whatever batch it is computed in:
//   acc[l], l < 16 lanes, starts at 0; for each chunk c of 32 weights (one block; one
//   sub-block of a K-quant super-block of 256, which is 8 chunks; 32 elements of the float
//   types, the last chunk zero-padded), in order:
//     acc[l] = fma(x[32c + l], w[32c + l], acc[l]), then
//     acc[l] = fma(x[32c + 16 + l], w[32c + 16 + l], acc[l]);
//   then the lanes are summed as a tree: s8[l] = acc[l] + acc[l + 8], s4[l] = s8[l] + s8[l + 4],
//   s2[l] = s4[l] + s4[l + 2], sum = s2[0] + s2[1]; out = sum (+ bias[n], one more rounding).
// The AVX-512 path holds the 16 lanes in one zmm register, the AVX2 path in two ymm
// registers (lanes 0-7, 8-15), the portable path in an array: identical arithmetic.
//
// Blocking: every weight block is read from memory once for all M rows. Up to kDirectM
// activation rows: a group of kDirectRows weight rows is decoded chunk by chunk in registers
// and multiplied with all rows at once. More rows: each group of kScratchRows weight rows is
// decoded once into an fp32 scratch (L1/L2 resident) and tiles of kScratchM rows run over it.
// Lines are prefetched ahead of the reading position (software: the rows of a group are read
// side by side, which the hardware prefetchers follow poorly). Threads split the weight rows.
//
// Cost (measured, bench/bench_linear.py): at M = 1 decoding is the limit, not memory (Q4_1 at
// ~8.5 GB/s on one Zen 4 core, ~1.7x the copy bandwidth); each further row costs two fused
// multiply-adds per 32 weights, so from M ~ 4 on the kernel is bound by the fp32 FMA rate
// (M = 8 ~2.7x and M = 16 ~5.5x the M = 1 time with Q4_1). Only integer dot products on
// quantised activations (llama.cpp's way, not done here) would be cheaper per row. The
// K-quants decode at about half Q4_0's weights per second (one AVX2 core, hot: Q4_K 3.7,
// Q6_K 4.2, Q4_0 7.0 Gweights/s), ~14% / ~19% of the copy bandwidth at M = 1 on Qwen2.5-1.5B's
// shapes: decode-bound too.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace specdec {
namespace gguf {

// GGML type ids (gguf.GGMLQuantizationType) of the formats quantized_linear reads.
enum : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kBF16 = 30
};

struct BlockFormat {
  const char* name;
  int64_t block_size;   // weights per block
  int64_t block_bytes;  // bytes per block
};

// The format of GGML type `type`, or nullptr when quantized_linear does not read it.
inline const BlockFormat* block_format(int64_t type) {
  static const BlockFormat f32{"F32", 1, 4}, f16{"F16", 1, 2}, q4_0{"Q4_0", 32, 18}, q4_1{"Q4_1", 32, 20},
      q5_0{"Q5_0", 32, 22}, q5_1{"Q5_1", 32, 24}, q8_0{"Q8_0", 32, 34}, q4_k{"Q4_K", 256, 144},
      q5_k{"Q5_K", 256, 176}, q6_k{"Q6_K", 256, 210}, bf16{"BF16", 1, 2};
  switch (type) {
    case kF32: return &f32;
    case kF16: return &f16;
    case kQ4_0: return &q4_0;
    case kQ4_1: return &q4_1;
    case kQ5_0: return &q5_0;
    case kQ5_1: return &q5_1;
    case kQ8_0: return &q8_0;
    case kQ4_K: return &q4_k;
    case kQ5_K: return &q5_k;
    case kQ6_K: return &q6_k;
    case kBF16: return &bf16;
    default: return nullptr;
  }
}

constexpr const char* kSupportedTypes =
    "F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30";

constexpr int64_t kChunk = 32;  // weights decoded at a time: one block, or 32 float weights

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------------------------------
// 16-lane fp32 vectors, one type per ISA path, with the same lane semantics.
// ---------------------------------------------------------------------------------------

// Portable: an array, std::fma (the reference for the vector paths' arithmetic).
struct VecGeneric {
  float v[16];
  static VecGeneric zero() {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = 0.f;
    return r;
  }
  static VecGeneric load(const float* p) {
    VecGeneric r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static void store(float* p, const VecGeneric& a) { std::memcpy(p, a.v, sizeof(a.v)); }
  static VecGeneric fma(const VecGeneric& a, const VecGeneric& b, const VecGeneric& c) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return r;
  }
  static VecGeneric mul(const VecGeneric& a, const VecGeneric& b) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] * b.v[l];
    return r;
  }
  static VecGeneric broadcast_f16(const uint8_t* p) {
    VecGeneric r;
    const float d = static_cast<float>(c10::Half(load_u16(p), c10::Half::from_bits()));
    for (int l = 0; l < 16; ++l) r.v[l] = d;
    return r;
  }
  // The 16 low (half 0) or high (half 1) nibbles of p[0..16), as floats; minus 8 if `centered`.
  static VecGeneric nibbles(const uint8_t* p, int half, bool centered) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = static_cast<float>(((p[l] >> (4 * half)) & 15) - (centered ? 8 : 0));
    return r;
  }
  static VecGeneric int8s(const uint8_t* p) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = static_cast<float>(static_cast<int8_t>(p[l]));
    return r;
  }
  static VecGeneric set1(float a) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = a;
    return r;
  }
  // Lane l: ((lo[l] >> lo_shift) & 15 | ((hi[l] >> hi_shift) & hi_mask) << 4) - offset, as a float
  // (lo_shift 0 or 4; hi_mask 1 or 3; the integer lies in -32..63).
  static VecGeneric quants(const uint8_t* lo, int lo_shift, const uint8_t* hi, int hi_shift, int hi_mask, int offset) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l)
      r.v[l] = static_cast<float>((((lo[l] >> lo_shift) & 15) | (((hi[l] >> hi_shift) & hi_mask) << 4)) - offset);
    return r;
  }
  // Lane l: (lo[l] >> lo_shift) & 15, as a float (lo_shift 0 or 4, known at run time only).
  static VecGeneric nibbles_shifted(const uint8_t* lo, int lo_shift) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = static_cast<float>((lo[l] >> lo_shift) & 15);
    return r;
  }
  // Lane l: ((lo[l] >> lo_shift) & 15 | ((bits >> l) & 1) << 4) - offset, as a float.
  static VecGeneric quants_bit(const uint8_t* lo, int lo_shift, uint32_t bits, int offset) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l)
      r.v[l] = static_cast<float>((((lo[l] >> lo_shift) & 15) | static_cast<int>(((bits >> l) & 1) << 4)) - offset);
    return r;
  }
  static VecGeneric f32s(const uint8_t* p) {
    VecGeneric r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static VecGeneric f16s(const uint8_t* p) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) r.v[l] = static_cast<float>(c10::Half(load_u16(p + 2 * l), c10::Half::from_bits()));
    return r;
  }
  static VecGeneric bf16s(const uint8_t* p) {
    VecGeneric r;
    for (int l = 0; l < 16; ++l) {
      const uint32_t bits = static_cast<uint32_t>(load_u16(p + 2 * l)) << 16;
      std::memcpy(&r.v[l], &bits, 4);
    }
    return r;
  }
  static float reduce(const VecGeneric& a) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; ++l) s8[l] = a.v[l] + a.v[l + 8];
    for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
};

#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDEC_GGUF_X86 1

// AVX2: lanes 0-7 in lo, 8-15 in hi.
struct VecAvx2 {
  __m256 lo, hi;
  static VecAvx2 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, const VecAvx2& a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
  static VecAvx2 fma(const VecAvx2& a, const VecAvx2& b, const VecAvx2& c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static VecAvx2 mul(const VecAvx2& a, const VecAvx2& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static VecAvx2 broadcast_f16(const uint8_t* p) {
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(p))));
    return {d, d};
  }
  static VecAvx2 nibbles(const uint8_t* p, int half, bool centered) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    if (half == 0) {
      const __m256i mask = _mm256_set1_epi32(15);
      lo = _mm256_and_si256(lo, mask), hi = _mm256_and_si256(hi, mask);
    } else {
      lo = _mm256_srli_epi32(lo, 4), hi = _mm256_srli_epi32(hi, 4);
    }
    if (centered) {
      const __m256i eight = _mm256_set1_epi32(8);
      lo = _mm256_sub_epi32(lo, eight), hi = _mm256_sub_epi32(hi, eight);
    }
    return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
  }
  static VecAvx2 int8s(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  static VecAvx2 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  // The 16 integers of quants / quants_bit are formed as bytes (16-bit shifts, then byte masks
  // that drop what crossed from the neighbouring byte), then widened as int8s.
  static VecAvx2 quants(const uint8_t* lo, int lo_shift, const uint8_t* hi, int hi_shift, int hi_mask, int offset) {
    const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)),
                                                  _mm_cvtsi32_si128(lo_shift)), _mm_set1_epi8(15));
    const __m128i h = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)),
                                                  _mm_cvtsi32_si128(hi_shift)), _mm_set1_epi8(static_cast<char>(hi_mask)));
    const __m128i q = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(h, 4)), _mm_set1_epi8(static_cast<char>(offset)));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
  }
  static VecAvx2 nibbles_shifted(const uint8_t* lo, int lo_shift) {
    const __m128i q = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)),
                                                  _mm_cvtsi32_si128(lo_shift)), _mm_set1_epi8(15));
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
  }
  static VecAvx2 quants_bit(const uint8_t* lo, int lo_shift, uint32_t bits, int offset) {
    const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)),
                                                  _mm_cvtsi32_si128(lo_shift)), _mm_set1_epi8(15));
    // Byte l gets byte l / 8 of the bits, keeps bit l % 8, and becomes 16 where it is set.
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                            _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128i bit = _mm_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    const __m128i h = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16));
    const __m128i q = _mm_sub_epi8(_mm_or_si128(l, h), _mm_set1_epi8(static_cast<char>(offset)));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
  }
  static VecAvx2 f32s(const uint8_t* p) {
    return {_mm256_loadu_ps(reinterpret_cast<const float*>(p)), _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8)};
  }
  static VecAvx2 f16s(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static VecAvx2 bf16s(const uint8_t* p) {
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  }
  static float reduce(const VecAvx2& a) {
    const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // [0] = s4[0] + s4[2], [1] = s4[1] + s4[3]
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};

// AVX-512 (F, VL, DQ, BW): 16 lanes in one register. Compiled for that target only; the
// kernel functions instantiated with it carry the same target (SPECDEC_GGUF_AVX512 +
// flatten, so that every helper is inlined into code compiled for AVX-512) and run only
// when cpu_has_avx512().
#define SPECDEC_GGUF_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,f16c,fma,avx2")))
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (their _mm512_undefined_*), and -Wpsabi
// notes that these internal helpers pass 512-bit vectors by value (always inlined): harmless.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
struct VecAvx512 {
  __m512 v;
  SPECDEC_GGUF_AVX512 static VecAvx512 zero() { return {_mm512_setzero_ps()}; }
  SPECDEC_GGUF_AVX512 static VecAvx512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  SPECDEC_GGUF_AVX512 static void store(float* p, const VecAvx512& a) { _mm512_storeu_ps(p, a.v); }
  SPECDEC_GGUF_AVX512 static VecAvx512 fma(const VecAvx512& a, const VecAvx512& b, const VecAvx512& c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 mul(const VecAvx512& a, const VecAvx512& b) { return {_mm512_mul_ps(a.v, b.v)}; }
  SPECDEC_GGUF_AVX512 static VecAvx512 broadcast_f16(const uint8_t* p) {
    return {_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(p))))};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 nibbles(const uint8_t* p, int half, bool centered) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q = half == 0 ? _mm512_and_si512(q, _mm512_set1_epi32(15)) : _mm512_srli_epi32(q, 4);
    if (centered) q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
    return {_mm512_cvtepi32_ps(q)};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 int8s(const uint8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 set1(float a) { return {_mm512_set1_ps(a)}; }
  // As VecAvx2's: the integers as bytes, then widened; quant_bit's high bits from a mask.
  SPECDEC_GGUF_AVX512 static VecAvx512 quants(const uint8_t* lo, int lo_shift, const uint8_t* hi, int hi_shift,
                                              int hi_mask, int offset) {
    const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)),
                                                  _mm_cvtsi32_si128(lo_shift)), _mm_set1_epi8(15));
    const __m128i h = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)),
                                                  _mm_cvtsi32_si128(hi_shift)), _mm_set1_epi8(static_cast<char>(hi_mask)));
    const __m128i q = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(h, 4)), _mm_set1_epi8(static_cast<char>(offset)));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 nibbles_shifted(const uint8_t* lo, int lo_shift) {
    const __m128i q = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)),
                                                  _mm_cvtsi32_si128(lo_shift)), _mm_set1_epi8(15));
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 quants_bit(const uint8_t* lo, int lo_shift, uint32_t bits, int offset) {
    const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)),
                                                  _mm_cvtsi32_si128(lo_shift)), _mm_set1_epi8(15));
    const __m128i h = _mm_maskz_mov_epi8(static_cast<__mmask16>(bits & 0xFFFF), _mm_set1_epi8(16));
    const __m128i q = _mm_sub_epi8(_mm_or_si128(l, h), _mm_set1_epi8(static_cast<char>(offset)));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 f32s(const uint8_t* p) { return {_mm512_loadu_ps(p)}; }
  SPECDEC_GGUF_AVX512 static VecAvx512 f16s(const uint8_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  SPECDEC_GGUF_AVX512 static VecAvx512 bf16s(const uint8_t* p) {
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(a, 16))};
  }
  SPECDEC_GGUF_AVX512 static float reduce(const VecAvx512& a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};
#pragma GCC diagnostic pop
#endif  // x86 with AVX2

// ---------------------------------------------------------------------------------------
// Decoding a chunk of 32 weights, exactly as gguf.dequantize.
// Decode<Type>::chunk<V>(row, c, w0, w1): weights 32c .. 32c + 16 (w0) and 32c + 16 .. 32c + 32
// (w1) of the row at `row`. unit_bytes / unit_chunks: the bytes of the unit the decoder
// addresses (a block; for the float types one chunk of 32 elements) and the chunks it holds
// (8 for the K-quants). A chunk is decoded whole so that its scales are formed once.
// ---------------------------------------------------------------------------------------

template <int64_t Type>
struct Decode;

template <>
struct Decode<kQ4_0> {
  static constexpr int64_t unit_bytes = 18, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {  // gguf: d * float(int8(nibble) - 8)
    const uint8_t* b = row + c * unit_bytes;
    const V d = V::broadcast_f16(b);
    w0 = V::mul(d, V::nibbles(b + 2, 0, /*centered=*/true));
    w1 = V::mul(d, V::nibbles(b + 2, 1, /*centered=*/true));
  }
};

template <>
struct Decode<kQ4_1> {
  static constexpr int64_t unit_bytes = 20, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {  // gguf: (d * nibble) + m, d * nibble exact
    const uint8_t* b = row + c * unit_bytes;
    const V d = V::broadcast_f16(b), m = V::broadcast_f16(b + 2);
    w0 = V::fma(d, V::nibbles(b + 4, 0, /*centered=*/false), m);
    w1 = V::fma(d, V::nibbles(b + 4, 1, /*centered=*/false), m);
  }
};

template <>
struct Decode<kQ5_0> {
  static constexpr int64_t unit_bytes = 22, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {  // gguf: d * float(int8(q) - 16)
    const uint8_t* b = row + c * unit_bytes;
    const V d = V::broadcast_f16(b);
    const uint32_t qh = load_u32(b + 2);
    w0 = V::mul(d, V::quants_bit(b + 6, 0, qh, 16));
    w1 = V::mul(d, V::quants_bit(b + 6, 4, qh >> 16, 16));
  }
};

template <>
struct Decode<kQ5_1> {
  static constexpr int64_t unit_bytes = 24, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {  // gguf: (d * q) + m, d * q exact
    const uint8_t* b = row + c * unit_bytes;
    const V d = V::broadcast_f16(b), m = V::broadcast_f16(b + 2);
    const uint32_t qh = load_u32(b + 4);
    w0 = V::fma(d, V::quants_bit(b + 8, 0, qh, 0), m);
    w1 = V::fma(d, V::quants_bit(b + 8, 4, qh >> 16, 0), m);
  }
};

template <>
struct Decode<kQ8_0> {
  static constexpr int64_t unit_bytes = 34, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {  // gguf: float(int8) * d
    const uint8_t* b = row + c * unit_bytes;
    const V d = V::broadcast_f16(b);
    w0 = V::mul(V::int8s(b + 2), d);
    w1 = V::mul(V::int8s(b + 18), d);
  }
};

// The 6-bit scale and min of sub-block s < 8 from a Q4_K / Q5_K super-block's 12 scale bytes:
// bytes 0-3 hold sc[0..3] and bytes 4-7 m[0..3] in their low 6 bits; sc[4..7] and m[4..7] take
// their low 4 bits from the low / high nibbles of bytes 8-11 and their top 2 bits from the top
// 2 bits of bytes 0-3 / 4-7.
inline void k_scale_min(const uint8_t* q, int s, int& sc, int& m) {
  if (s < 4) {
    sc = q[s] & 63, m = q[s + 4] & 63;
  } else {
    sc = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4), m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

// float(i) for i < 256 (byte_as_float) and float(int8_t(i)) (int8_as_float).
struct SmallFloats {
  float byte_as_float[256], int8_as_float[256];
  constexpr SmallFloats() : byte_as_float(), int8_as_float() {
    for (int i = 0; i < 256; ++i)
      byte_as_float[i] = static_cast<float>(i), int8_as_float[i] = static_cast<float>(i < 128 ? i : i - 256);
  }
};
inline constexpr SmallFloats kSmallFloats{};

// The K-quants' sub-block scales (and Q4_K / Q5_K's negated offsets) of the super-block a row
// is in, as fp32, formed once per super-block (all exact products: d * sc, dmin * -m =
// -(dmin * m), d * scale) and broadcast from here for each chunk. (Formed per chunk they cost
// 3-4x the decode: scalar conversions and spilled 6-bit unpacking stalled the loop, measured.)
struct KScales {
  int64_t block = -1;  // the super-block they are of
  float scale[16], neg_offset[8];
};

inline float f16_value(const uint8_t* p) { return static_cast<float>(c10::Half(load_u16(p), c10::Half::from_bits())); }

// Q4_K / Q5_K: sc[s], m[s] from the 12 scale bytes (see k_scale_min) for the 8 sub-blocks.
inline void fill_k_scales_mins(const uint8_t* b, KScales& st) {
  const float d = f16_value(b), dmin = f16_value(b + 2);
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    k_scale_min(b + 4, s, sc, m);
    st.scale[s] = d * kSmallFloats.byte_as_float[sc];
    st.neg_offset[s] = dmin * -kSmallFloats.byte_as_float[m];
  }
}

template <>
struct Decode<kQ4_K> {
  static constexpr int64_t unit_bytes = 144, unit_chunks = 8;
  using State = KScales;
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State& st, V& w0, V& w1) {  // gguf: (d * sc) * nibble - dmin * m
    const uint8_t* b = row + (c >> 3) * unit_bytes;
    if (st.block != (c >> 3)) fill_k_scales_mins(b, st), st.block = c >> 3;
    const int s = static_cast<int>(c & 7);
    const V scale = V::set1(st.scale[s]), neg_offset = V::set1(st.neg_offset[s]);
    const uint8_t* qs = b + 16 + 32 * (s >> 1);
    w0 = V::fma(scale, V::nibbles_shifted(qs, 4 * (s & 1)), neg_offset);
    w1 = V::fma(scale, V::nibbles_shifted(qs + 16, 4 * (s & 1)), neg_offset);
  }
};

template <>
struct Decode<kQ5_K> {
  static constexpr int64_t unit_bytes = 176, unit_chunks = 8;
  using State = KScales;
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State& st, V& w0, V& w1) {  // gguf: (d * sc) * q - dmin * m
    const uint8_t* b = row + (c >> 3) * unit_bytes;
    if (st.block != (c >> 3)) fill_k_scales_mins(b, st), st.block = c >> 3;
    const int s = static_cast<int>(c & 7);
    const V scale = V::set1(st.scale[s]), neg_offset = V::set1(st.neg_offset[s]);
    const uint8_t *qs = b + 48 + 32 * (s >> 1), *qh = b + 16;
    w0 = V::fma(scale, V::quants(qs, 4 * (s & 1), qh, s, 1, 0), neg_offset);
    w1 = V::fma(scale, V::quants(qs + 16, 4 * (s & 1), qh + 16, s, 1, 0), neg_offset);
  }
};

template <>
struct Decode<kQ6_K> {
  static constexpr int64_t unit_bytes = 210, unit_chunks = 8;
  using State = KScales;
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State& st, V& w0, V& w1) {  // gguf: (d * scale) * float(int8(q) - 32)
    const uint8_t* b = row + (c >> 3) * unit_bytes;
    if (st.block != (c >> 3)) {
      const float d = f16_value(b + 208);
      for (int k = 0; k < 16; ++k) st.scale[k] = d * kSmallFloats.int8_as_float[b[192 + k]];
      st.block = c >> 3;
    }
    const int s = static_cast<int>(c & 7), i = s >> 2, t = s & 3;  // weights 128 i + 32 t + lane
    const uint8_t *ql = b + 64 * i + 32 * (t & 1), *qh = b + 128 + 32 * i;
    w0 = V::mul(V::set1(st.scale[2 * s]), V::quants(ql, 4 * (t >> 1), qh, 2 * t, 3, 32));
    w1 = V::mul(V::set1(st.scale[2 * s + 1]), V::quants(ql + 16, 4 * (t >> 1), qh + 16, 2 * t, 3, 32));
  }
};

template <>
struct Decode<kF32> {
  static constexpr int64_t unit_bytes = 128, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {
    w0 = V::f32s(row + c * unit_bytes), w1 = V::f32s(row + c * unit_bytes + 64);
  }
};

template <>
struct Decode<kF16> {
  static constexpr int64_t unit_bytes = 64, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {
    w0 = V::f16s(row + c * unit_bytes), w1 = V::f16s(row + c * unit_bytes + 32);
  }
};

template <>
struct Decode<kBF16> {
  static constexpr int64_t unit_bytes = 64, unit_chunks = 1;
  struct State {};
  template <class V>
  static void chunk(const uint8_t* row, int64_t c, State&, V& w0, V& w1) {
    w0 = V::bf16s(row + c * unit_bytes), w1 = V::bf16s(row + c * unit_bytes + 32);
  }
};

// Bytes of a row up to chunk c (for prefetching; rounded down inside a K-quant super-block).
template <int64_t Type>
constexpr int64_t bytes_before_chunk(int64_t c) {
  return c * Decode<Type>::unit_bytes / Decode<Type>::unit_chunks;
}

constexpr bool is_float_type(int64_t type) { return type == kF32 || type == kF16 || type == kBF16; }

// ---------------------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------------------

struct Problem {
  const float* x;  // [M, ldx] fp32, ldx = chunks * 32, zero beyond H
  int64_t ldx;
  int64_t M;
  const uint8_t* w;  // [N, row_bytes]
  int64_t row_bytes;
  int64_t N;
  int64_t H;
  int64_t chunks;      // ceil(H / 32)
  const float* bias;   // [N] or nullptr
  float* out;          // [M, N]
};

// Software prefetch: the kernel reads the weight rows of a group side by side, which the
// hardware prefetchers follow poorly (short streams that start every few hundred bytes), so
// lines up to kPrefetchBytes ahead of the reading position are requested explicitly.
constexpr int64_t kPrefetchBytes = 4096;

struct Prefetcher {
  const uint8_t* base;  // the first byte of this thread's rows
  int64_t end;          // bytes of this thread's rows
  int64_t ahead;        // prefetch distance in bytes
  int64_t done = 0;     // bytes requested so far
  // The reader is at byte `pos` (relative to base): request the lines up to pos + ahead.
  void advance(int64_t pos) {
    const int64_t want = std::min(end, pos + ahead);
    for (; done < want; done += 64) __builtin_prefetch(base + done, 0, 3);
  }
};

// Weights straight from the blocks. Rows past N repeat row N - 1 (their results are
// dropped). For the float types the last chunk of a row may be partial: it is decoded
// from a zero-padded copy, so nothing past the row is read.
template <int64_t Type, int NR>
struct BlockSource {
  int64_t full_chunks;       // chunks read in place
  Prefetcher* pf = nullptr;  // when set, advanced as the chunks are read
  int64_t pf_at = 0;         // the group's first byte, relative to pf->base
  const uint8_t* rows[NR];
  typename Decode<Type>::State state[NR];       // the K-quants' scales of each row's super-block
  uint8_t tail[NR][Decode<Type>::unit_bytes];  // float types: the last chunk, zero-padded

  BlockSource(const Problem& p, int64_t n0) {
    for (int j = 0; j < NR; ++j) rows[j] = p.w + std::min(n0 + j, p.N - 1) * p.row_bytes;
    full_chunks = p.chunks;
    if constexpr (is_float_type(Type)) {
      const int64_t tail_weights = p.H % kChunk;
      if (tail_weights != 0) {
        full_chunks = p.chunks - 1;
        const int64_t elem = Decode<Type>::unit_bytes / kChunk;
        for (int j = 0; j < NR; ++j) {
          std::memset(tail[j], 0, sizeof(tail[j]));
          std::memcpy(tail[j], rows[j] + full_chunks * Decode<Type>::unit_bytes, tail_weights * elem);
        }
      }
    }
  }
  template <class V>
  void chunk(int j, int64_t c, V& w0, V& w1) {
    if constexpr (is_float_type(Type)) {
      if (c == full_chunks) return Decode<Type>::template chunk<V>(tail[j], 0, state[j], w0, w1);
    }
    Decode<Type>::template chunk<V>(rows[j], c, state[j], w0, w1);
  }
  void on_chunk(int64_t c) {
    if (pf != nullptr) pf->advance(pf_at + NR * bytes_before_chunk<Type>(c));
  }
};

// Weights already decoded into an fp32 scratch [NR, ldx].
template <int NR>
struct ScratchSource {
  const float* s;
  int64_t ld;
  template <class V>
  void chunk(int j, int64_t c, V& w0, V& w1) {
    w0 = V::load(s + j * ld + c * kChunk), w1 = V::load(s + j * ld + c * kChunk + 16);
  }
  void on_chunk(int64_t) const {}
};

// out[m0 .. m0 + MR, n0 .. n0 + NR) for the rows and weight rows that exist.
template <class V, int NR, int MR, class Src>
inline void tile(const Problem& p, Src& src, int64_t n0, int64_t m0) {
  V acc[NR][MR];
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < MR; ++i) acc[j][i] = V::zero();
  const float* x = p.x + m0 * p.ldx;
  for (int64_t c = 0; c < p.chunks; ++c) {
    src.on_chunk(c);
    V w[2][NR];
    for (int j = 0; j < NR; ++j) src.template chunk<V>(j, c, w[0][j], w[1][j]);
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < MR; ++i) {
        const V xv = V::load(x + i * p.ldx + c * kChunk + 16 * h);
        for (int j = 0; j < NR; ++j) acc[j][i] = V::fma(xv, w[h][j], acc[j][i]);
      }
    }
  }
  const int64_t nr = std::min<int64_t>(NR, p.N - n0);
  for (int i = 0; i < MR; ++i) {
    float* o = p.out + (m0 + i) * p.N + n0;
    for (int j = 0; j < NR; ++j) {
      if (j < nr) {
        const float s = V::reduce(acc[j][i]);
        o[j] = p.bias ? s + p.bias[n0 + j] : s;
      }
    }
  }
}

// The last rows of M: one tile of R = rest rows (R < MR, so rest in 1..R).
template <class V, int NR, int R, class Src>
inline void tail_tile(const Problem& p, Src& src, int64_t n0, int64_t m0, int64_t rest) {
  if constexpr (R >= 1) {
    if (rest == R) return tile<V, NR, R>(p, src, n0, m0);
    tail_tile<V, NR, R - 1>(p, src, n0, m0, rest);
  }
}

// Tiles of MR rows over all M rows, then one tile of the M % MR rows left.
template <class V, int NR, int MR, class Src>
inline void row_tiles(const Problem& p, Src&& src, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + MR <= p.M; m0 += MR) tile<V, NR, MR>(p, src, n0, m0);
  tail_tile<V, NR, MR - 1>(p, src, n0, m0, p.M - m0);
}

// Weight rows [n0, n1) in groups of NR (n0 a multiple of NR). Rows <= MR: each group is
// decoded chunk by chunk in registers, once for all rows (kScratch false); otherwise it is
// decoded once into scratch (NR * ldx floats) and tiles of MR rows run over it (the next
// group is prefetched while it is decoded, so the next decode does not wait for memory).
template <class V, int64_t Type, int NR, int MR, bool kScratch>
inline void run_groups(const Problem& p, int64_t n0, int64_t n1, float* scratch) {
  const int64_t group_bytes = NR * p.row_bytes;
  Prefetcher pf{p.w + n0 * p.row_bytes, (n1 - n0) * p.row_bytes,
                kScratch ? std::max(kPrefetchBytes, group_bytes) : kPrefetchBytes};
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t at = (n - n0) * p.row_bytes;
    BlockSource<Type, NR> blocks(p, n);
    if constexpr (!kScratch) {
      blocks.pf = &pf, blocks.pf_at = at;
      row_tiles<V, NR, MR>(p, blocks, n);
    } else {
      for (int64_t c = 0; c < p.chunks; ++c) {
        pf.advance(at + NR * bytes_before_chunk<Type>(c));
        for (int j = 0; j < NR; ++j) {
          V w0, w1;
          blocks.template chunk<V>(j, c, w0, w1);
          V::store(scratch + j * p.ldx + c * kChunk, w0);
          V::store(scratch + j * p.ldx + c * kChunk + 16, w1);
        }
      }
      row_tiles<V, NR, MR>(p, ScratchSource<NR>{scratch, p.ldx}, n);
    }
  }
}

// Tile shapes per ISA path, sized to the vector registers (AVX-512: 32 x 512 bit; AVX2: 16 x
// 256 bit, two per vector; measured with bench/bench_linear.py): M <= kDirectM rows run
// straight from the blocks in tiles of kDirectRows weight rows x M activation rows; more
// rows through the scratch in tiles of kScratchRows x kScratchM. Both row counts divide
// kRowUnit, the unit in which threads split the weight rows.
constexpr int64_t kRowUnit = 4;
struct PathAvx512 {
  static constexpr int kDirectRows = 2, kDirectM = 8, kScratchRows = 4, kScratchM = 4;
};
struct PathAvx2 {
  static constexpr int kDirectRows = 1, kDirectM = 4, kScratchRows = 2, kScratchM = 2;
};
using PathGeneric = PathAvx512;

// Weight rows [n0, n1) (multiples of kRowUnit, or n1 = N) for GGML type `type`.
// scratch: Path::kScratchRows * ldx floats when M > Path::kDirectM.
template <class V, class Path>
inline void run_path(const Problem& p, int64_t type, int64_t n0, int64_t n1, float* scratch) {
  static_assert(kRowUnit % Path::kDirectRows == 0 && kRowUnit % Path::kScratchRows == 0);
  constexpr int DR = Path::kDirectRows, DM = Path::kDirectM, SR = Path::kScratchRows, SM = Path::kScratchM;
  const bool direct = p.M <= DM;
#define SPECDEC_GGUF_CASE(T)                                                   \
  case T:                                                                      \
    return direct ? run_groups<V, T, DR, DM, false>(p, n0, n1, scratch)        \
                  : run_groups<V, T, SR, SM, true>(p, n0, n1, scratch);
  switch (type) {
    SPECDEC_GGUF_CASE(kQ4_0)
    SPECDEC_GGUF_CASE(kQ4_1)
    SPECDEC_GGUF_CASE(kQ5_0)
    SPECDEC_GGUF_CASE(kQ5_1)
    SPECDEC_GGUF_CASE(kQ8_0)
    SPECDEC_GGUF_CASE(kQ4_K)
    SPECDEC_GGUF_CASE(kQ5_K)
    SPECDEC_GGUF_CASE(kQ6_K)
    SPECDEC_GGUF_CASE(kF32)
    SPECDEC_GGUF_CASE(kF16)
    SPECDEC_GGUF_CASE(kBF16)
    default: TORCH_CHECK(false, "quantized_linear: unsupported block type ", type);
  }
#undef SPECDEC_GGUF_CASE
}

// One entry point per ISA path (flatten: every helper is inlined into code compiled for it).
using RunFn = void (*)(const Problem&, int64_t, int64_t, int64_t, float*);

#if defined(SPECDEC_GGUF_X86)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
SPECDEC_GGUF_AVX512 __attribute__((flatten, noinline)) inline void run_avx512(const Problem& p, int64_t type,
                                                                             int64_t n0, int64_t n1, float* scratch) {
  run_path<VecAvx512, PathAvx512>(p, type, n0, n1, scratch);
}
#pragma GCC diagnostic pop

__attribute__((flatten, noinline)) inline void run_avx2(const Problem& p, int64_t type, int64_t n0, int64_t n1,
                                                        float* scratch) {
  run_path<VecAvx2, PathAvx2>(p, type, n0, n1, scratch);
}
#endif

inline void run_generic(const Problem& p, int64_t type, int64_t n0, int64_t n1, float* scratch) {
  run_path<VecGeneric, PathGeneric>(p, type, n0, n1, scratch);
}

}  // namespace gguf
}  // namespace specdec
