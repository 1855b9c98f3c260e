// The weight-streaming GEMM for few activation rows under specdec::skinny_linear
// (linear.cpp) and specdec::medusa_topk (medusa.cpp).
//
// Both ops multiply a few activation rows (M <= 64) by a large weight: every weight row is
// read from memory once and multiplied, while it sits in L1/L2, with all M activation rows.
// F.linear (MKL) is tuned for large GEMMs and re-reads or packs the weight, so at M = 2..16
// it costs up to several times the time of streaming the weight once. Here, with the weight
// coming from DRAM, M = 4 costs about what M = 1 costs and M = 8 about 1.5x (measured); from
// M ~ 16 on the AVX2 arithmetic (~50-60 GFLOP/s per core here) is the limit and MKL, which
// uses AVX-512, wins; `ops.linear` switches to F.linear above the measured threshold.
//
// Arithmetic is fp32 whatever the input dtypes (bf16/fp16 weights are widened on the fly,
// which halves the bytes streamed); every dot product is reduced in the same order
// whatever the blocking, so equal weight rows give bit-identical logits (exact ties).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "dispatch.h"

namespace specdec {
namespace skinny {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kRowsW = 4;       // weight rows per micro-tile
constexpr int64_t kRowsX = 3;       // activation rows per micro-tile (3 x 4 accumulators)

// Horizontal sums of four vectors: out[j] = sum of the lanes of a_j, in one fixed order
// (used by every code path, so that equal inputs give bit-identical dot products).
inline void hsum4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 t0 = _mm256_hadd_ps(a0, a1);
  const __m256 t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t = _mm256_hadd_ps(t0, t1);  // lanes: 4 low-half sums, then 4 high-half sums
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  const Vec* a[4] = {&a0, &a1, &a2, &a3};
  for (int j = 0; j < 4; ++j) {
    float lanes[Vec::size()];
    a[j]->store(lanes);
    float s = 0.f;
    for (int l = 0; l < Vec::size(); ++l) s += lanes[l];
    out[j] = s;
  }
#endif
}

// ---------------------------------------------------------------------------------------
// Micro-kernel: acc[i][j] = dot(x[i], w[j]) for i < MB activation rows (stride ldx) and
// the 4 fp32 weight rows w[0..3], all of length H. When pf is not null, it also
// prefetches pf_lines cache lines from pf on, spread evenly over the loop: this call's
// share of the next weight-row group, so that its memory latency overlaps this group's
// arithmetic (the hardware prefetcher alone leaves the kernel stalled once M makes it
// compute-heavy, and the memory idle while a group is re-read from cache for more rows).
// ---------------------------------------------------------------------------------------
template <int MB>
inline void micro_kernel(const float* x, int64_t ldx, const float* const* w, int64_t H, float (*acc)[kRowsW],
                         const char* pf, int64_t pf_lines) {
  static_assert(MB >= 1 && MB <= 3, "micro_kernel handles 1 to 3 activation rows");
  // Named accumulators (not an array) so that the compiler keeps all 12 in registers.
  Vec a00(0.f), a01(0.f), a02(0.f), a03(0.f);
  Vec a10(0.f), a11(0.f), a12(0.f), a13(0.f);
  Vec a20(0.f), a21(0.f), a22(0.f), a23(0.f);
  const float* w0p = w[0];
  const float* w1p = w[1];
  const float* w2p = w[2];
  const float* w3p = w[3];
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  int64_t k = 0;
  const int64_t steps = H / Vec::size();
  int64_t pf_done = 0;  // cache lines of pf[0, pf_lines) prefetched so far, spread evenly
  for (; k + Vec::size() <= H; k += Vec::size()) {
    if (pf != nullptr) {
      const int64_t want = (k / Vec::size() + 1) * pf_lines / steps;
      for (; pf_done < want; ++pf_done) __builtin_prefetch(pf + pf_done * 64, 0, 3);
    }
    const Vec w0 = Vec::loadu(w0p + k);
    const Vec w1 = Vec::loadu(w1p + k);
    const Vec w2 = Vec::loadu(w2p + k);
    const Vec w3 = Vec::loadu(w3p + k);
    const Vec xv0 = Vec::loadu(x0 + k);
    a00 = at::vec::fmadd(xv0, w0, a00);
    a01 = at::vec::fmadd(xv0, w1, a01);
    a02 = at::vec::fmadd(xv0, w2, a02);
    a03 = at::vec::fmadd(xv0, w3, a03);
    if constexpr (MB >= 2) {
      const Vec xv1 = Vec::loadu(x1 + k);
      a10 = at::vec::fmadd(xv1, w0, a10);
      a11 = at::vec::fmadd(xv1, w1, a11);
      a12 = at::vec::fmadd(xv1, w2, a12);
      a13 = at::vec::fmadd(xv1, w3, a13);
    }
    if constexpr (MB >= 3) {
      const Vec xv2 = Vec::loadu(x2 + k);
      a20 = at::vec::fmadd(xv2, w0, a20);
      a21 = at::vec::fmadd(xv2, w1, a21);
      a22 = at::vec::fmadd(xv2, w2, a22);
      a23 = at::vec::fmadd(xv2, w3, a23);
    }
  }
  hsum4(a00, a01, a02, a03, acc[0]);
  if constexpr (MB >= 2) hsum4(a10, a11, a12, a13, acc[1]);
  if constexpr (MB >= 3) hsum4(a20, a21, a22, a23, acc[2]);
  if (k < H) {
    for (int i = 0; i < MB; ++i) {
      for (int j = 0; j < kRowsW; ++j) {
        float s = 0.f;
        for (int64_t t = k; t < H; ++t) s += x[i * ldx + t] * w[j][t];
        acc[i][j] += s;
      }
    }
  }
}

// Points rows[0..3] at fp32 copies of weight rows w[0..nr) (row stride H): the rows
// themselves when they are fp32 and all four exist, else widened / zero-padded copies in
// scratch [4, H].
template <typename W>
inline void prepare_rows(const W* w, int64_t nr, int64_t H, float* scratch, const float** rows) {
  if constexpr (std::is_same_v<W, float>) {
    if (nr == kRowsW) {
      for (int64_t j = 0; j < kRowsW; ++j) rows[j] = w + j * H;
      return;
    }
  }
  for (int64_t j = 0; j < kRowsW; ++j) {
    float* dst = scratch + j * H;
    if (j < nr) {
      widen_to_float(w + j * H, H, dst);
    } else {
      std::fill(dst, dst + H, 0.f);
    }
    rows[j] = dst;
  }
}

// For weight rows [n0, n1) of w [N, H] and activation rows x [M, H] (fp32, contiguous),
// calls epi(m, n, dot(x[m], w[n])) for every pair; each weight row is read once (from
// memory) and reused for all M rows from cache. scratch: 4 * H floats.
template <typename W, typename Epi>
inline void skinny_rows(const float* x, int64_t M, int64_t H, const W* w, int64_t n0, int64_t n1, float* scratch,
                        Epi&& epi) {
  float acc[kRowsX][kRowsW];
  const float* rows[kRowsW];
  // Every micro-kernel call of a group prefetches an equal share of the next group.
  const int64_t calls = (M + kRowsX - 1) / kRowsX;
  const int64_t group_lines = (kRowsW * H * static_cast<int64_t>(sizeof(W)) + 63) / 64;
  const int64_t share = calls > 0 ? (group_lines + calls - 1) / calls : 0;
  for (int64_t n = n0; n < n1; n += kRowsW) {
    const int64_t nr = std::min<int64_t>(kRowsW, n1 - n);
    prepare_rows<W>(w + n * H, nr, H, scratch, rows);
    const char* next = n + 2 * kRowsW <= n1 ? reinterpret_cast<const char*>(w + (n + kRowsW) * H) : nullptr;
    int64_t call = 0;
    auto pf_for = [&](int64_t c) -> const char* {
      if (next == nullptr || c * share >= group_lines) return nullptr;
      return next + c * share * 64;
    };
    auto lines_for = [&](int64_t c) { return std::min(share, group_lines - c * share); };
    int64_t m = 0;
    for (; m + kRowsX <= M; m += kRowsX, ++call) {
      micro_kernel<kRowsX>(x + m * H, H, rows, H, acc, pf_for(call), lines_for(call));
      for (int64_t i = 0; i < kRowsX; ++i)
        for (int64_t j = 0; j < nr; ++j) epi(m + i, n + j, acc[i][j]);
    }
    const int64_t rest = M - m;
    if (rest == 2) {
      micro_kernel<2>(x + m * H, H, rows, H, acc, pf_for(call), lines_for(call));
    } else if (rest == 1) {
      micro_kernel<1>(x + m * H, H, rows, H, acc, pf_for(call), lines_for(call));
    }
    for (int64_t i = 0; i < rest; ++i)
      for (int64_t j = 0; j < nr; ++j) epi(m + i, n + j, acc[i][j]);
  }
}

// Weight-row groups of 4 per parallel chunk such that a chunk streams >= ~64 KiB, so
// that small GEMMs do not pay for waking threads.
inline int64_t grain_groups(int64_t H, int64_t elem_size) {
  const int64_t bytes_per_group = std::max<int64_t>(1, kRowsW * H * elem_size);
  return std::max<int64_t>(1, (int64_t(64) << 10) / bytes_per_group);
}

}  // namespace skinny
}  // namespace specdec
