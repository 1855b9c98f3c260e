// CPU kernels of specdec::skinny_linear (the weight-streaming GEMM of linear.h for few rows),
// specdec::quantized_linear (the same on raw GGUF blocks, gguf_blocks.h) and
// specdec::int8_activation_linear (repacked blocks times int8 activations,
// int8_activation_linear.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "check.h"
#include "cpu_features.h"
#include "gguf_blocks.h"
#include "int8_activation_linear.h"
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
  // out is written while x and the weight are still read (out over x: an in-place square
  // layer gave wrong rows; found by fuzzing).
  check_no_overlap(out, "skinny_linear: out", x_f, "x");
  check_no_overlap(out, "skinny_linear: out", weight, "weight");
  if (bias_f.defined()) check_no_overlap(out, "skinny_linear: out", bias_f, "bias");
  const float* xp = x_f.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const at::ScalarType out_t = out.scalar_type();
  void* outp = out.data_ptr();
  const int64_t groups = (N + kRowsW - 1) / kRowsW;
  SPECDEC_DISPATCH_FLOAT_TYPES(weight.scalar_type(), "skinny_linear", [&] {
    using W = scalar_t;
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

// Whether SPECDEC_QUANTIZED_LINEAR_PORTABLE=1 (read once) forces the portable loops of
// quantized_linear and int8_activation_linear (tests compare them with the vector paths).
static bool portable_requested() {
  static const bool portable = std::getenv("SPECDEC_QUANTIZED_LINEAR_PORTABLE") &&
                               std::getenv("SPECDEC_QUANTIZED_LINEAR_PORTABLE")[0] == '1';
  return portable;
}

// The optional bias [N] of quantized_linear / int8_activation_linear, checked (CPU, one
// dimension of N, a float dtype) and as contiguous fp32; undefined when there is none.
// `shape_note` follows the expected shape in the error message.
static at::Tensor checked_float_bias(const std::optional<at::Tensor>& bias, int64_t N, const char* op,
                                     const std::string& shape_note) {
  if (!bias.has_value()) return {};
  check_cpu(*bias, (std::string(op) + ": bias").c_str());
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [", N, "]", shape_note, ", got ",
              bias->sizes());
  TORCH_CHECK(is_float_dtype(bias->scalar_type()), op, ": bias must be float32, bfloat16 or float16, got ",
              bias->scalar_type());
  return bias->to(at::kFloat).contiguous();
}

// =======================================================================================
// quantized_linear: x [M, H] times a weight stored as raw GGUF blocks (see gguf_blocks.h).
// =======================================================================================
void quantized_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t block_type,
                          const std::optional<at::Tensor>& bias, at::Tensor& out) {
  namespace g = gguf;
  check_cpu(x, "quantized_linear: x");
  check_cpu(weight, "quantized_linear: weight");
  check_dim(x, 2, "quantized_linear: x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "quantized_linear: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const g::BlockFormat* fmt = g::block_format(block_type);
  TORCH_CHECK(fmt != nullptr, "quantized_linear: block_type must be a GGML type id among ", g::kSupportedTypes,
              ", got ", block_type);
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(H % fmt->block_size == 0, "quantized_linear: x.size(1) (H = ", H, ") must be a multiple of the ",
              fmt->name, " block size ", fmt->block_size);
  const int64_t row_bytes = H / fmt->block_size * fmt->block_bytes;
  check_dtype(weight, at::kByte, "quantized_linear: weight");
  check_dim(weight, 2, "quantized_linear: weight");
  TORCH_CHECK(weight.size(1) == row_bytes, "quantized_linear: weight must have shape [N, ", row_bytes, "] (",
              H / fmt->block_size, " ", fmt->name, " blocks of ", fmt->block_bytes, " bytes per row, x is [", M, ", ",
              H, "]), got ", weight.sizes());
  check_contiguous(weight, "quantized_linear: weight");
  const int64_t N = weight.size(0);
  const at::Tensor bias_f = checked_float_bias(
      bias, N, "quantized_linear", " (weight is [" + std::to_string(N) + ", " + std::to_string(row_bytes) + "])");
  check_output(out, at::kFloat, {M, N}, "quantized_linear: out");
  if (M == 0 || N == 0) return;

  // Activations in fp32, rows padded with zeros to whole chunks of 32.
  const int64_t chunks = (H + g::kChunk - 1) / g::kChunk;
  const int64_t ldx = chunks * g::kChunk;
  at::Tensor x_f;
  if (x.scalar_type() == at::kFloat && x.is_contiguous() && ldx == H) {
    x_f = x;
  } else {
    x_f = at::zeros({M, ldx}, x.options().dtype(at::kFloat));
    x_f.narrow(1, 0, H).copy_(x);
  }
  const g::Problem p{x_f.data_ptr<float>(), ldx, M, weight.data_ptr<uint8_t>(), row_bytes, N, H, chunks,
                     bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<float>()};

  // The vector path: AVX-512 where the CPU has it (and SPECDEC_DISABLE_AVX512 is not 1), else
  // AVX2; SPECDEC_QUANTIZED_LINEAR_PORTABLE=1 forces the portable loops (tests compare them).
  const bool portable = portable_requested();
  g::RunFn run = &g::run_generic;
  int64_t direct_m = g::PathGeneric::kDirectM, scratch_rows = g::PathGeneric::kScratchRows;
#if defined(SPECDEC_GGUF_X86)
  if (!portable && cpu_has_avx512()) {
    run = &g::run_avx512, direct_m = g::PathAvx512::kDirectM, scratch_rows = g::PathAvx512::kScratchRows;
  } else if (!portable) {
    run = &g::run_avx2, direct_m = g::PathAvx2::kDirectM, scratch_rows = g::PathAvx2::kScratchRows;
  }
#endif
  // Threads split the weight rows in units of kRowUnit, at least ~64 KiB of weight bytes per
  // task, so that small layers do not pay for waking threads.
  const int64_t units = (N + g::kRowUnit - 1) / g::kRowUnit;
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(1, g::kRowUnit * row_bytes));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch(M > direct_m ? scratch_rows * ldx : 0);
    run(p, block_type, u0 * g::kRowUnit, std::min(N, u1 * g::kRowUnit), scratch.data());
  });
}

