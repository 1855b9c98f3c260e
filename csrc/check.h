// Argument checks shared by the CPU kernels; every message names the argument.
#pragma once
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#define SPECDEC_CHECK(cond, ...) TORCH_CHECK(cond, __VA_ARGS__)

namespace specdec {

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline void check_size(const at::Tensor& t, int64_t dim, int64_t size, const char* name) {
  TORCH_CHECK(t.size(dim) == size, name, ".size(", dim, ") must be ", size, ", got shape ", t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// An output tensor the op writes into: on the CPU, of `dtype`, of exactly `sizes`, contiguous.
inline void check_output(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes, const char* name) {
  check_cpu(t, name);
  check_dtype(t, dtype, name);
  check_dim(t, static_cast<int64_t>(sizes.size()), name);
  for (size_t d = 0; d < sizes.size(); ++d) check_size(t, static_cast<int64_t>(d), sizes[d], name);
  check_contiguous(t, name);
}

// An output must not share memory with an input the kernel still reads while writing it
// (e.g. output_token_ids passed as tree_token_ids too). Checked on the tensors the kernel
// actually reads (after .contiguous(), which copies a strided input).
inline void check_no_overlap(const at::Tensor& out, const char* out_name, const at::Tensor& in, const char* in_name) {
  const auto status = at::get_overlap_status(out, in);
  TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, out_name,
              " must not share memory with ", in_name, " (the op reads ", in_name, " while it writes ", out_name,
              "): pass a separate tensor");
}

}  // namespace specdec
