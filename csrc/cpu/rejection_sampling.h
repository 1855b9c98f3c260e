// What the files of the CPU rejection sampler share (namespace specdec::rejection):
//   rejection_sampling.cpp       the ops specdec::chain_rejection_sample (padded [B, K+1, V]),
//                                chain_rejection_sample_flat (the engines' flattened
//                                [num_tokens + B, V] layout) and tree_rejection_sample:
//                                argument checks, each layout's requests, the outputs
//   rejection_sampling_walk.cpp  phases 1 and 2 below, and sample(): the three phases for
//                                the requests of any op
//   rejection_sampling_race.cpp  phase 3 below: run_races()
//
// Semantics: docs/design.md and the docstrings in ops.py.
//
// Rejection sampling runs in three phases, none of which materialises a softmax. Every
// row in use must be checked (NaN / +inf / all -inf make the request -1), but the walk
// stops at the first rejection, so exponentials are computed only for the rows it
// reaches, and each row in use is read once unless the walk reaches it:
//   1. parallel over requests: the root row's statistics, the max m and Z = sum_v
//      exp(l_v / T - m) in one pass (chunk max, then sum of exponentials over the chunk
//      while it is in L1), with the validity check (a max) of the last ~60% of the other
//      rows in use fused in; greedy requests: the first argmax of every row in use;
//   2. the acceptance walk per request: p(x) = exp(l_x / T - m) / Z for the drafted token
//      x, compared with the uniform of (position of x, PURPOSE_ACCEPT), computing the
//      statistics of each row it reaches; the walk ends with a "race spec" saying from
//      which unnormalised weights the last token is drawn: w_v = max(exp(l_v / T - m) -
//      C q_v, 0) with some tokens zeroed (C = 0 and no q for the bonus token);
//   3. the exponential race argmax_v w_v / (-log u_v), parallel over (request, vocabulary
//      tile), with the validity checks of the remaining unreached rows fused in (their
//      memory traffic hidden behind Philox); the positive weights are compacted, Philox
//      runs 16 (AVX-512) or 8 (AVX2) lanes at a time with the index-independent parts of
//      rounds 1-2 precomputed (philox_simd.h), and the log is skipped where -log(u) >= 1 - u proves an
//      entry cannot win (see kPruneSlack); then a reduction over tiles (ties to the lower
//      index).
// Streams are prefetched a 4 KiB chunk ahead (hardware prefetchers stop at pages).
// Results are bit-identical to the plain three-pass algorithm (all statistics first, no
// pruning), which tests/test_rejection_sampling*.py check through python_ref.
// Tree residuals after an i.i.d. rejection need the residual's mass; it is computed by one
// extra pass over the row per rejected sibling (never for the last one).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "dispatch.h"

namespace specdec {
namespace rejection {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 1024;        // elements converted / scored at a time (fits L1)
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------
// Loading a chunk of logits as float.
// ---------------------------------------------------------------------------------------

template <typename scalar_t>
inline const float* load_chunk(const scalar_t* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;  // no copy
  } else {
    widen_to_float(src, n, buf);
    return buf;
  }
}

// Max of x[0..n) * scale, NaN-propagating (a NaN anywhere gives NaN). Four accumulators
// hide the latency of at::vec::maximum (a max is exact: the order does not matter).
inline float chunk_max(const float* x, int64_t n, float scale) {
  Vec acc(-kInf), a1(-kInf), a2(-kInf), a3(-kInf);
  const Vec s(scale);
  int64_t i = 0;
  for (; i + 4 * Vec::size() <= n; i += 4 * Vec::size()) {
    acc = at::vec::maximum(acc, Vec::loadu(x + i) * s);
    a1 = at::vec::maximum(a1, Vec::loadu(x + i + Vec::size()) * s);
    a2 = at::vec::maximum(a2, Vec::loadu(x + i + 2 * Vec::size()) * s);
    a3 = at::vec::maximum(a3, Vec::loadu(x + i + 3 * Vec::size()) * s);
  }
  acc = at::vec::maximum(at::vec::maximum(acc, a1), at::vec::maximum(a2, a3));
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + i) * s);
  if (i < n) acc = at::vec::maximum(acc, Vec::set(Vec(-kInf), Vec::loadu(x + i, n - i) * s, n - i));
  float lanes[Vec::size()];
  acc.store(lanes);
  float m = -kInf;
  for (int l = 0; l < Vec::size(); ++l) {
    if (std::isnan(lanes[l])) return lanes[l];
    m = std::max(m, lanes[l]);
  }
  return m;
}

