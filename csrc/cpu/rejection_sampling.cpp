// CPU kernels of specdec::chain_rejection_sample (padded [B, K+1, V] and the engines'
// flattened [num_tokens + B, V] layout: chain_rejection_sample_flat) and
// specdec::tree_rejection_sample: the ops' argument checks, each layout's requests and the
// outputs. The sampler they share (three phases): rejection_sampling.h and the files it
// lists.
//
// Semantics: docs/design.md and the docstrings in ops.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "check.h"
#include "dispatch.h"
#include "ops.h"
#include "rejection_sampling.h"

namespace specdec {
namespace {

using rejection::Request;
using rejection::sample;
using rejection::TreeView;
using rejection::WalkResult;

// ---------------------------------------------------------------------------------------
// Argument checks and outputs shared by the ops.
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// The tree op's requests and outputs.
// ---------------------------------------------------------------------------------------

// Request b of the tree op (nodes of parents / tree_token_ids row b, num_nodes[b] of them),
// checked: the root first, every parent before its child, the token ids in [0, vocab).
std::vector<Request> tree_requests(const int32_t* p, const int64_t* t, const int32_t* n_ptr, int64_t batch,
                                   int64_t max_nodes, int64_t vocab) {
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
  return reqs;
}

// Tree outputs: accepted nodes and their tokens, the final token, -1 padding; -1 counts for
// invalid requests, 0 for requests without nodes.
void write_tree_outputs(const std::vector<Request>& reqs, const std::vector<WalkResult>& walks,
                        const std::vector<char>& valid, const int64_t* t, int64_t max_nodes,
                        at::Tensor& accepted_nodes, at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  const int64_t batch = static_cast<int64_t>(reqs.size());
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

  const std::vector<Request> reqs = tree_requests(p, t, n_ptr, batch, max_nodes, vocab);
  std::vector<WalkResult> walks;
  std::vector<char> valid;
  sample(reqs, in.logits, in.q, in.temp, in.seed, in.offset, max_nodes, walks, valid);
  write_tree_outputs(reqs, walks, valid, t, max_nodes, accepted_nodes, output_token_ids, num_accepted);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("chain_rejection_sample", &chain_rejection_sample_cpu);
  m.impl("chain_rejection_sample_flat", &chain_rejection_sample_flat_cpu);
  m.impl("tree_rejection_sample", &tree_rejection_sample_cpu);
}

}  // namespace specdec
