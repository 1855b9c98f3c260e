// The schemas of every op of the `specdec` library (no kernels), each defined once below.
//
// Kernels are registered per backend: C++ CPU kernels in csrc/cpu/ (TORCH_LIBRARY_IMPL(specdec,
// CPU, m) in the file that implements the op), Triton kernels for the CUDA key and fakes for
// the Meta key in Python (specdec_kernels/triton/, specdec_kernels/ops.py).
//
// Conventions (docs/design.md): index tensors int32, token ids int64, padding -1; outputs are
// caller-given tensors marked (a!); no op synchronises with the host.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "cpu/int8_activation_linear.h"
#include "cpu_features.h"

namespace specdec {
void bind_decoder_stack(pybind11::module_& m);  // decoder_step.cpp
}

// Importing specdec_kernels._C loads this shared object, which runs the static initialisers
// below and registers the ops; the module itself holds the fused decode step's class.
PYBIND11_MODULE(_C, m) {
  specdec::bind_decoder_stack(m);
  m.def(
      "cpu_paths",
      [] {
        pybind11::dict d;
        d["avx512"] = specdec::cpu_has_avx512();
        d["avx512_vnni"] = specdec::cpu_has_avx512_vnni();
        d["amx_int8"] = specdec::use_amx_int8();
        return d;
      },
      "The wider CPU paths the kernels take in this process (after SPECDEC_DISABLE_AVX512 / "
      "SPECDEC_DISABLE_AMX and set_amx_enabled): {'avx512', 'avx512_vnni', 'amx_int8'} -> bool.");
  m.def(
      "amx_pays", [](int64_t block_type, int64_t rows) { return specdec::i8act::amx_pays(block_type, rows); },
      pybind11::arg("block_type"), pybind11::arg("rows"),
      "Whether int8_activation_linear takes the AMX path for this GGML block type and number of "
      "rows where the CPU has AMX (the measured rule; the bits are the same either way).");
  m.def(
      "set_amx_enabled", [](bool on) { specdec::amx_enabled() = on; }, pybind11::arg("on"),
      "Turns the AMX path of int8_activation_linear on (the default, where the CPU has it) or off "
      "(AVX-512 VNNI instead; the same bits): for benchmarks that time both paths in one process.");
}

TORCH_LIBRARY(specdec, m) {
  // Rejection sampling (rejection_sampling.cpp).
  m.def(
      "chain_rejection_sample(Tensor draft_token_ids, Tensor num_draft_tokens, "
      "Tensor target_logits, Tensor? draft_probs, Tensor temperature, Tensor seed, "
      "Tensor offset, Tensor(a!) output_token_ids, Tensor(b!) num_accepted) -> ()");
  // The same on engines' flattened ragged layout (vLLM's): draft_token_ids [T],
  // cu_num_draft_tokens [B], target_logits [T + B, V], draft_probs [T, V]; K = the width of
  // output_token_ids [B, K + 1] minus one.
  m.def(
      "chain_rejection_sample_flat(Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor target_logits, Tensor? draft_probs, Tensor temperature, Tensor seed, "
      "Tensor offset, Tensor(a!) output_token_ids, Tensor(b!) num_accepted) -> ()");
  m.def(
      "tree_rejection_sample(Tensor parents, Tensor tree_token_ids, Tensor num_nodes, "
      "Tensor target_logits, Tensor? draft_probs, Tensor temperature, Tensor seed, "
      "Tensor offset, Tensor(a!) accepted_nodes, Tensor(b!) output_token_ids, "
      "Tensor(c!) num_accepted) -> ()");
  // Logit masking before sampling (apply_top_k_top_p.cpp).
  m.def("apply_top_k_top_p(Tensor(a!) logits, Tensor? top_k, Tensor? top_p, Tensor? min_p) -> ()");

  // Tree attention (tree_attention.cpp).
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor prefix_lens, Tensor qo_indptr, Tensor? tree_mask, float sm_scale, "
      "Tensor(a!) out, Tensor(b!)? lse) -> ()");

  // KV-cache compaction (kv_compaction.cpp).
  m.def(
      "compact_kv(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor block_table, "
      "Tensor prefix_lens, Tensor accepted_nodes, Tensor num_accepted) -> ()");

  // Medusa heads (medusa.cpp).
  m.def(
      "medusa_topk(Tensor hidden, Tensor res_weight, Tensor res_bias, Tensor lm_head, "
      "int top_k, Tensor(a!) topk_ids, Tensor(b!) topk_logprobs) -> ()");

  // Linear layers for few rows (linear.cpp).
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
  // The same on a weight stored as raw GGUF blocks (uint8 [N, H / block_size * block_bytes]);
  // block_type is the GGML type id (gguf.GGMLQuantizationType: Q4_0 = 2, Q4_1 = 3, ...).
  m.def("quantized_linear(Tensor x, Tensor weight, int block_type, Tensor? bias, Tensor(a!) out) -> ()");
  // The same with x quantised to int8 per block of 32 and integer dot products, on Q4_0 / Q4_1 /
  // Q8_0 blocks repacked 16 rows at a time (uint8 [ceil(N / 16), H / 32, group block bytes]).
  m.def("int8_activation_linear(Tensor x, Tensor packed_weight, int block_type, Tensor? bias, Tensor(a!) out) -> ()");

  // RMSNorm over the last dim, out = x * rsqrt(mean(x^2) + eps) * weight (rms_norm.cpp): the
  // decode step's norms, one pass, batch-invariant.
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");

  // The MLP activation, out = silu(gate) * up of gate|up [..., 2I] -> [..., I] (silu_and_mul.cpp):
  // one pass, fixed fp32 arithmetic (the package's own exp), the same bits on every CPU.
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");

  // The counter-based generator, exposed so that tests can compare backends bit for bit (rng.cpp).
  m.def("philox_uniform(Tensor seed, Tensor offset, int position, int purpose, int num) -> Tensor");
}
