// The CPU kernel of specdec::int8_activation_linear: GGUF-block weights (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, Q4_K, Q5_K, Q6_K) repacked 16 rows at a time, times activations quantised to int8 with
// one scale per GGUF block (llama.cpp's way: integer dot products instead of decoding every
// weight to fp32).
//
// Why: quantized_linear (gguf_blocks.h) decodes each weight to fp32 and multiplies with fused
// multiply-adds: decoding limits one activation row, and every further row costs 2 FMAs per
// 32 weights. Here a 32-weight block times a 32-int8 activation block is 8 integer dot-product
// instructions (AVX-512 VNNI vpdpbusd: 64 byte products each) for 16 weight rows, plus one
// scale FMA per row: the weights are never decoded to fp32, and a further row costs about a
// third of what it costs there.
//
// Packed weight, uint8 [G, nr, record_bytes]: G = ceil(N / 16) groups of 16 weight rows (rows past
// N are zero), nr = H / B records per row (B = 32; 256 for the K-quants); record (g, r) holds GGUF
// block r of rows 16g..16g+15 (gguf_blocks.pack_int8_activation; each field the 16 rows side by
// side, row l's entry at l):
//   fp16 d[16]; Q4_1 / Q5_1: fp16 m[16]; Q4_K / Q5_K: fp16 dmin[16], uint8 sc[8][16], uint8 mn[8][16]
//   (sub-block s's 6-bit scale and min of row l at [s][l]); Q6_K: int8 sc[16][16] (the scale of
//   weights 16s..16s+15 of row l at [s][l]); then the weights of each sub-block of 32 (1, or 8
//   for the K-quants), one 4-byte word per row in each 64 bytes:
//   Q8_0: 8 steps of 64 bytes; step k, byte 4l + t = q[4k + t] of row l plus 128 (as uint8).
//   Others: 4 chunks of 64 bytes; chunk k, byte 4l + t: low nibble = the low 4 bits of weight
//       4k + t, high nibble = those of weight 16 + 4k + t; then
//     Q5_*: 64 bytes, byte 4l + t bit k = bit 4 of weight 4k + t (k < 8);
//     Q6_K: 2 x 64 bytes (weights 0..15, 16..31), byte 4l + t bits 2k, 2k + 1 = bits 4, 5 of
//       weight 4k + t of that half (k < 4).
// So the j-th unpacked word of a row (j < 8: weights 4j .. 4j + 3, stored unsigned: nibble,
// 5-bit or 6-bit integer, or q + 128) meets activation bytes 4j .. 4j + 3 of the block, and 64
// bytes give one int32 lane per row.
//
// Activations (each row m, each scale block a of A values: A = 256 for the K-quants, one scale
// per GGUF block as llama.cpp's Q8_K; A = 32 for the other formats, as its Q8_0): amax = max |x|
// over the scale block; d = amax / 127 (fp32); q = round_half_even(x * (1 / d)) clamped to
// [-127, 127]; per block b of 32, sq = sum q (and the halves' sums sq0, sq1 of q[0..16),
// q[16..32)) and s = d * float(sq) (fp32). A scale block with amax < 2^-96 counts as zero (d = s
// = 0, q = 0: 1 / d would overflow for subnormal amax). A scale block holding NaN or +-inf gets
// q = 0, d = s = NaN (its row's outputs are NaN).
//
// Result, per output (m, n), in one fixed order (so a row's result is bit-identical whatever M,
// the other rows, the ISA path or the threads are): acc = 0; for each GGUF block r of the row
// (one record), with its activation scale d_x:
//   I = the exact int32 dot product of the block's weight integers c and activations q:
//       Q4_0: c = nibble - 8; Q5_0: c = q5 - 16; Q8_0: c = q; Q4_1, Q5_1: c = the unsigned
//       integer; Q4_K / Q5_K: I = sum over sub-blocks s of sc_s * (sum_j u_j q_j), u the unsigned
//       integers and sc_s the 6-bit scale; Q6_K: I = sum over halves h of 16 of sc_h * (sum_j
//       (q6_j - 32) q_j), sc_h the int8 scale
//   acc = fma(float(I), d_w * d_x, acc)        (d_w * d_x rounded to fp32; d_w = d)
//   Q4_1 / Q5_1: acc = fma(m, s_x, acc); Q4_K / Q5_K: acc = fma(-float(Mn), dmin * d_x, acc) with
//       Mn = sum_s mn_s * sq_s (exact: |Mn| < 2^21)
//   out = acc (+ bias[n], one more rounding).
// The integer sums are exact in any order (|I| < 2^27), so the vector paths may split them; a
// K-quant block costs two fp32 roundings instead of sixteen (one per sub-block, the earlier
// rule): the per-sub-block fp32 scaling was a third of the AVX2 product's time.
//
// Blocking. AVX-512 VNNI: the M rows go in register tiles of up to kTileVnni (8) rows, whose
// integer sums stay in registers over a record; a K-quant group (and any group up to 8 rows) is
// gone through one tile at a time, the tile's accumulators in registers over the whole row of
// records and each sub-block unpacked into registers once per tile (the later tiles read the
// records from the caches); beyond 8 rows a 32-weight record is unpacked once for all tiles,
// the rows' accumulators in a small scratch (group_tiles_vnni). AVX2: up to kTileAvx2 (4) rows
// the same, both 8-row halves of a group in one pass; beyond, a record's sub-blocks are
// unpacked into L1 once for all rows, applied to the rows in tiles of tile_rows_avx2 rows (both
// halves at once) whose integer sums stay in registers over the record, and the record is
// scaled into the rows' accumulators in a small scratch. AMX: the tiles' products go through
// an integer scratch. Threads take
// contiguous runs of groups (linear.cpp: about one per thread below 16 rows, several from 16),
// each one stream, prefetched kPrefetchAhead bytes ahead. The vector paths
// quantise the activations with AVX2 (quantize_activations_avx2), the portable path with the
// scalar reference; the bits are the same.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"

