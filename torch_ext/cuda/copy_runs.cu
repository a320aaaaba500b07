// CUDA implementation of kvlayout::copy_runs: copy_rows done by the copy
// engine instead of SMs.
//
// The host reads the slots (CPU tensors), checks them, coalesces consecutive
// tokens whose rows are adjacent on both sides (host_checks.h for_each_block)
// and issues one memory copy per block on the current stream: one
// cudaMemcpyBatchAsync where the runtime has it (CUDA >= 12.8), else one
// cudaMemcpyAsync per block. It is meant for page-granular transfers (long
// runs), runs beside the forward pass without taking SMs, and cannot be
// captured in a CUDA graph (a batched copy is not capturable): it refuses a
// capturing stream. Pinned host memory is reached through unified addressing.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../host_checks.h"
#include "cuda_common.h"

namespace kvlayout {
namespace {

void check_host_slots(const std::optional<at::Tensor>& slots, const char* name) {
  TORCH_CHECK(!slots.has_value() || !slots->defined() || slots->device().is_cpu(), "kvlayout: ", name,
              " is on ", slots.has_value() ? slots->device() : c10::Device(c10::kCPU),
              "; the copy engine reads the slots on the host: pass a CPU tensor (or use the kernel)");
}

void issue(std::vector<void*>& dsts, std::vector<const void*>& srcs, std::vector<size_t>& sizes,
           cudaStream_t stream) {
  if (sizes.empty()) return;
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attr,
                                      &attr_index, 1, stream));
#else
  size_t fail_index = 0;
  C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                      sizes.size(), &attr, &attr_index, 1, &fail_index, stream));
#endif
#else
  for (size_t i = 0; i < sizes.size(); ++i)
    C10_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream));
#endif
}

void copy_runs_cuda(at::TensorList src, at::TensorList dst,
                    const std::optional<at::Tensor>& src_slots,
                    const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                    int64_t skip_prefix, c10::IntArrayRef src_segments,
                    c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                    c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes) {
  check_host_slots(src_slots, "src_slots");
  check_host_slots(dst_slots, "dst_slots");
  const CopyPlan plan =
      plan_copy_rows(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                     dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, 0);
  const auto cuda_dev = cuda::first_cuda_device(dst, src);
  TORCH_CHECK(cuda_dev.has_value(), "kvlayout::copy_runs: no CUDA tensor among src and dst");
  const c10::Device dev = *cuda_dev;
  const c10::cuda::CUDAGuard guard(dev);
  if (plan.empty()) return;
  check_slots_in_range_on_host(plan);

  cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index()).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "kvlayout: the copy engine cannot be captured in a CUDA graph; use the kernel "
              "(engine='kernel') inside graphs");

  std::vector<const char*> src_base(plan.num_segments);
  std::vector<char*> dst_base(plan.num_segments);
  for (int64_t g = 0; g < plan.num_segments; ++g) {
    src_base[g] = cuda::device_address(src[plan.src_tensor[g]], dev, "src", plan.src_tensor[g]) +
                  plan.src_offset[g];
    dst_base[g] = cuda::device_address(dst[plan.dst_tensor[g]], dev, "dst", plan.dst_tensor[g]) +
                  plan.dst_offset[g];
  }
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for_each_block(plan, plan.skip_prefix, plan.num_tokens,
                 [&](int64_t g, int64_t so, int64_t dof, int64_t bytes) {
                   dsts.push_back(dst_base[g] + dof);
                   srcs.push_back(src_base[g] + so);
                   sizes.push_back(static_cast<size_t>(bytes));
                 });
  issue(dsts, srcs, sizes, stream);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("copy_runs", &copy_runs_cuda); }

}  // namespace kvlayout
