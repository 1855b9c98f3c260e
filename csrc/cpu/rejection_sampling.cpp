// CPU kernels of specdec::chain_rejection_sample (padded [B, K+1, V] and the engines'
// flattened [num_tokens + B, V] layout: chain_rejection_sample_flat) and
// specdec::tree_rejection_sample.
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include "check.h"
#include "dispatch.h"
#include "ops.h"
#include "philox.h"
#include "philox_simd.h"

namespace specdec {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 1024;        // elements converted / scored at a time (fits L1)
constexpr int64_t kRaceTile = 16384;    // vocabulary entries per race task
constexpr float kInf = std::numeric_limits<float>::infinity();

// Requests with T >= 2^-64 sample; smaller temperatures (and 0, negative, NaN) are greedy,
// the limit of sampling as T -> 0 (MIN_SAMPLING_TEMPERATURE, specdec_kernels/checks.py:
// below it l / T would overflow fp32 for ordinary logits and the request would read as
// invalid).
constexpr float kMinSamplingTemperature = 0x1p-64f;
inline bool is_sampled(float temperature) { return temperature >= kMinSamplingTemperature; }

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

// First index i < n with x[i] * scale == value (value was found by chunk_max).
inline int64_t first_equal(const float* x, int64_t n, float scale, float value) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] * scale == value) return i;
  return 0;
}

// Hardware prefetchers stop at 4 KiB pages, and a chunk of fp32 logits is one page: the
// kernels ask for the next chunk of each row they stream while computing on this one.
template <typename T>
inline void prefetch(const T* p) {
  __builtin_prefetch(static_cast<const void*>(p), 0, 3);
}

// Issues the prefetches of [p, p + bytes) one line at a time, spread over a loop.
struct PrefetchStream {
  static constexpr int kMax = 8;
  const char* p[kMax];
  const char* end[kMax];
  int n = 0;
  void add(const void* begin, const void* stop) {
    p[n] = static_cast<const char*>(begin), end[n] = static_cast<const char*>(stop), ++n;
  }
  void step() {  // one line of every stream
    for (int j = 0; j < n; ++j)
      if (p[j] < end[j]) prefetch(p[j]), p[j] += 64;
  }
  void all() const {
    for (int j = 0; j < n; ++j)
      for (const char* a = p[j]; a < end[j]; a += 64) prefetch(a);
  }
};

// sum_i exp(x[i] * scale - m) as a vector accumulator (padding lanes contribute 0); one
// line of `ahead` is prefetched per 16 entries.
inline Vec chunk_sum_exp(const float* x, int64_t n, float scale, float m, PrefetchStream ahead) {
  Vec acc(0.0f);
  const Vec s(scale), vm(m);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    if ((i & 15) == 0) ahead.step();
    acc = acc + (Vec::loadu(x + i) * s - vm).exp_u20();
  }
  if (i < n) acc = acc + Vec::set(Vec(0.0f), (Vec::loadu(x + i, n - i) * s - vm).exp_u20(), n - i);
  return acc;
}

inline float hsum(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.0f;
  for (int l = 0; l < Vec::size(); ++l) s += lanes[l];
  return s;
}

// ---------------------------------------------------------------------------------------
// Phase 1: row statistics.
// ---------------------------------------------------------------------------------------

// Running max of chunk maxima (chunk_max with scale 1 / T) of an unchecked row, NaN once
// a NaN or +inf was seen: the row is valid iff the final value is finite. This is exactly
// row_stats(...).valid of a sampled row without its exponentials (when the max is finite
// the sum holds exp(0) and is finite).
inline float combine_check(float acc, float chunk) {
  if (std::isnan(acc) || std::isnan(chunk) || chunk == kInf) return std::numeric_limits<float>::quiet_NaN();
  return std::max(acc, chunk);
}

struct RowStats {
  float max = 0.0f;      // max of l / T (sampled) or of l (greedy)
  float sum = 0.0f;      // sum exp(l / T - max) (sampled only)
  int64_t argmax = -1;   // first argmax of l (greedy only)
  bool valid = false;    // no NaN, no +inf, not all -inf
  bool full = false;     // computed by row_stats
  bool checked = false;  // not full, but `valid` is known (checked alongside another row)
};

// check_rows (num_check < PrefetchStream::kMax of them, sampled rows only) are checked in
// the same pass (combine_check maxima into check_max), their memory traffic hidden behind
// the exponentials. The checks are incomplete when the row itself is invalid.
template <typename scalar_t>
RowStats row_stats(const scalar_t* row, int64_t vocab, float temperature, const scalar_t* const* check_rows = nullptr,
                   int num_check = 0, float* check_max = nullptr) {
  RowStats st;
  st.full = true;  // also when the row turns out invalid
  const bool greedy = !is_sampled(temperature);
  const float scale = greedy ? 1.0f : 1.0f / temperature;
  float buf[kChunk];
  float m = -kInf;
  Vec acc(0.0f);
  int64_t best = -1;
  for (int j = 0; j < num_check; ++j) check_max[j] = -kInf;
  for (int64_t begin = 0; begin < vocab; begin += kChunk) {
    const int64_t n = std::min(kChunk, vocab - begin);
    PrefetchStream ahead;  // the next chunk
    if (begin + kChunk < vocab) {
      const int64_t next_end = std::min(vocab, begin + 2 * kChunk);
      ahead.add(row + begin + kChunk, row + next_end);
      for (int j = 0; j < num_check; ++j) ahead.add(check_rows[j] + begin + kChunk, check_rows[j] + next_end);
    }
    if (greedy) ahead.all();  // memory-bound: nothing to spread the prefetches over
    for (int j = 0; j < num_check; ++j)
      check_max[j] = combine_check(check_max[j], chunk_max(load_chunk(check_rows[j] + begin, n, buf), n, scale));
    const float* x = load_chunk(row + begin, n, buf);
    const float cm = chunk_max(x, n, scale);
    if (std::isnan(cm) || cm == kInf) return st;  // invalid
    if (cm == -kInf) continue;                       // contributes nothing
    if (cm > m) {
      if (greedy) {
        best = begin + first_equal(x, n, scale, cm);
      } else {
        acc = acc * Vec(std::exp(m - cm));
      }
      m = cm;
    }
    if (!greedy) acc = acc + chunk_sum_exp(x, n, scale, m, ahead);
  }
  if (m == -kInf) return st;  // all -inf
  st.max = m;
  st.sum = greedy ? 0.0f : hsum(acc);
  st.argmax = best;
  st.valid = greedy || (st.sum > 0.0f && std::isfinite(st.sum));
  return st;
}