namespace specdec {
namespace i8act {

// GGML type ids of the formats beyond quantized_linear's (gguf.GGMLQuantizationType).
enum : int64_t { kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr const char* kTypesText = "Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14";

constexpr int64_t kGroupRows = 16;  // weight rows per group: one output lane each
constexpr int64_t kBlock = 32;      // weights (and activations) per block
constexpr float kTinyBlock = 0x1p-96f;  // activation blocks with max |x| below this count as zero

constexpr bool is_k_quant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }
// Blocks of 32 per record, GGUF block and activation scale: 8 for the K-quants, 1 otherwise.
constexpr int64_t record_subs(int64_t t) { return is_k_quant(t) ? 8 : 1; }
constexpr bool is_five_bit(int64_t t) { return t == kQ5_0 || t == kQ5_1 || t == kQ5_K; }
constexpr bool has_min(int64_t t) { return t == gguf::kQ4_1 || t == kQ5_1; }  // + fma(m, s_x)
constexpr bool has_k_min(int64_t t) { return t == kQ4_K || t == kQ5_K; }      // - dmin * mn * s_x
// The unsigned offset subtracted from the stored integers (times sum q), where there is one.
constexpr int32_t offset(int64_t t) {
  return t == gguf::kQ4_0 ? 8 : t == kQ5_0 ? 16 : t == gguf::kQ8_0 ? 128 : 0;
}
// Weights per record (the GGUF block size).
inline int64_t record_weights(int64_t type) { return record_subs(type) * kBlock; }
// Bytes of one record (16 rows of one GGUF block); 0 for types the op does not read.
inline int64_t record_bytes(int64_t type) {
  switch (type) {
    case gguf::kQ4_0: return 32 + 256;
    case gguf::kQ4_1: return 64 + 256;
    case kQ5_0: return 32 + 256 + 64;
    case kQ5_1: return 64 + 256 + 64;
    case gguf::kQ8_0: return 32 + 512;
    case kQ4_K: return 64 + 256 + 8 * 256;
    case kQ5_K: return 64 + 256 + 8 * (256 + 64);
    case kQ6_K: return 32 + 256 + 8 * (256 + 128);
    default: return 0;
  }
}
// Where sub-block 0's weights start in a record, and the weight bytes of one sub-block.
constexpr int64_t weights_at(int64_t t) {
  return t == kQ4_K || t == kQ5_K ? 320 : t == kQ6_K ? 288 : has_min(t) ? 64 : 32;
}
constexpr int64_t sub_bytes(int64_t t) {
  return t == gguf::kQ8_0 ? 512 : is_five_bit(t) ? 256 + 64 : t == kQ6_K ? 256 + 128 : 256;
}

// Rows multiplied per pass over the weight (int8_activation_linear_cpu): a chunk's int8
// activations (rows x H bytes: 192 KB at H = 1536, 573 KB at H = 8960) stay in L2 while every
// group of the weight streams past. Unchunked, the activations of all rows were read again
// from L3 for each group of 16 weight rows: a 256-token prefill of the 1.5B ran at 0.73x the
// rate of a 64-token one. (Measured there: 128-row chunks where H <= 2048 beat 64 by ~5%, 256
// lost 20%.)
constexpr int64_t row_chunk(int64_t H) { return H <= 2048 ? 128 : 64; }

struct Problem {
  const int8_t* q;     // [M, nb * 32] quantised activations
  const float* d;      // [M, nb / record_subs] their scales, one per record (GGUF block)
  const float* s;      // [M, nb] d * sum(q) per block of 32
  const int32_t* sq;   // [M, nb] sum(q)
  const int32_t* sqh;  // [M, nb, 2] the sums of q's halves (q[0..16), q[16..32))
  int64_t M, nb;       // nb = H / 32
  const uint8_t* w;    // [G, nb * 32 / record_weights, bb]
  int64_t bb;          // record_bytes(type)
  int64_t N;
  const float* bias;   // [N] or nullptr
  float* out;          // [M, N]
  const int8_t* qa = nullptr;  // the AMX path's copy of q, block-major: [nb, amx_padded_rows(M), 32], rows past M zero
  // The vector paths' broadcast operands (int16_pairs): [M * nb / 2] the int16 pairs (sq[2i], sq[2i + 1])
  // (Q4_K / Q5_K: blocks 2k, 2k + 1 of a record) and [M * nb] the pairs (sqh[2mb], sqh[2mb + 1])
  // (Q6_K); every vector path reads them.
  const int32_t* sqp = nullptr;
  const int32_t* sqhp = nullptr;
};

// The record holding block b of group g.
template <int64_t Type>
inline const uint8_t* record_at(const Problem& p, int64_t g, int64_t b) {
  constexpr int64_t per = record_subs(Type);
  return p.w + (g * (p.nb / per) + b / per) * p.bb;
}
// Row m's activation scale for record r.
template <int64_t Type>
inline float scale_at(const Problem& p, int64_t m, int64_t r) { return p.d[m * (p.nb / record_subs(Type)) + r]; }

// Scale block a (blocks a * per .. a * per + per - 1 of 32) holds NaN or +-inf: q = 0, d = s = NaN.
inline void write_non_finite(int64_t a, int64_t per, int8_t* q, float* d, float* s, int32_t* sq, int32_t* sqh) {
  std::memset(q + a * per * kBlock, 0, per * kBlock);
  d[a] = std::numeric_limits<float>::quiet_NaN();
  for (int64_t mb = a * per; mb < (a + 1) * per; ++mb) {
    s[mb] = std::numeric_limits<float>::quiet_NaN();
    sq[mb] = sqh[2 * mb] = sqh[2 * mb + 1] = 0;
  }
}
// Block mb's sums from its halves' sums h0, h1 (scale dm).
inline void write_block_sums(int64_t mb, float dm, int32_t h0, int32_t h1, float* s, int32_t* sq, int32_t* sqh) {
  sq[mb] = h0 + h1;
  sqh[2 * mb] = h0, sqh[2 * mb + 1] = h1;
  s[mb] = dm * static_cast<float>(sq[mb]);
}

// Quantises x [M, H] (fp32, contiguous, H = nb * 32) as the header says, per scale blocks of
// `per` blocks of 32 (record_subs). Plain scalar code: the portable path's, and the reference
// of quantize_activations_avx2 (the vector paths'), which gives the same bits.
inline void quantize_activations(const float* x, int64_t M, int64_t nb, int64_t per, int8_t* q, float* d, float* s,
                                 int32_t* sq, int32_t* sqh) {
  const int64_t span = per * kBlock;
  for (int64_t a = 0; a < M * nb / per; ++a) {  // scale block a = row a / (nb / per), its blocks a * per ..
    const float* xa = x + a * span;
    float amax = 0.f;
    bool finite = true;
    for (int64_t j = 0; j < span; ++j) {
      finite = finite && std::isfinite(xa[j]);
      amax = std::max(amax, std::fabs(xa[j]));
    }
    if (!finite) {
      write_non_finite(a, per, q, d, s, sq, sqh);
      continue;
    }
    const float dm = amax < kTinyBlock ? 0.f : amax / 127.f;
    const float id = dm != 0.f ? 1.f / dm : 0.f;
    d[a] = dm;
    for (int64_t mb = a * per; mb < (a + 1) * per; ++mb) {
      const float* xb = x + mb * kBlock;
      int8_t* qb = q + mb * kBlock;
      int32_t half[2] = {0, 0};
      for (int64_t j = 0; j < kBlock; ++j) {
        const float v = std::nearbyint(xb[j] * id);  // the default rounding mode: half to even
        const int32_t qi = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
        qb[j] = static_cast<int8_t>(qi);
        half[j / 16] += qi;
      }
      write_block_sums(mb, dm, half[0], half[1], s, sq, sqh);
    }
  }
}

// Writes lanes [0, width) of row m's accumulators for outputs n0 .. n0 + width - 1 (those < N).
inline void store_lanes(const Problem& p, int64_t m, int64_t n0, const float* lanes, int64_t width = kGroupRows) {
  const int64_t nr = std::min<int64_t>(width, p.N - n0);
  float* o = p.out + m * p.N + n0;
  for (int64_t l = 0; l < nr; ++l) o[l] = p.bias ? lanes[l] + p.bias[n0 + l] : lanes[l];
}

inline float f16_at(const uint8_t* p) { return static_cast<float>(c10::Half(gguf::load_u16(p), c10::Half::from_bits())); }

// The int16 pair (lo, hi) in one int32 (lo in the low half; both fit int16), for vpmaddwd.
inline int32_t int16_pair(int32_t lo, int32_t hi) {
  return (lo & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(hi) << 16);
}

// The int16 pairs of n blocks' sums (Problem::sqp and sqhp, read by every vector path):
// built once per call, not in scalar code once per group of 16 weight rows, which cost 2-4% of
// a 16-64-row K-quant product on a Zen 3 core's AVX2 path and about 5% of an 8-64-row Q4_K
// product on a Zen 4 core's VNNI path. Only the types that read them need them (reads_sqp: sqp,
// n / 2, for Q4_K / Q5_K; reads_sqhp: sqhp, n, for Q6_K); the caller passes null for an array its
// type does not read, and a null array is left unwritten. (|sq| <= 32 * 127 and |sqh| <= 16 * 127
// fit int16.)
constexpr bool reads_sqp(int64_t t) { return has_k_min(t); }
constexpr bool reads_sqhp(int64_t t) { return t == kQ6_K; }
inline void int16_pairs(int64_t n, const int32_t* sq, const int32_t* sqh, int32_t* sqp, int32_t* sqhp) {
  if (sqp)
    for (int64_t i = 0; i < n / 2; ++i) sqp[i] = int16_pair(sq[2 * i], sq[2 * i + 1]);
  if (sqhp)
    for (int64_t i = 0; i < n; ++i) sqhp[i] = int16_pair(sqh[2 * i], sqh[2 * i + 1]);
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The vector paths read a group's records front to back and the groups of a thread one after
// the other: one stream, which they prefetch kPrefetchAhead bytes ahead in software (the
// hardware prefetchers alone left a one-row product well below the memory bandwidth).
constexpr int64_t kPrefetchAhead = 2048;

// The prefetcher of a thread's groups [g0, g1): their records are one contiguous stream.
template <int64_t Type>
inline gguf::Prefetcher groups_prefetcher(const Problem& p, int64_t g0, int64_t g1) {
  const uint8_t* begin = record_at<Type>(p, g0, 0);
  return {begin, record_at<Type>(p, g1, 0) - begin, kPrefetchAhead};
}

// The bytes of block b's share of its record (a K-quant record: 1/8 per sub-block), relative
// to group g0's first byte: the stream position of the reader at block b of group g.
template <int64_t Type>
inline int64_t stream_pos(const Problem& p, int64_t g, int64_t g0, int64_t b) {
  constexpr int64_t per = is_k_quant(Type) ? 8 : 1;
  return ((g - g0) * p.nb + b) * p.bb / per;
}

// ---------------------------------------------------------------------------------------
// Portable path (the reference of the vector paths' arithmetic).
// ---------------------------------------------------------------------------------------

// The stored unsigned integer of weight 4j + t of row l in a sub-block's weight bytes wp.
template <int64_t Type>
inline int32_t stored_weight(const uint8_t* wp, int64_t l, int64_t j, int64_t t) {
  if constexpr (Type == gguf::kQ8_0) return wp[64 * j + 4 * l + t];
  const uint8_t byte = wp[64 * (j % 4) + 4 * l + t];
  int32_t u = j < 4 ? (byte & 15) : (byte >> 4);
  if constexpr (is_five_bit(Type)) u |= ((wp[256 + 4 * l + t] >> j) & 1) << 4;
  if constexpr (Type == kQ6_K) u |= ((wp[256 + 64 * (j / 4) + 4 * l + t] >> (2 * (j % 4))) & 3) << 4;
  return u;
}

// Row m's exact integer sums of sub-block sub of a record with weight row l: I's term (the
// header's "Result") and, for Q4_K / Q5_K, Mn's.
template <int64_t Type>
inline void sub_sums_generic(const Problem& p, const uint8_t* rec, int64_t sub, int64_t mb, int64_t l, int32_t& isum,
                             int32_t& mins) {
  const uint8_t* wp = rec + weights_at(Type) + sub * sub_bytes(Type);
  const int8_t* xq = p.q + mb * kBlock;
  int32_t half[2] = {0, 0};  // the dot products of words 0..3 and 4..7
  for (int64_t j = 0; j < 8; ++j)
    for (int64_t t = 0; t < 4; ++t) half[j / 4] += stored_weight<Type>(wp, l, j, t) * xq[4 * j + t];
  if constexpr (Type == kQ6_K) {
    isum += static_cast<int8_t>(rec[32 + 16 * (2 * sub) + l]) * (half[0] - 32 * p.sqh[2 * mb]) +
            static_cast<int8_t>(rec[32 + 16 * (2 * sub + 1) + l]) * (half[1] - 32 * p.sqh[2 * mb + 1]);
  } else if constexpr (has_k_min(Type)) {
    isum += rec[64 + 16 * sub + l] * (half[0] + half[1]);
    mins += rec[192 + 16 * sub + l] * p.sq[mb];
  } else {
    isum += half[0] + half[1] - offset(Type) * p.sq[mb];
  }
}

template <int64_t Type>
inline void group_generic(const Problem& p, int64_t g) {
  constexpr int64_t P = record_subs(Type);
  for (int64_t m = 0; m < p.M; ++m) {
    float acc[kGroupRows] = {};
    for (int64_t r = 0; r < p.nb / P; ++r) {
      const uint8_t* rec = record_at<Type>(p, g, r * P);
      const float dx = scale_at<Type>(p, m, r);
      for (int64_t l = 0; l < kGroupRows; ++l) {
        int32_t isum = 0, mins = 0;
        for (int64_t sub = 0; sub < P; ++sub) sub_sums_generic<Type>(p, rec, sub, m * p.nb + r * P + sub, l, isum, mins);
        acc[l] = std::fma(static_cast<float>(isum), f16_at(rec + 2 * l) * dx, acc[l]);
        if constexpr (has_min(Type)) acc[l] = std::fma(f16_at(rec + 32 + 2 * l), p.s[m * p.nb + r], acc[l]);
        if constexpr (has_k_min(Type)) acc[l] = std::fma(-static_cast<float>(mins), f16_at(rec + 32 + 2 * l) * dx, acc[l]);
      }
    }
    store_lanes(p, m, g * kGroupRows, acc);
  }
}

// Runs GROUP<Type>(args...) for the runtime type.
#define SPECDEC_I8_TYPE_SWITCH(type, GROUP, ...)                     \
  switch (type) {                                                    \
    case gguf::kQ4_0: GROUP<gguf::kQ4_0>(__VA_ARGS__); break;        \
    case gguf::kQ4_1: GROUP<gguf::kQ4_1>(__VA_ARGS__); break;        \
    case kQ5_0: GROUP<kQ5_0>(__VA_ARGS__); break;                    \
    case kQ5_1: GROUP<kQ5_1>(__VA_ARGS__); break;                    \
    case gguf::kQ8_0: GROUP<gguf::kQ8_0>(__VA_ARGS__); break;        \
    case kQ4_K: GROUP<kQ4_K>(__VA_ARGS__); break;                    \
    case kQ5_K: GROUP<kQ5_K>(__VA_ARGS__); break;                    \
    default: GROUP<kQ6_K>(__VA_ARGS__); break;                       \
  }

// scratch: the vector paths' (unused here).
inline void run_generic(const Problem& p, int64_t type, int64_t g0, int64_t g1, float*) {
  for (int64_t g = g0; g < g1; ++g) SPECDEC_I8_TYPE_SWITCH(type, group_generic, p, g)
}

#if defined(SPECDEC_GGUF_X86)
// ---------------------------------------------------------------------------------------
// AVX-512 VNNI: one zmm holds the 16 rows' int32 lanes; vpdpbusd multiplies the 64 weight
// bytes (unsigned) with the row's 4 activation bytes broadcast (signed) and adds 4 products
// per lane.
// ---------------------------------------------------------------------------------------
#ifndef SPECDEC_I8_VNNI  // (tests/int8_activation_linear_emulated.cpp defines it away: SIMDe's intrinsics)
#define SPECDEC_I8_VNNI __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512vnni,f16c,fma,avx2")))
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"

struct UnpackedVnni {  // one sub-block of 32 weights of the 16 rows
  __m512i w[8];       // the 8 words of each row (stored unsigned integers)
  __m512i sc0, sc1;   // Q4_K / Q5_K: sc0 the sub-block's scale; Q6_K: the int8 scales of the two halves
  __m512i scn;        // Q6_K: the int16 pairs (-32 sc0, -32 sc1) (the offset's term, add_term_vnni)
};
struct RecordVnni {   // one record's per-row fp32 values and the K-quants' mins
  __m512 dw, mw;      // d; Q4_1 / Q5_1: m; Q4_K / Q5_K: dmin
  __m512i mn[4];      // Q4_K / Q5_K: int16 pairs (mn of sub-blocks 2k, 2k + 1) per lane
};

// Zeroes n floats (n a multiple of 16) with vector stores. (A fill compiles to memset, whose
// `rep stosb` took ~6% of a 256-token prefill of the 1.5B on the AMX Xeon for these 8 KB a
// group, though a few hundred cycles of stores would do; the empty asm keeps GCC from turning
// this loop back into memset.)
SPECDEC_I8_VNNI inline void zero_floats_vnni(float* x, int64_t n) {
  const __m512 z = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    _mm512_storeu_ps(x + i, z);
    asm volatile("" ::: "memory");
  }
}

// Bit 4 (Q5) or bits 4, 5 (Q6_K) of word j, placed from the high-bit vector h: a 16-bit shift
// moves bit (4 - shift) of every byte to bit 4 without crossing a byte for |shift| <= 4.
template <int S>
SPECDEC_I8_VNNI inline __m512i shift_bits_vnni(__m512i h) {
  if constexpr (S > 0) return _mm512_slli_epi16(h, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(h, -S);
  else return h;
}

template <int64_t Type, int J>
SPECDEC_I8_VNNI inline void high_bits_vnni(const uint8_t* wp, UnpackedVnni& u) {
  if constexpr (J < 8) {
    if constexpr (is_five_bit(Type)) {
      const __m512i h = shift_bits_vnni<4 - J>(_mm512_loadu_si512(wp + 256));
      u.w[J] = _mm512_ternarylogic_epi32(h, _mm512_set1_epi8(0x10), u.w[J], 0xEA);  // (h & 16) | w
    } else {
      const __m512i h = shift_bits_vnni<4 - 2 * (J % 4)>(_mm512_loadu_si512(wp + 256 + 64 * (J / 4)));
      u.w[J] = _mm512_ternarylogic_epi32(h, _mm512_set1_epi8(0x30), u.w[J], 0xEA);  // (h & 48) | w
    }
    high_bits_vnni<Type, J + 1>(wp, u);
  }
}

// 16 fp16 / uint8 values at `at`, as fp32 lanes.
SPECDEC_I8_VNNI inline __m512 f16x16(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

SPECDEC_I8_VNNI inline __m512i u8x16_epi32(const uint8_t* at) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}
SPECDEC_I8_VNNI inline __m512i i8x16_epi32(const uint8_t* at) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

template <int64_t Type>
SPECDEC_I8_VNNI inline void unpack_vnni(const uint8_t* rec, int64_t sub, UnpackedVnni& u) {
  const uint8_t* wp = rec + weights_at(Type) + sub * sub_bytes(Type);
  if constexpr (Type == gguf::kQ8_0) {
    for (int j = 0; j < 8; ++j) u.w[j] = _mm512_loadu_si512(wp + 64 * j);
  } else {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; ++j) {
      const __m512i c = _mm512_loadu_si512(wp + 64 * j);
      u.w[j] = _mm512_and_si512(c, low4);
      u.w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
    }
    if constexpr (is_five_bit(Type) || Type == kQ6_K) high_bits_vnni<Type, 0>(wp, u);
  }
  if constexpr (has_k_min(Type)) u.sc0 = u8x16_epi32(rec + 64 + 16 * sub);
  if constexpr (Type == kQ6_K) {
    u.sc0 = i8x16_epi32(rec + 32 + 32 * sub);
    u.sc1 = i8x16_epi32(rec + 48 + 32 * sub);
    const __m512i pair = _mm512_ternarylogic_epi32(_mm512_slli_epi32(u.sc1, 16), u.sc0, _mm512_set1_epi32(0xFFFF), 0xF8);
    u.scn = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(pair, 5));
  }
}

template <int64_t Type>
SPECDEC_I8_VNNI inline RecordVnni record_vnni(const uint8_t* rec) {
  RecordVnni w;
  w.dw = f16x16(rec);
  if constexpr (has_min(Type) || has_k_min(Type)) w.mw = f16x16(rec + 32);
  if constexpr (has_k_min(Type)) {
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    for (int k = 0; k < 4; ++k) {
      w.mn[k] = _mm512_or_si512(_mm512_and_si512(u8x16_epi32(rec + 192 + 16 * (2 * k)), lo16),
                                _mm512_slli_epi32(u8x16_epi32(rec + 192 + 16 * (2 * k + 1)), 16));
    }
  }
  return w;
}

// isum plus sub-block u's term of I (the header's "Result") from its raw dot products with
// activation block mb: raw (Q6_K: raw and raw1, the halves'), the weights' stored unsigned
// integers times q. One copy for the VNNI and AMX paths, whose bits must agree.
template <int64_t Type>
SPECDEC_I8_VNNI inline __m512i add_term_vnni(const Problem& p, const UnpackedVnni& u, int64_t mb, __m512i raw,
                                             __m512i raw1, __m512i isum) {
  if constexpr (Type == kQ6_K) {
    // sc0 (raw - 32 sqh0) + sc1 (raw1 - 32 sqh1), the offsets' terms in one vpdpwssd of the pairs
    // (-32 sc0, -32 sc1) and (sqh0, sqh1): two scalar broadcasts and subtractions fewer a row and
    // sub-block, 3-5% faster at 16-64 rows on a Zen 4 core. Exact: |32 sc| <= 4096 fits int16.
    isum = _mm512_add_epi32(isum, _mm512_add_epi32(_mm512_mullo_epi32(raw, u.sc0), _mm512_mullo_epi32(raw1, u.sc1)));
    return _mm512_dpwssd_epi32(isum, u.scn, _mm512_set1_epi32(p.sqhp[mb]));
  } else if constexpr (has_k_min(Type)) {
    return _mm512_add_epi32(isum, _mm512_mullo_epi32(raw, u.sc0));
  } else if constexpr (offset(Type) != 0) {
    return _mm512_add_epi32(isum, _mm512_sub_epi32(raw, _mm512_set1_epi32(offset(Type) * p.sq[mb])));
  } else {
    return _mm512_add_epi32(isum, raw);
  }
}

// acc plus record r's contribution for activation row m from its exact integer sum isum (the
// header's fp32 order). Shared by the VNNI and AMX paths.
template <int64_t Type>
SPECDEC_I8_VNNI inline __m512 scale_record_vnni(const Problem& p, const RecordVnni& w, __m512i isum, int64_t m,
                                                int64_t r, __m512 acc) {
  const __m512 dx = _mm512_set1_ps(scale_at<Type>(p, m, r));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w.dw, dx), acc);
  if constexpr (has_min(Type)) acc = _mm512_fmadd_ps(w.mw, _mm512_set1_ps(p.s[m * p.nb + r]), acc);
  if constexpr (has_k_min(Type)) {
    const int32_t* sqp = p.sqp + (m * p.nb + r * record_subs(Type)) / 2;  // a broadcast from memory each
    __m512i mins = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) mins = _mm512_add_epi32(mins, _mm512_madd_epi16(w.mn[k], _mm512_set1_epi32(sqp[k])));
    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(w.mw, dx), acc);
  }
  return acc;
}

