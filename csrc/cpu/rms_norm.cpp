// specdec::rms_norm on the CPU: out = x * rsqrt(mean(x^2) + eps) * weight over the last dim.
//
// Why our own: the decode step runs two norms per layer on one to a few rows, and torch's
// rms_norm is composed of ~8 ops (pow, mean, add, rsqrt, mul, casts, mul), ~17 us a call on a
// 576-wide row, about 1 ms of a SmolLM2 step. This is one pass over the row. The sum of
// squares has a fixed order (16 interleaved fp32 partial sums, then pairwise; no fast-math,
// -ffp-contract=off), so a row's result depends on nothing but the row: batch-invariant, the
// same at every thread count, and the same bits wherever the model calls it (the Python layers
// through torch.ops, the fused decode step directly).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "check.h"
#include "dispatch.h"
#include "ops.h"
#include "rms_norm.h"

namespace specdec {

namespace {

constexpr int kLanes = 16;

float sum_of_squares(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j] * x[i + j];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

template <typename T>
void normalise_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  if constexpr (std::is_same_v<T, float>) {  // no widening copies
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H)), [&](int64_t r0, int64_t r1) {
      rms_norm_rows(x + r0 * H, w, out + r0 * H, r1 - r0, H, eps);
    });
    return;
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H)), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(H), weight(H);
    for (int64_t i = 0; i < H; ++i) weight[i] = static_cast<float>(w[i]);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      for (int64_t i = 0; i < H; ++i) row[i] = static_cast<float>(xr[i]);
      const float scale = 1.0f / std::sqrt(sum_of_squares(row.data(), H) / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(row[i] * scale * weight[i]);
    }
  });
}

}  // namespace

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    const float scale = 1.0f / std::sqrt(sum_of_squares(xr, H) / static_cast<float>(H) + eps);
    float* o = out + r * H;
    for (int64_t i = 0; i < H; ++i) o[i] = xr[i] * scale * w[i];
  }
}

void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_cpu(x, "rms_norm: x");
  check_cpu(weight, "rms_norm: weight");
  check_cpu(out, "rms_norm: out");
  TORCH_CHECK(x.dim() >= 1, "rms_norm: x must have at least one dimension");
  TORCH_CHECK(is_float_dtype(x.scalar_type()), "rms_norm: x must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  const int64_t H = x.size(-1);
  check_dim(weight, 1, "rms_norm: weight");
  TORCH_CHECK(weight.size(0) == H, "rms_norm: weight must have shape [", H, "] (x is ", x.sizes(), "), got ",
              weight.sizes());
  check_dtype(weight, x.scalar_type(), "rms_norm: weight");
  check_dtype(out, x.scalar_type(), "rms_norm: out");
  TORCH_CHECK(out.sizes() == x.sizes(), "rms_norm: out must have shape ", x.sizes(), ", got ", out.sizes());
  check_contiguous(out, "rms_norm: out");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "rms_norm: eps must be finite and >= 0, got ", eps);
  if (x.numel() == 0) return;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  check_no_overlap(out, "rms_norm: out", weight, "weight");
  check_no_overlap(out, "rms_norm: out", xc, "x");
  const int64_t rows = x.numel() / H;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      normalise_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, H, e);
      break;
    case at::kBFloat16:
      normalise_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, H, e);
      break;
    default:
      normalise_rows(xc.data_ptr<at::Half>(), wc.data_ptr<at::Half>(), out.data_ptr<at::Half>(), rows, H, e);
  }
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

}  // namespace specdec
