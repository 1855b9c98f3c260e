// Phases 1 and 2 of the CPU rejection sampler (rejection_sampling.h) and its driver,
// sample(): the statistics (max, sum of exponentials, argmax, validity) of the rows a
// request needs, and the acceptance walk of each request down its tree, which ends with
// the race spec of phase 3 (rejection_sampling_race.cpp) or, for greedy requests, the token.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "philox.h"
#include "rejection_sampling.h"

namespace specdec {
namespace rejection {
namespace {

// Requests with T >= 2^-64 sample; smaller temperatures (and 0, negative, NaN) are greedy,
// the limit of sampling as T -> 0 (MIN_SAMPLING_TEMPERATURE, specdec_kernels/checks.py:
// below it l / T would overflow fp32 for ordinary logits and the request would read as
// invalid).
constexpr float kMinSamplingTemperature = 0x1p-64f;
inline bool is_sampled(float temperature) { return temperature >= kMinSamplingTemperature; }

// ---------------------------------------------------------------------------------------
// Phase 1: row statistics.
// ---------------------------------------------------------------------------------------

// First index i < n with x[i] * scale == value (value was found by chunk_max).
inline int64_t first_equal(const float* x, int64_t n, float scale, float value) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] * scale == value) return i;
  return 0;
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

// The walk of a greedy request: down the child whose token is its parent's first argmax.
inline WalkResult walk_greedy(const TreeView& tree, const RowStats* stats) {
  WalkResult res;
  int64_t node = 0;
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

// The acceptance tests of a node's children (try_children).
struct Children {
  int64_t next;                   // the accepted child, -1: none
  float coef, mass;               // the residual after the rejections (see try_children)
  std::vector<int64_t> rejected;  // the rejected tokens, each once
};

// Tests the children of `node` of a sampled request in order, up to the first accepted one;
// row: the node's logits row, with statistics st; q: its draft_probs row (nullptr:
// deterministic / one-hot drafts).
template <typename scalar_t>
Children try_children(const TreeView& tree, int64_t node, const scalar_t* row, int64_t vocab, const float* q,
                      const RowStats& st, float inv_t, int64_t seed, int64_t offset) {
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
  return {next, coef, mass, std::move(rejected)};
}

// `row0`: flat index of this request's row 0; `stats`: its rows' statistics;
// `q_rows`: this request's draft_probs rows (nullptr: deterministic / one-hot drafts).
template <typename scalar_t>
WalkResult walk(const TreeView& tree, const scalar_t* logits, int64_t vocab, int64_t row0, RowStats* stats,
                const float* q_rows, float temperature, int64_t seed, int64_t offset) {
  if (!is_sampled(temperature)) return walk_greedy(tree, stats);
  WalkResult res;
  int64_t node = 0;
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
    const Children tried = try_children(tree, node, row, vocab, q, st, inv_t, seed, offset);
    if (tried.next >= 0) {
      res.path.push_back(tried.next);
      node = tried.next;
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
      if (!tried.rejected.empty()) {
        spec.q = q;
        spec.coef = tried.coef + tried.mass;
      }
    } else {
      spec.excluded = tried.rejected;
    }
    return res;
  }
}

// ---------------------------------------------------------------------------------------
// The driver of the three phases.
// ---------------------------------------------------------------------------------------

// Phase 1. Any invalid row in use makes the request invalid, but the walk stops at the
// first rejection, so of a sampled request only the root row surely needs its
// statistics (exponentials): the walk computes those of the rows it reaches. The other
// rows only need a validity check (a memory-bound max), done where arithmetic hides the
// memory traffic: the last ~60% of them (the least likely to be reached) alongside the
// root's exponentials here, the rest that the walk did not reach inside the race (which
// also streams q: the split keeps the number of streams of both passes close; measured
// best among 40 / 60%). Greedy rows need no exponentials: all are done here.
template <typename scalar_t>
std::vector<RowStats> first_stats(const std::vector<Request>& reqs, const scalar_t* data, int64_t vocab,
                                  const float* temperature, int64_t rows_per_request) {
  const int64_t batch = static_cast<int64_t>(reqs.size());
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
  return stats;
}

// Phase 2: the walk of every request whose rows are valid as far as phase 1 checked them;
// its race spec gets the rows in use that neither phase 1 nor the walk checked.
template <typename scalar_t>
void walk_requests(const std::vector<Request>& reqs, const scalar_t* data, int64_t vocab, const float* q_base,
                   const float* temperature, const int64_t* seed, const int64_t* offset, int64_t rows_per_request,
                   std::vector<RowStats>& stats, std::vector<WalkResult>& walks, std::vector<char>& valid) {
  const int64_t batch = static_cast<int64_t>(reqs.size());
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
}

template <typename scalar_t>
void sample_requests(const std::vector<Request>& reqs, const at::Tensor& logits, const float* q_base,
                     const float* temperature, const int64_t* seed, const int64_t* offset, int64_t rows_per_request,
                     std::vector<WalkResult>& walks, std::vector<char>& valid) {
  const int64_t batch = static_cast<int64_t>(reqs.size());
  const int64_t vocab = logits.size(-1);
  const scalar_t* data = logits.data_ptr<scalar_t>();
  std::vector<RowStats> stats = first_stats(reqs, data, vocab, temperature, rows_per_request);
  walk_requests(reqs, data, vocab, q_base, temperature, seed, offset, rows_per_request, stats, walks, valid);
  // Phase 3 (also drops the requests with an invalid unchecked row).
  std::vector<RaceSpec> specs(batch);
  for (int64_t b = 0; b < batch; ++b)
    if (valid[b]) specs[b] = walks[b].race;
  std::vector<int64_t> winner = run_races(data, vocab, specs, seed, offset, valid);
  for (int64_t b = 0; b < batch; ++b)
    if (valid[b] && specs[b].row >= 0) walks[b].final_token = winner[b];
}

}  // namespace

void sample(const std::vector<Request>& reqs, const at::Tensor& logits, const std::optional<at::Tensor>& q,
            const at::Tensor& temp, const at::Tensor& seed_c, const at::Tensor& offset_c, int64_t rows_per_request,
            std::vector<WalkResult>& walks, std::vector<char>& valid) {
  SPECDEC_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "rejection_sample", [&] {
    sample_requests<scalar_t>(reqs, logits, q ? q->data_ptr<float>() : nullptr, temp.data_ptr<float>(),
                              seed_c.data_ptr<int64_t>(), offset_c.data_ptr<int64_t>(), rows_per_request, walks,
                              valid);
  });
}

}  // namespace rejection
}  // namespace specdec