// ---------------------------------------------------------------------------------------
// Phase 3: the exponential race.
// ---------------------------------------------------------------------------------------

#if defined(SPECDEC_X86_SIMD)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see philox_simd.h)
#pragma GCC diagnostic ignored "-Wpsabi"

// Appends the indices i < n (n a multiple of 16) with w[i] > 0 to pos and their weights to
// wc, in order; returns how many. pos and wc need 16 entries of room beyond the count,
// which are left undefined.
SPECDEC_AVX512 int64_t compact_positive_avx512(const float* w, int64_t n, uint32_t* pos, float* wc) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t m = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 wv = _mm512_loadu_ps(w + i);
    const __mmask16 k = _mm512_cmp_ps_mask(wv, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_storeu_si512(pos + m, _mm512_maskz_compress_epi32(k, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(i)))));
    _mm512_storeu_ps(wc + m, _mm512_maskz_compress_ps(k, wv));
    m += __builtin_popcount(static_cast<unsigned>(k));
  }
  return m;
}
#pragma GCC diagnostic pop
#endif

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

struct RaceResult {
  float score = -1.0f;
  int64_t index = -1;
};


// Pruning the race. An entry scores w / E with E = -log(u) >= 1 - u (u in (0, 1], 1 - u
// exact in fp32), so it cannot beat the best score S found before it (a tie goes to the
// earlier entry) when (1 - u) S >= w: its log and division are then skipped. After the
// first few entries S is about the total weight, so only an entry with 1 - u below about
// its probability w / S remains a candidate: nearly none. The test is made conservative
// for fp32 rounding: with 1 - u >= 2^-24, S >= kPruneMinScore and w >= kPruneMinWeight all
// products stay normal, and the slack kPruneSlack (1e-3) dwarfs the relative errors of the
// score (log within 1 ulp, one division, one product each side: < 2^-21 together), so a
// skipped entry's computed score is <= S and the winner is bit-for-bit the unpruned one.
constexpr float kPruneSlack = 1.001f;
constexpr float kPruneMinScore = 0x1p-60f;
constexpr float kPruneMinWeight = 0x1p-100f;

inline bool any_lane(const Vec& mask) {
#if defined(SPECDEC_X86_SIMD)
  return _mm256_movemask_ps(mask) != 0;
#else
  float lanes[Vec::size()];
  mask.store(lanes);
  for (int l = 0; l < Vec::size(); ++l)
    if (lanes[l] != 0.0f || std::signbit(lanes[l])) return true;
  return false;
#endif
}

// Race over vocabulary entries [begin, end) of the spec's row.
// check_max (spec.unchecked.size() entries, when check) receives the running maxima of
// the unchecked rows over [begin, end) (see combine_check).
template <typename scalar_t>
RaceResult race_tile(const scalar_t* logits, int64_t vocab, const RaceSpec& spec, const PhiloxPlan& plan,
                     int64_t begin, int64_t end, bool ignore_q, bool check, float* check_max) {
  const scalar_t* row = logits + spec.row * vocab;
  const float* q = ignore_q ? nullptr : spec.q;
  const bool use_excluded = !ignore_q;
  constexpr int64_t kPad = 16;  // Philox runs 16 (AVX-512) or 8 lanes at a time
  alignas(64) float buf[kChunk], w[kChunk + kPad], wc[kChunk + kPad], u[kChunk + kPad];
  alignas(64) uint32_t pos[kChunk + kPad];
  static_assert(Vec::size() == 8, "the race scores 8 lanes per vector");
  const bool avx512 = cpu_has_avx512();
  RaceResult res;
  const Vec s(spec.inv_t), vm(spec.max), zero(0.0f), minus_one(-1.0f), one(1.0f), coef(spec.coef);
  const Vec slack(kPruneSlack), min_weight(kPruneMinWeight);
  const int64_t num_check = check ? static_cast<int64_t>(spec.unchecked.size()) : 0;
  for (int64_t j = 0; j < num_check; ++j) check_max[j] = -kInf;
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, end - c0);
    for (int64_t j = 0; j < num_check; ++j)
      check_max[j] = combine_check(
          check_max[j], chunk_max(load_chunk(logits + spec.unchecked[j] * vocab + c0, n, buf), n, spec.inv_t));
    const float* x = load_chunk(row + c0, n, buf);
    const bool ahead = c0 + kChunk < vocab;  // prefetch the next chunk of every stream
    int64_t i = 0;
    for (; i < n; i += Vec::size()) {
      if (ahead && (i & 15) == 0) {  // one 64-byte line of each fp32 stream per 16 entries
        const int64_t a = std::min(c0 + kChunk + i, vocab - 1);
        prefetch(row + a);
        if (q) prefetch(q + a);
        for (int64_t j = 0; j < num_check; ++j) prefetch(logits + spec.unchecked[j] * vocab + a);
      }
      const int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
      Vec e = (Vec::loadu(x + i, cnt) * s - vm).exp_u20();
      if (q) e = at::vec::maximum(e - coef * Vec::loadu(q + c0 + i, cnt), zero);
      if (cnt < Vec::size()) e = Vec::set(zero, e, cnt);
      e.store(w + i);
    }
    const int64_t padded = (n + kPad - 1) / kPad * kPad;  // lanes beyond n hold 0
    for (; i < padded; ++i) w[i] = 0.0f;
    if (use_excluded)
      for (int64_t t : spec.excluded)
        if (t >= c0 && t < c0 + n) w[t - c0] = 0.0f;
    // Zero weights never win, so uniforms are only drawn for positive ones. A residual
    // max(p - q, 0) or a top-k-masked row is mostly zeros: then the positive entries are
    // compacted first and Philox runs on them alone (always with AVX-512, where the
    // compaction costs little).
    int64_t m = padded;
    const uint32_t* idx = nullptr;
    const float* wp = w;