// Adds sub-block u's terms for rows m0 .. m0 + MR - 1 (activation blocks b of them) to isum.
template <int64_t Type, int MR>
SPECDEC_I8_VNNI inline void rows_vnni(const Problem& p, const UnpackedVnni& u, int64_t b, int64_t m0, __m512i* isum) {
  for (int i = 0; i < MR; ++i) {
    const int64_t mb = (m0 + i) * p.nb + b;
    const int8_t* xq = p.q + mb * kBlock;
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    if constexpr (Type == kQ6_K) {  // the halves' sums apart (their scales differ)
      for (int j = 0; j < 4; ++j) {
        s0 = _mm512_dpbusd_epi32(s0, u.w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, u.w[j + 4], _mm512_set1_epi32(load_i32(xq + 16 + 4 * j)));
      }
      isum[i] = add_term_vnni<Type>(p, u, mb, s0, s1, isum[i]);
    } else {
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u.w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, u.w[j + 1], _mm512_set1_epi32(load_i32(xq + 4 * j + 4)));
      }
      isum[i] = add_term_vnni<Type>(p, u, mb, _mm512_add_epi32(s0, s1), s1, isum[i]);
    }
  }
}

constexpr int kTileVnni = 8;  // rows of a register tile (8 integer sums, 8 accumulators, 8 words)

