// CPU implementation of kvlayout::rope_reposition: positions are read once and
// validated before anything is written, then tokens are split over threads; the pair
// math is the shared rope.h code.
#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../rope_plan.h"
#include "kvlayout/rope_kernel.h"

namespace kvlayout {
namespace {

template <class scalar_t, class cache_t>
void rope_cpu_tokens(const RopeParams& p) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, p.num_heads * p.half_rot));
  at::parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t op = p.old_positions.load(t);
      const int64_t np = p.new_positions.load(t);
      if (op < 0 || np < 0) continue;
      for (int64_t h = 0; h < p.num_heads; ++h) {
        rope_reposition_head<scalar_t, cache_t>(p, t, h, op, np, 0, 1);
      }
    }
  });
}

void rope_reposition_cpu(const at::Tensor& key, const at::Tensor& old_positions,
                         const at::Tensor& new_positions, const at::Tensor& cos_sin_cache,
                         bool is_neox, int64_t max_ctas, const at::Tensor& status) {
  (void)status;  // CPU raises instead of recording
  TORCH_CHECK_VALUE(key.device().is_cpu() && cos_sin_cache.device().is_cpu() &&
                  old_positions.device().is_cpu() && new_positions.device().is_cpu(),
              "kvlayout::rope_reposition (CPU): all tensors must be on the CPU");
  RopeParams p =
      plan_rope_reposition(key, old_positions, new_positions, cos_sin_cache, is_neox, max_ctas);
  if (p.num_tokens == 0 || p.num_heads == 0 || p.half_rot == 0) return;
  // Positions are read once into the op's own copy, checked, and used from it.
  std::vector<int64_t> old_copy, new_copy;
  read_positions_once(p, old_copy, new_copy);
  const bool cache_f32 = cos_sin_cache.scalar_type() == at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(),
                                  "kvlayout_rope_reposition_cpu", [&] {
                                    if (cache_f32)
                                      rope_cpu_tokens<scalar_t, float>(p);
                                    else
                                      rope_cpu_tokens<scalar_t, scalar_t>(p);
                                  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CPU, m) { m.impl("rope_reposition", &rope_reposition_cpu); }

}  // namespace kvlayout
