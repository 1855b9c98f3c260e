// CPU kernel of specdec::philox_uniform: the generator's uniforms, for cross-backend tests.
#include <torch/library.h>

#include "check.h"
#include "ops.h"
#include "philox.h"

namespace specdec {

at::Tensor philox_uniform_cpu(const at::Tensor& seed, const at::Tensor& offset, int64_t position, int64_t purpose,
                              int64_t num) {
  check_cpu(seed, "seed");
  check_cpu(offset, "offset");
  check_dtype(seed, at::kLong, "seed");
  check_dtype(offset, at::kLong, "offset");
  check_dim(seed, 1, "seed");
  TORCH_CHECK(offset.sizes() == seed.sizes(), "offset must have the shape of seed ", seed.sizes(), ", got ",
              offset.sizes());
  TORCH_CHECK(num >= 0 && num <= (int64_t(1) << 32), "num must lie in [0, 2^32], got ", num);
  TORCH_CHECK(purpose >= 0 && purpose < (int64_t(1) << 32), "purpose must fit in 32 bits, got ", purpose);
  const int64_t batch = seed.size(0);
  at::Tensor out = at::empty({batch, num}, seed.options().dtype(at::kFloat));
  auto seed_c = seed.contiguous();
  auto offset_c = offset.contiguous();
  const int64_t* s = seed_c.data_ptr<int64_t>();
  const int64_t* o = offset_c.data_ptr<int64_t>();
  float* u = out.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num; ++i) {
      u[b * num + i] = philox_uniform(s[b], o[b], position, static_cast<uint32_t>(purpose), static_cast<uint32_t>(i));
    }
  }
  return out;
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("philox_uniform", &philox_uniform_cpu); }

}  // namespace specdec