// Rows m0 .. m0 + MR - 1 (MR <= kTileVnni) of group g: their integer sums and accumulators in
// registers over the whole row of records, each sub-block unpacked into registers and applied
// to the MR rows.
template <int64_t Type, int MR>
SPECDEC_I8_VNNI inline void tile_regs_vnni(const Problem& p, int64_t g, int64_t m0, gguf::Prefetcher& pf, int64_t g0) {
  constexpr int64_t P = record_subs(Type);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  UnpackedVnni u;
  for (int64_t r = 0; r < p.nb / P; ++r) {
    const uint8_t* rec = record_at<Type>(p, g, r * P);
    __m512i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
    for (int64_t sub = 0; sub < P; ++sub) {
      pf.advance(stream_pos<Type>(p, g, g0, r * P + sub));
      unpack_vnni<Type>(rec, sub, u);
      rows_vnni<Type, MR>(p, u, r * P + sub, m0, isum);
    }
    const RecordVnni w = record_vnni<Type>(rec);
    for (int i = 0; i < MR; ++i) acc[i] = scale_record_vnni<Type>(p, w, isum[i], m0 + i, r, acc[i]);
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float lanes[kGroupRows];
    _mm512_store_ps(lanes, acc[i]);
    store_lanes(p, m0 + i, g * kGroupRows, lanes);
  }
}

// Rows m0 .. m0 + MR - 1 times record r (a 32-weight block, unpacked in u), scaled into their
// accumulators in scratch [M, 16].
template <int64_t Type, int MR>
SPECDEC_I8_VNNI inline void tile_scratch_vnni(const Problem& p, const UnpackedVnni& u, const RecordVnni& w, int64_t r,
                                              int64_t m0, float* scratch) {
  __m512i isum[MR];
  for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
  rows_vnni<Type, MR>(p, u, r, m0, isum);
  for (int i = 0; i < MR; ++i) {
    float* a = scratch + (m0 + i) * kGroupRows;
    _mm512_storeu_ps(a, scale_record_vnni<Type>(p, w, isum[i], m0 + i, r, _mm512_loadu_ps(a)));
  }
}

// The M rows of group g in ceil(M / kTileVnni) tiles of (nearly) equal size. Up to kTileVnni
// rows, and every K-quant group, go through the group one tile at a time (tile_regs_vnni; the
// later tiles read its records from the caches: 80 KB for the 1.5B's widest rows). Beyond
// kTileVnni rows a 32-weight record is unpacked once and applied to every tile, the rows'
// accumulators in scratch [M, 16]. Measured on a Zen 4 core (1.5B shapes), against unpacking a
// record's sub-blocks into L1 once for all rows in tiles of 4 with the accumulators in scratch:
// Q4_K 1.1-2.0x faster at 6-64 rows, Q6_K 1.8x at 6-8 rows and 1.0-1.1x at 32-64; Q5_0 did not
// gain from tiles of the whole group (0.7-0.9x at 12-32 rows), hence its scratch.
template <int64_t Type>
SPECDEC_I8_VNNI inline void group_tiles_vnni(const Problem& p, int64_t g, float* scratch, gguf::Prefetcher& pf,
                                             int64_t g0) {
  static_assert(kTileVnni == 8, "each_tile's cases go up to kTileVnni rows");
  const int64_t tiles = (p.M + kTileVnni - 1) / kTileVnni;
  auto each_tile = [&](auto&& tile) {
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t rows = (p.M - m0) / (tiles - t);  // the remaining rows over the remaining tiles
      switch (rows) {
        case 1: tile(std::integral_constant<int, 1>{}, m0); break;
        case 2: tile(std::integral_constant<int, 2>{}, m0); break;
        case 3: tile(std::integral_constant<int, 3>{}, m0); break;
        case 4: tile(std::integral_constant<int, 4>{}, m0); break;
        case 5: tile(std::integral_constant<int, 5>{}, m0); break;
        case 6: tile(std::integral_constant<int, 6>{}, m0); break;
        case 7: tile(std::integral_constant<int, 7>{}, m0); break;
        default: tile(std::integral_constant<int, 8>{}, m0); break;  // kTileVnni
      }
      m0 += rows;
    }
  };
  if (is_k_quant(Type) || p.M <= kTileVnni) {
    each_tile([&](auto mr, int64_t m0) { tile_regs_vnni<Type, decltype(mr)::value>(p, g, m0, pf, g0); });
  } else {
    zero_floats_vnni(scratch, p.M * kGroupRows);
    UnpackedVnni u;
    for (int64_t r = 0; r < p.nb; ++r) {
      const uint8_t* rec = record_at<Type>(p, g, r);
      pf.advance(stream_pos<Type>(p, g, g0, r));
      unpack_vnni<Type>(rec, 0, u);
      const RecordVnni w = record_vnni<Type>(rec);
      each_tile([&](auto mr, int64_t m0) { tile_scratch_vnni<Type, decltype(mr)::value>(p, u, w, r, m0, scratch); });
    }
    for (int64_t m = 0; m < p.M; ++m) store_lanes(p, m, g * kGroupRows, scratch + m * kGroupRows);
  }
}

