// Helpers shared by kvlayout's CUDA launchers: where a tensor's bytes are for
// the kernel (a CUDA tensor on the launch device, or pinned host memory
// reached through unified addressing), the error recorder of the status
// tensor, and the device part of the backend policy the shared launch
// templates take (cuda::Backend; see copy_rows_launch.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "../copy_plan.h"
#include "../device_args.h"
#include "../slots.h"
#include "../program.h"
#include "kvlayout/status.h"

namespace kvlayout {
namespace cuda {

// Device-accessible address of t.data_ptr() for a kernel running on `dev`.
// A CUDA tensor must be on `dev` (peer access between devices is not enabled
// yet: allowing it means accepting other devices here once
// cudaDeviceCanAccessPeer/cudaDeviceEnablePeerAccess succeeded). A host
// tensor must be pinned or registered (cudaHostAlloc / cudaHostRegister);
// its device alias is used. Returns nullptr for tensors without data.
inline char* device_address(const at::Tensor& t, c10::Device dev, const char* name,
                            int64_t index) {
  void* ptr = t.data_ptr();
  if (t.is_cuda()) {
    TORCH_CHECK_VALUE(t.device() == dev, "kvlayout: ", name, "[", index, "] is on ", t.device(),
                " but the operation runs on ", dev,
                "; tensors on other GPUs are not supported yet (move it to ", dev, ")");
    return static_cast<char*>(ptr);
  }
  TORCH_CHECK_VALUE(t.device().is_cpu(), "kvlayout: ", name, "[", index, "] is on ", t.device(),
              ", which a CUDA kernel cannot reach");
  if (ptr == nullptr) return nullptr;
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    attr.type = cudaMemoryTypeUnregistered;
  }
  TORCH_CHECK_VALUE(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, "kvlayout: ",
              name, "[", index,
              "] is an unpinned host tensor: pin it with .pin_memory() or move it to ", dev);
  return static_cast<char*>(attr.devicePointer);
}

// Same for an optional index tensor (name printed without an index).
inline const void* index_address(const std::optional<at::Tensor>& t, c10::Device dev,
                                 const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  void* ptr = t->data_ptr();
  if (t->is_cuda()) {
    TORCH_CHECK_VALUE(t->device() == dev, "kvlayout: ", name, " is on ", t->device(),
                " but the operation runs on ", dev);
    return ptr;
  }
  TORCH_CHECK_VALUE(t->device().is_cpu(), "kvlayout: ", name, " is on ", t->device(),
              ", which a CUDA kernel cannot reach");
  if (ptr == nullptr) return nullptr;
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    attr.type = cudaMemoryTypeUnregistered;
  }
  TORCH_CHECK_VALUE(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, "kvlayout: ",
              name, " is an unpinned host tensor: pin it with .pin_memory() or move it to ",
              dev);
  return attr.devicePointer;
}

// The status-word recorder (kvlayout/status.h) with CUDA's atomic add.
struct StatusRecorder {
  int64_t* status;
  __device__ void operator()(int64_t token, int64_t value, int64_t bound, int64_t which) const {
    record_status(
        status,
        [](int64_t* s) { return atomicAdd(reinterpret_cast<unsigned long long*>(s), 1ull); },
        token, value, bound, which);
  }
};

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// What may still run when a launch starts on a stream, so that a dependent
// launch may load before the previous kernel ends (the early-loads kernel of
// copy_rows_cuda.cuh) only where that is safe. Every dependent kvlayout launch is
// recorded with the bytes it writes. Every one waits for its predecessor
// before its writes and before it exits, so kernels end in stream order. A
// launch lets its successor start once it has waited (so when the successor
// starts, everything before this launch has ended), except an early-loads
// launch made kLoadsAndNext, which lets it start at once: the successor may
// then overlap this launch and everything this launch may overlap. The
// record of a stream is the *chain*: the bytes written by the launches that
// may still run when the next one starts. A new launch may load early when
// the previous kernel of the stream is the last recorded launch and the
// chain misses what it reads; it is kLoadsAndNext unless the chain would
// then hold more than kMaxChainRanges ranges (a kLoads launch starts a new
// chain). How deep the pipeline runs is then up to the SMs: a launch's
// successor starts only when all its CTAs have. Which kernel precedes a
// launch is known:
//   * under CUDA graph capture, from the stream's capture dependencies: the
//     only one must be the node of the last recorded launch of the capture;
//   * outside capture only by the caller's promise (RunArgs::early_loads):
//     between its calls the stream runs no kernel of other code that lets
//     its successor start early (programmatic dependent launch); ordinary
//     kernels, copies and event waits start after everything before them
//     has ended, so they cannot overlap a load. Without the promise eager
//     launches never load early.
// An order holds a process-wide lock while it lives, so that the launches of
// other threads cannot come between its check and its launch.
class LaunchOrder {
 public:
  // Distinct write ranges a chain may hold (a layer pipeline writes one
  // tensor per layer at most: a cache's per-layer tensors, or one chunk).
  static constexpr size_t kMaxChainRanges = 64;

  LaunchOrder(cudaStream_t stream, bool promised)
      : stream_(stream), lock_(mutex()) {
    capturing_ = only_dependency(only_dep_);
    promised_ = promised && !capturing_;
  }