#if defined(SPECDEC_X86_SIMD)
    if (avx512) {
      m = compact_positive_avx512(w, padded, pos, wc);
      for (; m % kPad != 0; ++m) pos[m] = 0, wc[m] = 0.0f;  // inert: weight 0
      idx = pos, wp = wc;
    }
#endif
    if (!avx512) {
      int64_t num_pos = 0;
      for (i = 0; i < padded; ++i) num_pos += w[i] > 0.0f;
      if (num_pos * 4 < padded * 3) {
        m = 0;
        for (i = 0; i < n; ++i) {  // branch-free append of the positive entries
          pos[m] = static_cast<uint32_t>(i);
          wc[m] = w[i];
          m += w[i] > 0.0f;
        }
        for (; m % kPad != 0; ++m) pos[m] = 0, wc[m] = 0.0f;  // inert: weight 0
        idx = pos, wp = wc;
      }
    }
    if (m == 0) continue;
    philox_uniforms(plan, static_cast<uint32_t>(c0), idx, m, u);
    for (i = 0; i < m; i += Vec::size()) {
      const Vec wv = Vec::loadu(wp + i), uv = Vec::loadu(u + i);
      const Vec best(res.score >= kPruneMinScore ? res.score : 0.0f);
      const Vec positive = wv > zero;
      if (!any_lane(positive & (((one - uv) * best < wv * slack) | (wv < min_weight)))) continue;
      // 0 - log(u) (not -log(u)): u = 1 gives +0 and w / +0 = +inf, the winner.
      const Vec score = Vec::blendv(minus_one, wv / (zero - uv.log()), positive);
      float lanes[Vec::size()];
      score.store(lanes);
      for (int l = 0; l < Vec::size(); ++l)  // in index order: ties go to the lower index
        if (lanes[l] > res.score) res.score = lanes[l], res.index = c0 + (idx ? idx[i + l] : i + l);
    }
  }
  return res;
}

// Runs every request's race, parallel over (request, tile); returns the winners (-1 where
// a request has no spec). When the weights are all zero, races over p of the same row.
template <typename scalar_t>
std::vector<int64_t> run_races(const scalar_t* logits, int64_t vocab, const std::vector<RaceSpec>& specs,
                               const int64_t* seed, const int64_t* offset, std::vector<char>& valid) {
  const int64_t batch = static_cast<int64_t>(specs.size());
  const int64_t tiles = (vocab + kRaceTile - 1) / kRaceTile;
  std::vector<RaceResult> partial(batch * tiles);
  // Maxima of the unchecked rows per (request, tile): request b's start at check_at[b].
  std::vector<int64_t> check_at(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    check_at[b + 1] = check_at[b] + tiles * static_cast<int64_t>(specs[b].unchecked.size());
  std::vector<float> check_max(check_at[batch]);
  auto run = [&](bool ignore_q, const std::vector<char>& todo) {
    at::parallel_for(0, batch * tiles, grain_for(kRaceTile), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t b = t / tiles, tile = t % tiles;
        if (!todo[b]) continue;
        const PhiloxPlan plan(make_philox_key(seed[b], offset[b], specs[b].position, kPurposeSample));
        partial[t] = race_tile(logits, vocab, specs[b], plan, tile * kRaceTile, std::min(vocab, (tile + 1) * kRaceTile),
                               ignore_q, !ignore_q,
                               check_max.data() + check_at[b] + tile * static_cast<int64_t>(specs[b].unchecked.size()));
      }
    });
  };
  auto reduce = [&](int64_t b) {
    RaceResult best;
    for (int64_t tile = 0; tile < tiles; ++tile)
      if (partial[b * tiles + tile].score > best.score) best = partial[b * tiles + tile];
    return best.index;
  };
  std::vector<char> todo(batch);
  for (int64_t b = 0; b < batch; ++b) todo[b] = specs[b].row >= 0;
  run(false, todo);
  std::vector<int64_t> winner(batch, -1);
  bool fallback = false;
  for (int64_t b = 0; b < batch; ++b) {
    if (!todo[b]) continue;
    const int64_t num_check = static_cast<int64_t>(specs[b].unchecked.size());
    for (int64_t j = 0; j < num_check; ++j) {
      float m = -kInf;
      for (int64_t tile = 0; tile < tiles; ++tile) m = combine_check(m, check_max[check_at[b] + tile * num_check + j]);
      if (!std::isfinite(m)) valid[b] = 0, todo[b] = 0;
    }
    if (!todo[b]) continue;
    winner[b] = reduce(b);
    todo[b] = winner[b] < 0;  // residual without mass (rounding only): draw from p
    fallback |= todo[b] != 0;
  }
  if (fallback) {
    run(true, todo);
    for (int64_t b = 0; b < batch; ++b)
      if (todo[b]) winner[b] = reduce(b);
  }
  return winner;
}

