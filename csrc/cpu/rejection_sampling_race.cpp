// Phase 3 of the CPU rejection sampler (rejection_sampling.h): the exponential race
// argmax_v w_v / (-log u_v) that draws each request's last token from the weights its walk
// left (RaceSpec), parallel over (request, vocabulary tile), with the validity checks of the
// rows the walk did not reach fused in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dispatch.h"
#include "philox.h"
#include "philox_simd.h"
#include "rejection_sampling.h"

namespace specdec {
namespace rejection {
namespace {

constexpr int64_t kRaceTile = 16384;    // vocabulary entries per race task

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

// Philox runs 16 (AVX-512) or 8 lanes at a time: a chunk's weights are padded to a multiple
// of kPad entries.
constexpr int64_t kPad = 16;
static_assert(Vec::size() == 8, "the race scores 8 lanes per vector");

// The weights w[0..padded) of x, the entries [c0, c0 + n) of the spec's row (q: nullptr when
// the race ignores it; the excluded entries zeroed when use_excluded); lanes beyond n hold 0.
// Prefetches the next chunk of every stream: the row, q and the first num_check unchecked
// rows. Returns padded (n rounded up to a multiple of kPad).
template <typename scalar_t>
int64_t chunk_weights(const scalar_t* logits, int64_t vocab, const RaceSpec& spec, const float* q, bool use_excluded,
                      int64_t num_check, int64_t c0, int64_t n, const float* x, float* w) {
  const scalar_t* row = logits + spec.row * vocab;
  const Vec s(spec.inv_t), vm(spec.max), zero(0.0f), coef(spec.coef);
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
  return padded;
}

// Zero weights never win, so uniforms are only drawn for positive ones. A residual
// max(p - q, 0) or a top-k-masked row is mostly zeros: then the positive entries are
// compacted first and Philox runs on them alone (always with AVX-512, where the
// compaction costs little).
// Returns m, how many entries of w[0..padded) get a uniform (a multiple of kPad), and points
// idx at their indices in the chunk (nullptr: the entries 0..m) and wp at their weights.
inline int64_t compact_weights(bool avx512, const float* w, int64_t n, int64_t padded, uint32_t* pos, float* wc,
                               const uint32_t*& idx, const float*& wp) {
  int64_t m = padded;
  idx = nullptr;
  wp = w;
#if defined(SPECDEC_X86_SIMD)
  if (avx512) {
    m = compact_positive_avx512(w, padded, pos, wc);
    for (; m % kPad != 0; ++m) pos[m] = 0, wc[m] = 0.0f;  // inert: weight 0
    idx = pos, wp = wc;
  }
#endif
  if (!avx512) {
    int64_t num_pos = 0;
    for (int64_t i = 0; i < padded; ++i) num_pos += w[i] > 0.0f;
    if (num_pos * 4 < padded * 3) {
      m = 0;
      for (int64_t i = 0; i < n; ++i) {  // branch-free append of the positive entries
        pos[m] = static_cast<uint32_t>(i);
        wc[m] = w[i];
        m += w[i] > 0.0f;
      }
      for (; m % kPad != 0; ++m) pos[m] = 0, wc[m] = 0.0f;  // inert: weight 0
      idx = pos, wp = wc;
    }
  }
  return m;
}

// res after the m entries of the chunk at c0 (weights wp, uniforms u, indices idx: see
// compact_weights), scored in index order; the log of an entry that cannot win is skipped
// (see kPruneSlack).
inline RaceResult score_chunk(const float* wp, const float* u, const uint32_t* idx, int64_t m, int64_t c0,
                              RaceResult res) {
  const Vec zero(0.0f), minus_one(-1.0f), one(1.0f);
  const Vec slack(kPruneSlack), min_weight(kPruneMinWeight);
  for (int64_t i = 0; i < m; i += Vec::size()) {
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
  return res;
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
  alignas(64) float buf[kChunk], w[kChunk + kPad], wc[kChunk + kPad], u[kChunk + kPad];
  alignas(64) uint32_t pos[kChunk + kPad];
  const bool avx512 = cpu_has_avx512();
  RaceResult res;
  const int64_t num_check = check ? static_cast<int64_t>(spec.unchecked.size()) : 0;
  for (int64_t j = 0; j < num_check; ++j) check_max[j] = -kInf;
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, end - c0);
    for (int64_t j = 0; j < num_check; ++j)
      check_max[j] = combine_check(
          check_max[j], chunk_max(load_chunk(logits + spec.unchecked[j] * vocab + c0, n, buf), n, spec.inv_t));
    const float* x = load_chunk(row + c0, n, buf);
    const int64_t padded = chunk_weights(logits, vocab, spec, q, use_excluded, num_check, c0, n, x, w);
    const uint32_t* idx;
    const float* wp;
    const int64_t m = compact_weights(avx512, w, n, padded, pos, wc, idx, wp);
    if (m == 0) continue;
    philox_uniforms(plan, static_cast<uint32_t>(c0), idx, m, u);
    res = score_chunk(wp, u, idx, m, c0, res);
  }
  return res;
}

}  // namespace

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

template std::vector<int64_t> run_races<float>(const float*, int64_t, const std::vector<RaceSpec>&, const int64_t*,
                                               const int64_t*, std::vector<char>&);
template std::vector<int64_t> run_races<at::BFloat16>(const at::BFloat16*, int64_t, const std::vector<RaceSpec>&,
                                                      const int64_t*, const int64_t*, std::vector<char>&);
template std::vector<int64_t> run_races<at::Half>(const at::Half*, int64_t, const std::vector<RaceSpec>&,
                                                  const int64_t*, const int64_t*, std::vector<char>&);

}  // namespace rejection
}  // namespace specdec
