// CPU kernel of specdec::tree_attention: verification attention of all tree nodes of a batch.
//
// One call for the whole batch (docs/design.md, "Tree attention").
//
// Work is split over (request, KV head), and over the key range too when those items are
// fewer than twice the threads (flash-decoding style; partials merged by log-sum-exp). When
// every request has fewer than kGemmRows rows per KV head (plain decoding), one work item
// takes all KV heads of a request instead, so that each position's [Hkv, D] rows are read
// contiguously (a single head's rows are D elements every Hkv * D, which defeats the
// hardware prefetcher). One work item holds the queries of all n tree
// nodes of its request times the G = Hq / Hkv query heads of its GQA group as one
// [n * G, D] fp32 matrix (row r = node r / G, head h * G + r % G), so every K/V row of
// the prefix is read from memory once for all of them. Keys are visited in tiles: the
// prefix first (no mask: every node sees the whole prefix), then the tree part (positions
// prefix_len + j, j < n), the only place the bit mask is read. Each tile gathers its K/V
// rows through the block table (converted to fp32 once), computes scores = Q K^T, the
// online-softmax update and acc = acc * alpha + P V, all in fp32. With few query rows
// (plain decoding) the products are at::vec dot products / FMAs over the tile (the op is
// bandwidth-bound there); with many rows (tree verification) they are two GEMMs per tile
// through ATen (MKL/oneDNN), i.e. the small GEMM the whole GQA group shares.
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
#include "ops.h"

