// The raw loop of specdec::silu_and_mul (silu_and_mul.cpp), for the fused decode step
// (decoder_step.cpp), which calls it on its own buffers without the op's checks.
#pragma once

#include <cstdint>

namespace specdec {

// out [rows, I] = silu(gate) * up of gate_up [rows, 2I] (fp32, contiguous, not overlapping out).
void silu_and_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t I);

}  // namespace specdec
