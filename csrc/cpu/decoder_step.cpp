// The decode / verification forward of a model's layer stack in one call (CPU), the fast path
// of models.llama.Llama.forward.
//
// It is models.block.DecoderBlock followed by models.block.paged_attention, layer after
// layer: the same ATen ops and the same specdec kernels, called in the same order on the same
// operands, so its outputs are the Python path's bits (tests/test_decoder_step.py). What it
// removes is the interpreter between them: ~25 torch calls per layer, each with its Python
// argument parsing, and the Python of the block itself (~0.4 ms per layer on a 2-core EPYC,
// more than a SmolLM2 layer's products). The products call the kernels directly, not through
// the dispatcher, because their arguments were checked when the stack was built.
//
// A layer's four products (q|k|v, o, gate|up, down) are each a list of parts whose outputs are
// concatenated (a fused weight whose rows have different GGUF types), each part one of: a
// dense fp32/bf16 tensor (ops.linear's rule: skinny_linear for the caller's row range, else
// at::linear), raw GGUF blocks (quantized_linear) or int8-activation packing
// (int8_activation_linear). Python builds it (models.decoder_step).
//
// With fp32 activations (every weight format but bf16) the layer loop runs on buffers kept per
// row count and on raw loops (norm, RoPE, residuals, SiLU): it makes no ATen call between the
// kernels. A decode step's products stream tens of MB of weights through the caches, so any
// code between them runs cold: an ATen allocation or view costs ~2 us there and torch's silu
// ~20 us a layer (measured on the 1.5B), against ~1 ms for the whole step's arithmetic
// outside the products. Other dtypes take the general path below, with the same kernels.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "ops.h"
#include "rms_norm.h"
#include "silu_and_mul.h"

