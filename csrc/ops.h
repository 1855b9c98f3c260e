// C++ signatures of every op of the `specdec` library (schemas: registration.cpp).
#pragma once
#include <ATen/ATen.h>
#include <optional>

namespace specdec {

void chain_rejection_sample_cpu(const at::Tensor& draft_token_ids, const at::Tensor& num_draft_tokens,
                                const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                                const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                                at::Tensor& output_token_ids, at::Tensor& num_accepted);

void chain_rejection_sample_flat_cpu(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                                     const at::Tensor& target_logits, const std::optional<at::Tensor>& draft_probs,
                                     const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                                     at::Tensor& output_token_ids, at::Tensor& num_accepted);

void tree_rejection_sample_cpu(const at::Tensor& parents, const at::Tensor& tree_token_ids,
                               const at::Tensor& num_nodes, const at::Tensor& target_logits,
                               const std::optional<at::Tensor>& draft_probs, const at::Tensor& temperature,
                               const at::Tensor& seed, const at::Tensor& offset, at::Tensor& accepted_nodes,
                               at::Tensor& output_token_ids, at::Tensor& num_accepted);

void apply_top_k_top_p_cpu(at::Tensor& logits, const std::optional<at::Tensor>& top_k,
                           const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p);

void tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& prefix_lens, const at::Tensor& qo_indptr,
                        const std::optional<at::Tensor>& tree_mask, double sm_scale, at::Tensor& out,
                        const std::optional<at::Tensor>& lse);

void compact_kv_cpu(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                    const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes, const at::Tensor& num_accepted);

void medusa_topk_cpu(const at::Tensor& hidden, const at::Tensor& res_weight, const at::Tensor& res_bias,
                     const at::Tensor& lm_head, int64_t top_k, at::Tensor& topk_ids, at::Tensor& topk_logprobs);

void skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::Tensor& out);

void quantized_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t block_type,
                          const std::optional<at::Tensor>& bias, at::Tensor& out);

void int8_activation_linear_cpu(const at::Tensor& x, const at::Tensor& packed_weight, int64_t block_type,
                                const std::optional<at::Tensor>& bias, at::Tensor& out);

void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);

void silu_and_mul_cpu(const at::Tensor& gate_up, at::Tensor& out);

at::Tensor philox_uniform_cpu(const at::Tensor& seed, const at::Tensor& offset, int64_t position, int64_t purpose,
                              int64_t num);

}  // namespace specdec