// Groups [g0, g1), read as one stream prefetched ahead (as on the AVX2 path).
template <int64_t Type>
SPECDEC_I8_VNNI __attribute__((flatten)) inline void groups_vnni(const Problem& p, int64_t g0, int64_t g1,
                                                                 float* scratch) {
  gguf::Prefetcher pf = groups_prefetcher<Type>(p, g0, g1);
  for (int64_t g = g0; g < g1; ++g) group_tiles_vnni<Type>(p, g, scratch, pf, g0);
}

SPECDEC_I8_VNNI __attribute__((noinline)) inline void run_vnni(const Problem& p, int64_t type, int64_t g0, int64_t g1,
                                                               float* scratch) {
  SPECDEC_I8_TYPE_SWITCH(type, groups_vnni, p, g0, g1, scratch)
}

// ---------------------------------------------------------------------------------------
// AMX (cpu_has_amx_int8): the exact int32 dot products of 16 activation rows with a block's 16
// weight rows in one tile instruction (tdpbsud: signed activation bytes times unsigned weight
// bytes, 4 products per int32 lane), in place of 8 vpdpbusd per row. The unpacked words of a
// block are the tile's B operand as they are (word j of row l at bytes 64 j + 4 l .. + 3: B's row
// j), and 16 activation rows of block b are A, read from Problem::qa (q block-major: a block's
// 16-row tiles one after the other). The int32 results leave the tile through memory and meet
// the scales exactly as on the VNNI path (add_term_vnni, scale_record_vnni), so the bits are
// the same. Q6_K's two halves of 16 weights have scales of their own: two products of K = 16 (A
// and B halves), as rows_vnni's h0 and h1. Rows past M in the last tile are qa's zero padding
// (amx_padded_rows(M) rows) and their results dropped.
// ---------------------------------------------------------------------------------------
#ifndef SPECDEC_I8_AMX
#define SPECDEC_I8_AMX \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512vl,avx512dq,avx512bw,avx512vnni,f16c,fma,avx2")))
#endif

constexpr int64_t kAmxRows = 16;  // activation rows per tile
// Where the AMX path is taken (amx_pays): from kAmxMinRows rows, on every format but Q6_K.
// Measured on a Sapphire Rapids core (1.5B shapes, 1 thread): the tile instructions and the
// vector scaling of the block products run one after the other, not overlapped, and the
// scaling (4 fp32 operations per row, block and 16 outputs) is the same on both paths, so the
// tiles win only where they replace many rows' vpdpbusd: Q4_K 1.1x the VNNI path at 32 rows,
// 1.2x at 64, but 0.9x at 16 and 0.55x at 8; Q6_K (two half-block products and their int32
// scale multiplies) never wins. Measured against the VNNI path before its register tiles (which
// made it 1.1-1.3x faster at 32-64 rows of Q4_K on a Zen 4 core): to be measured again on AMX.
constexpr int64_t kAmxMinRows = 32;
constexpr bool amx_pays(int64_t type, int64_t M) { return M >= kAmxMinRows && type != kQ6_K; }
inline int64_t amx_padded_rows(int64_t M) { return (M + kAmxRows - 1) / kAmxRows * kAmxRows; }

// The tile configuration (palette 1). Q4_0 .. Q5_K: tmm0 B [8 rows, 64 bytes], tmm1 / tmm2 A
// [16, 32] (alternating), tmm4 .. tmm7 C [16, 64]: 4 row tiles per pass. Q6_K: tmm0 / tmm1 B
// halves [4, 64], tmm2 / tmm3 A halves [16, 16], tmm4 / tmm5 and tmm6 / tmm7 the C halves of 2
// row tiles per pass.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
inline AmxConfig amx_config(bool halves) {
  AmxConfig c;
  auto set = [&c](int t, int rows, int colsb) { c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(colsb); };
  if (halves) {
    set(0, 4, 64), set(1, 4, 64), set(2, kAmxRows, 16), set(3, kAmxRows, 16);
  } else {
    set(0, 8, 64), set(1, kAmxRows, 32), set(2, kAmxRows, 32);
  }
  for (int t = 4; t < 8; ++t) set(t, kAmxRows, 64);
  return c;
}
// Row tiles of 16 activation rows per pass over a block (as many C tiles as the config has).
template <int64_t Type>
constexpr int64_t amx_pass_tiles() { return Type == kQ6_K ? 2 : 4; }

