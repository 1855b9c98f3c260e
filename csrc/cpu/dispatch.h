// How the CPU kernels dispatch work: over the float dtypes they take (fp32, bf16, fp16;
// arithmetic in fp32 after widen_to_float) and over threads (grain_for).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace specdec {

// Runs the lambda with scalar_t bound to the C++ type of a float32 / bfloat16 / float16 TYPE.
#define SPECDEC_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                              \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)                   \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// dst[0..n) = src[0..n) widened to fp32 (bf16 / fp16 a vector at a time; exact).
template <typename T>
inline void widen_to_float(const T* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    using VecT = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + VecT::size() <= n; i += VecT::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + at::vec::Vectorized<float>::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// Below this many elements per task group a thread hand-off costs more than it saves
// (and much more on an oversubscribed machine), so tasks are grouped to at least this.
constexpr int64_t kMinParallelElements = 1 << 16;

// at::parallel_for grain for tasks of elements_per_task elements each.
inline int64_t grain_for(int64_t elements_per_task) {
  return std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, elements_per_task));
}

}  // namespace specdec
