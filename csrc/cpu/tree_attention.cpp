// CPU kernel of specdec::tree_attention: verification attention of all tree nodes of a batch.
//
// One call for the whole batch (docs/design.md, "Tree attention").
//
// Work is split over (request, KV head); when every request has fewer than kFewRows rows per
// KV head (plain decoding) and the requests are at least the threads, one work item takes all
// KV heads of a request instead, so that each position's [Hkv, D] rows are read contiguously
// (a single head's rows are D elements every Hkv * D, which defeats the hardware
// prefetcher). One work item holds the queries of all n tree nodes of its request times the
// G = Hq / Hkv query heads of its GQA group as one [n * G, D] fp32 matrix (row r = node r / G,
// head h * G + r % G). Keys are visited in tiles of kTile: the whole tiles of the prefix
// first, shared by all rows (every K/V row read from memory once for all of them); then, per
// row, the rest of the prefix and the tree nodes its bit mask shows. Each tile converts its
// K/V rows to fp32 once, computes the scores (vectorised dot products), the online-softmax
// update and acc = acc * alpha + P V, all in fp32, with per-row arithmetic that does not
// depend on the other rows: a row's result is bit-identical whatever the batch, the tree and
// the threads (see attend_one). (An ATen GEMM for many rows would be faster on large trees,
// but its rounding depends on the matrix shapes.)
//
// Rows of q owned by no request (before qo_indptr[0] or from qo_indptr[B] on) and rows
// that see no key at all get out = 0 and lse = -inf: never NaN.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "check.h"
#include "linear.h"
#include "ops.h"

namespace specdec {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Visible keys per tile (the online softmax rescales once per tile), and the rows per KV
// head below which a request's KV heads share a work item.
constexpr int64_t kTile = 32;
constexpr int64_t kFewRows = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename scalar_t>
inline Vec load_as_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<scalar_t>(p, out);
    return out;
  }
}

// dst[0:d_pad] = float(src[0:d]), zero-padded (d_pad is a multiple of the vector width).
template <typename scalar_t>
inline void row_to_float(const scalar_t* src, float* dst, int64_t d, int64_t d_pad) {
  int64_t i = 0;
  for (; i + kVec <= d; i += kVec) load_as_float(src + i).store(dst + i);
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  for (; i < d_pad; ++i) dst[i] = 0.f;
}

// scores[r * ld + j] = q_r . k_j for `rows` query rows (stride d_pad) and `keys` key rows
// (key j at kf + j * ks): per (row, key) one vector of fused multiply-adds over d in
// order, reduced by skinny::hsum4 (linear.h: one fixed lane order) — the same arithmetic for
// every row count, key count and
// position in the tile. Two rows at a time share the key loads; four keys at a time share
// the reduction.
inline void scores_dot(const float* q, int64_t rows, int64_t d_pad, const float* kf, int64_t ks, int64_t keys,
                       float* scores, int64_t ld) {
  const Vec zero(0.f);
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* q0 = q + r * d_pad;
    const float* q1 = q0 + d_pad;
    for (int64_t j = 0; j < keys; j += 4) {
      const int64_t kn = std::min<int64_t>(4, keys - j);
      Vec a[2][4] = {{zero, zero, zero, zero}, {zero, zero, zero, zero}};
      for (int64_t d = 0; d < d_pad; d += kVec) {
        const Vec x0 = Vec::loadu(q0 + d), x1 = Vec::loadu(q1 + d);
        for (int64_t c = 0; c < kn; ++c) {
          const Vec kv = Vec::loadu(kf + (j + c) * ks + d);
          a[0][c] = at::vec::fmadd(x0, kv, a[0][c]);
          a[1][c] = at::vec::fmadd(x1, kv, a[1][c]);
        }
      }
      float s0[4], s1[4];
      skinny::hsum4(a[0][0], a[0][1], a[0][2], a[0][3], s0);
      skinny::hsum4(a[1][0], a[1][1], a[1][2], a[1][3], s1);
      for (int64_t c = 0; c < kn; ++c) scores[r * ld + j + c] = s0[c], scores[(r + 1) * ld + j + c] = s1[c];
    }
  }
  for (; r < rows; ++r) {
    const float* q0 = q + r * d_pad;
    for (int64_t j = 0; j < keys; j += 4) {
      const int64_t kn = std::min<int64_t>(4, keys - j);
      Vec a[4] = {zero, zero, zero, zero};
      for (int64_t d = 0; d < d_pad; d += kVec) {
        const Vec x0 = Vec::loadu(q0 + d);
        for (int64_t c = 0; c < kn; ++c) a[c] = at::vec::fmadd(x0, Vec::loadu(kf + (j + c) * ks + d), a[c]);
      }
      float s0[4];
      skinny::hsum4(a[0], a[1], a[2], a[3], s0);
      for (int64_t c = 0; c < kn; ++c) scores[r * ld + j + c] = s0[c];
    }
  }
}

