// Helpers shared by kvlayout's SYCL (XPU) launchers; the counterpart of
// torch_ext/cuda/cuda_common.h. A tensor reaches the kernel when it is an XPU
// tensor of the launch device (USM device memory) or a host tensor in USM host
// memory (torch's pinned memory on XPU, sycl::malloc_host).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/xpu/XPUStream.h>

#include <sycl/sycl.hpp>

#include <algorithm>
#include <cstdint>

#include "kvlayout/status.h"

namespace kvlayout {
namespace xpu {

// Work-group size of both kernels: 256 work-items in sub-groups of 16.
constexpr int kSubGroupSize = 16;

inline void* usm_address(void* ptr, bool is_xpu, c10::Device tensor_device, c10::Device dev,
                         sycl::queue& q, const char* name, int64_t index, bool indexed) {
  if (is_xpu) {
    if (indexed) {
      TORCH_CHECK_VALUE(tensor_device == dev, "kvlayout: ", name, "[", index, "] is on ",
                  tensor_device, " but the operation runs on ", dev,
                  "; tensors on other devices are not supported yet (move it to ", dev, ")");
    } else {
      TORCH_CHECK_VALUE(tensor_device == dev, "kvlayout: ", name, " is on ", tensor_device,
                  " but the operation runs on ", dev);
    }
    return ptr;
  }
  TORCH_CHECK_VALUE(tensor_device.is_cpu(), "kvlayout: ", name, " is on ", tensor_device,
              ", which an XPU kernel cannot reach");
  if (ptr == nullptr) return nullptr;
  const sycl::usm::alloc kind = sycl::get_pointer_type(ptr, q.get_context());
  if (indexed) {
    TORCH_CHECK_VALUE(kind == sycl::usm::alloc::host, "kvlayout: ", name, "[", index,
                "] is an unpinned host tensor: pin it with .pin_memory() or move it to ", dev);
  } else {
    TORCH_CHECK_VALUE(kind == sycl::usm::alloc::host, "kvlayout: ", name,
                " is an unpinned host tensor: pin it with .pin_memory() or move it to ", dev);
  }
  return ptr;
}

inline char* device_address(const at::Tensor& t, c10::Device dev, sycl::queue& q,
                            const char* name, int64_t index) {
  return static_cast<char*>(
      usm_address(t.data_ptr(), t.is_xpu(), t.device(), dev, q, name, index, true));
}

inline const void* index_address(const std::optional<at::Tensor>& t, c10::Device dev,
                                 sycl::queue& q, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  return usm_address(t->data_ptr(), t->is_xpu(), t->device(), dev, q, name, 0, false);
}

// The status-word recorder (kvlayout/status.h) with a SYCL atomic add.
struct StatusRecorder {
  int64_t* status;
  void operator()(int64_t token, int64_t value, int64_t bound, int64_t which) const {
    record_status(
        status,
        [](int64_t* s) {
          sycl::atomic_ref<unsigned long long, sycl::memory_order::relaxed,
                           sycl::memory_scope::device, sycl::access::address_space::global_space>
              count(*reinterpret_cast<unsigned long long*>(s));
          return count.fetch_add(1ull);
        },
        token, value, bound, which);
  }
};

// Work-groups of 256 work-items that fill the device once: each work-group
// takes 16 hardware threads (sub-groups of 16), and an Intel Xe vector engine
// (a compute unit) runs 8 of them.
inline int64_t resident_work_groups(sycl::queue& q) {
  const int64_t cus = q.get_device().get_info<sycl::info::device::max_compute_units>();
  return std::max<int64_t>(1, cus / 2);
}

}  // namespace xpu
}  // namespace kvlayout
