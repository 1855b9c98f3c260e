// GGUF weight blocks (llama.cpp's formats) and the CPU kernel of specdec::quantized_linear.
//
// A weight [N, H] is stored as its GGUF bytes, uint8 [N, H / block_size * block_bytes]:
// each row is a run of blocks, decoded exactly as gguf.dequantize (gguf-py's quants.py)
// does, in fp32:
//   Q4_0 (18 bytes / 32 weights): fp16 d, 16 bytes qs; weight j = d * ((qs[j % 16] >> 4 * (j / 16) & 15) - 8)
//   Q4_1 (20 bytes / 32 weights): fp16 d, fp16 m, 16 bytes qs; weight j = d * nibble_j + m
//   Q8_0 (34 bytes / 32 weights): fp16 d, 32 int8 qs; weight j = qs[j] * d
//   F32 / F16 / BF16 (4 / 2 / 2 bytes per weight): the value, widened to fp32.
// (d * nibble and qs * d are exact in fp32: 11 + 8 significant bits at most. So Q4_1's
// fma(d, q, m) rounds once, like gguf's (d * q) + m.)
//
// The kernel computes out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) in fp32 in one fixed
// order that depends on H only (never on M, on the other rows, on the ISA path or on the
// threads), so a row's result is bit-identical whatever batch it is computed in:
//   acc[l], l < 16 lanes, starts at 0; for each chunk c of 32 weights (one block; 32
//   elements of the float types, the last chunk zero-padded), in order:
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
// quantised activations (llama.cpp's way, not done here) would be cheaper per row.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace specdec {
namespace gguf {

// GGML type ids (gguf.GGMLQuantizationType) of the formats quantized_linear reads.
enum : int64_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30 };

struct BlockFormat {
  const char* name;
  int64_t block_size;   // weights per block
  int64_t block_bytes;  // bytes per block
};

// The format of GGML type `type`, or nullptr when quantized_linear does not read it.
inline const BlockFormat* block_format(int64_t type) {
  static const BlockFormat f32{"F32", 1, 4}, f16{"F16", 1, 2}, q4_0{"Q4_0", 32, 18}, q4_1{"Q4_1", 32, 20},
      q8_0{"Q8_0", 32, 34}, bf16{"BF16", 1, 2};
  switch (type) {
    case kF32: return &f32;
    case kF16: return &f16;
    case kQ4_0: return &q4_0;
    case kQ4_1: return &q4_1;
    case kQ8_0: return &q8_0;
    case kBF16: return &bf16;
    default: return nullptr;
  }
}

constexpr const char* kSupportedTypes = "F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30";

constexpr int64_t kChunk = 32;  // weights decoded at a time: one block, or 32 float weights

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
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
// Decoding one half (16 weights) of a chunk of 32, exactly as gguf.dequantize.
// ---------------------------------------------------------------------------------------

template <int64_t Type>
struct Decode;

template <>
struct Decode<kQ4_0> {
  static constexpr int64_t chunk_bytes = 18;
  template <class V>
  static V half(const uint8_t* b, int h) {  // gguf: d * float(int8(nibble) - 8)
    return V::mul(V::broadcast_f16(b), V::nibbles(b + 2, h, /*centered=*/true));
  }
};

template <>
struct Decode<kQ4_1> {
  static constexpr int64_t chunk_bytes = 20;
  template <class V>
  static V half(const uint8_t* b, int h) {  // gguf: (d * nibble) + m, d * nibble exact
    return V::fma(V::broadcast_f16(b), V::nibbles(b + 4, h, /*centered=*/false), V::broadcast_f16(b + 2));
  }
};

template <>
struct Decode<kQ8_0> {
  static constexpr int64_t chunk_bytes = 34;
  template <class V>
  static V half(const uint8_t* b, int h) {  // gguf: float(int8) * d
    return V::mul(V::int8s(b + 2 + 16 * h), V::broadcast_f16(b));
  }
};

template <>
struct Decode<kF32> {
  static constexpr int64_t chunk_bytes = 128;
  template <class V>
  static V half(const uint8_t* b, int h) { return V::f32s(b + 64 * h); }
};

template <>
struct Decode<kF16> {
  static constexpr int64_t chunk_bytes = 64;
  template <class V>
  static V half(const uint8_t* b, int h) { return V::f16s(b + 32 * h); }
};

template <>
struct Decode<kBF16> {
  static constexpr int64_t chunk_bytes = 64;
  template <class V>
  static V half(const uint8_t* b, int h) { return V::bf16s(b + 32 * h); }
};

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
  uint8_t tail[NR][Decode<Type>::chunk_bytes];

  BlockSource(const Problem& p, int64_t n0) {
    for (int j = 0; j < NR; ++j) rows[j] = p.w + std::min(n0 + j, p.N - 1) * p.row_bytes;
    full_chunks = p.chunks;
    if constexpr (is_float_type(Type)) {
      const int64_t tail_weights = p.H % kChunk;
      if (tail_weights != 0) {
        full_chunks = p.chunks - 1;
        const int64_t elem = Decode<Type>::chunk_bytes / kChunk;
        for (int j = 0; j < NR; ++j) {
          std::memset(tail[j], 0, sizeof(tail[j]));
          std::memcpy(tail[j], rows[j] + full_chunks * Decode<Type>::chunk_bytes, tail_weights * elem);
        }
      }
    }
  }
  template <class V>
  V half(int j, int64_t c, int h) const {
    if constexpr (is_float_type(Type)) {
      if (c == full_chunks) return Decode<Type>::template half<V>(tail[j], h);
    }
    return Decode<Type>::template half<V>(rows[j] + c * Decode<Type>::chunk_bytes, h);
  }
  void on_chunk(int64_t c) {
    if (pf != nullptr) pf->advance(pf_at + c * NR * Decode<Type>::chunk_bytes);
  }
};

// Weights already decoded into an fp32 scratch [NR, ldx].
template <int NR>
struct ScratchSource {
  const float* s;
  int64_t ld;
  template <class V>
  V half(int j, int64_t c, int h) const { return V::load(s + j * ld + c * kChunk + 16 * h); }
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
    for (int h = 0; h < 2; ++h) {
      V w[NR];
      for (int j = 0; j < NR; ++j) w[j] = src.template half<V>(j, c, h);
      for (int i = 0; i < MR; ++i) {
        const V xv = V::load(x + i * p.ldx + c * kChunk + 16 * h);
        for (int j = 0; j < NR; ++j) acc[j][i] = V::fma(xv, w[j], acc[j][i]);
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
  const int64_t step = NR * Decode<Type>::chunk_bytes;  // bytes read per chunk of a group
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
        pf.advance(at + c * step);
        for (int j = 0; j < NR; ++j)
          for (int h = 0; h < 2; ++h)
            V::store(scratch + j * p.ldx + c * kChunk + 16 * h, blocks.template half<V>(j, c, h));
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
    SPECDEC_GGUF_CASE(kQ8_0)
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