  // Whether this order can tell what precedes a launch on the stream.
  bool may_load_early() const { return capturing_ || promised_; }

  // How the next launch, reading the kernel-visible byte ranges `reads` and
  // writing `writes`, may start (see the class comment).
  EarlyStart early_start(const std::vector<ByteRange>& reads,
                         const std::vector<ByteRange>& writes) const {
    const Tail* tail = nullptr;
    if (capturing_) {
      const auto it = by_capture().find(capture_id_);
      if (only_dep_ != nullptr && it != by_capture().end() && it->second.node == only_dep_)
        tail = &it->second;
    } else if (promised_) {
      const auto it = by_stream().find(stream_);
      if (it != by_stream().end()) tail = &it->second;
    }
    if (tail == nullptr || tail->chain.empty()) return EarlyStart::kNone;
    for (const ByteRange& w : tail->chain)
      for (const ByteRange& r : reads)
        if (ranges_meet(w, r)) return EarlyStart::kNone;
    size_t grown = tail->chain.size();
    for (const ByteRange& w : writes) grown += tail->holds(w) ? 0 : 1;
    return grown <= kMaxChainRanges ? EarlyStart::kLoadsAndNext : EarlyStart::kLoads;
  }

  // Records the launch just made on the stream (started as `start`) and what
  // it writes (under capture: the node it added, now the stream's only
  // dependency).
  void launched(const std::vector<ByteRange>& writes, EarlyStart start) {
    Tail* tail = nullptr;
    if (capturing_) {
      if (!only_dependency(only_dep_) || only_dep_ == nullptr) return;
      if (by_capture().size() >= 64 && by_capture().count(capture_id_) == 0)
        by_capture().clear();  // finished captures; a live one only loses its record
      tail = &by_capture()[capture_id_];
      tail->node = only_dep_;
    } else {
      if (by_stream().size() >= 256 && by_stream().count(stream_) == 0) by_stream().clear();
      tail = &by_stream()[stream_];
    }
    // The next launch may overlap this one, and what this one may overlap if
    // it let the next start at once.
    if (start != EarlyStart::kLoadsAndNext) tail->chain.clear();
    for (const ByteRange& w : writes)
      if (!tail->holds(w)) tail->chain.push_back(w);
  }

 private:
  struct Tail {
    cudaGraphNode_t node = nullptr;  // under capture
    std::vector<ByteRange> chain;    // distinct ranges
    bool holds(const ByteRange& r) const {
      for (const ByteRange& c : chain)
        if (c.begin == r.begin && c.end == r.end) return true;
      return false;
    }
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  // The record of each capture sequence (by capture id) and of each stream
  // outside capture.
  static std::unordered_map<unsigned long long, Tail>& by_capture() {
    static std::unordered_map<unsigned long long, Tail> tails;
    return tails;
  }
  static std::unordered_map<cudaStream_t, Tail>& by_stream() {
    static std::unordered_map<cudaStream_t, Tail> tails;
    return tails;
  }

  // Whether the stream is capturing; `node`: its only capture dependency
  // (nullptr when it has none or several).
  bool only_dependency(cudaGraphNode_t& node) {
    node = nullptr;
#if CUDART_VERSION >= 12030
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* edges = nullptr;
    size_t n = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err =
        cudaStreamGetCaptureInfo(stream_, &status, &capture_id_, nullptr, &deps, &edges, &n);
#else
    const cudaError_t err =
        cudaStreamGetCaptureInfo_v3(stream_, &status, &capture_id_, nullptr, &deps, &edges, &n);
#endif
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (status != cudaStreamCaptureStatusActive) return false;
    if (n == 1) node = deps[0];
    return true;
#else
    return false;
#endif
  }

  cudaStream_t stream_;
  std::unique_lock<std::mutex> lock_;
  bool capturing_ = false;
  bool promised_ = false;
  unsigned long long capture_id_ = 0;
  cudaGraphNode_t only_dep_ = nullptr;
};

// What every CUDA launch policy shares (copy_rows_cuda.cuh and rope.cu derive their
// policies from it): the device type, its guard and current stream, and the
// addresses a kernel sees.
struct Backend {
  static constexpr c10::DeviceType kDeviceType = c10::DeviceType::CUDA;
  using Guard = c10::cuda::CUDAGuard;
  using Stream = cudaStream_t;
  using LaunchOrder = cuda::LaunchOrder;

  static Stream stream(c10::Device dev) {
    return at::cuda::getCurrentCUDAStream(dev.index()).stream();
  }
  static char* device_address(const at::Tensor& t, c10::Device dev, const char* name,
                              int64_t index) {
    return cuda::device_address(t, dev, name, index);
  }
  static const void* index_address(const std::optional<at::Tensor>& t, c10::Device dev,
                                   const char* name) {
    return cuda::index_address(t, dev, name);
  }
  // Whether host tensor `t`, whose device alias was `alias` when a launch was
  // bound, is still pinned with that alias (it may have been freed and its
  // address reused by other memory). The registration is looked up by
  // address alone: no device needed.
  static bool host_alias_valid(const at::Tensor& t, c10::Device /*dev*/, const char* alias) {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, t.data_ptr()) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.type == cudaMemoryTypeHost && attr.devicePointer == alias;
  }
};

}  // namespace cuda
}  // namespace kvlayout