// =======================================================================================
// int8_activation_linear: x [M, H] quantised to int8 (one scale per GGUF block), times a weight of GGUF
// blocks repacked 16 rows at a time (see int8_activation_linear.h).
// =======================================================================================
// Groups are shared out in about one task per thread below this many rows, kTasksPerThread
// tasks per thread from it (int8_activation_linear_cpu).
constexpr int64_t kDynamicRows = 16;
constexpr int64_t kTasksPerThread = 8;

// Buffers of one thread, reused by its later calls (grown, never shrunk or zeroed again).
template <typename T>
struct Buffer {
  std::unique_ptr<T[]> data;
  int64_t size = 0;
  T* at_least(int64_t n) {
    if (n > size) {
      data.reset(new T[n]);  // uninitialised: every element read is written first
      size = n;
    }
    return data.get();
  }
};

struct Workspace {
  Buffer<int8_t> q, qa;
  Buffer<float> d, s;
  Buffer<int32_t> sq, sqh, sqp, sqhp;
};

// Per calling thread: concurrent calls from several threads each get their own.
Workspace& workspace() {
  static thread_local Workspace ws;
  return ws;
}

void int8_activation_linear_cpu(const at::Tensor& x, const at::Tensor& packed_weight, int64_t block_type,
                                const std::optional<at::Tensor>& bias, at::Tensor& out) {
  namespace g = gguf;
  check_cpu(x, "int8_activation_linear: x");
  check_cpu(packed_weight, "int8_activation_linear: packed_weight");
  check_dim(x, 2, "int8_activation_linear: x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "int8_activation_linear: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t bb = i8act::record_bytes(block_type);
  TORCH_CHECK(bb != 0, "int8_activation_linear: block_type must be one of ", i8act::kTypesText, ", got ", block_type);
  check_dtype(packed_weight, at::kByte, "int8_activation_linear: packed_weight");
  check_dim(packed_weight, 3, "int8_activation_linear: packed_weight");
  check_contiguous(packed_weight, "int8_activation_linear: packed_weight");
  const int64_t M = x.size(0), H = x.size(1), G = packed_weight.size(0), nb = H / i8act::kBlock;
  const int64_t rw = i8act::record_weights(block_type);
  TORCH_CHECK(H % rw == 0 && packed_weight.size(1) == H / rw && packed_weight.size(2) == bb,
              "int8_activation_linear: packed_weight must have shape [ceil(N / 16), ", H / rw, ", ", bb, "] (x is [", M,
              ", ", H, "], H a multiple of ", rw, "), got ", packed_weight.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(1) > (G - 1) * i8act::kGroupRows && out.size(1) <= G * i8act::kGroupRows,
              "int8_activation_linear: out must have shape [", M, ", N] with ceil(N / 16) = ", G,
              " (packed_weight is ", packed_weight.sizes(), "), got ", out.sizes());
  const int64_t N = out.size(1);
  check_output(out, at::kFloat, {M, N}, "int8_activation_linear: out");
  const at::Tensor bias_f = checked_float_bias(bias, N, "int8_activation_linear", "");
  if (M == 0 || N == 0) return;
  const at::Tensor x_f = x.to(at::kFloat).contiguous();
  // Paths as in quantized_linear: AMX tiles where the CPU has them and they pay (amx_pays), else
  // AVX-512 VNNI where it has that, else AVX2, portable on request (the vector paths quantise
  // with AVX2, the portable one with the scalar reference: same bits).
  const bool portable = portable_requested();
  auto quantize = &i8act::quantize_activations;
  auto run = &i8act::run_generic;
  bool has_amx = false;
#if defined(SPECDEC_GGUF_X86)
  if (!portable) {
    quantize = &i8act::quantize_activations_avx2;
    run = cpu_has_avx512_vnni() ? &i8act::run_vnni : &i8act::run_avx2;
    has_amx = use_amx_int8();
  }
#endif
  // The activations' quantised form, in buffers of the calling thread kept from call to call:
  // freshly allocated, a prefill's few MB per product were zero-filled page by page (first-touch
  // faults), ~7% of a 256-token prefill of the 1.5B, all of it serial.
  Workspace& ws = workspace();
  int8_t* q = ws.q.at_least(M * H);
  float* d = ws.d.at_least(M * nb);
  float* s = ws.s.at_least(M * nb);
  int32_t* sq = ws.sq.at_least(M * nb);
  int32_t* sqh = ws.sqh.at_least(2 * M * nb);
  // Rows quantised in parallel (each row on its own; a 256-row prefill chunk of the 1.5B's
  // down projection is 2.3M values).
  const int64_t per = i8act::record_subs(block_type), nd = nb / per;  // activation scales per row
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t(1) << 16) / H), [&](int64_t r0, int64_t r1) {
    quantize(x_f.data_ptr<float>() + r0 * H, r1 - r0, nb, per, q + r0 * H, d + r0 * nd, s + r0 * nb, sq + r0 * nb,
             sqh + 2 * r0 * nb);
  });
  int32_t *sqp = nullptr, *sqhp = nullptr;