// acc[r, :] = acc[r, :] * alpha[r] + sum_j p[r, j] * vf[j, :] for rows r0..r0+RB-1
// (p has row stride kTile; value row j at vf + j * vs).
template <int RB>
inline void pv_block(const float* p, const float* alpha, const float* vf, int64_t vs, int64_t keys, int64_t d_pad,
                     float* acc, int64_t r0) {
  int64_t d = 0;
  for (; d + 4 * kVec <= d_pad; d += 4 * kVec) {
    Vec a[RB][4];
    for (int i = 0; i < RB; ++i) {
      const Vec s(alpha[r0 + i]);
      for (int c = 0; c < 4; ++c) a[i][c] = Vec::loadu(acc + (r0 + i) * d_pad + d + c * kVec) * s;
    }
    for (int64_t j = 0; j < keys; ++j) {
      Vec v[4];
      for (int c = 0; c < 4; ++c) v[c] = Vec::loadu(vf + j * vs + d + c * kVec);
      for (int i = 0; i < RB; ++i) {
        const Vec pv(p[(r0 + i) * kTile + j]);
        for (int c = 0; c < 4; ++c) a[i][c] = at::vec::fmadd(pv, v[c], a[i][c]);
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int c = 0; c < 4; ++c) a[i][c].store(acc + (r0 + i) * d_pad + d + c * kVec);
  }
  for (; d < d_pad; d += kVec) {
    Vec a[RB];
    for (int i = 0; i < RB; ++i) a[i] = Vec::loadu(acc + (r0 + i) * d_pad + d) * Vec(alpha[r0 + i]);
    for (int64_t j = 0; j < keys; ++j) {
      const Vec v = Vec::loadu(vf + j * vs + d);
      for (int i = 0; i < RB; ++i) a[i] = at::vec::fmadd(Vec(p[(r0 + i) * kTile + j]), v, a[i]);
    }
    for (int i = 0; i < RB; ++i) a[i].store(acc + (r0 + i) * d_pad + d);
  }
}

// One row's score against one key row: scores_dot's arithmetic for a single key.
inline float dot_one(const float* q, const float* k, int64_t d_pad) {
  Vec a(0.f);
  for (int64_t d = 0; d < d_pad; d += kVec) a = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(k + d), a);
  float s[4];
  skinny::hsum4(a, a, a, a, s);
  return s[0];
}

// Online-softmax update of one row for a tile of `keys` scores sr (in place: scores ->
// probabilities): new running max, *alpha = the rescale factor of the old sum and acc.
inline void softmax_update(float* sr, int64_t keys, float& row_max, float& row_sum, float& alpha) {
  float tile_max = kNegInf;
  int64_t jm = 0;
  if (keys >= kVec) {
    Vec vmax = Vec::loadu(sr);
    for (jm = kVec; jm + kVec <= keys; jm += kVec) vmax = at::vec::maximum(vmax, Vec::loadu(sr + jm));
    tile_max = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
  }
  for (; jm < keys; ++jm) tile_max = std::max(tile_max, sr[jm]);
  const float old_max = row_max;
  const float new_max = std::max(old_max, tile_max);
  if (new_max == kNegInf) {  // nothing visible yet: keep the row empty
    alpha = 1.f;
    for (int64_t j = 0; j < keys; ++j) sr[j] = 0.f;
    return;
  }
  alpha = old_max == kNegInf ? 0.f : std::exp(old_max - new_max);
  const Vec m(new_max);
  Vec sum(0.f);
  int64_t j = 0;
  for (; j + kVec <= keys; j += kVec) {
    const Vec p = (Vec::loadu(sr + j) - m).exp_u20();  // ~1e-6 relative error, fine in fp32
    p.store(sr + j);
    sum = sum + p;
  }
  float tail = 0.f;
  for (; j < keys; ++j) {
    sr[j] = std::exp(sr[j] - new_max);
    tail += sr[j];
  }
  row_sum = row_sum * alpha + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum) + tail;
  row_max = new_max;
}