// The tile instructions with their memory made visible to the compiler (GCC's intrinsics are
// asm statements without a memory clobber: stores to a B buffer could sink below its tile load,
// loads of a C buffer rise above its tile store). Tile registers are immediates: literal numbers.
#ifndef SPECDEC_AMX_LOAD  // (the emulation harness brings its own)
#define SPECDEC_AMX_LOAD(tmm, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define SPECDEC_AMX_STORE(tmm, base, stride) \
  __asm__ volatile("tilestored %%tmm" #tmm ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define SPECDEC_AMX_ZERO(tmm) __asm__ volatile("tilezero %%tmm" #tmm ::)
#define SPECDEC_AMX_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#endif

// The int32 products of `tiles` row tiles (16 activation rows each, from a with a stride of
// `stride` bytes) with the B tile(s) loaded, into c: [tiles * 16, 16] (Q6_K: c and c1, the two
// halves). The products go to distinct C tiles and are stored after all of them: the tile unit
// pipelines them (one C tile reused would serialise zero, load, product and store per tile).
template <int64_t Type>
SPECDEC_I8_AMX inline void products_amx(const int8_t* a, int64_t stride, int64_t tiles, int32_t* c, int32_t* c1) {
  constexpr int64_t kTile = kAmxRows * kGroupRows;  // int32 per C tile
  const int64_t rows16 = kAmxRows * stride;
  if constexpr (Type == kQ6_K) {
    SPECDEC_AMX_ZERO(4);
    SPECDEC_AMX_ZERO(5);
    SPECDEC_AMX_LOAD(2, a, stride);
    SPECDEC_AMX_LOAD(3, a + 16, stride);
    SPECDEC_AMX_DPBSUD(4, 2, 0);
    SPECDEC_AMX_DPBSUD(5, 3, 1);
    if (tiles > 1) {
      SPECDEC_AMX_ZERO(6);
      SPECDEC_AMX_ZERO(7);
      SPECDEC_AMX_LOAD(2, a + rows16, stride);
      SPECDEC_AMX_LOAD(3, a + rows16 + 16, stride);
      SPECDEC_AMX_DPBSUD(6, 2, 0);
      SPECDEC_AMX_DPBSUD(7, 3, 1);
    }
    SPECDEC_AMX_STORE(4, c, 64);
    SPECDEC_AMX_STORE(5, c1, 64);
    if (tiles > 1) {
      SPECDEC_AMX_STORE(6, c + kTile, 64);
      SPECDEC_AMX_STORE(7, c1 + kTile, 64);
    }
  } else {
    SPECDEC_AMX_ZERO(4);
    SPECDEC_AMX_LOAD(1, a, stride);
    SPECDEC_AMX_DPBSUD(4, 1, 0);
    if (tiles > 1) {
      SPECDEC_AMX_ZERO(5);
      SPECDEC_AMX_LOAD(2, a + rows16, stride);
      SPECDEC_AMX_DPBSUD(5, 2, 0);
    }
    if (tiles > 2) {
      SPECDEC_AMX_ZERO(6);
      SPECDEC_AMX_LOAD(1, a + 2 * rows16, stride);
      SPECDEC_AMX_DPBSUD(6, 1, 0);
    }
    if (tiles > 3) {
      SPECDEC_AMX_ZERO(7);
      SPECDEC_AMX_LOAD(2, a + 3 * rows16, stride);
      SPECDEC_AMX_DPBSUD(7, 2, 0);
    }
    SPECDEC_AMX_STORE(4, c, 64);
    if (tiles > 1) SPECDEC_AMX_STORE(5, c + kTile, 64);
    if (tiles > 2) SPECDEC_AMX_STORE(6, c + 2 * kTile, 64);
    if (tiles > 3) SPECDEC_AMX_STORE(7, c + 3 * kTile, 64);
  }
}

// Adds the terms of sub-block u (activation blocks b) from its raw int32 products c ([M, 16];
// Q6_K: c1 the second half's) to the rows' integer sums isum [M, 16] (add_term_vnni, as the
// VNNI path; isum starts at zero with a record's first sub-block).
template <int64_t Type>
SPECDEC_I8_AMX inline void add_rows_amx(const Problem& p, const UnpackedVnni& u, int64_t b, bool first, const int32_t* c,
                                        const int32_t* c1, int32_t* isum) {
  for (int64_t i = 0; i < p.M; ++i) {
    int32_t* s = isum + kGroupRows * i;
    const __m512i before = first ? _mm512_setzero_si512() : _mm512_loadu_si512(s);
    const __m512i raw1 = Type == kQ6_K ? _mm512_loadu_si512(c1 + kGroupRows * i) : _mm512_setzero_si512();
    _mm512_storeu_si512(s, add_term_vnni<Type>(p, u, i * p.nb + b, _mm512_loadu_si512(c + kGroupRows * i), raw1, before));
  }
}

// The scratch of run_amx, in floats: the accumulators [M, 16], the integer sums [M, 16], then one
// block's int32 products [2 halves, amx_padded_rows(M), 16].
inline int64_t amx_scratch_floats(int64_t M) { return 2 * M * kGroupRows + 2 * amx_padded_rows(M) * kGroupRows; }

// One group, all M rows: each sub-block unpacked once into the B tile(s), multiplied with every
// row tile of the block (passes of amx_pass_tiles row tiles into distinct C tiles, which the
// tile unit pipelines), its products added to the rows' integer sums, and each record scaled
// into the rows' accumulators. (Measured on a Sapphire Rapids core: the tile instructions and the
// vector work do not overlap, whether the products run a block or two ahead or not, so the
// plain order is kept.)
template <int64_t Type>
SPECDEC_I8_AMX inline void group_amx(const Problem& p, int64_t g, float* scratch, gguf::Prefetcher& pf, int64_t g0) {
  constexpr int64_t kPass = amx_pass_tiles<Type>() * kAmxRows;  // rows per pass
  constexpr int64_t P = record_subs(Type);
  const int64_t rows = amx_padded_rows(p.M);
  alignas(64) uint8_t bbuf[8 * 64];
  int32_t* isum = reinterpret_cast<int32_t*>(scratch + p.M * kGroupRows);
  int32_t* c = isum + p.M * kGroupRows;
  int32_t* c1 = c + rows * kGroupRows;
  zero_floats_vnni(scratch, p.M * kGroupRows);
  UnpackedVnni u;
  for (int64_t r = 0; r < p.nb / P; ++r) {
    const uint8_t* rec = record_at<Type>(p, g, r * P);
    for (int64_t sub = 0; sub < P; ++sub) {
      const int64_t b = r * P + sub;
      pf.advance(stream_pos<Type>(p, g, g0, b));
      unpack_vnni<Type>(rec, sub, u);
      for (int j = 0; j < 8; ++j) _mm512_store_si512(bbuf + 64 * j, u.w[j]);
      SPECDEC_AMX_LOAD(0, bbuf, 64);
      if constexpr (Type == kQ6_K) SPECDEC_AMX_LOAD(1, bbuf + 256, 64);
      const int8_t* a = p.qa + b * rows * kBlock;  // block b's 16-row A tiles, one after the other
      for (int64_t m0 = 0; m0 < rows; m0 += kPass) {
        products_amx<Type>(a + m0 * kBlock, kBlock, std::min(kPass, rows - m0) / kAmxRows, c + m0 * kGroupRows,
                           c1 + m0 * kGroupRows);
      }
      add_rows_amx<Type>(p, u, b, sub == 0, c, c1, isum);
    }
    const RecordVnni w = record_vnni<Type>(rec);
    for (int64_t i = 0; i < p.M; ++i) {
      float* acc = scratch + kGroupRows * i;
      _mm512_storeu_ps(acc, scale_record_vnni<Type>(p, w, _mm512_loadu_si512(isum + kGroupRows * i), i, r, _mm512_loadu_ps(acc)));
    }
  }
  for (int64_t m = 0; m < p.M; ++m) store_lanes(p, m, g * kGroupRows, scratch + m * kGroupRows);
}

template <int64_t Type>
SPECDEC_I8_AMX __attribute__((flatten)) inline void groups_amx(const Problem& p, int64_t g0, int64_t g1,
                                                               float* scratch) {
  const AmxConfig config = amx_config(Type == kQ6_K);
  _tile_loadconfig(&config);
  gguf::Prefetcher pf = groups_prefetcher<Type>(p, g0, g1);
  for (int64_t g = g0; g < g1; ++g) group_amx<Type>(p, g, scratch, pf, g0);
  _tile_release();
}

// Needs p.qa, a scratch of amx_scratch_floats(p.M) floats and a CPU with cpu_has_amx_int8().
SPECDEC_I8_AMX __attribute__((noinline)) inline void run_amx(const Problem& p, int64_t type, int64_t g0, int64_t g1,
                                                             float* scratch) {
  SPECDEC_I8_TYPE_SWITCH(type, groups_amx, p, g0, g1, scratch)
}
#pragma GCC diagnostic pop

// ---------------------------------------------------------------------------------------
// AVX2: the 16 rows as two halves of 8 int32 lanes (unpacked one after the other, applied in one pass);
// vpmaddubsw (unsigned x signed bytes -> saturating int16 pairs) then vpmaddwd. No int16 sum
// can saturate: a Q4 pair is at most 2 * 15 * 127 (8 words summed: 30480), a Q5 pair 2 * 31 *
// 127 (4 words: 31496), a Q6 pair 2 * 63 * 127 (2 words: 32004); Q8_0 uses |w| with the sign
// moved onto x (at most 2 * 128 * 127 per pair) instead of the unsigned offset bytes. Q6_K's
// int16 sums are multiplied by the scales in vpmaddwd itself.
// ---------------------------------------------------------------------------------------
// The AVX2 twin of quantize_activations (the vector paths' quantiser; AVX-512 CPUs have AVX2):
// per element the same operations (the max of |x|, x * (1 / d) rounded half to even by
// vroundps as nearbyint does in the default mode, clamped, converted) and exact integer sums,
// so the same bits. (The scalar loops cost ~4 ns per element: at H = 8960 more than the
// product with a 16-row group.)
inline void quantize_activations_avx2(const float* x, int64_t M, int64_t nb, int64_t per, int8_t* q, float* d,
                                      float* s, int32_t* sq, int32_t* sqh) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i dword_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  auto hsum = [](__m256i a) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  };
  const int64_t span = per * kBlock;
  for (int64_t a = 0; a < M * nb / per; ++a) {
    const float* xa = x + a * span;
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t k = 0; k < span; k += 8) {
      const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(xa + k));
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(v, inf, _CMP_LT_OQ));  // false for NaN and +-inf
      amax = _mm256_max_ps(amax, v);
    }
    if (_mm256_movemask_ps(finite) != 0xFF) {
      write_non_finite(a, per, q, d, s, sq, sqh);
      continue;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float dm = am < kTinyBlock ? 0.f : am / 127.f;
    const __m256 id = _mm256_set1_ps(dm != 0.f ? 1.f / dm : 0.f);
    d[a] = dm;
    for (int64_t mb = a * per; mb < (a + 1) * per; ++mb) {
      __m256i qi[4];
      for (int k = 0; k < 4; ++k) {
        const __m256 v = _mm256_loadu_ps(x + mb * kBlock + 8 * k);
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[k] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + mb * kBlock), _mm256_permutevar8x32_epi32(bytes, dword_order));
      write_block_sums(mb, dm, hsum(_mm256_add_epi32(qi[0], qi[1])), hsum(_mm256_add_epi32(qi[2], qi[3])), s, sq, sqh);
    }
  }
}

// One sub-block of 32 weights of 8 rows, unpacked.
struct UnpackedAvx2 {
  __m256i w[8];
  __m256i sc0;  // the int16 pair folded into the int32 sums per lane: Q4_K / Q5_K (sc, sc); Q6_K (sc0, sc0)
  __m256i sc1, sc01x32;  // Q6_K: (sc1, sc1), (32 sc0, 32 sc1)
};
// One record's per-row fp32 values and the K-quants' mins, 8 rows.
struct RecordAvx2 {
  __m256 dw, mw;    // d; Q4_1 / Q5_1: m; Q4_K / Q5_K: dmin
  __m256i mn[4];    // Q4_K / Q5_K: int16 pairs (mn of sub-blocks 2k, 2k + 1) per lane
};

