// Helpers shared by kvlayout's CUDA launchers: where a tensor's bytes are for
// the kernel (a CUDA tensor on the launch device, or pinned host memory
// reached through unified addressing), the device to launch on, and the error
// recorder of the status tensor.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

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

// The device of the first CUDA tensor among dst, then src (nullopt when all
// are host tensors): the device a copy between them runs on.
inline std::optional<c10::Device> first_cuda_device(at::TensorList dst, at::TensorList src) {
  for (const auto& t : dst)
    if (t.is_cuda()) return t.device();
  for (const auto& t : src)
    if (t.is_cuda()) return t.device();
  return std::nullopt;
}

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

}  // namespace cuda
}  // namespace kvlayout