// Hardware prefetchers stop at 4 KiB pages, and a chunk of fp32 logits is one page: the
// kernels ask for the next chunk of each row they stream while computing on this one.
template <typename T>
inline void prefetch(const T* p) {
  __builtin_prefetch(static_cast<const void*>(p), 0, 3);
}

// Running max of chunk maxima (chunk_max with scale 1 / T) of an unchecked row, NaN once
// a NaN or +inf was seen: the row is valid iff the final value is finite. This is exactly
// row_stats(...).valid of a sampled row without its exponentials (when the max is finite
// the sum holds exp(0) and is finite).
inline float combine_check(float acc, float chunk) {
  if (std::isnan(acc) || std::isnan(chunk) || chunk == kInf) return std::numeric_limits<float>::quiet_NaN();
  return std::max(acc, chunk);
}

// ---------------------------------------------------------------------------------------
// What the phases hand each other.
// ---------------------------------------------------------------------------------------

// From which weights the last token of a request is drawn: row `row` of the logits with
// statistics (max, inv_t), w_v = max(exp(l_v inv_t - max) - coef q_v, 0) (no q: w_v =
// exp(...)), entries in `excluded` zeroed, uniforms at `position`.
struct RaceSpec {
  int64_t row = -1;  // flat row index into the logits, -1: nothing to draw
  int64_t position = 0;
  float max = 0.0f;
  float inv_t = 1.0f;
  const float* q = nullptr;
  float coef = 0.0f;
  std::vector<int64_t> excluded;
  // Rows in use that the walk did not reach (flat indices): their validity check (a
  // memory-bound max) runs inside the race, hidden behind its arithmetic.
  std::vector<int64_t> unchecked;
};

// A request's tree (a chain is the tree parents = [-1, 0, 1, ...]).
struct TreeView {
  int64_t num_nodes;
  const int32_t* parents;    // nullptr: a chain (parent of node j is j - 1)
  const int64_t* tokens;     // chain: draft ids, token of node j = tokens[j - 1]
  bool chain;
  int64_t token(int64_t j) const { return chain ? tokens[j - 1] : tokens[j]; }
  // First child of `node` with index > after, or -1.
  int64_t next_child(int64_t node, int64_t after) const {
    if (chain) return (after < node + 1 && node + 1 < num_nodes) ? node + 1 : -1;
    for (int64_t j = std::max(after + 1, node + 1); j < num_nodes; ++j)
      if (parents[j] == node) return j;
    return -1;
  }
};

struct WalkResult {
  std::vector<int64_t> path;  // accepted nodes, root excluded
  int64_t final_token = -1;   // set for greedy requests
  RaceSpec race;              // set for sampled requests
  bool invalid = false;       // a row the walk reached is invalid (the request gives -1)
};

// One request as the op lays it out.
struct Request {
  TreeView tree;
  int64_t row0;      // target_logits row of node 0 (the padded layouts: b * rows per request)
  int64_t num_rows;
  int64_t q_row0;    // draft_probs row of node 0
};

// Phase 3 (rejection_sampling_race.cpp): runs every request's race, parallel over
// (request, tile); returns the winners (-1 where a request has no spec). When the weights
// are all zero, races over p of the same row. Requests whose unchecked rows turn out invalid
// get valid[b] = 0. Instantiated for float, at::BFloat16 and at::Half.
template <typename scalar_t>
std::vector<int64_t> run_races(const scalar_t* logits, int64_t vocab, const std::vector<RaceSpec>& specs,
                               const int64_t* seed, const int64_t* offset, std::vector<char>& valid);

// Runs the three phases for reqs on the arguments the ops share (rejection_sampling.cpp's
// SamplingInputs: made contiguous by the op, which checked its outputs against these very
// tensors); logits rows per request in the stats buffer: rows_per_request (draft_probs rows:
// Request::q_row0).
void sample(const std::vector<Request>& reqs, const at::Tensor& logits, const std::optional<at::Tensor>& q,
            const at::Tensor& temp, const at::Tensor& seed_c, const at::Tensor& offset_c, int64_t rows_per_request,
            std::vector<WalkResult>& walks, std::vector<char>& valid);

}  // namespace rejection
}  // namespace specdec
