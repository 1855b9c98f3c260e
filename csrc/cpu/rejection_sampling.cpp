// CPU kernels of specdec::chain_rejection_sample, specdec::tree_rejection_sample and
// specdec::apply_top_k_top_p (semantics: DESIGN.md and the docstrings in ops.py).
//
// Rejection sampling runs in three phases, none of which materialises a softmax:
//   1. row statistics, parallel over (request, row): for sampled requests the max m and
//      Z = sum_v exp(l_v / T - m) in one pass (chunk max, then sum of exponentials over the
//      chunk while it is in L1); for greedy requests the first argmax; NaN / +inf /
//      all -inf rows mark the request invalid;
//   2. the acceptance walk per request: p(x) = exp(l_x / T - m) / Z for the drafted token
//      x, compared with the uniform of (position of x, PURPOSE_ACCEPT); the walk ends with
//      a "race spec" saying from which unnormalised weights the last token is drawn:
//      w_v = max(exp(l_v / T - m) - C q_v, 0) with some tokens zeroed (C = 0 and no q for
//      the bonus token);
//   3. the exponential race argmax_v w_v / (-log u_v), parallel over (request, vocabulary
//      tile), with Philox uniforms computed 8 lanes at a time, then a reduction over tiles
//      (ties to the lower index). Only the row the walk stopped at is read again.
// Tree residuals after an i.i.d. rejection need the residual's mass; it is computed by one
// extra pass over the row per rejected sibling (never for the last one).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "check.h"
#include "ops.h"
#include "philox.h"

namespace specdec {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 1024;        // elements converted / scored at a time (fits L1)
constexpr int64_t kRaceTile = 16384;    // vocabulary entries per race task
// Below this many elements per task group a thread hand-off costs more than it saves
// (and much more on an oversubscribed machine), so tasks are grouped to at least this.
constexpr int64_t kMinParallelElements = 1 << 16;

inline int64_t grain_for(int64_t elements_per_task) {
  return std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, elements_per_task));
}
constexpr float kInf = std::numeric_limits<float>::infinity();

#define SPECDEC_DISPATCH_LOGITS(TYPE, NAME, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)                   \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// ---------------------------------------------------------------------------------------
// Loading a chunk of logits as float.
// ---------------------------------------------------------------------------------------

template <typename scalar_t>
inline const float* load_chunk(const scalar_t* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    using bVec = at::vec::Vectorized<scalar_t>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(bVec::loadu(src + i));
      lo.store(buf + i);
      hi.store(buf + i + Vec::size());
    }
    for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// Max of x[0..n) * scale, NaN-propagating (a NaN anywhere gives NaN).
inline float chunk_max(const float* x, int64_t n, float scale) {
  Vec acc(-kInf);
  const Vec s(scale);
  int64_t i = 0;
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

// sum_i exp(x[i] * scale - m) as a vector accumulator (padding lanes contribute 0).
inline Vec chunk_sum_exp(const float* x, int64_t n, float scale, float m) {
  Vec acc(0.0f);
  const Vec s(scale), vm(m);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = acc + (Vec::loadu(x + i) * s - vm).exp_u20();
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

struct RowStats {
  float max = 0.0f;      // max of l / T (sampled) or of l (greedy)
  float sum = 0.0f;      // sum exp(l / T - max) (sampled only)
  int64_t argmax = -1;   // first argmax of l (greedy only)
  bool valid = false;    // no NaN, no +inf, not all -inf
};

template <typename scalar_t>
RowStats row_stats(const scalar_t* row, int64_t vocab, float temperature) {
  RowStats st;
  const bool greedy = !(temperature > 0.0f);
  const float scale = greedy ? 1.0f : 1.0f / temperature;
  float buf[kChunk];
  float m = -kInf;
  Vec acc(0.0f);
  int64_t best = -1;
  for (int64_t begin = 0; begin < vocab; begin += kChunk) {
    const int64_t n = std::min(kChunk, vocab - begin);
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
    if (!greedy) acc = acc + chunk_sum_exp(x, n, scale, m);
  }
  if (m == -kInf) return st;  // all -inf
  st.max = m;
  st.sum = greedy ? 0.0f : hsum(acc);
  st.argmax = best;
  st.valid = greedy || (st.sum > 0.0f && std::isfinite(st.sum));
  return st;
}

// ---------------------------------------------------------------------------------------
// Philox uniforms for 8 consecutive vocabulary indices.
// ---------------------------------------------------------------------------------------

struct PhiloxKey {
  uint32_t k0, k1, c1, c2, c3;  // key words and the fixed counter words (purpose, position)
};

inline PhiloxKey make_key(int64_t seed, int64_t offset, int64_t position, uint32_t purpose) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint64_t c = static_cast<uint64_t>(offset) + static_cast<uint64_t>(position);
  return {static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32), purpose, static_cast<uint32_t>(c),
          static_cast<uint32_t>(c >> 32)};
}

