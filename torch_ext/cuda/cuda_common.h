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

#include "../host_checks.h"
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

// What precedes a launch on a stream under CUDA graph capture, so that a
// dependent launch may load before the previous kernel ends (the early-loads
// kernel of copy_rows.cu) exactly when that is safe: when the stream's only
// dependency is the last node this class recorded in the same capture, and
// that kernel writes nothing the new launch reads. Every kernel launched with
// this order waits for its own predecessor before its writes and before it
// exits, so everything before that node has finished when the new launch
// starts. Outside capture nothing says what else was queued on the stream
// since, so early loads are never allowed there.
class LaunchOrder {
 public:
  explicit LaunchOrder(cudaStream_t stream) : stream_(stream) {
    capturing_ = only_dependency(only_dep_);
  }

  // Whether the stream is being captured (else nothing here applies).
  bool capturing() const { return capturing_; }

  // Whether the stream's only dependency is the last launch recorded in this
  // capture and none of its writes meet `reads`.
  bool previous_writes_miss(const std::vector<ByteRange>& reads) const {
    if (!capturing_ || only_dep_ == nullptr) return false;
    std::lock_guard<std::mutex> lock(mutex());
    const auto it = last().find(capture_id_);
    if (it == last().end() || it->second.node != only_dep_) return false;
    for (const ByteRange& w : it->second.writes)
      for (const ByteRange& r : reads)
        if (ranges_meet(w, r)) return false;
    return true;
  }

  // Records the launch just made on the stream (the node it added, now the
  // stream's only dependency) and what it writes.
  void launched(const std::vector<ByteRange>& writes) {
    if (!capturing_ || !only_dependency(only_dep_) || only_dep_ == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex());
    if (last().size() >= 64) last().clear();  // finished captures; a live one just loses its record
    last()[capture_id_] = Tail{only_dep_, writes};
  }

 private:
  struct Tail {
    cudaGraphNode_t node;
    std::vector<ByteRange> writes;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  // The last recorded launch of each capture sequence (by capture id).
  static std::unordered_map<unsigned long long, Tail>& last() {
    static std::unordered_map<unsigned long long, Tail> tails;
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
  bool capturing_ = false;
  unsigned long long capture_id_ = 0;
  cudaGraphNode_t only_dep_ = nullptr;
};

// What every CUDA launch policy shares (copy_rows.cu and rope.cu derive their
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