namespace specdec {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Keys per tile: kTile on the few-rows path (own vectorised dot products), kGemmTile when
// there are at least kGemmRows query rows and the tile's two products go to ATen's GEMM
// (MKL / oneDNN: AVX-512 where the machine has it, which this file's AVX2 build cannot use).
constexpr int64_t kTile = 32;
constexpr int64_t kGemmTile = 128;
constexpr int64_t kGemmRows = 16;
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

// Few query rows (plain decoding: n = 1): dot products with the converted key rows
// (row j at kf + j * ks), four keys at a time. scores has row stride ld.
inline void scores_dot(const float* q, int64_t rows, int64_t d_pad, const float* kf, int64_t ks, int64_t keys,
                       float* scores, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * d_pad;
    int64_t j = 0;
    for (; j + 4 <= keys; j += 4) {
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      for (int64_t d = 0; d < d_pad; d += kVec) {
        const Vec qv = Vec::loadu(qr + d);
        a0 = at::vec::fmadd(qv, Vec::loadu(kf + (j + 0) * ks + d), a0);
        a1 = at::vec::fmadd(qv, Vec::loadu(kf + (j + 1) * ks + d), a1);
        a2 = at::vec::fmadd(qv, Vec::loadu(kf + (j + 2) * ks + d), a2);
        a3 = at::vec::fmadd(qv, Vec::loadu(kf + (j + 3) * ks + d), a3);
      }
      auto sum = [](const Vec& v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v); };
      scores[r * ld + j + 0] = sum(a0);
      scores[r * ld + j + 1] = sum(a1);
      scores[r * ld + j + 2] = sum(a2);
      scores[r * ld + j + 3] = sum(a3);
    }
    for (; j < keys; ++j) {
      Vec a(0.f);
      for (int64_t d = 0; d < d_pad; d += kVec) a = at::vec::fmadd(Vec::loadu(qr + d), Vec::loadu(kf + j * ks + d), a);
      scores[r * ld + j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
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

// Per-thread scratch of one work item.
struct Scratch {
  std::vector<float> q, acc, scores, row_max, row_sum, alpha, kf, vf;
  void resize(int64_t rows, int64_t d_pad, int64_t tile, int64_t heads) {
    q.resize(rows * d_pad);
    acc.assign(rows * d_pad, 0.f);
    scores.resize(rows * tile);
    row_max.assign(rows, kNegInf);
    row_sum.assign(rows, 0.f);
    alpha.resize(rows);
    kf.resize(tile * heads * d_pad);
    vf.resize(tile * heads * d_pad);
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
  int64_t num_tokens;
  // Split-KV partials (only when the key range of a request is split over work items):
  // unnormalised acc [S, T, Hq, D], running max and sum [S, T, Hq].
  float* part_acc;
  float* part_max;
  float* part_sum;
};

// Attention of request b's nodes x the query heads of KV heads h0..h0+num_heads-1 over the
// cache positions [split * split_len, (split + 1) * split_len) of its prefix + n positions
// (all of them when split_len <= 0). Writes out/lse directly, or the split's partials.
// Rows are ordered (KV head, node, query head of the group). num_heads > 1 only on the
// few-rows path: reading every KV head of a position at once keeps the reads contiguous
// ([Hkv, D] per position) where one head alone would read D elements every Hkv * D.
template <typename scalar_t>
void attend_one(const Problem& pb, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, scalar_t* out,
                int64_t b, int64_t h0, int64_t num_heads, int64_t split, int64_t split_len, Scratch& s) {
  const int64_t q_begin = pb.qo_indptr[b];
  const int64_t n = pb.qo_indptr[b + 1] - q_begin;
  if (n <= 0) return;
  const int64_t prefix = pb.prefix_lens[b];
  const int64_t G = pb.group, D = pb.head_dim, Dp = pb.d_pad;
  const int64_t rows_per_head = n * G, Hh = num_heads;
  const int64_t rows = rows_per_head * Hh;
  const bool use_gemm = rows_per_head >= kGemmRows;
  TORCH_INTERNAL_ASSERT(!use_gemm || Hh == 1);
  const int64_t tile = use_gemm ? kGemmTile : kTile;
  const int64_t kv_stride = Hh * Dp;  // floats between consecutive positions in kf / vf
  s.resize(rows, Dp, tile, Hh);
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

  // GEMM path: ATen views of the scratch buffers (row stride d_pad / tile).
  at::Tensor q_mat, acc_mat;
  if (use_gemm) {
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    q_mat = at::from_blob(s.q.data(), {rows, D}, {Dp, 1}, opts);
    acc_mat = at::from_blob(s.acc.data(), {rows, D}, {Dp, 1}, opts);
  }
  const int64_t total = split_len > 0 ? std::min(prefix + n, (split + 1) * split_len) : prefix + n;
  for (int64_t t0 = split_len > 0 ? split * split_len : 0; t0 < total;) {
    // Tiles never straddle the prefix / tree boundary, so prefix tiles skip the mask.
    const bool tree_tile = t0 >= prefix;
    const int64_t t1 = std::min(t0 + tile, tree_tile ? total : std::min(prefix, total));
    const int64_t keys = t1 - t0;

    // Gather and convert the tile's K and V rows (each read once for all rows).
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t pos = t0 + j;
      const int64_t blk = blocks[pos / pb.block_size], off = pos % pb.block_size;
      const scalar_t* krow = k_cache + blk * pb.k_strides[0] + off * pb.k_strides[1];
      const scalar_t* vrow = v_cache + blk * pb.v_strides[0] + off * pb.v_strides[1];
      for (int64_t hh = 0; hh < Hh; ++hh) {
        row_to_float(krow + (h0 + hh) * pb.k_strides[2], s.kf.data() + j * kv_stride + hh * Dp, D, Dp);
        row_to_float(vrow + (h0 + hh) * pb.v_strides[2], s.vf.data() + j * kv_stride + hh * Dp, D, Dp);
      }
    }
    float* scores = s.scores.data();
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    at::Tensor scores_mat, v_mat;
    if (use_gemm) {
      scores_mat = at::from_blob(scores, {rows, keys}, {tile, 1}, opts);
      v_mat = at::from_blob(s.vf.data(), {keys, D}, {Dp, 1}, opts);
      at::mm_out(scores_mat, q_mat, at::from_blob(s.kf.data(), {keys, D}, {Dp, 1}, opts).t());
    } else {
      for (int64_t hh = 0; hh < Hh; ++hh) {
        scores_dot(s.q.data() + hh * rows_per_head * Dp, rows_per_head, Dp, s.kf.data() + hh * Dp, kv_stride, keys,
                   scores + hh * rows_per_head * tile, tile);
      }
    }

    if (tree_tile) {
      const int64_t j0 = t0 - prefix;  // node index of the tile's first key
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (r % rows_per_head) / G;
        float* sr = scores + r * tile;
        if (pb.tree_mask == nullptr) {
          for (int64_t j = 0; j < keys; ++j)
            if (j0 + j > i) sr[j] = kNegInf;
        } else {
          const int64_t* words = pb.tree_mask + (q_begin + i) * pb.mask_words;
          for (int64_t j = 0; j < keys; ++j) {
            const int64_t node = j0 + j;
            if (!((static_cast<uint64_t>(words[node >> 6]) >> (node & 63)) & 1u)) sr[j] = kNegInf;
          }
        }
      }
    }

    // Online softmax: new running max, rescale factor, probabilities in place.
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores + r * tile;
      float tile_max = kNegInf;
      int64_t jm = 0;
      if (keys >= kVec) {
        Vec vmax = Vec::loadu(sr);
        for (jm = kVec; jm + kVec <= keys; jm += kVec) vmax = at::vec::maximum(vmax, Vec::loadu(sr + jm));
        tile_max = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
      }
      for (; jm < keys; ++jm) tile_max = std::max(tile_max, sr[jm]);
      const float old_max = s.row_max[r];
      const float new_max = std::max(old_max, tile_max);
      if (new_max == kNegInf) {  // nothing visible yet: keep the row empty
        s.alpha[r] = 1.f;
        for (int64_t j = 0; j < keys; ++j) sr[j] = 0.f;
        continue;
      }
      s.alpha[r] = old_max == kNegInf ? 0.f : std::exp(old_max - new_max);
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
      s.row_sum[r] = s.row_sum[r] * s.alpha[r] +
                     at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum) + tail;
      s.row_max[r] = new_max;
    }

    if (use_gemm) {
      // acc = acc * alpha (per row), then acc += P V in one GEMM with beta = 1.
      for (int64_t r = 0; r < rows; ++r) {
        float* a = s.acc.data() + r * Dp;
        const Vec al(s.alpha[r]);
        for (int64_t d = 0; d < Dp; d += kVec) (Vec::loadu(a + d) * al).store(a + d);
      }
      acc_mat.addmm_(scores_mat, v_mat);
    } else {
      for (int64_t hh = 0; hh < Hh; ++hh) {
        const float* vf = s.vf.data() + hh * Dp;
        const int64_t r_end = (hh + 1) * rows_per_head;
        int64_t r = hh * rows_per_head;
        for (; r + 2 <= r_end; r += 2) pv_block<2>(scores, s.alpha.data(), vf, kv_stride, keys, Dp, s.acc.data(), r);
        for (; r < r_end; ++r) pv_block<1>(scores, s.alpha.data(), vf, kv_stride, keys, Dp, s.acc.data(), r);
      }
    }
    t0 = t1;
  }