// out[l] = philox_uniform(indices[l]) for l < 8.
inline void philox_uniform8(const PhiloxKey& key, const uint32_t* indices, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(indices));
  __m256i x1 = _mm256_set1_epi32(static_cast<int>(key.c1));
  __m256i x2 = _mm256_set1_epi32(static_cast<int>(key.c2));
  __m256i x3 = _mm256_set1_epi32(static_cast<int>(key.c3));
  __m256i k0 = _mm256_set1_epi32(static_cast<int>(key.k0));
  __m256i k1 = _mm256_set1_epi32(static_cast<int>(key.k1));
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __m256i w0 = _mm256_set1_epi32(static_cast<int>(0x9E3779B9u));
  const __m256i w1 = _mm256_set1_epi32(static_cast<int>(0xBB67AE85u));
  // 32 x 32 -> 64-bit products of all 8 lanes: even lanes directly, odd lanes shifted down;
  // hi and lo words are then blended back into lane order.
  auto mulhilo = [](__m256i m, __m256i x, __m256i& hi, __m256i& lo) {
    const __m256i pe = _mm256_mul_epu32(m, x);
    const __m256i po = _mm256_mul_epu32(m, _mm256_srli_epi64(x, 32));
    hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
    lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
  };
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 = _mm256_add_epi32(k0, w0);
      k1 = _mm256_add_epi32(k1, w1);
    }
    __m256i hi0, lo0, hi1, lo1;
    mulhilo(m0, x0, hi0, lo0);
    mulhilo(m1, x2, hi1, lo1);
    x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), k0);
    x1 = lo1;
    x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), k1);
    x3 = lo0;
  }
  const __m256i bits = _mm256_add_epi32(_mm256_srli_epi32(x0, 8), _mm256_set1_epi32(1));
  // (bits in [1, 2^24]) exactly representable: convert as signed int.
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(1.0f / 16777216.0f)));
#else
  for (uint32_t l = 0; l < 8; ++l) {
    Philox4x32 r = philox4x32_10(indices[l], key.c1, key.c2, key.c3, key.k0, key.k1);
    out[l] = uniform_from_bits(r.v[0]);
  }
#endif
}

// Number of positive entries among w[0..8).
inline int count_positive8(const float* w) {
#if defined(CPU_CAPABILITY_AVX2)
  return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w), _mm256_setzero_ps(), _CMP_GT_OQ)));
#else
  int c = 0;
  for (int l = 0; l < 8; ++l) c += w[l] > 0.0f;
  return c;
#endif
}

// ---------------------------------------------------------------------------------------
// Phase 3: the exponential race.
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
};

struct RaceResult {
  float score = -1.0f;
  int64_t index = -1;
};