// Per-thread scratch of one work item.
struct Scratch {
  std::vector<float> q, acc, scores, row_max, row_sum, alpha, kf, vf;
  std::vector<int32_t> visible;
  void resize(int64_t rows, int64_t d_pad, int64_t keys, int64_t heads) {
    q.resize(rows * d_pad);
    acc.assign(rows * d_pad, 0.f);
    scores.resize(rows * kTile);
    row_max.assign(rows, kNegInf);
    row_sum.assign(rows, 0.f);
    alpha.resize(rows);
    kf.resize(keys * heads * d_pad);
    vf.resize(keys * heads * d_pad);
    visible.resize(keys);
  }
};

struct Problem {
  int64_t num_q_heads, num_kv_heads, group, head_dim, d_pad, block_size, max_blocks, mask_words;
  const int32_t* block_table;
  const int32_t* prefix_lens;
  const int32_t* qo_indptr;
  const int64_t* tree_mask;  // nullptr = causal among the new tokens
  int64_t q_strides[3], k_strides[4], v_strides[4], out_strides[3];
  float sm_scale;
  float* lse;  // nullptr when not requested; contiguous [T, Hq]
};

// K and V rows of cache positions [t0, t0 + keys) of request b, heads h0..h0+Hh-1, as fp32
// into kf / vf (position j at j * Hh * d_pad, head hh at + hh * d_pad).
template <typename scalar_t>
void gather_kv(const Problem& pb, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* blocks, int64_t t0,
               int64_t keys, int64_t h0, int64_t Hh, float* kf, float* vf) {
  const int64_t kv_stride = Hh * pb.d_pad;
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t pos = t0 + j;
    const int64_t blk = blocks[pos / pb.block_size], off = pos % pb.block_size;
    const scalar_t* krow = k_cache + blk * pb.k_strides[0] + off * pb.k_strides[1];
    const scalar_t* vrow = v_cache + blk * pb.v_strides[0] + off * pb.v_strides[1];
    for (int64_t hh = 0; hh < Hh; ++hh) {
      row_to_float(krow + (h0 + hh) * pb.k_strides[2], kf + j * kv_stride + hh * pb.d_pad, pb.head_dim, pb.d_pad);
      row_to_float(vrow + (h0 + hh) * pb.v_strides[2], vf + j * kv_stride + hh * pb.d_pad, pb.head_dim, pb.d_pad);
    }
  }
}

