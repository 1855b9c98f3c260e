// CPU kernels of specdec::skinny_linear and specdec::medusa_topk.
//
// Both are weight-streaming kernels for few activation rows (M <= 64): every weight row is
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "check.h"
#include "ops.h"

namespace specdec {
namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kRowsW = 4;       // weight rows per micro-tile
constexpr int64_t kRowsX = 3;       // activation rows per micro-tile (3 x 4 accumulators)
constexpr int64_t kVocabTile = 32;  // vocabulary rows per top-k / log-sum-exp epilogue

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

// Widens one weight row to fp32.
template <typename W>
inline void widen_row(const W* src, float* dst, int64_t H) {
  if constexpr (std::is_same_v<W, float>) {
    std::copy(src, src + H, dst);
  } else {
    using VecW = at::vec::Vectorized<W>;
    int64_t k = 0;
    for (; k + VecW::size() <= H; k += VecW::size()) {
      auto [lo, hi] = at::vec::convert_to_float<W>(VecW::loadu(src + k));
      lo.store(dst + k);
      hi.store(dst + k + Vec::size());
    }
    for (; k < H; ++k) dst[k] = static_cast<float>(src[k]);
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
      widen_row<W>(w + j * H, dst, H);
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

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

#define SPECDEC_DISPATCH_WEIGHT(dtype, NAME, ...)                        \
  [&] {                                                                  \
    switch (dtype) {                                                     \
      case at::kFloat: {                                                 \
        using NAME = float;                                              \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case at::kBFloat16: {                                              \
        using NAME = at::BFloat16;                                       \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case at::kHalf: {                                                  \
        using NAME = at::Half;                                           \
        return __VA_ARGS__();                                            \
      }                                                                  \
      default:                                                           \
        TORCH_CHECK(false, "unsupported weight dtype ", dtype);          \
    }                                                                    \
  }()

// ---------------------------------------------------------------------------------------
// Running top-k (min-heap on the order "higher logit, then lower id") and log-sum-exp.
// ---------------------------------------------------------------------------------------
using Entry = std::pair<float, int64_t>;  // (logit, vocabulary id)

inline bool better(const Entry& a, const Entry& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

struct RowState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;  // sum of exp(logit - max)
  std::vector<Entry> heap;  // heap.front() is the worst kept entry
};

// Folds logits[0..VT) (ids v0.., entries >= n are -inf padding) into the row's state.
// The ids of successive calls increase, so an equal logit never displaces a kept one.
inline void fold_tile(RowState& st, const float* logits, int64_t n, int64_t v0, int64_t top_k) {
  Vec vmax(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < kVocabTile; j += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(logits + j));
  float lanes[Vec::size()];
  vmax.store(lanes);
  float tile_max = lanes[0];
  for (int l = 1; l < Vec::size(); ++l) {
    // NaN must survive (it makes the row's log-sum-exp NaN, which is reported).
    if (std::isnan(lanes[l]) || lanes[l] > tile_max) tile_max = lanes[l];
  }
  if (std::isnan(tile_max)) {
    st.max = tile_max;
  } else if (tile_max > st.max) {
    st.sum *= std::exp(st.max - tile_max);
    st.max = tile_max;
  }
  if (st.max != -std::numeric_limits<float>::infinity()) {
    const Vec vm(st.max);
    Vec vs(0.f);
    for (int64_t j = 0; j < kVocabTile; j += Vec::size()) vs = vs + (Vec::loadu(logits + j) - vm).exp();
    vs.store(lanes);
    float s = 0.f;
    for (int l = 0; l < Vec::size(); ++l) s += lanes[l];
    st.sum += s;
  }
  auto& heap = st.heap;
  if (static_cast<int64_t>(heap.size()) == top_k && !(tile_max > heap.front().first)) return;
  for (int64_t j = 0; j < n; ++j) {
    const Entry e{logits[j], v0 + j};
    if (static_cast<int64_t>(heap.size()) < top_k) {
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (e.first > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = e;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
}

template <typename W>
void silu_resblock_layer(const float* x, float* x_next, int64_t K, int64_t M, int64_t H, const W* weight,
                         int64_t weight_head_stride, const W* bias, int64_t bias_head_stride) {
  // x, x_next: [K, M, H]; head k: x_next = x + SiLU(x W_k^T + b_k). One parallel loop over
  // (head, weight-row group) pairs: with L = 0 -> 1 all heads read the same input, so this
  // is the stacked [K*H, H] GEMM of the first ResBlock of every head.
  const int64_t groups = (H + kRowsW - 1) / kRowsW;
  at::parallel_for(0, K * groups, grain_groups(H, sizeof(W)), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kRowsW * H);
    for (int64_t t = begin; t < end;) {
      const int64_t k = t / groups;
      const int64_t g_end = std::min(end, (k + 1) * groups);
      const int64_t n0 = (t - k * groups) * kRowsW;
      const int64_t n1 = std::min(H, (g_end - k * groups) * kRowsW);
      const float* xk = x + k * M * H;
      float* yk = x_next + k * M * H;
      const W* wk = weight + k * weight_head_stride;
      const W* bk = bias + k * bias_head_stride;
      skinny_rows<W>(xk, M, H, wk, n0, n1, scratch.data(), [&](int64_t m, int64_t n, float v) {
        const float z = v + static_cast<float>(bk[n]);
        yk[m * H + n] = xk[m * H + n] + z / (1.f + std::exp(-z));
      });
      t = g_end;
    }
  });
}

}  // namespace

// =======================================================================================
// skinny_linear: out [M, N] = x [M, H] @ weight [N, H]^T + bias [N].
// Any M is correct; the kernel is designed for M <= 64 (beyond that each group of 4
// weight rows is re-read from cache for every 3 activation rows, and MKL wins).
// =======================================================================================
void skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::Tensor& out) {
  check_cpu(x, "skinny_linear: x");
  check_cpu(weight, "skinny_linear: weight");
  check_cpu(out, "skinny_linear: out");
  check_dim(x, 2, "skinny_linear: x");
  check_dim(weight, 2, "skinny_linear: weight");
  check_dim(out, 2, "skinny_linear: out");
  TORCH_CHECK(is_float_dtype(x.scalar_type()), "skinny_linear: x must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(is_float_dtype(weight.scalar_type()),
              "skinny_linear: weight must be float32, bfloat16 or float16, got ", weight.scalar_type());
  check_dtype(out, x.scalar_type(), "skinny_linear: out");
  const int64_t M = x.size(0), H = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == H, "skinny_linear: weight must have shape [N, ", H, "] (x is [", M, ", ", H,
              "]), got ", weight.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "skinny_linear: out must have shape [", M, ", ", N,
              "], got ", out.sizes());
  check_contiguous(weight, "skinny_linear: weight");
  check_contiguous(out, "skinny_linear: out");
  at::Tensor bias_f;
  if (bias.has_value()) {
    check_cpu(*bias, "skinny_linear: bias");
    check_dim(*bias, 1, "skinny_linear: bias");
    TORCH_CHECK(bias->size(0) == N, "skinny_linear: bias must have shape [", N, "] (weight is [", N, ", ", H,
                "]), got ", bias->sizes());
    TORCH_CHECK(is_float_dtype(bias->scalar_type()),
                "skinny_linear: bias must be float32, bfloat16 or float16, got ", bias->scalar_type());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return;
  const at::Tensor x_f = x.to(at::kFloat).contiguous();
  const float* xp = x_f.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const at::ScalarType out_t = out.scalar_type();
  void* outp = out.data_ptr();
  const int64_t groups = (N + kRowsW - 1) / kRowsW;
  SPECDEC_DISPATCH_WEIGHT(weight.scalar_type(), W, [&] {
    const W* wp = weight.data_ptr<W>();
    at::parallel_for(0, groups, grain_groups(H, sizeof(W)), [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(kRowsW * H);
      const int64_t n0 = begin * kRowsW, n1 = std::min(N, end * kRowsW);
      auto store = [&](auto* o) {
        using O = std::remove_pointer_t<decltype(o)>;
        skinny_rows<W>(xp, M, H, wp, n0, n1, scratch.data(), [&](int64_t m, int64_t n, float v) {
          o[m * N + n] = static_cast<O>(bp ? v + bp[n] : v);
        });
      };
      if (out_t == at::kFloat) {
        store(static_cast<float*>(outp));
      } else if (out_t == at::kBFloat16) {
        store(static_cast<at::BFloat16*>(outp));
      } else {
        store(static_cast<at::Half*>(outp));
      }
    });
  });
}

// =======================================================================================
// medusa_topk: K Medusa heads (L ResBlocks each, then a shared [V, H] or per-head
// [K, V, H] LM head) -> top_k ids and log-probabilities per (row, head), without ever
// materialising the [M, K, V] logits.
// =======================================================================================
void medusa_topk_cpu(const at::Tensor& hidden, const at::Tensor& res_weight, const at::Tensor& res_bias,
                     const at::Tensor& lm_head, int64_t top_k, at::Tensor& topk_ids, at::Tensor& topk_logprobs) {
  check_cpu(hidden, "medusa_topk: hidden");
  check_cpu(res_weight, "medusa_topk: res_weight");
  check_cpu(res_bias, "medusa_topk: res_bias");
  check_cpu(lm_head, "medusa_topk: lm_head");
  check_cpu(topk_ids, "medusa_topk: topk_ids");
  check_cpu(topk_logprobs, "medusa_topk: topk_logprobs");
  check_dim(hidden, 2, "medusa_topk: hidden");
  check_dim(res_weight, 4, "medusa_topk: res_weight ([K, L, H, H])");
  check_dim(res_bias, 3, "medusa_topk: res_bias ([K, L, H])");
  TORCH_CHECK(is_float_dtype(hidden.scalar_type()), "medusa_topk: hidden must be float32, bfloat16 or float16, got ",
              hidden.scalar_type());
  TORCH_CHECK(is_float_dtype(res_weight.scalar_type()),
              "medusa_topk: res_weight must be float32, bfloat16 or float16, got ", res_weight.scalar_type());
  TORCH_CHECK(is_float_dtype(res_bias.scalar_type()),
              "medusa_topk: res_bias must be float32, bfloat16 or float16, got ", res_bias.scalar_type());
  TORCH_CHECK(is_float_dtype(lm_head.scalar_type()),
              "medusa_topk: lm_head must be float32, bfloat16 or float16, got ", lm_head.scalar_type());
  const int64_t M = hidden.size(0), H = hidden.size(1);
  const int64_t K = res_weight.size(0), L = res_weight.size(1);
  TORCH_CHECK(K >= 1, "medusa_topk: res_weight must have at least one head (K >= 1), got shape ",
              res_weight.sizes());
  TORCH_CHECK(res_weight.size(2) == H && res_weight.size(3) == H, "medusa_topk: res_weight must have shape [K, L, ",
              H, ", ", H, "] (hidden is [M, ", H, "]), got ", res_weight.sizes());
  TORCH_CHECK(res_bias.size(0) == K && res_bias.size(1) == L && res_bias.size(2) == H,
              "medusa_topk: res_bias must have shape [", K, ", ", L, ", ", H, "], got ", res_bias.sizes());
  const bool shared = lm_head.dim() == 2;
  TORCH_CHECK(lm_head.dim() == 2 || lm_head.dim() == 3, "medusa_topk: lm_head must have shape [V, ", H,
              "] (shared) or [", K, ", V, ", H, "] (per head), got ", lm_head.sizes());
  const int64_t V = lm_head.size(shared ? 0 : 1);
  TORCH_CHECK(lm_head.size(-1) == H && (shared || lm_head.size(0) == K), "medusa_topk: lm_head must have shape [V, ",
              H, "] (shared) or [", K, ", V, ", H, "] (per head), got ", lm_head.sizes());
  TORCH_CHECK(V >= 1, "medusa_topk: lm_head must have at least one vocabulary row, got ", lm_head.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= V, "medusa_topk: top_k must lie in [1, V = ", V, "], got ", top_k);
  check_dtype(topk_ids, at::kLong, "medusa_topk: topk_ids");
  check_dtype(topk_logprobs, at::kFloat, "medusa_topk: topk_logprobs");
  TORCH_CHECK(topk_ids.dim() == 3 && topk_ids.size(0) == M && topk_ids.size(1) == K && topk_ids.size(2) == top_k,
              "medusa_topk: topk_ids must have shape [", M, ", ", K, ", ", top_k, "], got ", topk_ids.sizes());
  TORCH_CHECK(topk_logprobs.dim() == 3 && topk_logprobs.size(0) == M && topk_logprobs.size(1) == K &&
                  topk_logprobs.size(2) == top_k,
              "medusa_topk: topk_logprobs must have shape [", M, ", ", K, ", ", top_k, "], got ",
              topk_logprobs.sizes());
  check_contiguous(res_weight, "medusa_topk: res_weight");
  check_contiguous(res_bias, "medusa_topk: res_bias");
  check_contiguous(lm_head, "medusa_topk: lm_head");
  check_contiguous(topk_ids, "medusa_topk: topk_ids");
  check_contiguous(topk_logprobs, "medusa_topk: topk_logprobs");
  if (M == 0) return;

  // Activations of every head, [K, M, H] fp32 (row r = k * M + m): each head starts from
  // the hidden state and runs its ResBlocks (double-buffered: a layer reads x, writes y).
  // (A fresh buffer: the layers write into both buffers, never into the caller's hidden.)
  at::Tensor xs = at::empty({K, M, H}, hidden.options().dtype(at::kFloat));
  xs.copy_(hidden.unsqueeze(0).expand({K, M, H}));
  if (L > 0) {
    at::Tensor ys = at::empty_like(xs);
    const at::Tensor bias_same = res_bias.scalar_type() == res_weight.scalar_type()
                                     ? res_bias
                                     : res_bias.to(res_weight.scalar_type()).contiguous();
    SPECDEC_DISPATCH_WEIGHT(res_weight.scalar_type(), W, [&] {
      const W* wp = res_weight.data_ptr<W>();
      const W* bp = bias_same.data_ptr<W>();
      for (int64_t l = 0; l < L; ++l) {
        silu_resblock_layer<W>(xs.data_ptr<float>(), ys.data_ptr<float>(), K, M, H, wp + l * H * H, L * H * H,
                               bp + l * H, L * H);
        std::swap(xs, ys);
      }
    });
  }

  // One pass over the vocabulary. Chunks of vocabulary tiles run in parallel, each with
  // its own running top-k and log-sum-exp per row; a tile of the LM head is read once for
  // all rows that use it (all K*M rows when shared, the M rows of head k otherwise).
  const int64_t R = K * M;
  const int64_t num_tiles = (V + kVocabTile - 1) / kVocabTile;
  const int64_t num_chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tiles));
  std::vector<std::vector<RowState>> states(num_chunks, std::vector<RowState>(R));
  const float* xp = xs.data_ptr<float>();
  SPECDEC_DISPATCH_WEIGHT(lm_head.scalar_type(), W, [&] {
    const W* wp = lm_head.data_ptr<W>();
    at::parallel_for(0, num_chunks, 1, [&](int64_t cbegin, int64_t cend) {
      std::vector<float> scratch(kRowsW * H);
      std::vector<float> logits(R * kVocabTile);
      for (int64_t c = cbegin; c < cend; ++c) {
        auto& st = states[c];
        for (auto& s : st) s.heap.reserve(top_k);
        const int64_t t0 = num_tiles * c / num_chunks, t1 = num_tiles * (c + 1) / num_chunks;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t v0 = t * kVocabTile, v1 = std::min(V, v0 + kVocabTile), n = v1 - v0;
          std::fill(logits.begin(), logits.end(), -std::numeric_limits<float>::infinity());
          const int64_t groups = shared ? 1 : K;
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t r0 = shared ? 0 : g * M;
            const int64_t rows = shared ? R : M;
            const W* w = wp + (shared ? 0 : g * V * H);
            float* lg = logits.data() + r0 * kVocabTile;
            skinny_rows<W>(xp + r0 * H, rows, H, w, v0, v1, scratch.data(),
                           [&](int64_t m, int64_t v, float val) { lg[m * kVocabTile + (v - v0)] = val; });
          }
          for (int64_t r = 0; r < R; ++r) fold_tile(st[r], logits.data() + r * kVocabTile, n, v0, top_k);
        }
      }
    });
  });