// Race over vocabulary entries [begin, end) of the spec's row.
template <typename scalar_t>
RaceResult race_tile(const scalar_t* logits, int64_t vocab, const RaceSpec& spec, const PhiloxKey& key, int64_t begin,
                     int64_t end, bool ignore_q) {
  const scalar_t* row = logits + spec.row * vocab;
  const float* q = ignore_q ? nullptr : spec.q;
  const bool use_excluded = !ignore_q;
  float buf[kChunk], w[kChunk], u[kChunk], wc[kChunk + 8];
  uint32_t pos[kChunk + 8];
  static_assert(Vec::size() == 8, "the race processes 8 lanes (one philox_uniform8) per vector");
  RaceResult res;
  const Vec s(spec.inv_t), vm(spec.max), zero(0.0f), minus_one(-1.0f), coef(spec.coef);
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, end - c0);
    const float* x = load_chunk(row + c0, n, buf);
    int64_t i = 0;
    for (; i < n; i += Vec::size()) {
      const int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
      Vec e = (Vec::loadu(x + i, cnt) * s - vm).exp_u20();
      if (q) e = at::vec::maximum(e - coef * Vec::loadu(q + c0 + i, cnt), zero);
      if (cnt < Vec::size()) e = Vec::set(zero, e, cnt);
      e.store(w + i);
    }
    if (use_excluded)
      for (int64_t t : spec.excluded)
        if (t >= c0 && t < c0 + n) w[t - c0] = 0.0f;
    // Zero weights never win, so uniforms are only drawn for positive ones. A residual
    // max(p - q, 0) or a top-k-masked row is mostly zeros: then the positive entries are
    // compacted first and Philox runs on them alone.
    const int64_t padded = (n + 7) / 8 * 8;  // lanes beyond n hold 0
    int64_t num_pos = 0;
    for (i = 0; i < padded; i += 8) num_pos += count_positive8(w + i);
    const bool compact = num_pos * 4 < padded * 3;
    int64_t m = padded;
    if (compact) {
      m = 0;
      for (i = 0; i < n; ++i) {  // branch-free append of the positive entries
        pos[m] = static_cast<uint32_t>(i);
        wc[m] = w[i];
        m += w[i] > 0.0f;
      }
      for (int64_t j = m; j < (m + 7) / 8 * 8; ++j) pos[j] = 0, wc[j] = 0.0f;
      m = (m + 7) / 8 * 8;
    } else {
      for (i = 0; i < padded; ++i) pos[i] = static_cast<uint32_t>(i), wc[i] = w[i];
    }
    Vec vmax(-1.0f);
    for (i = 0; i < m; i += 8) {
      const Vec wv = Vec::loadu(wc + i);
      uint32_t idx[8];
      for (int l = 0; l < 8; ++l) idx[l] = static_cast<uint32_t>(c0) + pos[i + l];
      float ub[8];
      philox_uniform8(key, idx, ub);
      // 0 - log(u) (not -log(u)): u = 1 gives +0 and w / +0 = +inf, the winner.
      const Vec score = Vec::blendv(minus_one, wv / (zero - Vec::loadu(ub).log()), wv > zero);
      score.store(u + i);  // u is the score buffer (in compacted order)
      vmax = at::vec::maximum(vmax, score);
    }
    float lanes[Vec::size()];
    vmax.store(lanes);
    float cmax = -1.0f;
    for (int l = 0; l < Vec::size(); ++l) cmax = std::max(cmax, lanes[l]);
    if (cmax > res.score) {
      res.score = cmax;
      for (i = 0; i < m; ++i)  // compaction keeps the order: the first is the lowest index
        if (u[i] == cmax) break;
      res.index = c0 + pos[i];
    }
  }
  return res;
}

