// CPU kernel of specdec::compact_kv: the accepted nodes' K/V of every layer next to the root.
//
// After acceptance, one call moves the accepted tree nodes' K and V of every layer.
//
// For i < num_accepted[b]:  position prefix_lens[b] + 1 + i  <-  position
// prefix_lens[b] + accepted_nodes[b, i], every head. Caches are [num_blocks, block_size,
// num_kv_heads, head_dim] (contiguous cache: block_size = max_len, one block per request),
// any dtype (the element size is all that matters; uint8/fp8 caches work).
//
// Why no gather buffer is needed: accepted_nodes is strictly increasing and >= 1 (checked),
// so node_i >= i + 1 and the source of move i is never before its destination; the
// destination of move i, prefix+1+i, lies strictly before every later source
// prefix+node_j >= prefix+1+j. Doing the moves of one (layer, request) in increasing i
// therefore reads every source before anything overwrites it: the same result as
// gather-then-scatter, with half the memory traffic. Identity moves (node_i == i + 1, e.g.
// a fully accepted chain) are dropped before any data is touched.
//
// All checks (shapes, dtypes, node order, positions within the block table, block ids
// in range) run before the first write, so an error leaves the caches unchanged.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "check.h"
#include "ops.h"

namespace specdec {

namespace {

// One row move inside a layer tensor, as element offsets of the (position) row.
struct RowMove {
  int64_t src;
  int64_t dst;
};

}  // namespace

void compact_kv_cpu(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                    const at::Tensor& prefix_lens, const at::Tensor& accepted_nodes, const at::Tensor& num_accepted) {
  TORCH_CHECK(!k_caches.empty(), "k_caches must hold at least one layer tensor, got an empty list");
  TORCH_CHECK(k_caches.size() == v_caches.size(), "k_caches and v_caches must have the same length, got ",
              k_caches.size(), " and ", v_caches.size());
  const at::Tensor& first = k_caches[0];
  TORCH_CHECK(first.dim() == 4, "k_caches[0] must have 4 dimensions [num_blocks, block_size, num_kv_heads, ",
              "head_dim], got shape ", first.sizes());
  const auto sizes = first.sizes();
  const auto strides = first.strides();
  const auto dtype = first.scalar_type();
  for (size_t l = 0; l < k_caches.size(); ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& t = kv == 0 ? k_caches[l] : v_caches[l];
      const char* name = kv == 0 ? "k_caches" : "v_caches";
      TORCH_CHECK(t.device().is_cpu(), name, "[", l, "] must be a CPU tensor, got device ", t.device());
      TORCH_CHECK(t.sizes() == sizes, name, "[", l, "] must have the shape of k_caches[0] ", sizes, ", got ",
                  t.sizes());
      TORCH_CHECK(t.scalar_type() == dtype, name, "[", l, "] must have the dtype of k_caches[0] (", dtype,
                  "), got ", t.scalar_type());
      TORCH_CHECK(t.strides() == strides, name, "[", l, "] must have the strides of k_caches[0] ", strides,
                  ", got ", t.strides());
    }
  }
  TORCH_CHECK(strides[3] == 1, "k_caches/v_caches must be contiguous in head_dim (stride 1), got strides ",
              strides);
  const int64_t num_blocks = sizes[0], block_size = sizes[1], num_heads = sizes[2], head_dim = sizes[3];

  for (auto [t, name] : {std::pair{&block_table, "block_table"}, {&prefix_lens, "prefix_lens"},
                         {&accepted_nodes, "accepted_nodes"}, {&num_accepted, "num_accepted"}}) {
    check_cpu(*t, name);
    check_dtype(*t, at::kInt, name);
  }
  check_dim(block_table, 2, "block_table");
  const int64_t batch = block_table.size(0), max_blocks = block_table.size(1);
  check_dim(prefix_lens, 1, "prefix_lens");
  check_size(prefix_lens, 0, batch, "prefix_lens");
  check_dim(accepted_nodes, 2, "accepted_nodes");
  check_size(accepted_nodes, 0, batch, "accepted_nodes");
  check_dim(num_accepted, 1, "num_accepted");
  check_size(num_accepted, 0, batch, "num_accepted");
  const int64_t max_accepted = accepted_nodes.size(1);