// Mass sum_v max(exp(l_v inv_t - m) - coef q_v, 0) of an i.i.d. tree residual.
template <typename scalar_t>
float residual_mass(const scalar_t* row, int64_t vocab, float inv_t, float m, const float* q, float coef) {
  float buf[kChunk];
  Vec acc(0.0f);
  const Vec s(inv_t), vm(m), zero(0.0f), c(coef);
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const float* x = load_chunk(row + c0, n, buf);
    for (int64_t i = 0; i < n; i += Vec::size()) {
      const int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
      Vec e = at::vec::maximum((Vec::loadu(x + i, cnt) * s - vm).exp_u20() - c * Vec::loadu(q + c0 + i, cnt), zero);
      acc = acc + Vec::set(zero, e, cnt);
    }
  }
  return hsum(acc);
}

// ---------------------------------------------------------------------------------------
// Phase 2: the acceptance walk of one request over a tree (a chain is the tree
// parents = [-1, 0, 1, ...]).
// ---------------------------------------------------------------------------------------

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

// `row0`: flat index of this request's row 0; `stats`: its rows' statistics;
// `q_rows`: this request's draft_probs rows (nullptr: deterministic / one-hot drafts).
template <typename scalar_t>
WalkResult walk(const TreeView& tree, const scalar_t* logits, int64_t vocab, int64_t row0, RowStats* stats,
                const float* q_rows, float temperature, int64_t seed, int64_t offset) {
  WalkResult res;
  int64_t node = 0;
  if (!is_sampled(temperature)) {
    while (true) {
      const int64_t best = stats[node].argmax;
      int64_t next = -1;
      for (int64_t c = tree.next_child(node, node); c >= 0; c = tree.next_child(node, c))
        if (tree.token(c) == best) {
          next = c;
          break;
        }
      if (next < 0) {
        res.final_token = best;
        return res;
      }
      res.path.push_back(next);
      node = next;
    }
  }
  const float inv_t = 1.0f / temperature;
  while (true) {
    // Rows below the root get their statistics only when the walk reaches them.
    if (!stats[node].full) stats[node] = row_stats(logits + (row0 + node) * vocab, vocab, temperature);
    if (!stats[node].valid) {
      res.invalid = true;
      return res;
    }
    const RowStats& st = stats[node];
    const scalar_t* row = logits + (row0 + node) * vocab;
    const float* q = q_rows ? q_rows + node * vocab : nullptr;
    auto e_of = [&](int64_t v) { return std::exp(static_cast<float>(row[v]) * inv_t - st.max); };
    // Residual p' = w / mass: i.i.d. drafts w = max(e - coef q, 0); deterministic drafts
    // w = e with the rejected tokens zeroed.
    float coef = 0.0f, mass = st.sum;
    std::vector<int64_t> rejected;
    int64_t next = -1;
    for (int64_t c = tree.next_child(node, node); c >= 0; c = tree.next_child(node, c)) {
      const int64_t x = tree.token(c);
      const float u = philox_uniform(seed, offset, c, kPurposeAccept, 0);
      float w_x, q_x;
      if (q) {
        q_x = q[x];
        w_x = std::max(e_of(x) - coef * q_x, 0.0f);
      } else {
        q_x = 1.0f;
        w_x = std::find(rejected.begin(), rejected.end(), x) != rejected.end() ? 0.0f : e_of(x);
      }
      const float p_x = w_x / mass;
      if (p_x > 0.0f && (q_x <= 0.0f || u <= p_x / q_x)) {
        next = c;
        break;
      }
      if (std::find(rejected.begin(), rejected.end(), x) == rejected.end()) rejected.push_back(x);
      if (tree.next_child(node, c) < 0) break;  // last sibling: the race needs no mass
      // Mass of the new residual (p' without mass, only reachable through rounding: p).
      if (q) {
        coef += mass;
        mass = residual_mass(row, vocab, inv_t, st.max, q, coef);
        if (!(mass > 0.0f)) coef = 0.0f, mass = st.sum;
      } else {
        mass -= w_x;
        if (!(mass > 0.0f)) rejected.clear(), mass = st.sum;
      }
    }
    if (next >= 0) {
      res.path.push_back(next);
      node = next;
      continue;
    }
    RaceSpec& spec = res.race;
    spec.row = row0 + node;
    spec.position = node;
    spec.max = st.max;
    spec.inv_t = inv_t;
    if (q) {
      // After the last rejection: w = max(e - (coef + mass) q, 0); without rejections
      // (a leaf) w = e.
      if (!rejected.empty()) {
        spec.q = q;
        spec.coef = coef + mass;
      }
    } else {
      spec.excluded = rejected;
    }
    return res;
  }
}