// Runs every request's race, parallel over (request, tile); returns the winners (-1 where
// a request has no spec). When the weights are all zero, races over p of the same row.
template <typename scalar_t>
std::vector<int64_t> run_races(const scalar_t* logits, int64_t vocab, const std::vector<RaceSpec>& specs,
                               const int64_t* seed, const int64_t* offset) {
  const int64_t batch = static_cast<int64_t>(specs.size());
  const int64_t tiles = (vocab + kRaceTile - 1) / kRaceTile;
  std::vector<RaceResult> partial(batch * tiles);
  auto run = [&](bool ignore_q, const std::vector<char>& todo) {
    at::parallel_for(0, batch * tiles, grain_for(kRaceTile), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t b = t / tiles, tile = t % tiles;
        if (!todo[b]) continue;
        const PhiloxKey key = make_key(seed[b], offset[b], specs[b].position, kPurposeSample);
        partial[t] = race_tile(logits, vocab, specs[b], key, tile * kRaceTile,
                               std::min(vocab, (tile + 1) * kRaceTile), ignore_q);
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
};

// `row0`: flat index of this request's row 0; `stats`: its rows' statistics;
// `q_rows`: this request's draft_probs rows (nullptr: deterministic / one-hot drafts).
template <typename scalar_t>
WalkResult walk(const TreeView& tree, const scalar_t* logits, int64_t vocab, int64_t row0, const RowStats* stats,
                const float* q_rows, float temperature, int64_t seed, int64_t offset) {
  WalkResult res;
  int64_t node = 0;
  if (!(temperature > 0.0f)) {
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
  int64_t row0;
  int64_t num_rows;
};

template <typename scalar_t>
void sample_requests(const std::vector<Request>& reqs, const at::Tensor& logits, const float* q_base,
                     int64_t q_rows_per_request, const float* temperature, const int64_t* seed, const int64_t* offset,
                     int64_t rows_per_request, std::vector<WalkResult>& walks, std::vector<char>& valid) {
  const int64_t batch = static_cast<int64_t>(reqs.size());
  const int64_t vocab = logits.size(-1);
  const scalar_t* data = logits.data_ptr<scalar_t>();
  // Phase 1.
  std::vector<RowStats> stats(batch * rows_per_request);
  at::parallel_for(0, batch * rows_per_request, grain_for(vocab), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = r / rows_per_request, k = r % rows_per_request;
      if (k >= reqs[b].num_rows) continue;
      stats[r] = row_stats(data + (reqs[b].row0 + k) * vocab, vocab, temperature[b]);
    }
  });
  // Phase 2.
  walks.assign(batch, WalkResult());
  valid.assign(batch, 0);
  // A chain walk reads a few scalars per request; a tree walk may pass over rows.
  const bool is_chain = batch > 0 && reqs[0].tree.chain;
  at::parallel_for(0, batch, is_chain ? std::max<int64_t>(batch, 1) : grain_for(vocab), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const RowStats* st = stats.data() + b * rows_per_request;
      if (reqs[b].num_rows == 0) continue;
      bool ok = true;
      for (int64_t k = 0; k < reqs[b].num_rows; ++k) ok &= st[k].valid;
      if (!ok) continue;
      valid[b] = 1;
      walks[b] = walk(reqs[b].tree, data, vocab, reqs[b].row0, st,
                      q_base ? q_base + b * q_rows_per_request * vocab : nullptr, temperature[b], seed[b], offset[b]);
    }
  });
  // Phase 3.
  std::vector<RaceSpec> specs(batch);
  for (int64_t b = 0; b < batch; ++b)
    if (valid[b]) specs[b] = walks[b].race;
  std::vector<int64_t> winner = run_races(data, vocab, specs, seed, offset);
  for (int64_t b = 0; b < batch; ++b)
    if (valid[b] && specs[b].row >= 0) walks[b].final_token = winner[b];
}