template <int S>
inline __m256i shift_bits_avx2(__m256i h) {
  if constexpr (S > 0) return _mm256_slli_epi16(h, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(h, -S);
  else return h;
}

template <int64_t Type, int J>
inline void high_bits_avx2(const uint8_t* wp, UnpackedAvx2& u) {
  if constexpr (J < 8) {
    if constexpr (is_five_bit(Type)) {
      const __m256i h = shift_bits_avx2<4 - J>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 256)));
      u.w[J] = _mm256_or_si256(u.w[J], _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    } else {
      const __m256i h = shift_bits_avx2<4 - 2 * (J % 4)>(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 256 + 64 * (J / 4))));
      u.w[J] = _mm256_or_si256(u.w[J], _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
    }
    high_bits_avx2<Type, J + 1>(wp, u);
  }
}

inline __m256i u8x8_epi32(const uint8_t* at) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))); }
inline __m256i i8x8_epi32(const uint8_t* at) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))); }
// The int16 pairs (lo, hi) of two vectors of 8 int32 lanes holding int16 values.
inline __m256i pair16(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}

// Unpacks rows 8 * half .. 8 * half + 7 of sub-block sub of record rec (the weight bytes and
// the high-bit vectors offset by 32 * half).
template <int64_t Type>
inline void unpack_avx2(const uint8_t* rec, int64_t sub, int half, UnpackedAvx2& u) {
  const uint8_t* wp = rec + weights_at(Type) + sub * sub_bytes(Type) + 32 * half;
  auto load = [](const uint8_t* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); };
  if constexpr (Type == gguf::kQ8_0) {
    for (int j = 0; j < 8; ++j) u.w[j] = _mm256_xor_si256(load(wp + 64 * j), _mm256_set1_epi8(-128));  // signed q
  } else {
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; ++j) {
      const __m256i c = load(wp + 64 * j);
      u.w[j] = _mm256_and_si256(c, low4);
      u.w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
    }
    if constexpr (is_five_bit(Type) || Type == kQ6_K) high_bits_avx2<Type, 0>(wp, u);
  }
  if constexpr (has_k_min(Type)) {
    const __m256i sc = u8x8_epi32(rec + 64 + 16 * sub + 8 * half);
    u.sc0 = pair16(sc, sc);
  }
  if constexpr (Type == kQ6_K) {
    const __m256i s0 = i8x8_epi32(rec + 32 + 32 * sub + 8 * half), s1 = i8x8_epi32(rec + 48 + 32 * sub + 8 * half);
    u.sc0 = pair16(s0, s0);
    u.sc1 = pair16(s1, s1);
    u.sc01x32 = _mm256_slli_epi16(pair16(s0, s1), 5);  // |32 sc| <= 4096
  }
}

template <int64_t Type>
inline RecordAvx2 record_avx2(const uint8_t* rec, int half) {
  auto f16x8 = [](const uint8_t* at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))); };
  RecordAvx2 w;
  w.dw = f16x8(rec + 16 * half);
  if constexpr (has_min(Type) || has_k_min(Type)) w.mw = f16x8(rec + 32 + 16 * half);
  if constexpr (has_k_min(Type)) {
    for (int k = 0; k < 4; ++k)
      w.mn[k] = pair16(u8x8_epi32(rec + 192 + 16 * (2 * k) + 8 * half), u8x8_epi32(rec + 192 + 16 * (2 * k + 1) + 8 * half));
  }
  return w;
}

// An empty asm that "changes" v: GCC may not reassociate the sums across it. Without it, GCC
// turned each row's chain into a tree, computed all 64 products of a tile first and spilled
// them to the stack (more stack traffic than arithmetic).
inline void keep_in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// Whether the AVX2 sums subtract offset(Type) * sum q (Q8_0's bytes were made signed by unpack_avx2).
constexpr bool subtracts_offset_avx2(int64_t t) { return offset(t) != 0 && t != gguf::kQ8_0; }

// Block mb's correction of the integer sums, broadcast: Q6_K the int16 pair (sq0, sq1);
// formats with an offset offset * sq; else 0.
template <int64_t Type>
inline __m256i block_corr_avx2(const Problem& p, int64_t mb) {
  if constexpr (Type == kQ6_K) {
    return _mm256_set1_epi32(p.sqhp[mb]);
  } else if constexpr (subtracts_offset_avx2(Type)) {
    return _mm256_set1_epi32(offset(Type) * p.sq[mb]);
  } else {
    return _mm256_setzero_si256();
  }
}

// isum minus a block's correction: the unsigned offset times sum q; Q6_K: 32 * (sc0 * sq0 + sc1 *
// sq1), the stored q6 minus 32 (|sq half| <= 2032 fits int16).
template <int64_t Type>
inline __m256i correct_avx2(const UnpackedAvx2& u, __m256i isum, __m256i corr) {
  if constexpr (Type == kQ6_K) return _mm256_sub_epi32(isum, _mm256_madd_epi16(u.sc01x32, corr));
  else if constexpr (subtracts_offset_avx2(Type)) return _mm256_sub_epi32(isum, corr);
  else return isum;
}

// Row m's values for record r, broadcast (loaded once for both halves: stores to the float
// accumulators between them would make the compiler load them again).
struct RowRecordAvx2 {
  __m256 d, s;       // d_x; Q4_1 / Q5_1: s_x
  __m256i sq[4];     // Q4_K / Q5_K: int16 pairs (sq of blocks 2k, 2k + 1)
};
template <int64_t Type>
inline RowRecordAvx2 row_record_avx2(const Problem& p, int64_t m, int64_t r) {
  constexpr int64_t P = record_subs(Type);
  RowRecordAvx2 x;
  x.d = _mm256_set1_ps(scale_at<Type>(p, m, r));
  if constexpr (has_min(Type)) x.s = _mm256_set1_ps(p.s[m * p.nb + r]);
  if constexpr (has_k_min(Type)) {
    const int32_t* sqp = p.sqp + (m * p.nb + r * P) / 2;
    for (int k = 0; k < 4; ++k) x.sq[k] = _mm256_set1_epi32(sqp[k]);
  }
  return x;
}

// acc + a record's contribution from its exact integer sum isum (the header's fp32 order).
template <int64_t Type>
inline __m256 scale_record_avx2(const RecordAvx2& w, __m256i isum, const RowRecordAvx2& x, __m256 acc) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(w.dw, x.d), acc);
  if constexpr (has_min(Type)) acc = _mm256_fmadd_ps(w.mw, x.s, acc);
  if constexpr (has_k_min(Type)) {
    __m256i mins = _mm256_madd_epi16(w.mn[0], x.sq[0]);
    for (int k = 1; k < 4; ++k) mins = _mm256_add_epi32(mins, _mm256_madd_epi16(w.mn[k], x.sq[k]));
    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(w.mw, x.d), acc);
  }
  return acc;
}

// Adds word j's products of one row and one half (w: the half's unpacked word, x: the row's
// broadcast activation word) to the running int32 sum s32 (every AVX2 path's arithmetic):
// int16 chains of as many words as cannot saturate, each folded into s32 by vpmaddwd (with the
// sub-block's scales for the K-quants; Q8_0: every word).
template <int64_t Type>
inline void dot_word_avx2(int j, __m256i w, __m256i x, const UnpackedAvx2& u, __m256i& s16, __m256i& s32) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Type == gguf::kQ8_0) {
    s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones));
    keep_in_register(s32);
  } else {
    constexpr int chain = Type == kQ6_K ? 2 : is_five_bit(Type) ? 4 : 8;
    const __m256i prod = _mm256_maddubs_epi16(w, x);
    s16 = j % chain == 0 ? prod : _mm256_add_epi16(s16, prod);
    keep_in_register(s16);
    if (j % chain == chain - 1) {
      const __m256i fold = !is_k_quant(Type) ? ones : Type == kQ6_K && j >= 4 ? u.sc1 : u.sc0;
      s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s16, fold));
      keep_in_register(s32);
    }
  }
}

// isum plus the exact integer dot products (8 lanes) of the unpacked sub-block with activation
// block mb, corrected (correct_avx2).
template <int64_t Type>
inline __m256i add_isum_avx2(const Problem& p, const UnpackedAvx2& u, int64_t mb, __m256i isum) {
  const int8_t* xq = p.q + mb * kBlock;
  __m256i s16;
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) dot_word_avx2<Type>(j, u.w[j], _mm256_set1_epi32(load_i32(xq + 4 * j)), u, s16, isum);
  return correct_avx2<Type>(u, isum, block_corr_avx2<Type>(p, mb));
}

