// The rope_reposition op of every device backend, written once and templated
// on the backend policy, as copy_rows_launch.h is for copy_rows: a backend's
// file (cuda/rope.cu, sycl/rope.sycl) keeps its kernel, its policy and
// TORCH_LIBRARY_IMPL.
//
// The policy `Backend` provides the device part (kDeviceType, Guard, Stream,
// stream(dev), index_address(t, dev, name): cuda::Backend, xpu::Backend; see
// copy_rows_launch.h) and
//   default_budget(stream) -> int64_t
//                          thread blocks of a launch when max_ctas is 0
//   launch<scalar_t, cache_t>(params, max_blocks, stream)
//                          one kernel launch of at most max_blocks blocks of
//                          kRopeThreadsPerBlock threads (key elements
//                          scalar_t, cos/sin cache elements cache_t)
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>

#include "device_args.h"
#include "rope_plan.h"
#include "kvlayout/rope_kernel.h"

namespace kvlayout {

// kvlayout::rope_reposition on the backend. key and cos_sin_cache are tensors
// of the launch device; positions may be device or pinned host tensors.
// Out-of-range positions are skipped and recorded in `status`.
template <class Backend>
void rope_reposition_impl(const at::Tensor& key, const at::Tensor& old_positions,
                          const at::Tensor& new_positions, const at::Tensor& cos_sin_cache,
                          bool is_neox, int64_t max_ctas, const at::Tensor& status) {
  const c10::Device dev = key.device();
  TORCH_CHECK(dev.type() == Backend::kDeviceType, "kvlayout::rope_reposition: key must be on ",
              c10::DeviceTypeName(Backend::kDeviceType), ", got ", dev);
  const typename Backend::Guard guard(dev);
  TORCH_CHECK(cos_sin_cache.device() == dev, "kvlayout::rope_reposition: cos_sin_cache is on ",
              cos_sin_cache.device(), " but key is on ", dev);
  check_status_tensor(status, dev);
  RopeParams p =
      plan_rope_reposition(key, old_positions, new_positions, cos_sin_cache, is_neox, max_ctas);
  if (p.num_tokens == 0 || p.num_heads == 0 || p.half_rot == 0) return;
  p.old_positions.data = Backend::index_address(old_positions, dev, "old_positions");
  p.new_positions.data = Backend::index_address(new_positions, dev, "new_positions");
  p.status = status.data_ptr<int64_t>();
  typename Backend::Stream stream = Backend::stream(dev);
  const int64_t budget = max_ctas > 0 ? max_ctas : Backend::default_budget(stream);
  const bool cache_f32 = cos_sin_cache.scalar_type() == at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(),
                                  "kvlayout_rope_reposition", [&] {
                                    if (cache_f32)
                                      Backend::template launch<scalar_t, float>(p, budget, stream);
                                    else
                                      Backend::template launch<scalar_t, scalar_t>(p, budget,
                                                                                   stream);
                                  });
}

}  // namespace kvlayout