void check_common(const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                  const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset, int64_t batch,
                  int64_t rows, int64_t q_rows) {
  check_cpu(target_logits, "target_logits");
  check_dim(target_logits, 3, "target_logits");
  TORCH_CHECK(target_logits.scalar_type() == at::kFloat || target_logits.scalar_type() == at::kBFloat16 ||
                  target_logits.scalar_type() == at::kHalf,
              "target_logits must have dtype float32, bfloat16 or float16, got ", target_logits.scalar_type());
  check_size(target_logits, 0, batch, "target_logits");
  check_size(target_logits, 1, rows, "target_logits");
  TORCH_CHECK(target_logits.size(2) > 0 && target_logits.size(2) < (int64_t(1) << 31),
              "target_logits.size(2) (the vocabulary) must lie in [1, 2^31), got shape ", target_logits.sizes());
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    check_cpu(q, "draft_probs");
    check_dtype(q, at::kFloat, "draft_probs");
    check_dim(q, 3, "draft_probs");
    check_size(q, 0, batch, "draft_probs");
    check_size(q, 1, q_rows, "draft_probs");
    check_size(q, 2, target_logits.size(2), "draft_probs");
  }
  for (auto [t, name, dtype] : {std::tuple{&temperature, "temperature", at::kFloat},
                                std::tuple{&seed, "seed", at::kLong}, std::tuple{&offset, "offset", at::kLong}}) {
    check_cpu(*t, name);
    check_dtype(*t, dtype, name);
    check_dim(*t, 1, name);
    check_size(*t, 0, batch, name);
  }
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
  auto logits = target_logits.contiguous();
  std::optional<at::Tensor> q;
  if (draft_probs.has_value()) q = draft_probs->contiguous();
  auto temp = temperature.contiguous();
  auto seed_c = seed.contiguous();
  auto offset_c = offset.contiguous();
  const int64_t* d = drafts.data_ptr<int64_t>();
  const int32_t* nd = num_drafts.data_ptr<int32_t>();

  std::vector<Request> reqs(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = nd[b];
    TORCH_CHECK(n >= 0 && n <= max_drafts, "num_draft_tokens[", b, "] must lie in [0, ", max_drafts, "], got ", n);
    for (int64_t k = 0; k < n; ++k)
      TORCH_CHECK(d[b * max_drafts + k] >= 0 && d[b * max_drafts + k] < vocab, "draft_token_ids[", b, ", ", k,
                  "] = ", d[b * max_drafts + k], " is not a token id in [0, ", vocab, ")");
    reqs[b] = Request{TreeView{n + 1, nullptr, d + b * max_drafts, true}, b * (max_drafts + 1), n + 1};
  }
  std::vector<WalkResult> walks;
  std::vector<char> valid;
  SPECDEC_DISPATCH_LOGITS(logits.scalar_type(), "chain_rejection_sample", [&] {
    sample_requests<scalar_t>(reqs, logits, q ? q->data_ptr<float>() : nullptr, max_drafts, temp.data_ptr<float>(),
                              seed_c.data_ptr<int64_t>(), offset_c.data_ptr<int64_t>(), max_drafts + 1, walks, valid);
  });
  output_token_ids.fill_(-1);
  int64_t* out = output_token_ids.data_ptr<int64_t>();
  int32_t* acc = num_accepted.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    if (!valid[b]) {
      acc[b] = -1;
      continue;
    }
    const auto& path = walks[b].path;
    for (size_t i = 0; i < path.size(); ++i) out[b * (max_drafts + 1) + i] = d[b * max_drafts + path[i] - 1];
    out[b * (max_drafts + 1) + path.size()] = walks[b].final_token;
    acc[b] = static_cast<int32_t>(path.size());
  }
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
  auto logits = target_logits.contiguous();
  std::optional<at::Tensor> q;
  if (draft_probs.has_value()) q = draft_probs->contiguous();
  auto temp = temperature.contiguous();
  auto seed_c = seed.contiguous();
  auto offset_c = offset.contiguous();
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
    reqs[b] = Request{TreeView{n, pb, tb, false}, b * max_nodes, n};
  }
  std::vector<WalkResult> walks;
  std::vector<char> valid;
  SPECDEC_DISPATCH_LOGITS(logits.scalar_type(), "tree_rejection_sample", [&] {
    sample_requests<scalar_t>(reqs, logits, q ? q->data_ptr<float>() : nullptr, max_nodes, temp.data_ptr<float>(),
                              seed_c.data_ptr<int64_t>(), offset_c.data_ptr<int64_t>(), max_nodes, walks, valid);
  });
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

