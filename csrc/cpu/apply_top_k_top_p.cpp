// CPU kernel of specdec::apply_top_k_top_p: top-k / top-p / min-p masking of logits in place.
//
// Semantics: the docstring of ops.apply_top_k_top_p. The file lives beside
// rejection_sampling.cpp, whose samplers take the masked logits, and is named after its op
// like its tests (tests/test_apply_top_k_top_p.py).
//
// Per row: the k-th largest value by nth_element, the top-p threshold from the values at
// or above it sorted in descending order (ties are kept or masked together), the min-p
// test against the row's max; rows with a NaN are left as they are (the sampler flags them).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "check.h"
#include "dispatch.h"
#include "ops.h"

namespace specdec {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Masks one row in place (entries below the top-k / top-p threshold or under min_p times
// the max probability become -inf); vals and work are scratch reused across rows.
template <typename scalar_t>
void mask_row(scalar_t* row, int64_t vocab, int64_t k, float top_p, float min_p, std::vector<float>& vals,
              std::vector<float>& work) {
  vals.resize(vocab);
  for (int64_t v = 0; v < vocab; ++v) vals[v] = static_cast<float>(row[v]);
  float m = -kInf;
  for (float x : vals) {
    if (std::isnan(x)) return;  // rows with NaN stay as they are (the sampler flags them)
    m = std::max(m, x);
  }
  if (m == -kInf) return;
  float threshold = -kInf;
  if (k > 0 && k < vocab) {
    work.assign(vals.begin(), vals.end());
    std::nth_element(work.begin(), work.begin() + (k - 1), work.end(), std::greater<float>());
    threshold = work[k - 1];
  }
  if (top_p < 1.0f) {
    work.clear();
    for (float x : vals)
      if (x >= threshold) work.push_back(x);
    std::sort(work.begin(), work.end(), std::greater<float>());
    float z = 0.0f;
    for (float x : work) z += std::exp(x - m);
    const float target = top_p * z;
    float above = 0.0f;
    size_t i = 0;
    float t_p = m;
    while (i < work.size()) {
      if (i > 0 && !(above < target)) break;
      t_p = work[i];
      size_t j = i;
      for (; j < work.size() && work[j] == work[i]; ++j) above += std::exp(work[j] - m);
      i = j;
    }
    threshold = std::max(threshold, t_p);
  }
  const float mp = std::min(min_p, 1.0f);
  const scalar_t neg_inf = static_cast<scalar_t>(-kInf);
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = vals[v];
    if (x < threshold || (mp > 0.0f && !(std::exp(x - m) >= mp))) row[v] = neg_inf;
  }
}

}  // namespace

void apply_top_k_top_p_cpu(at::Tensor& logits, const std::optional<at::Tensor>& top_k,
                           const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p) {
  check_cpu(logits, "logits");
  check_dim(logits, 2, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(is_float_dtype(logits.scalar_type()), "logits must have dtype float32, bfloat16 or float16, got ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  std::optional<at::Tensor> k_c, p_c, mp_c;
  for (auto [t, out, name, dtype] :
       {std::tuple{&top_k, &k_c, "top_k", at::kInt}, std::tuple{&top_p, &p_c, "top_p", at::kFloat},
        std::tuple{&min_p, &mp_c, "min_p", at::kFloat}}) {
    if (!t->has_value()) continue;
    check_cpu(**t, name);
    check_dtype(**t, dtype, name);
    check_dim(**t, 1, name);
    check_size(**t, 0, rows, name);
    *out = (*t)->contiguous();
  }
  const int32_t* kp = k_c ? k_c->data_ptr<int32_t>() : nullptr;
  const float* pp = p_c ? p_c->data_ptr<float>() : nullptr;
  const float* mpp = mp_c ? mp_c->data_ptr<float>() : nullptr;
  SPECDEC_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "apply_top_k_top_p", [&] {
    scalar_t* data = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(vocab), [&](int64_t lo, int64_t hi) {
      std::vector<float> vals, work;
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t k = kp ? kp[r] : 0;
        const float p = pp ? pp[r] : 1.0f;
        const float mp = mpp ? mpp[r] : 0.0f;
        if ((k <= 0 || k >= vocab) && !(p < 1.0f) && !(mp > 0.0f)) continue;
        mask_row(data + r * vocab, vocab, k, p, mp, vals, work);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("apply_top_k_top_p", &apply_top_k_top_p_cpu); }

}  // namespace specdec
