// CUDA implementation of the staged host transfer's run loop (staged.h): the
// copy kernel between the device cache and a ring slot on the caller's
// stream, cudaMemcpyAsync between the ring slot and the pinned host chunk on
// a side stream, ordered by events (reused across calls: a wait takes the
// event's latest record at the time it is issued).
//
// Host work per call: one small kernel that writes the ring row of every
// token (and, device -> host, which host rows must be kept), then per chunk
// one or two program runs, the chunk's copies (adjacent ones merged) and two
// event records with their waits. No allocation beyond the per-call token
// table (torch's caching allocator), no synchronisation.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "../staged.h"
#include "cuda_common.h"

namespace kvlayout {
namespace {

// rows[0][t]: token t's ring row ((t - skip) % per_chunk; -1 before skip).
// With keep (device -> host): rows[1][t] = t and rows[2][t] = its ring row
// where token t has no device row (slot < 0 or >= num_slots), else -1: the
// keep kernel copies those host rows into the ring so that the copy back
// leaves them as they were.
template <class Slot>
__global__ void staged_rows_kernel(const Slot* slots, int64_t num_tokens, int64_t skip,
                                   int64_t per_chunk, int64_t num_slots, bool keep,
                                   int64_t* rows) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < num_tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t ring_row = t >= skip ? (t - skip) % per_chunk : -1;
    rows[t] = ring_row;
    if (keep) {
      const int64_t s = slots != nullptr ? int64_t(slots[t]) : t;
      const bool kept = ring_row >= 0 && (s < 0 || s >= num_slots);
      rows[num_tokens + t] = kept ? t : -1;
      rows[2 * num_tokens + t] = kept ? ring_row : -1;
    }
  }
}