// ---------------------------------------------------------------------------------------
// apply_top_k_top_p.
// ---------------------------------------------------------------------------------------

namespace {

template <typename scalar_t>
void mask_row(scalar_t* row, int64_t vocab, int64_t k, float top_p, float min_p, std::vector<float>& vals,
              std::vector<float>& work) {
  vals.resize(vocab);
  for (int64_t v = 0; v < vocab; ++v) vals[v] = static_cast<float>(row[v]);
  float m = -kInf;
  for (float x : vals) {
    if (std::isnan(x)) return;  // rows with NaN stay as they are (the sampler flags them)
    m = std::max(m, x);
  }
  if (m == -kInf) return;
  float threshold = -kInf;
  if (k > 0 && k < vocab) {
    work.assign(vals.begin(), vals.end());
    std::nth_element(work.begin(), work.begin() + (k - 1), work.end(), std::greater<float>());
    threshold = work[k - 1];
  }
  if (top_p < 1.0f) {
    work.clear();
    for (float x : vals)
      if (x >= threshold) work.push_back(x);
    std::sort(work.begin(), work.end(), std::greater<float>());
    float z = 0.0f;
    for (float x : work) z += std::exp(x - m);
    const float target = top_p * z;
    float above = 0.0f;
    size_t i = 0;
    float t_p = m;
    while (i < work.size()) {
      if (i > 0 && !(above < target)) break;
      t_p = work[i];
      size_t j = i;
      for (; j < work.size() && work[j] == work[i]; ++j) above += std::exp(work[j] - m);
      i = j;
    }
    threshold = std::max(threshold, t_p);
  }
  const float mp = std::min(min_p, 1.0f);
  const scalar_t neg_inf = static_cast<scalar_t>(-kInf);
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = vals[v];
    if (x < threshold || (mp > 0.0f && !(std::exp(x - m) >= mp))) row[v] = neg_inf;
  }
}

}  // namespace

void apply_top_k_top_p_cpu(at::Tensor& logits, const std::optional<at::Tensor>& top_k,
                           const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p) {
  check_cpu(logits, "logits");
  check_dim(logits, 2, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              "logits must have dtype float32, bfloat16 or float16, got ", logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  std::optional<at::Tensor> k_c, p_c, mp_c;
  for (auto [t, out, name, dtype] :
       {std::tuple{&top_k, &k_c, "top_k", at::kInt}, std::tuple{&top_p, &p_c, "top_p", at::kFloat},
        std::tuple{&min_p, &mp_c, "min_p", at::kFloat}}) {
    if (!t->has_value()) continue;
    check_cpu(**t, name);
    check_dtype(**t, dtype, name);
    check_dim(**t, 1, name);
    check_size(**t, 0, rows, name);
    *out = (*t)->contiguous();
  }
  const int32_t* kp = k_c ? k_c->data_ptr<int32_t>() : nullptr;
  const float* pp = p_c ? p_c->data_ptr<float>() : nullptr;
  const float* mpp = mp_c ? mp_c->data_ptr<float>() : nullptr;
  SPECDEC_DISPATCH_LOGITS(logits.scalar_type(), "apply_top_k_top_p", [&] {
    scalar_t* data = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(vocab), [&](int64_t lo, int64_t hi) {
      std::vector<float> vals, work;
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t k = kp ? kp[r] : 0;
        const float p = pp ? pp[r] : 1.0f;
        const float mp = mpp ? mpp[r] : 0.0f;
        if ((k <= 0 || k >= vocab) && !(p < 1.0f) && !(mp > 0.0f)) continue;
        mask_row(data + r * vocab, vocab, k, p, mp, vals, work);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("chain_rejection_sample", &chain_rejection_sample_cpu);
  m.impl("tree_rejection_sample", &tree_rejection_sample_cpu);
  m.impl("apply_top_k_top_p", &apply_top_k_top_p_cpu);
}

}  // namespace specdec
