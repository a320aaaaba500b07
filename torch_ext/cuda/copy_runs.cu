// CUDA implementation of kvlayout::copy_runs: copy_rows done by the copy
// engine instead of SMs.
//
// The host reads the slots (CPU tensors) once, checks them (range, repeated
// destination slots), builds the run list (copy_list.h: consecutive tokens
// whose rows are adjacent on both sides coalesced, copies that continue each
// other merged), and issues the copies in stream order on the current stream:
//
// * cudaMemcpyBatchAsync where the runtime has it (CUDA >= 12.8), in batches
//   of at most kMaxBatch copies. The batch API refuses the legacy NULL stream
//   (torch's default stream): there the batches go to a side stream that
//   waits for the current stream before and is waited on after (events), so
//   the caller still sees stream order.
// * one cudaMemcpyAsync per copy where the runtime lacks the batch API or
//   refuses a batch (the refusal is cleared and the batch is re-issued), or
//   when the environment variable KVLAYOUT_COPY_BATCH is 0 (to test and
//   compare that path).
//
// It is meant for page-granular transfers (long runs), runs beside the
// forward pass without taking SMs, and cannot be captured in a CUDA graph (a
// batched copy is not capturable): it refuses a capturing stream. Pinned host
// memory is reached through unified addressing.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "../copy_list.h"
#include "../copy_plan.h"
#include "../device_args.h"
#include "../slots.h"
#include "../thread_scratch.h"
#include "cuda_common.h"

namespace kvlayout {
namespace {

// Copies per cudaMemcpyBatchAsync call: very large batches have failed on
// some drivers, and a few thousand already amortise the call.
constexpr size_t kMaxBatch = 2048;

void check_host_slots(const std::optional<at::Tensor>& slots, const char* name) {
  TORCH_CHECK(!slots.has_value() || !slots->defined() || slots->device().is_cpu(), "kvlayout: ", name,
              " is on ", slots.has_value() ? slots->device() : c10::Device(c10::kCPU),
              "; the copy engine reads the slots on the host: pass a CPU tensor (or use the kernel)");
}

void issue_one_by_one(const CopyList& c, size_t begin, size_t end, cudaStream_t stream) {
  for (size_t i = begin; i < end; ++i)
    C10_CUDA_CHECK(cudaMemcpyAsync(c.dsts[i], c.srcs[i], c.sizes[i], cudaMemcpyDefault, stream));
}

#if CUDART_VERSION >= 12080
// One batch [begin, end); false (error cleared) when the runtime refuses it.
bool issue_batch(CopyList& c, size_t begin, size_t end, cudaStream_t stream) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaMemcpyBatchAsync(c.dsts.data() + begin, c.srcs.data() + begin,
                                               c.sizes.data() + begin, end - begin, &attr,
                                               &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  const cudaError_t err = cudaMemcpyBatchAsync(
      c.dsts.data() + begin, const_cast<void**>(c.srcs.data() + begin), c.sizes.data() + begin,
      end - begin, &attr, &attr_index, 1, &fail_index, stream);
#endif
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();  // a refused batch is not sticky: clear it, copy one by one
  return false;
}
#endif

bool batch_api_enabled() {
  const char* v = std::getenv("KVLAYOUT_COPY_BATCH");
  return v == nullptr || std::string(v) != "0";
}

// Issues every copy in stream order with respect to the current stream.
void issue(CopyList& c, c10::Device dev) {
  if (c.sizes.empty()) return;
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(dev.index());
  if (!batch_api_enabled()) {
    issue_one_by_one(c, 0, c.sizes.size(), current.stream());
    return;
  }
#if CUDART_VERSION >= 12080
  // The batch API needs a stream other than the legacy NULL stream.
  const bool legacy = current.stream() == nullptr || current.stream() == cudaStreamLegacy;
  const c10::cuda::CUDAStream stream =
      legacy ? c10::cuda::getStreamFromPool(/*isHighPriority=*/false, dev.index()) : current;
  if (legacy) {
    at::cuda::CUDAEvent before;
    before.record(current);
    before.block(stream);
  }
  bool batched = true;
  for (size_t begin = 0; begin < c.sizes.size(); begin += kMaxBatch) {
    const size_t end = std::min(c.sizes.size(), begin + kMaxBatch);
    if (!(batched && issue_batch(c, begin, end, stream.stream()))) {
      batched = false;  // once refused, the rest goes one by one
      issue_one_by_one(c, begin, end, stream.stream());
    }
  }
  if (legacy) {
    at::cuda::CUDAEvent after;
    after.record(stream);
    after.block(current);
  }
#else
  issue_one_by_one(c, 0, c.sizes.size(), current.stream());
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
  CopyPlan checked =
      plan_copy_rows(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                     dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, 0);
  const auto cuda_dev = first_device_of_type(c10::DeviceType::CUDA, dst, src);
  TORCH_CHECK(cuda_dev.has_value(), "kvlayout::copy_runs: no CUDA tensor among src and dst");
  const c10::Device dev = *cuda_dev;
  const c10::cuda::CUDAGuard guard(dev);
  if (checked.empty()) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(
      cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(dev.index()).stream(), &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "kvlayout: the copy engine cannot be captured in a CUDA graph; use the kernel "
              "(engine='kernel') inside graphs");
  const ScratchScope scope;
  ThreadScratch& scratch = ThreadScratch::mine();
  run_list_at(
      checked, src, dst,
      [&](const at::Tensor& t, const char* name, int64_t i) {
        return cuda::device_address(t, dev, name, i);
      },
      scratch.slots, scratch.copies);
  issue(scratch.copies, dev);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("copy_runs", &copy_runs_cuda); }

}  // namespace kvlayout
