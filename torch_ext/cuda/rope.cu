// CUDA implementation of kvlayout::rope_reposition: the kernel and the policy
// (CudaRope) that the op shared with SYCL (rope_launch.h) runs it with.
// key and cos_sin_cache are CUDA tensors of the launch device; positions may
// be CUDA or pinned host tensors. Out-of-range positions are skipped and
// recorded in `status`.
// CTA budget (max_ctas): 0 = 4 CTAs of 256 threads per SM; n > 0 caps at n.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <algorithm>

#include "../rope_launch.h"
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

// The CUDA backend of rope_launch.h.
struct CudaRope : cuda::Backend {
  static int64_t default_budget(cudaStream_t /*stream*/) {
    return int64_t(cuda::num_sms()) * kDefaultRopeCtasPerSm;
  }

  template <class scalar_t, class cache_t>
  static void launch(const RopeParams& p, int64_t max_blocks, cudaStream_t stream) {
    const int64_t threads_needed = (p.num_tokens * p.num_heads) << p.log2_group;
    int64_t blocks = (threads_needed + kRopeThreadsPerBlock - 1) / kRopeThreadsPerBlock;
    blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks));
    rope_reposition_kernel<scalar_t, cache_t>
        <<<static_cast<unsigned>(blocks), kRopeThreadsPerBlock, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) {
  m.impl("rope_reposition", &rope_reposition_impl<CudaRope>);
}

}  // namespace kvlayout
