// CPU kernel of specdec::skinny_linear: the weight-streaming GEMM of linear.h for few rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "check.h"
#include "linear.h"
#include "ops.h"

namespace specdec {

using namespace skinny;

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

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace specdec