constexpr int kTileAvx2 = 4;  // rows of the register pass (group_regs_avx2; groups_avx2's cases)

// Up to kTileAvx2 rows: one pass over the group's records, each sub-block unpacked and applied
// half by half (rows 0-7, then 8-15), the integer sums and accumulators of both halves in
// registers (at 3-4 rows some of them on the stack, touched once a sub-block or record). (Two
// passes, one per half, read every line of the group twice and each half's 32 bytes of a line
// apart from the other's: measured slower.) At 3-4 rows this beat the tiles below for Q4_K, 1.25-1.48x
// (Q5_0 1.07-1.13x, Q6_K 0.95-1.06x), on a Zen 4 core running this AVX2 path (one thread,
// alternating processes, 7 rounds); not measured on a Zen 3.
template <int64_t Type, int MR>
inline void group_regs_avx2(const Problem& p, int64_t g, gguf::Prefetcher& pf, int64_t g0) {
  constexpr int64_t P = record_subs(Type);
  __m256 acc[2][MR];
  for (int half = 0; half < 2; ++half)
    for (int i = 0; i < MR; ++i) acc[half][i] = _mm256_setzero_ps();
  for (int64_t r = 0; r < p.nb / P; ++r) {
    const uint8_t* rec = record_at<Type>(p, g, r * P);
    __m256i isum[2][MR];
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < MR; ++i) isum[half][i] = _mm256_setzero_si256();
    for (int64_t sub = 0; sub < P; ++sub) {
      pf.advance(stream_pos<Type>(p, g, g0, r * P + sub));
      for (int half = 0; half < 2; ++half) {
        UnpackedAvx2 u;
        unpack_avx2<Type>(rec, sub, half, u);
        for (int i = 0; i < MR; ++i) isum[half][i] = add_isum_avx2<Type>(p, u, i * p.nb + r * P + sub, isum[half][i]);
      }
    }
    const RecordAvx2 w[2] = {record_avx2<Type>(rec, 0), record_avx2<Type>(rec, 1)};
    for (int i = 0; i < MR; ++i) {
      const RowRecordAvx2 x = row_record_avx2<Type>(p, i, r);
      for (int half = 0; half < 2; ++half) acc[half][i] = scale_record_avx2<Type>(w[half], isum[half][i], x, acc[half][i]);
    }
  }
  for (int half = 0; half < 2; ++half) {
    for (int i = 0; i < MR; ++i) {
      float lanes[8];
      _mm256_storeu_ps(lanes, acc[half][i]);
      store_lanes(p, i, g * kGroupRows + 8 * half, lanes, 8);
    }
  }
}

// M > kTileAvx2 rows: a record's sub-blocks are unpacked once (both halves: 16 weight rows),
// then applied to tile_rows_avx2 rows at a time: word j of both halves meets one broadcast of
// each row's activation word j, the tile's integer sums stay in registers over the record's
// sub-blocks, and the record is scaled into the rows' accumulators in scratch[h M 8 ..] (half h)
// once. With the int16 chains kept in order (keep_in_register) and each row's values loaded once
// for both halves, the products of 16-64 rows ran 1.32x (Q4_K) and 1.18x (Q6_K) faster than
// tiles of 2 rows per half on a Zen 3 core.
template <int64_t Type>
constexpr int tile_rows_avx2() {  // registers: 2 int16 chains and 2 int32 sums per row, 2 weight words, x
  // Measured on a Zen 3 core (products of 16-128 rows): Q6_K 3 rows 1.07x 2 rows and 4 rows; Q4_K
  // 4 rows 1.04x 3 rows.
  return Type == gguf::kQ8_0 || is_five_bit(Type) ? 2 : Type == kQ6_K ? 3 : 4;
}

// The exact dot products of rows m0 .. m0 + MR - 1 with both halves of record r (its sub-blocks
// unpacked in u[sub][half], its fp32 values in w), scaled into their accumulators.
template <int64_t Type, int MR>
inline void tile_rows_avx2(const Problem& p, const UnpackedAvx2 (&u)[record_subs(Type)][2], const RecordAvx2 (&w)[2],
                           int64_t r, int64_t m0, float* scratch) {
  constexpr int64_t P = record_subs(Type);
  __m256i isum[MR][2];
  for (int i = 0; i < MR; ++i) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
  for (int64_t sub = 0; sub < P; ++sub) {
    __m256i s16[MR][2];
    const int8_t* xq[MR];
    for (int i = 0; i < MR; ++i) xq[i] = p.q + ((m0 + i) * p.nb + r * P + sub) * kBlock;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w0 = u[sub][0].w[j], w1 = u[sub][1].w[j];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256i x = _mm256_set1_epi32(load_i32(xq[i] + 4 * j));
        dot_word_avx2<Type>(j, w0, x, u[sub][0], s16[i][0], isum[i][0]);
        dot_word_avx2<Type>(j, w1, x, u[sub][1], s16[i][1], isum[i][1]);
      }
    }
    if constexpr (Type == kQ6_K || subtracts_offset_avx2(Type)) {
      for (int i = 0; i < MR; ++i) {
        const __m256i corr = block_corr_avx2<Type>(p, (m0 + i) * p.nb + r * P + sub);
        for (int h = 0; h < 2; ++h) isum[i][h] = correct_avx2<Type>(u[sub][h], isum[i][h], corr);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    const RowRecordAvx2 x = row_record_avx2<Type>(p, m0 + i, r);
    for (int h = 0; h < 2; ++h) {
      float* a = scratch + (h * p.M + m0 + i) * 8;
      _mm256_storeu_ps(a, scale_record_avx2<Type>(w[h], isum[i][h], x, _mm256_loadu_ps(a)));
    }
  }
}

// The last rows (fewer than a tile): one tile of `rest` rows.
template <int64_t Type, int R>
inline void tail_rows_avx2(const Problem& p, const UnpackedAvx2 (&u)[record_subs(Type)][2], const RecordAvx2 (&w)[2],
                           int64_t r, int64_t m0, int64_t rest, float* scratch) {
  if constexpr (R > 0) {
    if (rest == R) tile_rows_avx2<Type, R>(p, u, w, r, m0, scratch);
    else tail_rows_avx2<Type, R - 1>(p, u, w, r, m0, rest, scratch);
  }
}

template <int64_t Type>
inline void group_tiles_avx2(const Problem& p, int64_t g, float* scratch, gguf::Prefetcher& pf, int64_t g0) {
  constexpr int MR = tile_rows_avx2<Type>();
  constexpr int64_t P = record_subs(Type);
  std::fill(scratch, scratch + 2 * p.M * 8, 0.f);
  UnpackedAvx2 u[P][2];
  RecordAvx2 w[2];
  for (int64_t r = 0; r < p.nb / P; ++r) {
    const uint8_t* rec = record_at<Type>(p, g, r * P);
    for (int64_t sub = 0; sub < P; ++sub) {
      pf.advance(stream_pos<Type>(p, g, g0, r * P + sub));
      unpack_avx2<Type>(rec, sub, 0, u[sub][0]);
      unpack_avx2<Type>(rec, sub, 1, u[sub][1]);
    }
    w[0] = record_avx2<Type>(rec, 0), w[1] = record_avx2<Type>(rec, 1);
    int64_t m0 = 0;
    for (; m0 + MR <= p.M; m0 += MR) tile_rows_avx2<Type, MR>(p, u, w, r, m0, scratch);
    tail_rows_avx2<Type, MR - 1>(p, u, w, r, m0, p.M - m0, scratch);
  }
  for (int half = 0; half < 2; ++half) {
    for (int64_t m = 0; m < p.M; ++m) store_lanes(p, m, g * kGroupRows + 8 * half, scratch + (half * p.M + m) * 8, 8);
  }
}

template <int64_t Type>
__attribute__((flatten)) inline void groups_avx2(const Problem& p, int64_t g0, int64_t g1, float* scratch) {
  gguf::Prefetcher pf = groups_prefetcher<Type>(p, g0, g1);
  for (int64_t g = g0; g < g1; ++g) {
    switch (p.M) {
      case 1: group_regs_avx2<Type, 1>(p, g, pf, g0); break;
      case 2: group_regs_avx2<Type, 2>(p, g, pf, g0); break;
      case 3: group_regs_avx2<Type, 3>(p, g, pf, g0); break;
      case 4: group_regs_avx2<Type, 4>(p, g, pf, g0); break;  // kTileAvx2
      default: group_tiles_avx2<Type>(p, g, scratch, pf, g0); break;
    }
  }
}

__attribute__((noinline)) inline void run_avx2(const Problem& p, int64_t type, int64_t g0, int64_t g1, float* scratch) {
  SPECDEC_I8_TYPE_SWITCH(type, groups_avx2, p, g0, g1, scratch)
}
#endif  // SPECDEC_GGUF_X86

}  // namespace i8act
}  // namespace specdec
