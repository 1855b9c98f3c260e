// CPU kernel of specdec::medusa_topk: top-k ids and log-probs of K Medusa heads.
//
// The heads (ResBlocks, then the LM head) are streamed through the few-row GEMM of
// linear.h, with a running top-k and log-sum-exp per row, so that the [M, K, V] logits are
// never written.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "check.h"
#include "linear.h"
#include "ops.h"

namespace specdec {
namespace {

using namespace skinny;

constexpr int64_t kVocabTile = 32;  // vocabulary rows per top-k / log-sum-exp epilogue

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
    SPECDEC_DISPATCH_FLOAT_TYPES(res_weight.scalar_type(), "medusa_topk", [&] {
      using W = scalar_t;
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
  SPECDEC_DISPATCH_FLOAT_TYPES(lm_head.scalar_type(), "medusa_topk", [&] {
    using W = scalar_t;
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
}

}  // namespace specdec
