// CUDA implementation of kvlayout::rope_reposition. key and cos_sin_cache are
// CUDA tensors of the launch device; positions may be CUDA or pinned host
// tensors. Out-of-range positions are skipped and recorded in `status`.
// CTA budget (max_ctas): 0 = 4 CTAs of 256 threads per SM; n > 0 caps at n.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "../host_checks.h"
#include "cuda_common.h"
#include "kvlayout/rope_kernel.h"

namespace kvlayout {
namespace {

constexpr int kDefaultRopeCtasPerSm = 4;

template <class scalar_t, class cache_t>
__global__ void __launch_bounds__(kRopeThreadsPerBlock)
    rope_reposition_kernel(const __grid_constant__ RopeParams p) {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_threads = int64_t(gridDim.x) * blockDim.x;
  rope_reposition_thread<scalar_t, cache_t>(p, thread, num_threads,
                                            cuda::StatusRecorder{p.status});
}

template <class scalar_t, class cache_t>
void launch(const RopeParams& p, int64_t max_blocks, cudaStream_t stream) {
  const int64_t threads_needed = (p.num_tokens * p.num_heads) << p.log2_group;
  int64_t blocks = (threads_needed + kRopeThreadsPerBlock - 1) / kRopeThreadsPerBlock;
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks));
  rope_reposition_kernel<scalar_t, cache_t>
      <<<static_cast<unsigned>(blocks), kRopeThreadsPerBlock, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rope_reposition_cuda(const at::Tensor& key, const at::Tensor& old_positions,
                          const at::Tensor& new_positions, const at::Tensor& cos_sin_cache,
                          bool is_neox, int64_t max_ctas, const at::Tensor& status) {
  TORCH_CHECK(key.is_cuda(), "kvlayout::rope_reposition: key must be a CUDA tensor, got ",
              key.device());
  const c10::Device dev = key.device();
  const c10::cuda::CUDAGuard guard(dev);
  TORCH_CHECK(cos_sin_cache.device() == dev, "kvlayout::rope_reposition: cos_sin_cache is on ",
              cos_sin_cache.device(), " but key is on ", dev);
  check_status_tensor(status, dev);
  RopeParams p =
      plan_rope_reposition(key, old_positions, new_positions, cos_sin_cache, is_neox, max_ctas);
  if (p.num_tokens == 0 || p.num_heads == 0 || p.half_rot == 0) return;
  p.old_positions.data = cuda::index_address(old_positions, dev, "old_positions");
  p.new_positions.data = cuda::index_address(new_positions, dev, "new_positions");
  p.status = status.data_ptr<int64_t>();
  const int64_t budget =
      max_ctas > 0 ? max_ctas : int64_t(cuda::num_sms()) * kDefaultRopeCtasPerSm;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index()).stream();
  const bool cache_f32 = cos_sin_cache.scalar_type() == at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(),
                                  "kvlayout_rope_reposition_cuda", [&] {
                                    if (cache_f32)
                                      launch<scalar_t, float>(p, budget, stream);
                                    else
                                      launch<scalar_t, scalar_t>(p, budget, stream);
                                  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("rope_reposition", &rope_reposition_cuda); }

}  // namespace kvlayout