// ---------------------------------------------------------------------------------------
// Shared driver of both ops.
// ---------------------------------------------------------------------------------------

struct Request {
  TreeView tree;
  int64_t row0;      // target_logits row of node 0 (the padded layouts: b * rows per request)
  int64_t num_rows;
  int64_t q_row0;    // draft_probs row of node 0
};

template <typename scalar_t>
void sample_requests(const std::vector<Request>& reqs, const at::Tensor& logits, const float* q_base,
                     const float* temperature, const int64_t* seed, const int64_t* offset, int64_t rows_per_request,
                     std::vector<WalkResult>& walks, std::vector<char>& valid) {
  const int64_t batch = static_cast<int64_t>(reqs.size());
  const int64_t vocab = logits.size(-1);
  const scalar_t* data = logits.data_ptr<scalar_t>();
  // Phase 1. Any invalid row in use makes the request invalid, but the walk stops at the
  // first rejection, so of a sampled request only the root row surely needs its
  // statistics (exponentials): the walk computes those of the rows it reaches. The other
  // rows only need a validity check (a memory-bound max), done where arithmetic hides the
  // memory traffic: the last ~60% of them (the least likely to be reached) alongside the
  // root's exponentials here, the rest that the walk did not reach inside the race (which
  // also streams q: the split keeps the number of streams of both passes close; measured
  // best among 40 / 60%). Greedy rows need no exponentials: all are done here.
  std::vector<RowStats> stats(batch * rows_per_request);
  at::parallel_for(0, batch * rows_per_request, grain_for(vocab), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = r / rows_per_request, k = r % rows_per_request;
      const int64_t num_rows = reqs[b].num_rows;
      const float t = temperature[b];
      if (k >= num_rows || (k > 0 && is_sampled(t))) continue;
      const scalar_t* row = data + (reqs[b].row0 + k) * vocab;
      if (!is_sampled(t)) {
        stats[r] = row_stats(row, vocab, t);
        continue;
      }
      const int num_check = static_cast<int>(std::min<int64_t>(PrefetchStream::kMax - 1, (num_rows - 1) * 3 / 5));
      const int64_t first = num_rows - num_check;
      const scalar_t* check_rows[PrefetchStream::kMax];
      float check_max[PrefetchStream::kMax];
      for (int j = 0; j < num_check; ++j) check_rows[j] = data + (reqs[b].row0 + first + j) * vocab;
      stats[r] = row_stats(row, vocab, t, check_rows, num_check, check_max);
      for (int j = 0; j < num_check; ++j) {
        RowStats& checked = stats[b * rows_per_request + first + j];  // only this task writes it
        checked.checked = true;
        checked.valid = std::isfinite(check_max[j]);
      }
    }
  });
  // Phase 2.
  walks.assign(batch, WalkResult());
  valid.assign(batch, 0);
  at::parallel_for(0, batch, grain_for(vocab), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      RowStats* st = stats.data() + b * rows_per_request;
      const int64_t num_rows = reqs[b].num_rows;
      if (num_rows == 0) continue;
      bool ok = true;
      for (int64_t k = 0; k < num_rows; ++k) ok &= !(st[k].full || st[k].checked) || st[k].valid;
      if (!ok) continue;
      WalkResult w = walk(reqs[b].tree, data, vocab, reqs[b].row0, st,
                          q_base ? q_base + reqs[b].q_row0 * vocab : nullptr, temperature[b], seed[b], offset[b]);
      if (w.invalid) continue;
      if (w.race.row >= 0)
        for (int64_t k = 0; k < num_rows; ++k)
          if (!st[k].full && !st[k].checked) w.race.unchecked.push_back(reqs[b].row0 + k);
      walks[b] = std::move(w);
      valid[b] = 1;
    }
  });
  // Phase 3 (also drops the requests with an invalid unchecked row).
  std::vector<RaceSpec> specs(batch);
  for (int64_t b = 0; b < batch; ++b)
    if (valid[b]) specs[b] = walks[b].race;
  std::vector<int64_t> winner = run_races(data, vocab, specs, seed, offset, valid);
  for (int64_t b = 0; b < batch; ++b)
    if (valid[b] && specs[b].row >= 0) walks[b].final_token = winner[b];
}

// target_logits of `dims` dimensions (3: [B, rows, V]; 2: the flattened [rows, V]), whose
// leading sizes are `lead`, and draft_probs (if given) of the same layout with `q_lead`.
void check_logits_and_q(const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                        at::IntArrayRef lead, at::IntArrayRef q_lead) {
  const int64_t dims = static_cast<int64_t>(lead.size()) + 1;
  check_cpu(target_logits, "target_logits");
  check_dim(target_logits, dims, "target_logits");
  TORCH_CHECK(is_float_dtype(target_logits.scalar_type()),
              "target_logits must have dtype float32, bfloat16 or float16, got ", target_logits.scalar_type());
  for (int64_t d = 0; d + 1 < dims; ++d) check_size(target_logits, d, lead[d], "target_logits");
  const int64_t vocab = target_logits.size(dims - 1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t(1) << 31), "target_logits.size(", dims - 1,
              ") (the vocabulary) must lie in [1, 2^31), got shape ", target_logits.sizes());
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    check_cpu(q, "draft_probs");
    check_dtype(q, at::kFloat, "draft_probs");
    check_dim(q, dims, "draft_probs");
    for (int64_t d = 0; d + 1 < dims; ++d) check_size(q, d, q_lead[d], "draft_probs");
    check_size(q, dims - 1, vocab, "draft_probs");
  }
}