namespace specdec {

namespace {

enum PartKind : int64_t { kDense = 0, kBlocks = 1, kInt8 = 2 };

struct Part {
  at::Tensor weight;  // dense [N, H]; blocks uint8 [N, row bytes]; int8 packing uint8 [ceil(N/16), ., .]
  int64_t kind, block_type, rows;
  std::optional<at::Tensor> bias;  // [N] (the part's slice of the product's bias)
};

using Product = std::vector<Part>;

struct Layer {
  at::Tensor attn_norm, mlp_norm;
  Product qkv, o, gate_up, down;
  const float* attn_norm_p = nullptr;  // the norms' data where they are fp32 and contiguous (the fp32 loop)
  const float* mlp_norm_p = nullptr;
};

// The rotary tables' rows of a forward's tokens: cos, sin [R, D] (models.block.rope_tables, in
// the activations' dtype), rows[t] the row of token t (its position; checked to be < R).
struct RopeRows {
  at::Tensor cos, sin;
  std::vector<int64_t> rows;
};

struct RowRange {
  int64_t lo, hi;  // dense parts use skinny_linear for lo <= rows <= hi (models.skinny_rows)
};

// A block part's product into out [M, rows] (fp32, contiguous): QuantizedWeight.linear.
void block_product(const at::Tensor& flat, const Part& p, at::Tensor out) {
  if (p.kind == kInt8) {
    int8_activation_linear_cpu(flat, p.weight, p.block_type, p.bias, out);
  } else {
    quantized_linear_cpu(flat, p.weight, p.block_type, p.bias, out);
  }
}

at::Tensor part_product(const at::Tensor& x, const Part& p, RowRange skinny) {
  const int64_t H = x.size(-1), M = x.numel() / H;
  if (p.kind == kDense) {  // ops.linear
    const auto t = x.scalar_type();
    const bool use_skinny = skinny.lo <= M && M <= skinny.hi && (t == at::kFloat || t == at::kBFloat16) &&
                            p.weight.scalar_type() == t && p.weight.is_contiguous() &&
                            (!p.bias.has_value() || p.bias->scalar_type() == t);
    if (!use_skinny) return at::linear(x, p.weight, p.bias);
    at::Tensor out = at::empty({M, p.rows}, x.options());
    skinny_linear_cpu(x.reshape({M, H}), p.weight, p.bias, out);
    return out;
  }
  at::Tensor flat = x.reshape({M, H});  // QuantizedWeight.linear
  if (!flat.is_contiguous()) flat = flat.contiguous();
  at::Tensor out = at::empty({M, p.rows}, x.options().dtype(at::kFloat));
  block_product(flat, p, out);
  return out;
}

at::Tensor product(const at::Tensor& x, const Product& parts, RowRange skinny) {
  if (parts.size() == 1) return part_product(x, parts[0], skinny);
  const int64_t H = x.size(-1), M = x.numel() / H;
  const bool blocks = std::all_of(parts.begin(), parts.end(), [](const Part& p) { return p.kind != kDense; });
  if (M == 1 && blocks) {  // one row: each part's columns are a contiguous slice of the output (no cat)
    int64_t N = 0;
    for (const Part& p : parts) N += p.rows;
    at::Tensor flat = x.reshape({1, H}).contiguous();
    at::Tensor out = at::empty({1, N}, x.options().dtype(at::kFloat));
    int64_t col = 0;
    for (const Part& p : parts) {
      block_product(flat, p, out.narrow(1, col, p.rows));
      col += p.rows;
    }
    return out;
  }
  std::vector<at::Tensor> outs;
  outs.reserve(parts.size());
  for (const Part& p : parts) outs.push_back(part_product(x, p, skinny));
  return at::cat(outs, -1);
}

// The product of x [M, H] (fp32, contiguous) into out [M, N] (fp32, contiguous), for the
// fp32 path, whose dense parts are fp32 (DecoderStack::fp32_ready_). part_views: out's column
// slices, one per part, where M = 1 (none: made here).
void product_into(const at::Tensor& x, const Product& parts, RowRange skinny, at::Tensor& out,
                  const std::vector<at::Tensor>& part_views) {
  const int64_t M = x.size(0);
  auto one = [&](const Part& p, at::Tensor dst) {
    if (p.kind != kDense) {
      block_product(x, p, dst);
    } else if (skinny.lo <= M && M <= skinny.hi) {
      skinny_linear_cpu(x, p.weight, p.bias, dst);
    } else {
      dst.copy_(at::linear(x, p.weight, p.bias));
    }
  };
  if (parts.size() == 1) return one(parts[0], out);
  int64_t col = 0;
  for (size_t j = 0; j < parts.size(); ++j) {
    const Part& p = parts[j];
    if (M == 1) {
      one(p, part_views.empty() ? out.narrow(1, col, p.rows) : part_views[j]);
    } else {
      at::Tensor part = at::empty({M, p.rows}, out.options());
      one(p, part);
      out.narrow(1, col, p.rows).copy_(part);
    }
    col += p.rows;
  }
}

// out = a + b over n fp32 values (the residuals; at::add's single rounding).
void add_into(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// A layer's activations for one row count T (fp32, contiguous), kept between calls.
struct Buffers {
  at::Tensor normed, qkv, q, attn, h, o, gate_up, act, x;  // [T, H], [T, W], [T, Hq, D] x2, [T, H] x3 (h, o|down, x), [T, 2I], [T, I]
  std::vector<std::vector<at::Tensor>> part_views;         // [4 L]: a product's column slices of its output (T = 1, several parts)
};

}  // namespace

class DecoderStack {
 public:
  // norms: [2 L (+ 1)] (attn_norm, mlp_norm of each layer, then the final norm where the stack
  // has the LM head); weights: one per part, in the order layer, product (q|k|v, o, gate|up,
  // down), part, then the LM head's parts; part_info: 4 ints per part (kind, block_type, rows,
  // index into biases or -1); parts_per_product: [4 L (+ 1: the LM head's)].
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, std::vector<at::Tensor> norms,
               std::vector<at::Tensor> weights, std::vector<int64_t> part_info,
               std::vector<int64_t> parts_per_product, std::vector<at::Tensor> biases)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0 && num_heads % num_kv_heads == 0,
                "DecoderStack: bad head shape (num_heads ", num_heads, ", num_kv_heads ", num_kv_heads, ", head_dim ",
                head_dim, ")");
    const bool has_head = norms.size() % 2 == 1;
    TORCH_CHECK(parts_per_product.size() + (has_head ? 1 : 0) == 2 * norms.size(),
                "DecoderStack: norms must hold 2 tensors per layer (+ the final norm) and parts_per_product 4 counts "
                "per layer (+ the LM head's), got ", norms.size(), " and ", parts_per_product.size());
    TORCH_CHECK(part_info.size() == 4 * weights.size(), "DecoderStack: part_info must hold 4 ints per weight, got ",
                part_info.size(), " for ", weights.size(), " weights");
    size_t next = 0;
    auto take = [&](int64_t count) {
      Product parts;
      TORCH_CHECK(count > 0 && next + count <= weights.size(), "DecoderStack: parts_per_product does not match weights");
      for (int64_t j = 0; j < count; ++j, ++next) {
        const int64_t* info = &part_info[4 * next];
        TORCH_CHECK(info[0] >= kDense && info[0] <= kInt8, "DecoderStack: bad part kind ", info[0]);
        TORCH_CHECK(info[3] < static_cast<int64_t>(biases.size()), "DecoderStack: bias index out of range");
        TORCH_CHECK(weights[next].device().is_cpu(), "DecoderStack: weights must be on the CPU");
        std::optional<at::Tensor> bias;
        if (info[3] >= 0) bias = biases[info[3]];
        parts.push_back(Part{weights[next], info[0], info[1], info[2], bias});
      }
      return parts;
    };
    for (size_t i = 0; i < norms.size() / 2; ++i) {
      const int64_t* counts = &parts_per_product[4 * i];
      Layer L{norms[2 * i], norms[2 * i + 1], take(counts[0]), take(counts[1]), take(counts[2]), take(counts[3])};
      layers_.push_back(std::move(L));
    }
    if (has_head) {
      final_norm_ = norms.back();
      head_ = take(parts_per_product.back());
    }
    TORCH_CHECK(next == weights.size(), "DecoderStack: ", weights.size() - next, " weights left over");
    TORCH_CHECK(!layers_.empty() || !has_head, "DecoderStack: an LM head needs at least one layer");
    fp32_ready_ = std::all_of(norms.begin(), norms.end(), [](const at::Tensor& n) {
      return n.scalar_type() == at::kFloat && n.is_contiguous() && n.dim() == 1;
    });
    auto dense_fp32 = [](const Product& prod) {
      return std::all_of(prod.begin(), prod.end(),
                         [](const Part& p) { return p.kind != kDense || p.weight.scalar_type() == at::kFloat; });
    };
    for (const Layer& L : layers_) {
      fp32_ready_ = fp32_ready_ && dense_fp32(L.qkv) && dense_fp32(L.o) && dense_fp32(L.gate_up) && dense_fp32(L.down);
    }
    fp32_ready_ = fp32_ready_ && dense_fp32(head_);
    if (fp32_ready_) {
      for (Layer& L : layers_) {
        L.attn_norm_p = L.attn_norm.data_ptr<float>();
        L.mlp_norm_p = L.mlp_norm.data_ptr<float>();
      }
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Benchmarks: accumulate the seconds spent inside the products, the attention kernel and
  // (the fp32 layer loop only) the norms, RoPE with the K/V write, SiLU and the residuals;
  // take_timings returns [products, attention, norms, rope_kv, silu, residuals] since the last
  // take and resets them.
  void set_timing(bool on) { timing_ = on; }
  std::vector<double> take_timings() {
    std::vector<double> t{products_s_, attention_s_, norms_s_, rope_s_, silu_s_, residuals_s_};
    products_s_ = attention_s_ = norms_s_ = rope_s_ = silu_s_ = residuals_s_ = 0;
    return t;
  }

  // One layer's halves, for a caller with its own attention in between (the EAGLE head):
  // DecoderBlock.qkv, x [T, H] -> [q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]] (RoPE on q, k)...
  // cos, sin [T, 1, D] (models.block.rope_at).
  std::vector<at::Tensor> qkv(int64_t layer, at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t skinny_min_rows,
                              int64_t skinny_max_rows) {
    const Layer& L = checked_layer(layer, x);
    const int64_t T = x.size(0);
    const at::Tensor qkv = timed_product(norm(x, L.attn_norm), L.qkv, RowRange{skinny_min_rows, skinny_max_rows});
    at::Tensor q = at::empty({T, num_heads_, head_dim_}, qkv.options());
    at::Tensor k = at::empty({T, num_kv_heads_, head_dim_}, qkv.options());
    at::Tensor v = at::empty_like(k);
    RopeRows rope{cos.reshape({T, head_dim_}), sin.reshape({T, head_dim_}), std::vector<int64_t>(T)};
    for (int64_t t = 0; t < T; ++t) rope.rows[t] = t;
    rope_and_write(qkv, rope, at::arange(T, x.options().dtype(at::kLong)), k, v, q);
    return {q, k, v};
  }

  // ... and DecoderBlock.output, x [T, H], attn [T, Hq * D] -> [T, H].
  at::Tensor output_of(int64_t layer, at::Tensor x, at::Tensor attn, int64_t skinny_min_rows, int64_t skinny_max_rows) {
    return output(checked_layer(layer, x), x, attn, RowRange{skinny_min_rows, skinny_max_rows});
  }

  // The hidden states the next forward copies out besides its last one (EAGLE-3's low and
  // middle features): the outputs of the given layer counts (each in [1, num_layers of that
  // forward]), read in that order with take_captured, which also clears the request. Set and
  // taken around one call by its caller (Llama.forward_logits' feature_layers); a stack serves
  // one caller at a time there.
  void set_capture(std::vector<int64_t> counts) {
    for (int64_t n : counts) {
      TORCH_CHECK(n >= 1 && n <= num_layers(), "DecoderStack.set_capture: layer counts must be in [1, ", num_layers(),
                  "], got ", n);
    }
    capture_ = std::move(counts);
    captured_.assign(capture_.size(), at::Tensor());
  }
  std::vector<at::Tensor> take_captured() {
    std::vector<at::Tensor> out = std::move(captured_);
    const std::vector<int64_t> counts = std::move(capture_);
    capture_.clear();
    captured_.clear();
    for (size_t j = 0; j < counts.size(); ++j) {
      TORCH_CHECK(out[j].defined(), "DecoderStack.take_captured: the last forward ran fewer than ", counts[j],
                  " layers");
    }
    return out;
  }

  // h [T, H] (the embeddings) through the first num_layers layers; positions int32/int64 [T]
  // (RoPE's), cos, sin [R, D] (the model's tables, models.block.rope_tables; positions < R);
  // the caches and batch fields as models.block.paged_attention takes them (k_caches /
  // v_caches: one [num_blocks, block_size, Hkv, D] tensor per layer). Writes the new K/V into
  // the caches; returns the last hidden states [T, H].
  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor block_table,
                     at::Tensor prefix_lens, at::Tensor qo_indptr, at::Tensor slot_mapping,
                     std::optional<at::Tensor> tree_mask, int64_t num_layers, int64_t skinny_min_rows,
                     int64_t skinny_max_rows) {
    TORCH_CHECK(num_layers >= 0 && num_layers <= this->num_layers(), "DecoderStack.forward: num_layers must be in [0, ",
                this->num_layers(), "], got ", num_layers);
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) >= num_layers &&
                    static_cast<int64_t>(v_caches.size()) >= num_layers,
                "DecoderStack.forward: need a K and a V cache per layer");
    TORCH_CHECK(h.dim() == 2 && h.device().is_cpu(), "DecoderStack.forward: h must be a CPU tensor [T, H], got ",
                h.sizes());
    const RowRange skinny{skinny_min_rows, skinny_max_rows};
    const double sm_scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    const RopeRows rope = rope_rows(positions, cos, sin, h.size(0));
    if (fp32_ready_ && num_layers > 0 && h.scalar_type() == at::kFloat && h.size(1) == layers_[0].attn_norm.size(0)) {
      std::optional<RawCaches> raw = raw_caches(k_caches, v_caches, slot_mapping, rope, num_layers, h.size(0));
      if (raw.has_value()) {
        return forward_fp32(h.contiguous(), rope, *raw, k_caches, v_caches, block_table, prefix_lens, qo_indptr,
                            tree_mask, num_layers, skinny, sm_scale);
      }
    }
    at::Tensor x = h;
    for (int64_t i = 0; i < num_layers; ++i) {
      const at::Tensor attn = attention(layers_[i], x, rope, k_caches[i], v_caches[i], block_table, prefix_lens,
                                        qo_indptr, slot_mapping, tree_mask, sm_scale, skinny);
      x = output(layers_[i], x, attn, skinny);
      keep_captured(i + 1, x);
    }
    return x;
  }

  // forward_logits of chain rows (causal among each request's rows, no tree mask) whose batch
  // comes as the cache's host integers, not tensors (Llama.decode_logits): each tensor made in
  // Python costs ~25 us when cold, as a step that has just streamed the weights finds it.
  // positions, slot_mapping [T]; block_table [B * max_blocks] (row-major); prefix_lens [B];
  // qo_indptr [B + 1].
  std::vector<at::Tensor> forward_logits_host(at::Tensor h, std::vector<int64_t> positions, at::Tensor cos,
                                              at::Tensor sin, std::vector<at::Tensor> k_caches,
                                              std::vector<at::Tensor> v_caches, std::vector<int32_t> block_table,
                                              std::vector<int32_t> prefix_lens, std::vector<int32_t> qo_indptr,
                                              std::vector<int64_t> slot_mapping, int64_t num_layers,
                                              int64_t skinny_min_rows, int64_t skinny_max_rows) {
    const int64_t B = static_cast<int64_t>(prefix_lens.size());
    TORCH_CHECK(B > 0 && !block_table.empty() && static_cast<int64_t>(block_table.size()) % B == 0,
                "DecoderStack.forward_logits_host: block_table must hold B = ", B, " rows of equal width, got ",
                block_table.size(), " entries");
    const auto host = [](auto& v, at::ScalarType t) {
      return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(t));
    };
    const at::Tensor table = host(block_table, at::kInt).view({B, -1});
    return forward_logits(h, host(positions, at::kLong), cos, sin, std::move(k_caches), std::move(v_caches), table,
                          host(prefix_lens, at::kInt), host(qo_indptr, at::kInt), host(slot_mapping, at::kLong),
                          std::nullopt, num_layers, skinny_min_rows, skinny_max_rows);
  }

  // forward, then the final norm and the LM head over every row (Llama.logits): [hidden [T, H],
  // logits fp32 [T, V]]. Only for a stack built with the LM head.
  std::vector<at::Tensor> forward_logits(at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                         std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                         at::Tensor block_table, at::Tensor prefix_lens, at::Tensor qo_indptr,
                                         at::Tensor slot_mapping, std::optional<at::Tensor> tree_mask,
                                         int64_t num_layers, int64_t skinny_min_rows, int64_t skinny_max_rows) {
    TORCH_CHECK(!head_.empty(), "DecoderStack.forward_logits: the stack was built without the LM head");
    const at::Tensor hidden = forward(h, positions, cos, sin, std::move(k_caches), std::move(v_caches), block_table,
                                      prefix_lens, qo_indptr, slot_mapping, tree_mask, num_layers, skinny_min_rows,
                                      skinny_max_rows);
    const RowRange skinny{skinny_min_rows, skinny_max_rows};
    const int64_t T = hidden.size(0), H = hidden.size(1);
    if (fp32_ready_ && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && H == final_norm_.size(0)) {
      int64_t V = 0;
      for (const Part& p : head_) V += p.rows;
      at::Tensor normed = at::empty({T, H}, hidden.options());
      timed(norms_s_, [&] {
        rms_norm_rows(hidden.data_ptr<float>(), final_norm_.data_ptr<float>(), normed.data_ptr<float>(), T, H,
                      static_cast<float>(eps_));
      });
      at::Tensor logits = at::empty({T, V}, hidden.options());
      timed_product_into(normed, head_, skinny, logits, {});
      return {hidden, logits};
    }
    return {hidden, timed_product(norm(hidden, final_norm_), head_, skinny).to(at::kFloat)};
  }

 private:
  static constexpr int64_t kMaxBufferedRows = 64;  // decode and verification steps; more rows allocate per call

  Buffers make_buffers(int64_t T) const {
    const int64_t H = layers_[0].attn_norm.size(0), Hq = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
    int64_t I = 0;
    for (const Part& p : layers_[0].gate_up) I += p.rows;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    Buffers b{at::empty({T, H}, f32), at::empty({T, (Hq + 2 * Hkv) * D}, f32), at::empty({T, Hq, D}, f32),
              at::empty({T, Hq, D}, f32), at::empty({T, H}, f32), at::empty({T, H}, f32), at::empty({T, I}, f32),
              at::empty({T, I / 2}, f32), at::empty({T, H}, f32), {}};
    b.part_views.resize(4 * layers_.size());
    if (T != 1) return b;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const std::pair<const Product*, at::Tensor*> prods[] = {{&L.qkv, &b.qkv}, {&L.o, &b.o}, {&L.gate_up, &b.gate_up},
                                                             {&L.down, &b.o}};
      for (int k = 0; k < 4; ++k) {
        if (prods[k].first->size() < 2) continue;
        int64_t col = 0;
        for (const Part& p : *prods[k].first) {
          b.part_views[4 * i + k].push_back(prods[k].second->narrow(1, col, p.rows));
          col += p.rows;
        }
      }
    }
    return b;
  }

  // What the fp32 loop writes and reads by address, checked once per forward instead of once
  // per layer (each check reads a tensor's metadata, cold after a product has streamed the
  // weights): every layer's K and V cache fp32, contiguous and of layer 0's shape, the slot
  // mapping int64 [T] within it, the rotary tables fp32 and contiguous.
  struct RawCaches {
    std::vector<float*> k, v;  // [num_layers]
    std::vector<int64_t> slots;  // [T], each in [0, num_blocks * block_size)
  };

  std::optional<RawCaches> raw_caches(const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                                      const at::Tensor& slot_mapping, const RopeRows& rope, int64_t num_layers,
                                      int64_t T) const {
    const at::Tensor& k0 = k_caches[0];
    const bool tables = rope.cos.scalar_type() == at::kFloat && rope.sin.scalar_type() == at::kFloat &&
                        rope.cos.is_contiguous() && rope.sin.is_contiguous();
    if (!tables || k0.dim() != 4 || k0.size(2) != num_kv_heads_ || k0.size(3) != head_dim_ ||
        slot_mapping.scalar_type() != at::kLong || slot_mapping.dim() != 1 || slot_mapping.size(0) != T ||
        !slot_mapping.device().is_cpu()) {
      return std::nullopt;
    }
    RawCaches raw;
    raw.k.reserve(num_layers);
    raw.v.reserve(num_layers);
    for (int64_t i = 0; i < num_layers; ++i) {
      for (const at::Tensor* c : {&k_caches[i], &v_caches[i]}) {
        if (c->scalar_type() != at::kFloat || !c->is_contiguous() || c->sizes() != k0.sizes() ||
            !c->device().is_cpu()) {
          return std::nullopt;
        }
      }
      raw.k.push_back(k_caches[i].data_ptr<float>());
      raw.v.push_back(v_caches[i].data_ptr<float>());
    }
    const int64_t slots = k0.numel() / (num_kv_heads_ * head_dim_);
    const at::Tensor sm = slot_mapping.contiguous();
    const int64_t* sp = sm.data_ptr<int64_t>();
    raw.slots.assign(sp, sp + T);
    check_slots(raw.slots.data(), T, slots);
    return raw;
  }

  // The fp32 layer loop: DecoderBlock and paged_attention on this row count's buffers. The last
  // layer writes a new tensor (the caller keeps it); h is not written.
  at::Tensor forward_fp32(const at::Tensor& h, const RopeRows& rope, const RawCaches& raw,
                          const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                          const at::Tensor& block_table, const at::Tensor& prefix_lens, const at::Tensor& qo_indptr,
                          const std::optional<at::Tensor>& tree_mask, int64_t num_layers, RowRange skinny,
                          double sm_scale) {
    const int64_t T = h.size(0), H = h.size(1);
    // Buffers are shared state: a second thread in forward at the same time gets its own.
    std::unique_lock<std::mutex> lock(buffers_mutex_, std::try_to_lock);
    Buffers local;
    Buffers* b = &local;
    if (lock.owns_lock() && T <= kMaxBufferedRows) {
      auto it = buffers_.find(T);
      if (it == buffers_.end()) it = buffers_.emplace(T, make_buffers(T)).first;
      b = &it->second;
    } else {
      local = make_buffers(T);
    }
    const int64_t I = b->act.size(1);
    const float eps = static_cast<float>(eps_);
    const at::Tensor attn_flat = b->attn.view({T, -1});
    at::Tensor out = at::empty({T, H}, h.options());
    const float* x = h.data_ptr<float>();
    float *normed = b->normed.data_ptr<float>(), *hb = b->h.data_ptr<float>(), *o = b->o.data_ptr<float>();
    float *qkv_p = b->qkv.data_ptr<float>(), *q_p = b->q.data_ptr<float>();
    float *gate_up_p = b->gate_up.data_ptr<float>(), *act_p = b->act.data_ptr<float>();
    for (int64_t i = 0; i < num_layers; ++i) {
      const Layer& L = layers_[i];
      const std::vector<at::Tensor>* views = &b->part_views[4 * i];
      timed(norms_s_, [&] { rms_norm_rows(x, L.attn_norm_p, normed, T, H, eps); });
      timed_product_into(b->normed, L.qkv, skinny, b->qkv, views[0]);
      timed(rope_s_, [&] { rope_write_rows(qkv_p, rope, raw.slots.data(), T, raw.k[i], raw.v[i], q_p); });
      timed(attention_s_, [&] {
        tree_attention_cpu(b->q, k_caches[i], v_caches[i], block_table, prefix_lens, qo_indptr, tree_mask, sm_scale,
                           b->attn, std::nullopt);
      });
      timed_product_into(attn_flat, L.o, skinny, b->o, views[1]);
      timed(residuals_s_, [&] { add_into(x, o, hb, T * H); });
      timed(norms_s_, [&] { rms_norm_rows(hb, L.mlp_norm_p, normed, T, H, eps); });
      timed_product_into(b->normed, L.gate_up, skinny, b->gate_up, views[2]);
      timed(silu_s_, [&] { silu_and_mul_rows(gate_up_p, act_p, T, I); });
      timed_product_into(b->act, L.down, skinny, b->o, views[3]);
      float* next = i + 1 == num_layers ? out.data_ptr<float>() : b->x.data_ptr<float>();
      timed(residuals_s_, [&] { add_into(hb, o, next, T * H); });
      x = next;
      if (!capture_.empty()) keep_captured(i + 1, at::from_blob(next, {T, H}, h.options()));
    }
    return out;
  }

  // A copy of the hidden states x [T, H] after `count` layers, where set_capture asked for them.
  void keep_captured(int64_t count, const at::Tensor& x) {
    for (size_t j = 0; j < capture_.size(); ++j) {
      if (capture_[j] == count) captured_[j] = x.clone();
    }
  }

  template <typename F>
  void timed(double& acc, F&& fn) const {
    const Timer timer(timing_ ? &acc : nullptr);
    fn();
  }

  void timed_product_into(const at::Tensor& x, const Product& parts, RowRange skinny, at::Tensor& out,
                          const std::vector<at::Tensor>& views) const {
    const Timer timer(timing_ ? &products_s_ : nullptr);
    product_into(x, parts, skinny, out, views);
  }

  // Wall time inside the products and the attention kernel, for the benchmark's step breakdown
  // (bench/bench_decode.py); off unless set_timing(true).
  struct Timer {
    explicit Timer(double* acc) : acc_(acc), start_(acc ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{}) {}
    ~Timer() {
      if (acc_) *acc_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }
    double* acc_;
    std::chrono::steady_clock::time_point start_;
  };

  at::Tensor timed_product(const at::Tensor& x, const Product& parts, RowRange skinny) const {
    const Timer timer(timing_ ? &products_s_ : nullptr);
    return product(x, parts, skinny);
  }

  const Layer& checked_layer(int64_t layer, const at::Tensor& x) const {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "DecoderStack: layer must be in [0, ", num_layers(), "), got ",
                layer);
    TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "DecoderStack: x must be a CPU tensor [T, H], got ", x.sizes());
    return layers_[layer];
  }

  // DecoderBlock.qkv, then paged_attention: [T, H] -> [T, Hq * D].
  at::Tensor attention(const Layer& L, const at::Tensor& x, const RopeRows& rope, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& prefix_lens, const at::Tensor& qo_indptr, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& tree_mask, double sm_scale, RowRange skinny) const {
    const int64_t Hq = num_heads_, D = head_dim_, T = x.size(0);
    const at::Tensor qkv = timed_product(norm(x, L.attn_norm), L.qkv, skinny);
    at::Tensor q = at::empty({T, Hq, D}, qkv.options());
    rope_and_write(qkv, rope, slot_mapping, k_cache, v_cache, q);
    at::Tensor out = at::empty_like(q);
    {
      const Timer timer(timing_ ? &attention_s_ : nullptr);
      tree_attention_cpu(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale, out,
                         std::nullopt);
    }
    return out.view({T, -1});
  }

  // DecoderBlock.output: the residual, o, the MLP and its residual.
  at::Tensor output(const Layer& L, const at::Tensor& x, const at::Tensor& attn, RowRange skinny) const {
    const at::Tensor h = residual(x, timed_product(attn, L.o, skinny));
    return residual(h, timed_product(silu_and_mul(timed_product(norm(h, L.mlp_norm), L.gate_up, skinny)), L.down, skinny));
  }

  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const {  // block.rms_norm
    if (weight.scalar_type() != x.scalar_type()) return at::rms_norm(x, {x.size(-1)}, weight, eps_);
    at::Tensor out = at::empty(x.sizes(), x.options());
    rms_norm_cpu(x, weight, eps_, out);
    return out;
  }

  // apply_rope to the q|k columns of qkv [T, (Hq + 2 Hkv) D], q into q [T, Hq, D], and k and v
  // into the caches at slot_mapping (PagedKVCache.write). The fp32 loop is the ATen ops' bits:
  // x * cos + roll(x, D/2) * sin is two products and a sum, each rounded once (-ffp-contract=off).
  void rope_and_write(const at::Tensor& qkv, const RopeRows& rope, const at::Tensor& slot_mapping,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& q) const {
    const int64_t Hq = num_heads_, Hkv = num_kv_heads_, D = head_dim_, T = qkv.size(0);
    const at::Tensor &cos = rope.cos, &sin = rope.sin;
    const bool fast = qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && cos.scalar_type() == at::kFloat &&
                      sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                      k_cache.scalar_type() == at::kFloat &&
                      v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                      slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                      slot_mapping.size(0) == T && slot_mapping.is_contiguous();
    if (!fast) {
      const auto qk_v = qkv.split_with_sizes({(Hq + Hkv) * D, Hkv * D}, -1);
      const at::Tensor qk = qk_v[0].unflatten(-1, {Hq + Hkv, D});
      const at::Tensor rows = at::tensor(rope.rows, at::TensorOptions().dtype(at::kLong));
      const at::Tensor c = cos.index_select(0, rows).unsqueeze(-2), s = sin.index_select(0, rows).unsqueeze(-2);
      const auto q_k = (qk * c + at::roll(qk, {D / 2}, {-1}) * s).split_with_sizes({Hq, Hkv}, -2);
      k_cache.view({-1, Hkv, D}).index_copy_(0, slot_mapping, q_k[1].to(k_cache.scalar_type()));
      v_cache.view({-1, Hkv, D}).index_copy_(0, slot_mapping, qk_v[1].unflatten(-1, {Hkv, D}).to(v_cache.scalar_type()));
      q.copy_(q_k[0]);
      return;
    }
    const int64_t slots = k_cache.numel() / (Hkv * D);
    const int64_t* slot = slot_mapping.data_ptr<int64_t>();
    check_slots(slot, T, slots);
    rope_write_rows(qkv.data_ptr<float>(), rope, slot, T, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                    q.data_ptr<float>());
  }

  // Every slot of slot[0, T) inside a cache of `slots` positions, before anything is written.
  static void check_slots(const int64_t* slot, int64_t T, int64_t slots) {
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "DecoderStack: slot_mapping[", t, "] = ", slot[t],
                  " is out of range [0, ", slots, ")");
    }
  }

  // rope_and_write's fp32 loop on checked addresses: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D],
  // and k, v into the caches [slots, Hkv, D] at slot[t] (each in range).
  void rope_write_rows(const float* src, const RopeRows& rope, const int64_t* slot, int64_t T, float* kp, float* vp,
                       float* qp) const {
    const int64_t Hq = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
    const int64_t width = (Hq + 2 * Hkv) * D, half = D / 2;
    const float *c = rope.cos.data_ptr<float>(), *s = rope.sin.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float *row = src + t * width, *ct = c + rope.rows[t] * D, *st = s + rope.rows[t] * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        const float* xh = row + h * D;
        float* dst = h < Hq ? qp + (t * Hq + h) * D : kp + (slot[t] * Hkv + h - Hq) * D;
        for (int64_t d = 0; d < half; ++d) dst[d] = xh[d] * ct[d] + xh[d + half] * st[d];
        for (int64_t d = half; d < D; ++d) dst[d] = xh[d] * ct[d] + xh[d - half] * st[d];
      }
      std::copy(row + (Hq + Hkv) * D, row + width, vp + slot[t] * Hkv * D);
    }
  }

  // The rows of the tables cos, sin [R, D] at positions [T] (int32 or int64, each in [0, R)).
  RopeRows rope_rows(const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t T) const {
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim_ && sin.sizes() == cos.sizes(),
                "DecoderStack: cos and sin must be tables [R, ", head_dim_, "], got ", cos.sizes(), " and ", sin.sizes());
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.device().is_cpu() &&
                    (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong),
                "DecoderStack: positions must be a CPU int32/int64 tensor [", T, "], got ", positions.scalar_type(),
                " ", positions.sizes());
    RopeRows rope{cos, sin, std::vector<int64_t>(T)};
    const at::Tensor pc = positions.contiguous();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = pc.scalar_type() == at::kInt ? pc.data_ptr<int32_t>()[t] : pc.data_ptr<int64_t>()[t];
      TORCH_CHECK(pos >= 0 && pos < cos.size(0), "DecoderStack: positions[", t, "] = ", pos,
                  " is outside the rotary tables [0, ", cos.size(0), ")");
      rope.rows[t] = pos;
    }
    return rope;
  }

  // silu(gate) * up of gate|up [T, 2I] -> [T, I]: specdec::silu_and_mul.
  static at::Tensor silu_and_mul(const at::Tensor& gate_up) {
    at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul_cpu(gate_up, act);
    return act;
  }

  // x + y (the residuals): fp32 in one loop (the same single rounding as at::add).
  static at::Tensor residual(const at::Tensor& x, const at::Tensor& y) {
    if (x.scalar_type() != at::kFloat || y.scalar_type() != at::kFloat || !x.is_contiguous() || !y.is_contiguous() ||
        x.sizes() != y.sizes()) {
      return x + y;
    }
    at::Tensor out = at::empty_like(x);
    const float *a = x.data_ptr<float>(), *b = y.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) o[i] = a[i] + b[i];
    return out;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  bool timing_ = false;
  bool fp32_ready_ = false;  // fp32 norms and dense weights: forward_fp32 can run
  mutable double products_s_ = 0, attention_s_ = 0, norms_s_ = 0, rope_s_ = 0, silu_s_ = 0, residuals_s_ = 0;
  std::vector<Layer> layers_;
  at::Tensor final_norm_;  // [H], with head_ (the LM head's parts; empty: built without it)
  Product head_;
  std::mutex buffers_mutex_;
  std::map<int64_t, Buffers> buffers_;  // by row count
  std::vector<int64_t> capture_;       // set_capture's layer counts
  std::vector<at::Tensor> captured_;   // their states from the last forward (undefined: not reached)
};

// A pybind11 class, not a torch.classes one: a call from Python through torch.classes (schema
// matching, boxing) runs ~140 us when cold, as every call between two weight streams is; a
// pybind11 call ~20 us.
void bind_decoder_stack(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecoderStack, std::shared_ptr<DecoderStack>>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>>())
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_timing", &DecoderStack::set_timing)
      .def("take_timings", &DecoderStack::take_timings)
      .def("forward", &DecoderStack::forward)
      .def("forward_logits", &DecoderStack::forward_logits)
      .def("forward_logits_host", &DecoderStack::forward_logits_host)
      .def("set_capture", &DecoderStack::set_capture)
      .def("take_captured", &DecoderStack::take_captured)
      .def("qkv", &DecoderStack::qkv)
      .def("output", &DecoderStack::output_of);
}

}  // namespace specdec
