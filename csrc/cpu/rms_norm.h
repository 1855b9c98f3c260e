// The raw loop of specdec::rms_norm (rms_norm.cpp), for the fused decode step
// (decoder_step.cpp), which calls it on its own buffers without the op's checks.
#pragma once

#include <cstdint>

namespace specdec {

// out [rows, H] = x * rsqrt(mean(x^2) + eps) * w, the op's fp32 arithmetic (contiguous rows).
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t H, float eps);

}  // namespace specdec