void check_request_params(const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                          int64_t batch) {
  for (auto [t, name, dtype] : {std::tuple{&temperature, "temperature", at::kFloat},
                                std::tuple{&seed, "seed", at::kLong}, std::tuple{&offset, "offset", at::kLong}}) {
    check_cpu(*t, name);
    check_dtype(*t, dtype, name);
    check_dim(*t, 1, name);
    check_size(*t, 0, batch, name);
  }
}

using NamedTensors = std::initializer_list<std::pair<const at::Tensor*, const char*>>;

// The outputs are written while the inputs are still read (and written one after another):
// none may share memory with an input or another output.
void check_outputs_apart(NamedTensors outputs, NamedTensors inputs) {
  for (auto it = outputs.begin(); it != outputs.end(); ++it) {
    for (const auto& [in, in_name] : inputs)
      if (in->defined()) check_no_overlap(*it->first, it->second, *in, in_name);
    for (auto other = std::next(it); other != outputs.end(); ++other)
      check_no_overlap(*it->first, it->second, *other->first, other->second);
  }
}

// The inputs every sampling op reads, made contiguous once (sample() then reads these very
// tensors, the ones the outputs were checked against).
struct SamplingInputs {
  at::Tensor logits;
  std::optional<at::Tensor> q;
  at::Tensor temp, seed, offset, no_q;
  SamplingInputs(const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                 const at::Tensor& temperature, const at::Tensor& seed_, const at::Tensor& offset_)
      : logits(target_logits.contiguous()),
        q(draft_probs.has_value() ? std::optional<at::Tensor>(draft_probs->contiguous()) : std::nullopt),
        temp(temperature.contiguous()),
        seed(seed_.contiguous()),
        offset(offset_.contiguous()) {}
  const at::Tensor* q_or_none() const { return q ? &*q : &no_q; }
};

void check_common(const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                  const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset, int64_t batch,
                  int64_t rows, int64_t q_rows) {
  check_logits_and_q(target_logits, draft_probs, {batch, rows}, {batch, q_rows});
  check_request_params(temperature, seed, offset, batch);
}

// Chain outputs: accepted drafts, the final token, -1 padding (rows of `width`); -1 counts
// for invalid requests.
void write_chain_outputs(const std::vector<Request>& reqs, const std::vector<WalkResult>& walks,
                         const std::vector<char>& valid, at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  const int64_t width = output_token_ids.size(1);
  output_token_ids.fill_(-1);
  int64_t* out = output_token_ids.data_ptr<int64_t>();
  int32_t* acc = num_accepted.data_ptr<int32_t>();
  for (size_t b = 0; b < reqs.size(); ++b) {
    if (!valid[b]) {
      acc[b] = -1;
      continue;
    }
    const auto& path = walks[b].path;
    for (size_t i = 0; i < path.size(); ++i) out[b * width + i] = reqs[b].tree.token(path[i]);
    out[b * width + path.size()] = walks[b].final_token;
    acc[b] = static_cast<int32_t>(path.size());
  }
}