class Events {
 public:
  explicit Events(size_t n) : events_(n, nullptr) {
    for (cudaEvent_t& e : events_) C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~Events() {
    for (cudaEvent_t e : events_)
      if (e != nullptr) (void)cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// `waiter` waits for what `stream` has queued so far, through `event`.
void join(cudaEvent_t event, cudaStream_t stream, cudaStream_t waiter) {
  C10_CUDA_CHECK(cudaEventRecord(event, stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
}

class CudaStaged final : public StagedEngine {
 public:
  explicit CudaStaged(StagedSetup setup)
      : s_(std::move(setup)), events_(2 + 2 * s_.ring_slots.size()) {
    const c10::cuda::CUDAGuard guard(s_.device);
    for (const at::Tensor& slot : s_.ring_slots) ring_.push_back(static_cast<char*>(slot.data_ptr()));
    for (size_t i = 0; i < s_.host_tensors.size(); ++i) {
      (void)cuda::device_address(s_.host_tensors[i], s_.device, "host", int64_t(i));  // pinned?
      host_.push_back(static_cast<char*>(s_.host_tensors[i].data_ptr()));
    }
  }

  void run(const StagedArgs& a) override {
    if (a.skip_prefix >= a.num_tokens) return;
    const c10::cuda::CUDAGuard guard(s_.device);
    const cudaStream_t main = c10::cuda::getCurrentCUDAStream(s_.device.index()).stream();
    const auto side = reinterpret_cast<cudaStream_t>(s_.side_stream);
    const size_t R = ring_.size();
    const bool keep = s_.host_is_dst && !s_.keeps.empty();
    const at::Tensor device_slots =
        a.device_slots.has_value() && a.device_slots->defined() ? *a.device_slots : at::Tensor();
    // The token table's rows, each read by every chunk as a prefix (RunArgs::slot_prefixes): one view
    // per row per call, none per chunk.
    const at::Tensor rows = token_rows(a, keep, main);
    const at::Tensor ring_rows = rows[0];
    const at::Tensor kept_host_rows = keep ? rows[1] : at::Tensor();
    const at::Tensor kept_ring_rows = keep ? rows[2] : at::Tensor();
    // what the caller queued before (the caches, the host chunk) comes first on the side stream
    join(events_[0], main, side);
    const int64_t per_chunk = s_.tokens_per_chunk;
    size_t c = 0;
    for (size_t g = 0; g < s_.groups.size(); ++g) {
      for (int64_t t0 = a.skip_prefix; t0 < a.num_tokens; t0 += per_chunk, ++c) {
        // tokens [t0, end): the slot arrays' first `end` entries, with skip_prefix t0 (so a
        // recorded out-of-range slot names its index in the caller's slots)
        const int64_t end = std::min(t0 + per_chunk, a.num_tokens);
        const size_t r = c % R;
        const cudaEvent_t filled = events_[2 + r], drained = events_[2 + R + r];
        const BoundProgram& kernel = *s_.kernels[g * R + r];
        // every layer group reads the same slots: only the first records bad ones (each once)
        const auto run = [&](const BoundProgram& p, const at::Tensor& src_slots,
                             const at::Tensor& dst_slots, bool validate) {
          RunArgs args{slots_or_none(src_slots), slots_or_none(dst_slots), end, t0, a.max_ctas,
                       validate};
          args.record_errors = g == 0;
          args.slot_prefixes = true;
          p.run(0, args);
        };
        if (s_.host_is_dst) {
          if (c >= R) C10_CUDA_CHECK(cudaStreamWaitEvent(main, drained, 0));  // its copy out is done
          if (keep) run(*s_.keeps[g * R + r], kept_host_rows, kept_ring_rows, false);
          run(kernel, device_slots, ring_rows, a.validate);
          join(filled, main, side);
          copy(g, r, t0, end - t0, /*to_host=*/true, side);
          C10_CUDA_CHECK(cudaEventRecord(drained, side));
        } else {
          if (c >= R) C10_CUDA_CHECK(cudaStreamWaitEvent(side, drained, 0));  // its kernel is done
          copy(g, r, t0, end - t0, /*to_host=*/false, side);
          join(filled, side, main);
          run(kernel, ring_rows, device_slots, a.validate);
          C10_CUDA_CHECK(cudaEventRecord(drained, main));
        }
      }
    }
    // the side stream's last work joins the caller's stream (a graph capture
    // needs every forked stream joined; a device -> host transfer ends there)
    join(events_[1], side, main);
  }

 private:
  // An undefined tensor stands for "no slots" (token t uses slot t).
  static std::optional<at::Tensor> slots_or_none(const at::Tensor& t) {
    if (!t.defined()) return std::nullopt;
    return t;
  }

  at::Tensor token_rows(const StagedArgs& a, bool keep, cudaStream_t main) const {
    const int64_t T = a.num_tokens;
    at::Tensor rows = at::empty({keep ? 3 : 1, T}, at::TensorOptions().dtype(at::kLong).device(s_.device));
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>((T + threads - 1) / threads, 1024));
    const bool has_slots = a.device_slots.has_value() && a.device_slots->defined();
    if (has_slots && a.device_slots->scalar_type() == at::kInt) {
      staged_rows_kernel<int32_t><<<blocks, threads, 0, main>>>(
          a.device_slots->data_ptr<int32_t>(), T, a.skip_prefix, s_.tokens_per_chunk,
          s_.device_num_slots, keep, rows.data_ptr<int64_t>());
    } else {
      staged_rows_kernel<int64_t><<<blocks, threads, 0, main>>>(
          has_slots ? a.device_slots->data_ptr<int64_t>() : nullptr, T, a.skip_prefix,
          s_.tokens_per_chunk, s_.device_num_slots, keep, rows.data_ptr<int64_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return rows;
  }

  // The copy engine's part of chunk (group g, tokens [t0, t0 + n)) through
  // ring slot r: host rows t0.. <-> ring rows 0.., one copy per segment, a
  // copy that continues the previous one on both sides merged into it.
  void copy(size_t g, size_t r, int64_t t0, int64_t n, bool to_host, cudaStream_t side) const {
    char *prev_host = nullptr, *prev_ring = nullptr;
    size_t prev_bytes = 0;
    auto flush = [&] {
      if (prev_bytes == 0) return;
      C10_CUDA_CHECK(to_host ? cudaMemcpyAsync(prev_host, prev_ring, prev_bytes,
                                               cudaMemcpyDeviceToHost, side)
                             : cudaMemcpyAsync(prev_ring, prev_host, prev_bytes,
                                               cudaMemcpyHostToDevice, side));
    };
    for (const StagedSegment& seg : s_.groups[g]) {
      char* host = host_[static_cast<size_t>(seg.host_tensor)] + seg.host_offset + t0 * seg.row_bytes;
      char* ring = ring_[r] + seg.ring_offset;
      const size_t bytes = static_cast<size_t>(n * seg.row_bytes);
      if (prev_bytes != 0 && prev_host + prev_bytes == host && prev_ring + prev_bytes == ring) {
        prev_bytes += bytes;
        continue;
      }
      flush();
      prev_host = host;
      prev_ring = ring;
      prev_bytes = bytes;
    }
    flush();
  }

  StagedSetup s_;
  Events events_;  // 0: side waits for main; 1: main waits for side; then filled[R], free[R]
  std::vector<char*> ring_, host_;
};

std::unique_ptr<StagedEngine> make_cuda_staged(StagedSetup setup) {
  return std::make_unique<CudaStaged>(std::move(setup));
}

const bool registered = (register_staged_factory(c10::DeviceType::CUDA, &make_cuda_staged), true);

}  // namespace
}  // namespace kvlayout