#if defined(SPECDEC_GGUF_X86)
  if (!portable) {
    if (i8act::reads_sqp(block_type)) sqp = ws.sqp.at_least(M * nb / 2 + 1);
    if (i8act::reads_sqhp(block_type)) sqhp = ws.sqhp.at_least(M * nb);
    i8act::int16_pairs(M * nb, sq, sqh, sqp, sqhp);
  }
#endif
  // Threads split the groups, at least ~64 KiB of weight bytes per task.
  const int64_t group_bytes = H / rw * bb;
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(1, group_bytes));
  // Rows a chunk at a time (row_chunk), every row's result independent of the others.
  const int64_t chunk = i8act::row_chunk(H);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    i8act::Problem p{q + m0 * H, d + m0 * nd, s + m0 * nb, sq + m0 * nb, sqh + 2 * m0 * nb, rows, nb,
                     packed_weight.data_ptr<uint8_t>(), bb, N, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                     out.data_ptr<float>() + m0 * N};
    if (sqp) p.sqp = sqp + m0 * nb / 2;  // m0 * nb is even (row_chunk)
    if (sqhp) p.sqhp = sqhp + m0 * nb;
    auto run_chunk = run;
    if (has_amx && i8act::amx_pays(block_type, rows)) {
      // The AMX path's block-major copy of the chunk (each block's 16-row A tiles contiguous,
      // rows past `rows` zero), made in parallel over the blocks.
      const int64_t padded = i8act::amx_padded_rows(rows), K = i8act::kBlock;
      int8_t* qa = ws.qa.at_least(nb * padded * K);
      at::parallel_for(0, nb, std::max<int64_t>(1, 4096 / (padded * K)), [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          int8_t* dst = qa + b * padded * K;
          for (int64_t m = 0; m < rows; ++m) std::memcpy(dst + m * K, p.q + (m * nb + b) * K, K);
          std::memset(dst + rows * K, 0, (padded - rows) * K);
        }
      });
      p.qa = qa;
      run_chunk = &i8act::run_amx;
    }
    const int64_t scratch_floats = p.qa ? i8act::amx_scratch_floats(rows) : rows * i8act::kGroupRows;
    // Threads take tasks of groups from a shared counter until none are left, each task one
    // contiguous run of groups. Below kDynamicRows rows (bound by streaming the weight) a thread
    // gets about one task, one contiguous stream; from kDynamicRows (compute-bound) about
    // kTasksPerThread, so that a thread that was preempted (a shared machine) or runs slower does
    // not hold the others at the end. A group's result is the same whichever thread computes it.
    const int64_t threads = at::get_num_threads();
    const int64_t tasks_wanted = threads * (rows < kDynamicRows ? 1 : kTasksPerThread);
    const int64_t task = std::max(grain, (G + tasks_wanted - 1) / tasks_wanted);
    const int64_t workers = std::min(threads, (G + task - 1) / task);  // 1: runs on this thread, no wake-ups
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch(scratch_floats);  // the accumulators of rows beyond a register tile (+ AMX products)
      for (int64_t g0; (g0 = next.fetch_add(task)) < G;) run_chunk(p, block_type, g0, std::min(G, g0 + task), scratch.data());
    });
  }
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear_cpu);
  m.impl("quantized_linear", &quantized_linear_cpu);
  m.impl("int8_activation_linear", &int8_activation_linear_cpu);
}

}  // namespace specdec