// Runs the three phases for reqs on the arguments the ops share (SamplingInputs: made contiguous
// by the op, which checked its outputs against these very tensors); logits
// rows per request in the stats buffer: rows_per_request (draft_probs rows: Request::q_row0).
void sample(const std::vector<Request>& reqs, const at::Tensor& logits, const std::optional<at::Tensor>& q,
            const at::Tensor& temp, const at::Tensor& seed_c, const at::Tensor& offset_c, int64_t rows_per_request,
            std::vector<WalkResult>& walks, std::vector<char>& valid) {
  SPECDEC_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "rejection_sample", [&] {
    sample_requests<scalar_t>(reqs, logits, q ? q->data_ptr<float>() : nullptr, temp.data_ptr<float>(),
                              seed_c.data_ptr<int64_t>(), offset_c.data_ptr<int64_t>(), rows_per_request, walks,
                              valid);
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Ops.
// ---------------------------------------------------------------------------------------

void chain_rejection_sample_cpu(const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                                const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                                const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                                at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  check_cpu(draft_token_ids, "draft_token_ids");
  check_dtype(draft_token_ids, at::kLong, "draft_token_ids");
  check_dim(draft_token_ids, 2, "draft_token_ids");
  const int64_t batch = draft_token_ids.size(0), max_drafts = draft_token_ids.size(1);
  check_cpu(num_draft_tokens, "num_draft_tokens");
  check_dtype(num_draft_tokens, at::kInt, "num_draft_tokens");
  check_dim(num_draft_tokens, 1, "num_draft_tokens");
  check_size(num_draft_tokens, 0, batch, "num_draft_tokens");
  check_common(target_logits, draft_probs, temperature, seed, offset, batch, max_drafts + 1, max_drafts);
  check_output(output_token_ids, at::kLong, {batch, max_drafts + 1}, "output_token_ids");
  check_output(num_accepted, at::kInt, {batch}, "num_accepted");

  const int64_t vocab = target_logits.size(2);
  auto drafts = draft_token_ids.contiguous();
  auto num_drafts = num_draft_tokens.contiguous();
  const SamplingInputs in(target_logits, draft_probs, temperature, seed, offset);
  check_outputs_apart({{&output_token_ids, "output_token_ids"}, {&num_accepted, "num_accepted"}},
                      {{&drafts, "draft_token_ids"}, {&num_drafts, "num_draft_tokens"}, {&in.logits, "target_logits"},
                       {in.q_or_none(), "draft_probs"}, {&in.temp, "temperature"}, {&in.seed, "seed"},
                       {&in.offset, "offset"}});
  const int64_t* d = drafts.data_ptr<int64_t>();
  const int32_t* nd = num_drafts.data_ptr<int32_t>();

  std::vector<Request> reqs(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = nd[b];
    TORCH_CHECK(n >= 0 && n <= max_drafts, "num_draft_tokens[", b, "] must lie in [0, ", max_drafts, "], got ", n);
    for (int64_t k = 0; k < n; ++k)
      TORCH_CHECK(d[b * max_drafts + k] >= 0 && d[b * max_drafts + k] < vocab, "draft_token_ids[", b, ", ", k,
                  "] = ", d[b * max_drafts + k], " is not a token id in [0, ", vocab, ")");
    reqs[b] = Request{TreeView{n + 1, nullptr, d + b * max_drafts, true}, b * (max_drafts + 1), n + 1, b * max_drafts};
  }
  std::vector<WalkResult> walks;
  std::vector<char> valid;
  sample(reqs, in.logits, in.q, in.temp, in.seed, in.offset, max_drafts + 1, walks, valid);
  write_chain_outputs(reqs, walks, valid, output_token_ids, num_accepted);
}

// The flattened ragged layout of engines: request b's drafts (and draft_probs rows) are
// start_b .. start_b + n_b - 1 with start_b = cu[b - 1] (0 for b = 0) and n_b = cu[b] -
// start_b; its logits rows are start_b + b .. start_b + b + n_b (drafts' rows, then the
// bonus row). The same driver as the padded op, with each request's rows where they are.
// A negative draft id is padding (vLLM pads some decodes with -1 drafts): the request's
// drafts end there, and the token at that position is drawn from p like a bonus token.
void chain_rejection_sample_flat_cpu(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                                     const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                                     const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                                     at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  check_cpu(draft_token_ids, "draft_token_ids");
  check_dtype(draft_token_ids, at::kLong, "draft_token_ids");
  check_dim(draft_token_ids, 1, "draft_token_ids");
  const int64_t num_tokens = draft_token_ids.size(0);
  check_cpu(cu_num_draft_tokens, "cu_num_draft_tokens");
  check_dtype(cu_num_draft_tokens, at::kInt, "cu_num_draft_tokens");
  check_dim(cu_num_draft_tokens, 1, "cu_num_draft_tokens");
  const int64_t batch = cu_num_draft_tokens.size(0);
  check_logits_and_q(target_logits, draft_probs, {num_tokens + batch}, {num_tokens});
  check_request_params(temperature, seed, offset, batch);
  TORCH_CHECK(output_token_ids.dim() == 2 && output_token_ids.size(1) >= 1,
              "output_token_ids must have shape [B, K + 1] with K >= 0, got shape ", output_token_ids.sizes());
  const int64_t max_drafts = output_token_ids.size(1) - 1;
  check_output(output_token_ids, at::kLong, {batch, max_drafts + 1}, "output_token_ids");
  check_output(num_accepted, at::kInt, {batch}, "num_accepted");

  const int64_t vocab = target_logits.size(1);
  auto drafts = draft_token_ids.contiguous();
  auto cu_c = cu_num_draft_tokens.contiguous();
  const SamplingInputs in(target_logits, draft_probs, temperature, seed, offset);
  check_outputs_apart({{&output_token_ids, "output_token_ids"}, {&num_accepted, "num_accepted"}},
                      {{&drafts, "draft_token_ids"}, {&cu_c, "cu_num_draft_tokens"}, {&in.logits, "target_logits"},
                       {in.q_or_none(), "draft_probs"}, {&in.temp, "temperature"}, {&in.seed, "seed"},
                       {&in.offset, "offset"}});
  const int64_t* d = drafts.data_ptr<int64_t>();
  const int32_t* cu = cu_c.data_ptr<int32_t>();

  std::vector<Request> reqs(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = b == 0 ? 0 : cu[b - 1];
    const int64_t n = cu[b] - start;
    TORCH_CHECK(n >= 0 && n <= max_drafts, "cu_num_draft_tokens[", b, "] - cu_num_draft_tokens[", b - 1,
                "] (request ", b, "'s drafts) must lie in [0, K = ", max_drafts, "], got ", n,
                " (cu_num_draft_tokens holds inclusive prefix sums)");
    TORCH_CHECK(cu[b] <= num_tokens, "cu_num_draft_tokens[", b, "] = ", cu[b], " exceeds draft_token_ids.size(0) = ",
                num_tokens);
    int64_t used = 0;  // drafts before the first padding (negative) id
    while (used < n && d[start + used] >= 0) ++used;
    for (int64_t k = 0; k < used; ++k)
      TORCH_CHECK(d[start + k] < vocab, "draft_token_ids[", start + k, "] = ", d[start + k],
                  " is not a token id in [0, ", vocab, ") (negative ids are padding)");
    reqs[b] = Request{TreeView{used + 1, nullptr, d + start, true}, start + b, used + 1, start};
  }
  TORCH_CHECK(batch == 0 ? num_tokens == 0 : cu[batch - 1] == num_tokens, "cu_num_draft_tokens[-1] must equal "
              "draft_token_ids.size(0) = ", num_tokens, ", got ", batch == 0 ? 0 : cu[batch - 1]);
  std::vector<WalkResult> walks;
  std::vector<char> valid;
  sample(reqs, in.logits, in.q, in.temp, in.seed, in.offset, max_drafts + 1, walks, valid);
  write_chain_outputs(reqs, walks, valid, output_token_ids, num_accepted);
}

void tree_rejection_sample_cpu(const at::Tensor& parents, const at::Tensor& tree_token_ids,
                               const at::Tensor& num_nodes, const at::Tensor& target_logits,
                               const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
                               const at::Tensor& seed, const at::Tensor& offset, at::Tensor& accepted_nodes,
                               at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  check_cpu(parents, "parents");
  check_dtype(parents, at::kInt, "parents");
  check_dim(parents, 2, "parents");
  const int64_t batch = parents.size(0), max_nodes = parents.size(1);
  TORCH_CHECK(max_nodes >= 1, "parents.size(1) (the number of tree nodes) must be >= 1, got shape ", parents.sizes());
  check_cpu(tree_token_ids, "tree_token_ids");
  check_dtype(tree_token_ids, at::kLong, "tree_token_ids");
  TORCH_CHECK(tree_token_ids.sizes() == parents.sizes(), "tree_token_ids must have the shape of parents ",
              parents.sizes(), ", got ", tree_token_ids.sizes());
  check_cpu(num_nodes, "num_nodes");
  check_dtype(num_nodes, at::kInt, "num_nodes");
  check_dim(num_nodes, 1, "num_nodes");
  check_size(num_nodes, 0, batch, "num_nodes");
  check_common(target_logits, draft_probs, temperature, seed, offset, batch, max_nodes, max_nodes);
  check_output(accepted_nodes, at::kInt, {batch, max_nodes - 1}, "accepted_nodes");
  check_output(output_token_ids, at::kLong, {batch, max_nodes}, "output_token_ids");
  check_output(num_accepted, at::kInt, {batch}, "num_accepted");

  const int64_t vocab = target_logits.size(2);
  auto par = parents.contiguous();
  auto tokens = tree_token_ids.contiguous();
  auto nn = num_nodes.contiguous();
  const SamplingInputs in(target_logits, draft_probs, temperature, seed, offset);
  check_outputs_apart({{&accepted_nodes, "accepted_nodes"}, {&output_token_ids, "output_token_ids"},
                       {&num_accepted, "num_accepted"}},
                      {{&par, "parents"}, {&tokens, "tree_token_ids"}, {&nn, "num_nodes"}, {&in.logits, "target_logits"},
                       {in.q_or_none(), "draft_probs"}, {&in.temp, "temperature"}, {&in.seed, "seed"},
                       {&in.offset, "offset"}});
  const int32_t* p = par.data_ptr<int32_t>();
  const int64_t* t = tokens.data_ptr<int64_t>();
  const int32_t* n_ptr = nn.data_ptr<int32_t>();

  std::vector<Request> reqs(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = n_ptr[b];
    TORCH_CHECK(n >= 0 && n <= max_nodes, "num_nodes[", b, "] must lie in [0, ", max_nodes, "], got ", n);
    const int32_t* pb = p + b * max_nodes;
    const int64_t* tb = t + b * max_nodes;
    if (n > 0) TORCH_CHECK(pb[0] == -1, "parents[", b, ", 0] must be -1 (the root), got ", pb[0]);
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK(pb[i] >= 0 && pb[i] < i, "parents[", b, ", ", i, "] = ", pb[i], " must lie in [0, ", i,
                  ") (a parent precedes its child)");
      TORCH_CHECK(tb[i] >= 0 && tb[i] < vocab, "tree_token_ids[", b, ", ", i, "] = ", tb[i],
                  " is not a token id in [0, ", vocab, ")");
    }
    reqs[b] = Request{TreeView{n, pb, tb, false}, b * max_nodes, n, b * max_nodes};
  }
  std::vector<WalkResult> walks;
  std::vector<char> valid;
  sample(reqs, in.logits, in.q, in.temp, in.seed, in.offset, max_nodes, walks, valid);
  accepted_nodes.fill_(-1);
  output_token_ids.fill_(-1);
  int32_t* an = accepted_nodes.data_ptr<int32_t>();
  int64_t* out = output_token_ids.data_ptr<int64_t>();
  int32_t* acc = num_accepted.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    if (reqs[b].num_rows == 0) {
      acc[b] = 0;
      continue;
    }
    if (!valid[b]) {
      acc[b] = -1;
      continue;
    }
    const auto& path = walks[b].path;
    for (size_t i = 0; i < path.size(); ++i) {
      an[b * (max_nodes - 1) + i] = static_cast<int32_t>(path[i]);
      out[b * max_nodes + i] = t[b * max_nodes + path[i]];
    }
    out[b * max_nodes + path.size()] = walks[b].final_token;
    acc[b] = static_cast<int32_t>(path.size());
  }
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("chain_rejection_sample", &chain_rejection_sample_cpu);
  m.impl("chain_rejection_sample_flat", &chain_rejection_sample_flat_cpu);
  m.impl("tree_rejection_sample", &tree_rejection_sample_cpu);
}

}  // namespace specdec
