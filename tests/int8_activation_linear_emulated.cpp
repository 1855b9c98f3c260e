// The AVX-512 VNNI and AMX paths of int8_activation_linear run on any x86-64 CPU with AVX2:
// their AVX-512 intrinsics come from SIMDe (portable implementations, Debian's libsimde-dev),
// the AMX tile instructions from the emulation below. Each path's result is compared bit for bit
// with the portable path's, for every format, at row counts that take every register and tile
// code path, with a bias, a zero row and a row holding NaN; on random blocks and on blocks whose
// integers and scales are all at their largest, with activations at +-127. Prints one line per mismatch and
// "cases N, mismatches K"; exits 1 on any mismatch.
//
// Built and run by tests/test_int8_activation_linear.py (test_vnni_and_amx_paths_emulated):
//   g++ -std=c++20 -O1 -mavx2 -mfma -mf16c -ffp-contract=off -I csrc -I <torch includes> THIS_FILE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

// The four conversions SIMDe 0.7 lacks, element by element.
template <typename To, typename From, int N, typename R, typename A>
static inline R convert_lanes(A a) {
  From in[N];
  To out[N];
  std::memcpy(in, &a, sizeof(in));
  for (int i = 0; i < N; ++i) out[i] = static_cast<To>(in[i]);
  R r;
  std::memcpy(&r, out, sizeof(out));
  return r;
}
static inline __m512 emu_cvtepi32_ps(__m512i a) { return convert_lanes<float, int32_t, 16, __m512>(a); }
static inline __m512i emu_cvtepi8_epi32(__m128i a) { return convert_lanes<int32_t, int8_t, 16, __m512i>(a); }
static inline __m512i emu_cvtepu8_epi32(__m128i a) { return convert_lanes<int32_t, uint8_t, 16, __m512i>(a); }
static inline __m512 emu_cvtph_ps(__m256i a) {  // two native F16C halves
  __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
  __m512 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#define _mm512_cvtph_ps emu_cvtph_ps
#undef _mm512_madd_epi16  // SIMDe 0.7.4's alias takes 4 arguments
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

// AMX: eight tile registers and the four instructions the kernel uses (palette 1).
namespace emu {
struct Tile {
  int rows = 0, colsb = 0;
  uint8_t b[16][64] = {};
};
inline Tile tmm[8];
inline bool configured = false;
inline void loadconfig(const void* config) {
  const auto* c = static_cast<const uint8_t*>(config);
  for (int t = 0; t < 8; ++t) tmm[t].colsb = c[16 + 2 * t] | (c[17 + 2 * t] << 8), tmm[t].rows = c[48 + t];
  configured = c[0] == 1;
}
inline void release() { configured = false; }
inline void fail(const char* what) {
  std::fprintf(stderr, "AMX emulation: %s\n", what);
  std::exit(2);
}
inline void load(int t, const void* base, long stride) {
  if (!configured) fail("tileloadd without a configuration");
  for (int r = 0; r < tmm[t].rows; ++r) std::memcpy(tmm[t].b[r], static_cast<const uint8_t*>(base) + r * stride, tmm[t].colsb);
}
inline void store(int t, void* base, long stride) {
  for (int r = 0; r < tmm[t].rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, tmm[t].b[r], tmm[t].colsb);
}
inline void zero(int t) { std::memset(tmm[t].b, 0, sizeof(tmm[t].b)); }
// tdpbsud: C[m][n] += sum over k, i < 4 of int8 A[m][4k + i] * uint8 B[k][4n + i].
inline void dpbsud(int c, int a, int b) {
  Tile &C = tmm[c], &A = tmm[a], &B = tmm[b];
  if (A.rows != C.rows || B.rows != A.colsb / 4 || B.colsb != C.colsb) fail("tdpbsud shapes do not match");
  for (int m = 0; m < C.rows; ++m) {
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, C.b[m] + 4 * n, 4);
      for (int k = 0; k < A.colsb / 4; ++k)
        for (int i = 0; i < 4; ++i) acc += static_cast<int8_t>(A.b[m][4 * k + i]) * static_cast<int32_t>(B.b[k][4 * n + i]);
      std::memcpy(C.b[m] + 4 * n, &acc, 4);
    }
  }
}
}  // namespace emu
#define SPECDEC_AMX_LOAD(t, base, stride) ::emu::load(t, base, stride)
#define SPECDEC_AMX_STORE(t, base, stride) ::emu::store(t, base, stride)
#define SPECDEC_AMX_ZERO(t) ::emu::zero(t)
#define SPECDEC_AMX_DPBSUD(c, a, b) ::emu::dpbsud(c, a, b)
#define _tile_loadconfig(config) ::emu::loadconfig(config)
#define _tile_release() ::emu::release()
// No AVX-512 code generation: the intrinsics above are plain AVX2 code.
#define SPECDEC_I8_VNNI
#define SPECDEC_I8_AMX