  // Merge the chunks: log-sum-exp, then the best top_k of the chunks' candidates.
  int64_t* ids = topk_ids.data_ptr<int64_t>();
  float* lps = topk_logprobs.data_ptr<float>();
  std::vector<Entry> cand;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t k = r / M, m = r % M;
    float mx = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t c = 0; c < num_chunks; ++c) {
      nan |= std::isnan(states[c][r].max);
      if (states[c][r].max > mx) mx = states[c][r].max;
    }
    double sum = 0.0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (states[c][r].max != -std::numeric_limits<float>::infinity())
        sum += static_cast<double>(states[c][r].sum) * std::exp(static_cast<double>(states[c][r].max - mx));
    }
    const float lse = static_cast<float>(static_cast<double>(mx) + std::log(sum));
    TORCH_CHECK(!nan && std::isfinite(lse), "medusa_topk: the logits of row ", m, ", head ", k,
                " are not finite (NaN or inf in hidden or in the weights)");
    cand.clear();
    for (int64_t c = 0; c < num_chunks; ++c) cand.insert(cand.end(), states[c][r].heap.begin(), states[c][r].heap.end());
    std::partial_sort(cand.begin(), cand.begin() + top_k, cand.end(), better);
    int64_t* id_out = ids + (m * K + k) * top_k;
    float* lp_out = lps + (m * K + k) * top_k;
    for (int64_t i = 0; i < top_k; ++i) {
      id_out[i] = cand[i].second;
      lp_out[i] = cand[i].first - lse;
    }
  }
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("medusa_topk", &medusa_topk_cpu);
  m.impl("skinny_linear", &skinny_linear_cpu);
}

}  // namespace specdec
