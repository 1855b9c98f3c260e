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
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"

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

}  // namespace

class DecoderStack : public torch::CustomClassHolder {
 public:
  // norms: [2 L] (attn_norm, mlp_norm of each layer); weights: one per part, in the order
  // layer, product (q|k|v, o, gate|up, down), part; part_info: 4 ints per part (kind,
  // block_type, rows, index into biases or -1); parts_per_product: [4 L].
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, std::vector<at::Tensor> norms,
               std::vector<at::Tensor> weights, std::vector<int64_t> part_info,
               std::vector<int64_t> parts_per_product, std::vector<at::Tensor> biases)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0 && num_heads % num_kv_heads == 0,
                "DecoderStack: bad head shape (num_heads ", num_heads, ", num_kv_heads ", num_kv_heads, ", head_dim ",
                head_dim, ")");
    TORCH_CHECK(norms.size() % 2 == 0 && parts_per_product.size() == 2 * norms.size(),
                "DecoderStack: norms must hold 2 tensors per layer and parts_per_product 4 counts per layer, got ",
                norms.size(), " and ", parts_per_product.size());
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
    TORCH_CHECK(next == weights.size(), "DecoderStack: ", weights.size() - next, " weights left over");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Benchmarks: accumulate the seconds spent inside the products and the attention kernel;
  // take_timings returns [products, attention] since the last take and resets them.
  void set_timing(bool on) { timing_ = on; }
  std::vector<double> take_timings() {
    std::vector<double> t{products_s_, attention_s_};
    products_s_ = attention_s_ = 0;
    return t;
  }

  // One layer's halves, for a caller with its own attention in between (the EAGLE head):
  // DecoderBlock.qkv, x [T, H] -> [q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]] (RoPE on q, k)...
  std::vector<at::Tensor> qkv(int64_t layer, at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t skinny_min_rows,
                              int64_t skinny_max_rows) {
    const Layer& L = checked_layer(layer, x);
    const int64_t T = x.size(0);
    const at::Tensor qkv = timed_product(norm(x, L.attn_norm), L.qkv, RowRange{skinny_min_rows, skinny_max_rows});
    at::Tensor q = at::empty({T, num_heads_, head_dim_}, qkv.options());
    at::Tensor k = at::empty({T, num_kv_heads_, head_dim_}, qkv.options());
    at::Tensor v = at::empty_like(k);
    rope_and_write(qkv, cos, sin, at::arange(T, x.options().dtype(at::kLong)), k, v, q);
    return {q, k, v};
  }

  // ... and DecoderBlock.output, x [T, H], attn [T, Hq * D] -> [T, H].
  at::Tensor output_of(int64_t layer, at::Tensor x, at::Tensor attn, int64_t skinny_min_rows, int64_t skinny_max_rows) {
    return output(checked_layer(layer, x), x, attn, RowRange{skinny_min_rows, skinny_max_rows});
  }

  // h [T, H] (the embeddings) through the first num_layers layers; cos, sin [T, 1, D]
  // (models.block.rope_at); the caches and batch fields as models.block.paged_attention takes
  // them (k_caches / v_caches: one [num_blocks, block_size, Hkv, D] tensor per layer). Writes
  // the new K/V into the caches; returns the last hidden states [T, H].
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, at::Tensor block_table, at::Tensor prefix_lens,
                     at::Tensor qo_indptr, at::Tensor slot_mapping, std::optional<at::Tensor> tree_mask,
                     int64_t num_layers, int64_t skinny_min_rows, int64_t skinny_max_rows) {
    TORCH_CHECK(num_layers >= 0 && num_layers <= this->num_layers(), "DecoderStack.forward: num_layers must be in [0, ",
                this->num_layers(), "], got ", num_layers);
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) >= num_layers &&
                    static_cast<int64_t>(v_caches.size()) >= num_layers,
                "DecoderStack.forward: need a K and a V cache per layer");
    TORCH_CHECK(h.dim() == 2 && h.device().is_cpu(), "DecoderStack.forward: h must be a CPU tensor [T, H], got ",
                h.sizes());
    const RowRange skinny{skinny_min_rows, skinny_max_rows};
    const double sm_scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    at::Tensor x = h;
    for (int64_t i = 0; i < num_layers; ++i) {
      const at::Tensor attn = attention(layers_[i], x, cos, sin, k_caches[i], v_caches[i], block_table, prefix_lens,
                                        qo_indptr, slot_mapping, tree_mask, sm_scale, skinny);
      x = output(layers_[i], x, attn, skinny);
    }
    return x;
  }

 private:
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
  at::Tensor attention(const Layer& L, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& prefix_lens, const at::Tensor& qo_indptr, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& tree_mask, double sm_scale, RowRange skinny) const {
    const int64_t Hq = num_heads_, D = head_dim_, T = x.size(0);
    const at::Tensor qkv = timed_product(norm(x, L.attn_norm), L.qkv, skinny);
    at::Tensor q = at::empty({T, Hq, D}, qkv.options());
    rope_and_write(qkv, cos, sin, slot_mapping, k_cache, v_cache, q);
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
  void rope_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slot_mapping, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      at::Tensor& q) const {
    const int64_t Hq = num_heads_, Hkv = num_kv_heads_, D = head_dim_, T = qkv.size(0);
    const bool fast = qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && cos.scalar_type() == at::kFloat &&
                      sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                      cos.numel() == T * D && sin.numel() == T * D && k_cache.scalar_type() == at::kFloat &&
                      v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                      slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                      slot_mapping.size(0) == T && slot_mapping.is_contiguous();
    if (!fast) {
      const auto qk_v = qkv.split_with_sizes({(Hq + Hkv) * D, Hkv * D}, -1);
      const at::Tensor qk = qk_v[0].unflatten(-1, {Hq + Hkv, D});
      const auto q_k = (qk * cos + at::roll(qk, {D / 2}, {-1}) * sin).split_with_sizes({Hq, Hkv}, -2);
      k_cache.view({-1, Hkv, D}).index_copy_(0, slot_mapping, q_k[1].to(k_cache.scalar_type()));
      v_cache.view({-1, Hkv, D}).index_copy_(0, slot_mapping, qk_v[1].unflatten(-1, {Hkv, D}).to(v_cache.scalar_type()));
      q.copy_(q_k[0]);
      return;
    }
    const int64_t slots = k_cache.numel() / (Hkv * D), width = (Hq + 2 * Hkv) * D, half = D / 2;
    const float *src = qkv.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
    const int64_t* slot = slot_mapping.data_ptr<int64_t>();
    float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "DecoderStack: slot_mapping[", t, "] = ", slot[t],
                  " is out of range [0, ", slots, ")");
      const float *row = src + t * width, *ct = c + t * D, *st = s + t * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        const float* xh = row + h * D;
        float* dst = h < Hq ? qp + (t * Hq + h) * D : kp + (slot[t] * Hkv + h - Hq) * D;
        for (int64_t d = 0; d < half; ++d) dst[d] = xh[d] * ct[d] + xh[d + half] * st[d];
        for (int64_t d = half; d < D; ++d) dst[d] = xh[d] * ct[d] + xh[d - half] * st[d];
      }
      std::copy(row + (Hq + Hkv) * D, row + width, vp + slot[t] * Hkv * D);
    }
  }

  // silu(gate) * up of gate|up [T, 2I] -> [T, I]: at::silu, then the product in place (fp32:
  // the same single rounding as at::mul).
  static at::Tensor silu_and_mul(const at::Tensor& gate_up) {
    const int64_t I = gate_up.size(-1) / 2;
    at::Tensor act = at::silu(gate_up.narrow(-1, 0, I));
    const at::Tensor up = gate_up.narrow(-1, I, I);
    if (act.scalar_type() != at::kFloat || up.scalar_type() != at::kFloat || !act.is_contiguous() ||
        !gate_up.is_contiguous() || gate_up.dim() != 2) {
      return act * up;
    }
    float* a = act.data_ptr<float>();
    const float* u = gate_up.data_ptr<float>() + I;
    for (int64_t t = 0, T = gate_up.size(0); t < T; ++t) {
      for (int64_t i = 0; i < I; ++i) a[t * I + i] *= u[t * 2 * I + i];
    }
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
  mutable double products_s_ = 0, attention_s_ = 0;
  std::vector<Layer> layers_;
};

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>>())
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_timing", &DecoderStack::set_timing)
      .def("take_timings", &DecoderStack::take_timings)
      .def("forward", &DecoderStack::forward)
      .def("qkv", &DecoderStack::qkv)
      .def("output", &DecoderStack::output_of);
}

}  // namespace specdec