  if (split_len > 0) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = row_token(r), head = row_head(r);
      const int64_t row = (split * pb.num_tokens + token) * pb.num_q_heads + head;
      std::copy(s.acc.data() + r * Dp, s.acc.data() + r * Dp + D, pb.part_acc + row * D);
      pb.part_max[row] = s.row_max[r];
      pb.part_sum[row] = s.row_sum[r];
    }
    return;
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
  check_size(k_cache, 3, D, "k_cache (the head dim of q)");
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
  TORCH_CHECK(qi_p[B] <= T, "qo_indptr[", B, "] = ", qi_p[B], " exceeds the number of query rows T = ", T);
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
  pb.num_tokens = T;

  // Split the key ranges when (request, KV head) items are too few for the threads; each
  // split keeps at least kMinSplitKeys positions so that partials stay cheap.
  constexpr int64_t kMinSplitKeys = 512;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (qi_p[b + 1] > qi_p[b]) max_len = std::max(max_len, static_cast<int64_t>(pl_p[b]) + qi_p[b + 1] - qi_p[b]);
  }
  // Few rows per KV head everywhere (decoding): one work item takes all KV heads of a
  // request, so that each position's [Hkv, D] K/V rows are read contiguously.
  int64_t max_nodes = 0;
  for (int64_t b = 0; b < B; ++b) max_nodes = std::max(max_nodes, static_cast<int64_t>(qi_p[b + 1] - qi_p[b]));
  const bool all_heads = max_nodes * (Hq / Hkv) < kGemmRows;
  const int64_t heads_per_item = all_heads ? Hkv : 1;
  const int64_t threads = at::get_num_threads(), items = B * (Hkv / heads_per_item);
  int64_t num_splits = 1, split_len = 0;
  if (items > 0 && items < 2 * threads && max_len >= 2 * kMinSplitKeys) {
    num_splits = std::min((2 * threads + items - 1) / items, max_len / kMinSplitKeys);
    split_len = (max_len + num_splits - 1) / num_splits;
    split_len = (split_len + kGemmTile - 1) / kGemmTile * kGemmTile;
    num_splits = (max_len + split_len - 1) / split_len;
  }
  at::Tensor partials;
  if (num_splits > 1) {
    partials = at::empty({num_splits * T * Hq * (D + 2)}, q.options().dtype(at::kFloat));
    pb.part_acc = partials.data_ptr<float>();
    pb.part_max = pb.part_acc + num_splits * T * Hq * D;
    pb.part_sum = pb.part_max + num_splits * T * Hq;
  }

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
    const int64_t groups = Hkv / heads_per_item;  // work items per request and split
    if (num_splits == 1) {
      at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch;
        for (int64_t item = begin; item < end; ++item) {
          attend_one<scalar_t>(pb, q_p, k_p, v_p, out_p, item / groups, (item % groups) * heads_per_item,
                               heads_per_item, 0, 0, scratch);
        }
      });
      return;
    }
    // Split-KV: too few (request, KV head) items to keep every thread busy, so each
    // request's key range is cut in num_splits pieces; the partials are merged per row.
    at::parallel_for(0, B * groups * num_splits, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t split = item % num_splits, bg = item / num_splits;
        attend_one<scalar_t>(pb, q_p, k_p, v_p, out_p, bg / groups, (bg % groups) * heads_per_item, heads_per_item,
                             split, split_len, scratch);
      }
    });
    at::parallel_for(qi_p[0], qi_p[B], 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t hq = 0; hq < Hq; ++hq) {
          float m = kNegInf;
          for (int64_t sp = 0; sp < num_splits; ++sp) m = std::max(m, pb.part_max[(sp * T + t) * Hq + hq]);
          float l = 0.f;
          std::vector<float> acc(D, 0.f);
          if (m != kNegInf) {
            for (int64_t sp = 0; sp < num_splits; ++sp) {
              const int64_t row = (sp * T + t) * Hq + hq;
              if (pb.part_max[row] == kNegInf) continue;
              const float w = std::exp(pb.part_max[row] - m);
              l += pb.part_sum[row] * w;
              const float* a = pb.part_acc + row * D;
              for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
            }
          }
          const float inv = l > 0.f ? 1.f / l : 0.f;
          scalar_t* dst = out_p + t * pb.out_strides[0] + hq * pb.out_strides[1];
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
          if (pb.lse != nullptr) pb.lse[t * Hq + hq] = l > 0.f ? m + std::log(l) : kNegInf;
        }
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