// Attention of request b's nodes x the query heads of KV heads h0..h0+num_heads-1. Rows are
// ordered (KV head, node, query head of the group).
//
// Batch invariance: a row's result is a function of its query and of the keys it sees, in
// order, never of the other rows, the tree around it, the batch or the threads. Each row
// runs the online softmax over its *visible* keys (the prefix, then the tree nodes its mask
// shows, in node order) in tiles of kTile visible keys aligned at multiples of kTile counted
// from the first key, with the same per-row arithmetic everywhere. So a verified node whose
// ancestors are accepted gets exactly the bits the same token gets when it is decoded alone
// after them (its visible keys are the same rows in the same order: the accepted nodes'
// K/V, compacted), and speculative greedy output equals autoregressive output even where
// the next step rounds activations (int8_activation_linear amplifies a last-bit change).
// Full prefix tiles are shared by all rows (each K/V row is read once for all of them); the
// partial prefix tile and the tree part run per row over the visible keys only.
template <typename scalar_t>
void attend_one(const Problem& pb, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, scalar_t* out,
                int64_t b, int64_t h0, int64_t num_heads, Scratch& s) {
  const int64_t q_begin = pb.qo_indptr[b];
  const int64_t n = pb.qo_indptr[b + 1] - q_begin;
  if (n <= 0) return;
  const int64_t prefix = pb.prefix_lens[b];
  const int64_t G = pb.group, D = pb.head_dim, Dp = pb.d_pad;
  const int64_t rows_per_head = n * G, Hh = num_heads;
  const int64_t rows = rows_per_head * Hh;
  const int64_t full = prefix / kTile * kTile;  // positions in whole shared tiles
  const int64_t tail = prefix - full + n;       // partial prefix tile + tree nodes
  const int64_t kv_stride = Hh * Dp;            // floats between consecutive positions in kf / vf
  s.resize(rows, Dp, std::max(kTile, tail), Hh);
  // Row r -> (token, query head).
  auto row_token = [&](int64_t r) { return q_begin + (r % rows_per_head) / G; };
  auto row_head = [&](int64_t r) { return (h0 + r / rows_per_head) * G + r % G; };
  const int32_t* blocks = pb.block_table + b * pb.max_blocks;

  // Queries of the group, pre-scaled so that scores come out scaled.
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* src = q + row_token(r) * pb.q_strides[0] + row_head(r) * pb.q_strides[1];
    float* dst = s.q.data() + r * Dp;
    row_to_float(src, dst, D, Dp);
    for (int64_t d = 0; d < D; ++d) dst[d] *= pb.sm_scale;
  }

  // Whole prefix tiles: every row sees every key (no mask).
  for (int64_t t0 = 0; t0 < full; t0 += kTile) {
    gather_kv(pb, k_cache, v_cache, blocks, t0, kTile, h0, Hh, s.kf.data(), s.vf.data());
    float* scores = s.scores.data();
    for (int64_t hh = 0; hh < Hh; ++hh) {
      scores_dot(s.q.data() + hh * rows_per_head * Dp, rows_per_head, Dp, s.kf.data() + hh * Dp, kv_stride, kTile,
                 scores + hh * rows_per_head * kTile, kTile);
    }
    for (int64_t r = 0; r < rows; ++r)
      softmax_update(scores + r * kTile, kTile, s.row_max[r], s.row_sum[r], s.alpha[r]);
    for (int64_t hh = 0; hh < Hh; ++hh) {
      const float* vf = s.vf.data() + hh * Dp;
      const int64_t r_end = (hh + 1) * rows_per_head;
      int64_t r = hh * rows_per_head;
      for (; r + 2 <= r_end; r += 2) pv_block<2>(scores, s.alpha.data(), vf, kv_stride, kTile, Dp, s.acc.data(), r);
      for (; r < r_end; ++r) pv_block<1>(scores, s.alpha.data(), vf, kv_stride, kTile, Dp, s.acc.data(), r);
    }
  }

  // The rest, per row: positions [full, prefix) and the tree nodes the row sees, in tiles of
  // kTile visible keys (the first tile continues the partial prefix tile).
  gather_kv(pb, k_cache, v_cache, blocks, full, tail, h0, Hh, s.kf.data(), s.vf.data());
  const int64_t partial = prefix - full;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = (r % rows_per_head) / G, hh = r / rows_per_head;
    int64_t count = 0;
    for (int64_t j = 0; j < partial; ++j) s.visible[count++] = static_cast<int32_t>(j);
    const int64_t* words = pb.tree_mask == nullptr ? nullptr : pb.tree_mask + (q_begin + i) * pb.mask_words;
    for (int64_t node = 0; node < n; ++node) {
      const bool seen = words == nullptr ? node <= i : ((static_cast<uint64_t>(words[node >> 6]) >> (node & 63)) & 1u);
      if (seen) s.visible[count++] = static_cast<int32_t>(partial + node);
    }
    const float* qr = s.q.data() + r * Dp;
    float* acc = s.acc.data() + r * Dp;
    float sr[kTile];
    for (int64_t c0 = 0; c0 < count; c0 += kTile) {
      const int64_t keys = std::min(kTile, count - c0);
      for (int64_t j = 0; j < keys; ++j) sr[j] = dot_one(qr, s.kf.data() + s.visible[c0 + j] * kv_stride + hh * Dp, Dp);
      float alpha;
      softmax_update(sr, keys, s.row_max[r], s.row_sum[r], alpha);
      // acc = acc * alpha + sum_j p_j v_j, element by element as pv_block does.
      for (int64_t d = 0; d < Dp; d += kVec) {
        Vec a = Vec::loadu(acc + d) * Vec(alpha);
        for (int64_t j = 0; j < keys; ++j)
          a = at::vec::fmadd(Vec(sr[j]), Vec::loadu(s.vf.data() + s.visible[c0 + j] * kv_stride + hh * Dp + d), a);
        a.store(acc + d);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = row_token(r), head = row_head(r);
    const float l = s.row_sum[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    scalar_t* dst = out + token * pb.out_strides[0] + head * pb.out_strides[1];
    const float* a = s.acc.data() + r * Dp;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
    if (pb.lse != nullptr) pb.lse[token * pb.num_q_heads + head] = l > 0.f ? s.row_max[r] + std::log(l) : kNegInf;
  }
}

}  // namespace

void tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& prefix_lens, const at::Tensor& qo_indptr,
                        const std::optional<at::Tensor>& tree_mask, double sm_scale, at::Tensor& out,
                        const std::optional<at::Tensor>& lse) {
  // ---- shapes, dtypes, devices, layouts ----
  check_cpu(q, "q");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(block_table, "block_table");
  check_cpu(prefix_lens, "prefix_lens");
  check_cpu(qo_indptr, "qo_indptr");
  check_cpu(out, "out");
  check_dim(q, 3, "q");
  check_dim(k_cache, 4, "k_cache");
  check_dim(v_cache, 4, "v_cache");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "q must have dtype float32, bfloat16 or float16, got ", dtype);
  check_dtype(k_cache, dtype, "k_cache (the dtype of q)");
  check_dtype(v_cache, dtype, "v_cache (the dtype of q)");
  check_dtype(out, dtype, "out (the dtype of q)");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(D >= 1, "q must have a head dimension of at least 1, got shape ", q.sizes());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "v_cache must have the shape of k_cache ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(block_size >= 1, "k_cache must have block_size >= 1, got shape ", k_cache.sizes());
  // Neither q nor the cache is known to be right: name both head dimensions.
  TORCH_CHECK(k_cache.size(3) == D, "q and k_cache must have the same head dimension D, got q [T, Hq, D] = ",
              q.sizes(), " and k_cache [num_blocks, block_size, Hkv, D] = ", k_cache.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "q's number of heads (", Hq, ") must be a multiple of k_cache's (", Hkv,
              ")");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have the shape of q ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(q.stride(2) == 1, "q must be contiguous in its last dimension");
  TORCH_CHECK(k_cache.stride(3) == 1, "k_cache must be contiguous in its last dimension");
  TORCH_CHECK(v_cache.stride(3) == 1, "v_cache must be contiguous in its last dimension");
  TORCH_CHECK(out.stride(2) == 1, "out must be contiguous in its last dimension");
  check_dtype(block_table, at::kInt, "block_table");
  check_dtype(prefix_lens, at::kInt, "prefix_lens");
  check_dtype(qo_indptr, at::kInt, "qo_indptr");
  check_dim(block_table, 2, "block_table");
  const int64_t B = block_table.size(0), max_blocks = block_table.size(1);
  TORCH_CHECK(prefix_lens.dim() == 1 && prefix_lens.size(0) == B, "prefix_lens must have shape [", B,
              "] (block_table's batch), got ", prefix_lens.sizes());
  TORCH_CHECK(qo_indptr.dim() == 1 && qo_indptr.size(0) == B + 1, "qo_indptr must have shape [", B + 1,
              "] (batch + 1), got ", qo_indptr.sizes());
  int64_t mask_words = 0;
  if (tree_mask.has_value()) {
    const auto& tm = *tree_mask;
    check_cpu(tm, "tree_mask");
    check_dtype(tm, at::kLong, "tree_mask");
    check_dim(tm, 2, "tree_mask");
    TORCH_CHECK(tm.size(0) == T && tm.size(1) >= 1, "tree_mask must have shape [", T, ", W >= 1], got ", tm.sizes());
    check_contiguous(tm, "tree_mask");
    mask_words = tm.size(1);
  }
  if (lse.has_value()) {
    check_cpu(*lse, "lse");
    check_dtype(*lse, at::kFloat, "lse");
    TORCH_CHECK(lse->dim() == 2 && lse->size(0) == T && lse->size(1) == Hq, "lse must have shape [", T, ", ", Hq,
                "], got ", lse->sizes());
    check_contiguous(*lse, "lse");
  }

  // ---- data: every index the kernel will follow is checked first ----
  const auto bt = block_table.contiguous();
  const auto pl = prefix_lens.contiguous();
  const auto qi = qo_indptr.contiguous();
  const int32_t* bt_p = bt.data_ptr<int32_t>();
  const int32_t* pl_p = pl.data_ptr<int32_t>();
  const int32_t* qi_p = qi.data_ptr<int32_t>();
  TORCH_CHECK(qi_p[0] >= 0, "qo_indptr[0] must be >= 0, got ", qi_p[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qi_p[b + 1] >= qi_p[b], "qo_indptr must be non-decreasing, got qo_indptr[", b, "] = ", qi_p[b],
                " > qo_indptr[", b + 1, "] = ", qi_p[b + 1]);
  }
  // Named for the caller, who may have passed num_nodes (the wrapper makes qo_indptr from it).
  TORCH_CHECK(qi_p[B] <= T, "q must have a row for every node: the requests have ", qi_p[B],
              " nodes in all (qo_indptr[", B, "], the sum of num_nodes) but q [T, Hq, D] = ", q.sizes(), " has T = ",
              T, " rows");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qi_p[b + 1] - qi_p[b];
    if (n == 0) continue;
    TORCH_CHECK(pl_p[b] >= 0, "prefix_lens[", b, "] must be >= 0, got ", pl_p[b]);
    const int64_t len = static_cast<int64_t>(pl_p[b]) + n;
    TORCH_CHECK(len <= max_blocks * block_size, "request ", b, " needs ", len, " cache positions (prefix_lens ",
                pl_p[b], " + ", n, " nodes) but block_table holds ", max_blocks, " blocks of ", block_size);
    TORCH_CHECK(!tree_mask.has_value() || n <= 64 * mask_words, "request ", b, " has ", n,
                " nodes but tree_mask has ", mask_words, " words per row (", 64 * mask_words, " nodes)");
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t blk = bt_p[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_table[", b, ", ", i, "] = ", blk, " is out of range [0, ",
                  num_blocks, ")");
    }
  }

  const auto tm_c = tree_mask.has_value() ? tree_mask->contiguous() : at::Tensor();
  Problem pb{};
  pb.num_q_heads = Hq;
  pb.num_kv_heads = Hkv;
  pb.group = Hq / Hkv;
  pb.head_dim = D;
  pb.d_pad = (D + kVec - 1) / kVec * kVec;
  pb.block_size = block_size;
  pb.max_blocks = max_blocks;
  pb.mask_words = mask_words;
  pb.block_table = bt_p;
  pb.prefix_lens = pl_p;
  pb.qo_indptr = qi_p;
  pb.tree_mask = tree_mask.has_value() ? tm_c.data_ptr<int64_t>() : nullptr;
  for (int i = 0; i < 3; ++i) pb.q_strides[i] = q.stride(i), pb.out_strides[i] = out.stride(i);
  for (int i = 0; i < 4; ++i) pb.k_strides[i] = k_cache.stride(i), pb.v_strides[i] = v_cache.stride(i);
  pb.sm_scale = static_cast<float>(sm_scale);
  pb.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;

  // Work items: (request, KV head), or (request) with all its KV heads when there are as
  // many requests as threads and every request has few rows per KV head (decoding): then
  // each position's [Hkv, D] K/V rows are read contiguously. (The key range is never split
  // over threads: split partials would make a row's bits depend on the threads and on the
  // other rows, see attend_one.)
  int64_t max_nodes = 0;
  for (int64_t b = 0; b < B; ++b) max_nodes = std::max(max_nodes, static_cast<int64_t>(qi_p[b + 1] - qi_p[b]));
  const bool all_heads = max_nodes * (Hq / Hkv) < kFewRows && B >= at::get_num_threads();
  const int64_t heads_per_item = all_heads ? Hkv : 1;

  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* q_p = q.const_data_ptr<scalar_t>();
    const scalar_t* k_p = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* v_p = v_cache.const_data_ptr<scalar_t>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    // Rows owned by no request: defined as zero output and lse = -inf.
    auto clear_rows = [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t hq = 0; hq < Hq; ++hq) {
          scalar_t* dst = out_p + t * pb.out_strides[0] + hq * pb.out_strides[1];
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(0.f);
          if (pb.lse != nullptr) pb.lse[t * Hq + hq] = kNegInf;
        }
    };
    clear_rows(0, qi_p[0]);
    clear_rows(qi_p[B], T);
    const int64_t groups = Hkv / heads_per_item;  // work items per request
    at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t item = begin; item < end; ++item) {
        attend_one<scalar_t>(pb, q_p, k_p, v_p, out_p, item / groups, (item % groups) * heads_per_item,
                             heads_per_item, scratch);
      }
    });
  };
  if (dtype == at::kFloat) {
    run(float{});
  } else if (dtype == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(at::Half{});
  }
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace specdec
