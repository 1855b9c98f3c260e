// specdec::silu_and_mul on the CPU: out = silu(gate) * up of gate|up [..., 2I] -> [..., I],
// the MLP activation of every decoder layer.
//
// Why our own: torch's silu then mul is two ops, each through the dispatcher and
// TensorIterator. In a decode step they run right after the gate|up product has streamed tens
// of MB of weights through the caches, so their code and bookkeeping run cold: ~20-26 us a
// layer on the 1.5B's 8,960-wide rows, where the arithmetic needs ~3 us. This is one short
// loop, called directly by the fused decode step (csrc/cpu/decoder_step.cpp) and through
// torch.ops by the Python layers, so both give the same bits.
//
// The arithmetic is fixed (fp32, no contraction): e = exp(-g) by range reduction to
// r in [-ln2/2, ln2/2] (n = floor(-g log2e + 1/2), two-part ln2) and a degree-5 polynomial,
// scaled by 2^n, with -g clamped to [-87.3, 88.9] so that 2^n is a normal number or, past
// exp's range, infinity (then s = -0, as silu's limit); then s = g / (1 + e) and out = s * u, rounded once to out's dtype. The AVX-512
// loop (16 values, where the CPU has it), the AVX2 loop and the scalar tail run the same
// operations in the same order, so a value's result depends on nothing but the value:
// batch-invariant, the same at every thread count and on every CPU. NaN propagates.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "check.h"
#include "cpu_features.h"
#include "dispatch.h"
#include "ops.h"
#include "silu_and_mul.h"

namespace specdec {

namespace {

constexpr float kClampLo = -87.3f, kClampHi = 88.9f;  // n in [-126, 128]: 2^n normal, or infinity at 128
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline float silu_mul_one(float g, float u) {
  float x = -g;
  x = x > kClampLo ? x : kClampLo;  // S::max(x, lo): NaN -> lo (g's NaN still reaches s)
  x = x < kClampHi ? x : kClampHi;  // S::min(x, hi)
  const float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * (r * r) + r;
  p = p + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float e = p * scale;
  const float s = g / (1.0f + e);
  return s * u;
}

#if defined(__AVX2__)
// The vector loops: silu_mul_one's operations in one template, per ISA the float vector V, its
// lanes and the operations (each an IEEE operation of the same inputs on every ISA: the same bits).
struct SiluAvx2 {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }  // NaN in a -> b, as silu_mul_one's compare
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V floor(V a) { return _mm256_floor_ps(a); }
  static V pow2(V n) {  // 2^n for integral n in [-126, 128] (128: infinity)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};

// The same on 16 lanes, where the CPU has AVX-512 (a 1.5B prefill spends ~3% of its time here).
#define SPECDEC_SILU_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
struct SiluAvx512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  SPECDEC_SILU_AVX512 static V set1(float x) { return _mm512_set1_ps(x); }
  SPECDEC_SILU_AVX512 static V load(const float* p) { return _mm512_loadu_ps(p); }
  SPECDEC_SILU_AVX512 static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  SPECDEC_SILU_AVX512 static V add(V a, V b) { return _mm512_add_ps(a, b); }
  SPECDEC_SILU_AVX512 static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  SPECDEC_SILU_AVX512 static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  SPECDEC_SILU_AVX512 static V div(V a, V b) { return _mm512_div_ps(a, b); }
  SPECDEC_SILU_AVX512 static V max(V a, V b) { return _mm512_max_ps(a, b); }
  SPECDEC_SILU_AVX512 static V min(V a, V b) { return _mm512_min_ps(a, b); }
  SPECDEC_SILU_AVX512 static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  SPECDEC_SILU_AVX512 static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};

// silu_mul_one, operation for operation, S::kLanes values at a time: the first multiple of
// S::kLanes values of a run of n from i; returns where it stopped.
template <typename S>
__attribute__((always_inline)) inline int64_t silu_mul_lanes(const float* g_in, const float* u_in, float* out,
                                                             int64_t i, int64_t n) {
  using V = typename S::V;
  const V one = S::set1(1.0f);
  for (; i + S::kLanes <= n; i += S::kLanes) {
    const V g = S::load(g_in + i), u = S::load(u_in + i);
    V x = S::sub(S::set1(0.0f), g);
    x = S::max(x, S::set1(kClampLo));
    x = S::min(x, S::set1(kClampHi));
    const V m = S::floor(S::add(S::mul(x, S::set1(kLog2e)), S::set1(0.5f)));
    V r = S::sub(x, S::mul(m, S::set1(kLn2Hi)));
    r = S::sub(r, S::mul(m, S::set1(kLn2Lo)));
    V p = S::set1(kP0);
    for (const float c : {kP1, kP2, kP3, kP4, kP5}) p = S::add(S::mul(p, r), S::set1(c));
    p = S::add(S::mul(p, S::mul(r, r)), r);
    p = S::add(p, one);
    const V e = S::mul(p, S::pow2(m));
    const V s = S::div(g, S::add(one, e));
    S::store(out + i, S::mul(s, u));
  }
  return i;
}

SPECDEC_SILU_AVX512 int64_t silu_mul_run_avx512(const float* g, const float* u, float* out, int64_t n) {
  return silu_mul_lanes<SiluAvx512>(g, u, out, 0, n);
}
#pragma GCC diagnostic pop
#endif

// a fp32 run of n values.
void silu_mul_run(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  if (cpu_has_avx512()) i = silu_mul_run_avx512(g, u, out, n);
  i = silu_mul_lanes<SiluAvx2>(g, u, out, i, n);
#endif
  for (; i < n; ++i) out[i] = silu_mul_one(g[i], u[i]);
}

// Rows of another dtype: through fp32 in chunks of the row, each result rounded once.
template <typename T>
void silu_mul_rows_of(const T* gate_up, T* out, int64_t r0, int64_t r1, int64_t I) {
  constexpr int64_t kChunk = 256;
  float g[kChunk], u[kChunk], o[kChunk];
  for (int64_t r = r0; r < r1; ++r) {
    const T* gr = gate_up + r * 2 * I;
    for (int64_t c = 0; c < I; c += kChunk) {
      const int64_t n = std::min(kChunk, I - c);
      for (int64_t j = 0; j < n; ++j) {
        g[j] = static_cast<float>(gr[c + j]);
        u[j] = static_cast<float>(gr[I + c + j]);
      }
      silu_mul_run(g, u, o, n);
      for (int64_t j = 0; j < n; ++j) out[r * I + c + j] = static_cast<T>(o[j]);
    }
  }
}

}  // namespace

void silu_and_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t I) {
  for (int64_t r = 0; r < rows; ++r) silu_mul_run(gate_up + r * 2 * I, gate_up + r * 2 * I + I, out + r * I, I);
}