  const auto bt = block_table.accessor<int32_t, 2>();
  const auto prefix = prefix_lens.accessor<int32_t, 1>();
  const auto nodes = accepted_nodes.accessor<int32_t, 2>();
  const auto counts = num_accepted.accessor<int32_t, 1>();
  const int64_t capacity = max_blocks * block_size;

  // Element offset of cache position `pos` of request b (checked: inside the block table,
  // block id in range).
  auto row_offset = [&](int64_t b, int64_t pos, const char* what, int64_t i) -> int64_t {
    TORCH_CHECK(pos >= 0 && pos < capacity, "compact_kv: request ", b, ", accepted index ", i, ": ", what,
                " cache position ", pos, " lies outside the block table capacity [0, ", capacity,
                ") (max_blocks ", max_blocks, " x block_size ", block_size, ")");
    const int64_t block = bt[b][pos / block_size];
    TORCH_CHECK(block >= 0 && block < num_blocks, "compact_kv: block_table[", b, ", ", pos / block_size, "] = ",
                block, " (", what, " position ", pos, ") is not a block id in [0, ", num_blocks, ")");
    return block * strides[0] + (pos % block_size) * strides[1];
  };

  // Validate everything and list the non-identity moves of each request.
  std::vector<std::vector<RowMove>> moves(batch);
  for (int64_t b = 0; b < batch; ++b) {
    // A negative count (a NaN row of the rejection samplers) moves nothing.
    const int64_t n = std::max<int64_t>(counts[b], 0);
    TORCH_CHECK(n <= max_accepted, "num_accepted[", b, "] = ", n, " exceeds accepted_nodes.size(1) = ",
                max_accepted);
    const int64_t p = prefix[b];
    TORCH_CHECK(p >= 0, "prefix_lens[", b, "] must be >= 0, got ", p);
    int64_t previous = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t node = nodes[b][i];
      TORCH_CHECK(node > previous, "accepted_nodes[", b, "] must be strictly increasing node indices >= 1 ",
                  "in its first num_accepted[", b, "] = ", n, " entries, got ", node, " at index ", i,
                  (i ? " after " : ""), (i ? std::to_string(previous) : std::string()));
      previous = node;
      const int64_t src = row_offset(b, p + node, "source", i);
      const int64_t dst = row_offset(b, p + 1 + i, "destination", i);
      if (src != dst) moves[b].push_back({src, dst});
    }
  }

  // Base pointers of every layer's K and V: work item w = (cache c, request b).
  const int64_t num_caches = 2 * static_cast<int64_t>(k_caches.size());
  std::vector<char*> bases(num_caches);
  for (int64_t c = 0; c < num_caches; ++c) {
    const at::Tensor& t = c % 2 == 0 ? k_caches[c / 2] : v_caches[c / 2];
    bases[c] = static_cast<char*>(t.data_ptr());
  }
  const int64_t elem = first.element_size();
  // Heads of one position are adjacent in the usual layout: then one memcpy moves the
  // whole [num_kv_heads, head_dim] row instead of one per head.
  const bool heads_adjacent = num_heads == 1 || strides[2] == head_dim;
  const int64_t row_bytes = (heads_adjacent ? num_heads * head_dim : head_dim) * elem;
  const int64_t copies_per_row = heads_adjacent ? 1 : num_heads;
  const int64_t head_stride_bytes = strides[2] * elem;

  int64_t total_moves = 0;
  for (const auto& m : moves) total_moves += static_cast<int64_t>(m.size());
  if (total_moves == 0) return;  // e.g. every request accepted a chain: nothing to move.

  // Parallel over (layer and K/V, request, head group); within one work item the moves run
  // in increasing i (see the top of the file for why that order is safe).
  const int64_t items = num_caches * batch * copies_per_row;
  const int64_t bytes_per_item = std::max<int64_t>(1, total_moves / std::max<int64_t>(batch, 1)) * row_bytes;
  // ~256 KiB of copies per task: below that, waking a second thread costs more than the
  // copy (a tree step of a small model moves tens of KiB) and runs inline.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / bytes_per_item);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w % copies_per_row;
      const int64_t b = (w / copies_per_row) % batch;
      const int64_t c = w / (copies_per_row * batch);
      char* base = bases[c] + h * head_stride_bytes;
      for (const RowMove& m : moves[b]) {
        std::memcpy(base + m.dst * elem, base + m.src * elem, row_bytes);
      }
    }
  });
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("compact_kv", &compact_kv_cpu); }

}  // namespace specdec