#include "cpu/int8_activation_linear.h"

using namespace specdec;

namespace {

// Packed records of random bytes (saturated: every byte 0xFF, the largest integers and scales),
// their fp16 fields (d; m or dmin) finite.
std::vector<uint8_t> random_records(int64_t type, int64_t G, int64_t nr, std::mt19937& rng, bool saturated) {
  const int64_t bb = i8act::record_bytes(type);
  std::vector<uint8_t> w(G * nr * bb);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  for (auto& v : w) v = saturated ? 0xFF : static_cast<uint8_t>(byte(rng));
  const int fields = i8act::has_min(type) || i8act::has_k_min(type) ? 32 : 16;
  for (int64_t r = 0; r < G * nr; ++r) {
    for (int f = 0; f < fields; ++f) {
      const uint16_t h = c10::Half(scale(rng)).x;
      std::memcpy(&w[r * bb + 2 * f], &h, 2);
    }
  }
  return w;
}

struct Quantised {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sq, sqh;
};

int compare(const char* path, int64_t type, int64_t M, const std::vector<float>& want, const std::vector<float>& got) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &got[i], 4) != 0 && bad++ < 3)
      std::printf("%s type %ld M %ld: out[%zu] = %.9g, portable %.9g\n", path, long(type), long(M), i, got[i], want[i]);
  }
  return bad != 0;
}

}  // namespace

int main() {
  std::mt19937 rng(20261205);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t types[] = {gguf::kQ4_0, gguf::kQ4_1, i8act::kQ5_0, i8act::kQ5_1, gguf::kQ8_0,
                           i8act::kQ4_K, i8act::kQ5_K, i8act::kQ6_K};
  const int64_t rows[] = {1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 40, 70};
  const int64_t H = 512, N = 40, G = (N + 15) / 16, nb = H / i8act::kBlock;
  int cases = 0, mismatches = 0;
  for (int64_t type : types) for (bool saturated : {false, true}) {
    const int64_t nr = H / i8act::record_weights(type);
    const std::vector<uint8_t> w = random_records(type, G, nr, rng, saturated);
    std::vector<float> bias(N);
    for (auto& v : bias) v = normal(rng);
    for (int64_t M : rows) {
      std::vector<float> x(M * H);
      for (int64_t i = 0; i < M * H; ++i) x[i] = saturated ? ((i / H) % 2 ? -1.f : 1.f) : normal(rng);  // +-127
      if (M >= 5) {
        std::fill(x.begin() + 3 * H, x.begin() + 4 * H, 0.f);  // a zero row
        x[4 * H + 300] = std::numeric_limits<float>::quiet_NaN();  // one scale block NaN
      }
      Quantised a{std::vector<int8_t>(M * H), std::vector<float>(M * nb), std::vector<float>(M * nb),
                  std::vector<int32_t>(M * nb), std::vector<int32_t>(2 * M * nb)};
      i8act::quantize_activations(x.data(), M, nb, i8act::record_subs(type), a.q.data(), a.d.data(), a.s.data(),
                                  a.sq.data(), a.sqh.data());
      const float* b = M % 2 ? bias.data() : nullptr;
      std::vector<float> portable(M * N), vnni(M * N), amx(M * N);
      i8act::Problem p{a.q.data(), a.d.data(), a.s.data(), a.sq.data(), a.sqh.data(), M, nb, w.data(),
                       i8act::record_bytes(type), N, b, portable.data()};
      // The int16 pairs the vector paths read (as linear.cpp makes them).
      std::vector<int32_t> sqp(M * nb / 2 + 1), sqhp(M * nb);
      i8act::int16_pairs(M * nb, a.sq.data(), a.sqh.data(), sqp.data(), sqhp.data());
      p.sqp = sqp.data();
      p.sqhp = sqhp.data();
      std::vector<float> scratch(i8act::amx_scratch_floats(M));
      i8act::run_generic(p, type, 0, G, scratch.data());
      p.out = vnni.data();
      i8act::run_vnni(p, type, 0, G, scratch.data());
      // The AMX path's block-major copy of q (as linear.cpp makes it).
      const int64_t padded = i8act::amx_padded_rows(M), K = i8act::kBlock;
      std::vector<int8_t> qa(nb * padded * K, 0);
      for (int64_t blk = 0; blk < nb; ++blk)
        for (int64_t m = 0; m < M; ++m) std::memcpy(&qa[(blk * padded + m) * K], &a.q[(m * nb + blk) * K], K);
      p.qa = qa.data();
      p.out = amx.data();
      i8act::run_amx(p, type, 0, G, scratch.data());
      mismatches += compare("vnni", type, M, portable, vnni) + compare("amx", type, M, portable, amx);
      cases += 2;
    }
  }
  std::printf("cases %d, mismatches %d\n", cases, mismatches);
  return mismatches != 0;
}