void silu_and_mul_cpu(const at::Tensor& gate_up, at::Tensor& out) {
  check_cpu(gate_up, "silu_and_mul: gate_up");
  check_cpu(out, "silu_and_mul: out");
  TORCH_CHECK(gate_up.dim() >= 1, "silu_and_mul: gate_up must have at least one dimension");
  TORCH_CHECK(is_float_dtype(gate_up.scalar_type()), "silu_and_mul: gate_up must be float32, bfloat16 or float16, got ",
              gate_up.scalar_type());
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_and_mul: gate_up's last dim must be even (gate|up), got ",
              gate_up.sizes());
  const int64_t I = gate_up.size(-1) / 2;
  std::vector<int64_t> sizes(gate_up.sizes().begin(), gate_up.sizes().end());
  sizes.back() = I;
  check_dtype(out, gate_up.scalar_type(), "silu_and_mul: out");
  TORCH_CHECK(out.sizes() == at::IntArrayRef(sizes), "silu_and_mul: out must have shape ", at::IntArrayRef(sizes),
              ", got ", out.sizes());
  check_contiguous(out, "silu_and_mul: out");
  if (out.numel() == 0) return;
  const at::Tensor x = gate_up.contiguous();
  check_no_overlap(out, "silu_and_mul: out", x, "gate_up");
  const int64_t rows = out.numel() / I;
  const int64_t grain = std::max<int64_t>(1, 65536 / I);  // a decode step's row runs inline
  switch (x.scalar_type()) {
    case at::kFloat: {
      const float* src = x.data_ptr<float>();
      float* dst = out.data_ptr<float>();
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        silu_and_mul_rows(src + r0 * 2 * I, dst + r0 * I, r1 - r0, I);
      });
      break;
    }
    case at::kBFloat16: {
      const auto* src = x.data_ptr<at::BFloat16>();
      auto* dst = out.data_ptr<at::BFloat16>();
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { silu_mul_rows_of(src, dst, r0, r1, I); });
      break;
    }
    default: {
      const auto* src = x.data_ptr<at::Half>();
      auto* dst = out.data_ptr<at::Half>();
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { silu_mul_rows_of(src, dst, r0, r1, I); });
    }
  }
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("silu_and_mul", &silu_and_mul_cpu); }

}  // namespace specdec
