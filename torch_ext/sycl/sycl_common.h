// Helpers shared by kvlayout's SYCL (XPU) launchers; the counterpart of
// torch_ext/cuda/cuda_common.h. A tensor reaches the kernel when it is an XPU
// tensor of the launch device (USM device memory) or a host tensor in USM host
// memory (torch's pinned memory on XPU, sycl::malloc_host). xpu::Backend is
// the device part of the backend policy the shared launch templates take
// (see copy_rows_launch.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <c10/xpu/XPUStream.h>

#include <sycl/sycl.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>

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

// What every SYCL launch policy shares (copy_rows.sycl and rope.sycl derive
// their policies from it): the device type, its guard and current queue, and
// the addresses a kernel sees (USM pointers are the same on host and device).
struct Backend {
  static constexpr c10::DeviceType kDeviceType = c10::DeviceType::XPU;
  using Guard = c10::DeviceGuard;
  using Stream = sycl::queue&;

  static Stream stream(c10::Device dev) {
    return c10::xpu::getCurrentXPUStream(dev.index()).queue();
  }
  static char* device_address(const at::Tensor& t, c10::Device dev, const char* name,
                              int64_t index) {
    return xpu::device_address(t, dev, stream(dev), name, index);
  }
  static const void* index_address(const std::optional<at::Tensor>& t, c10::Device dev,
                                   const char* name) {
    return xpu::index_address(t, dev, stream(dev), name);
  }
  // Whether host tensor `t`, bound at `alias` (its own address), is still USM
  // host memory of the queue's context (it may have been freed and its address
  // reused by an unpinned allocation).
  static bool host_alias_valid(const at::Tensor& t, c10::Device dev, const char* alias) {
    return t.data_ptr() == alias &&
           sycl::get_pointer_type(alias, stream(dev).get_context()) == sycl::usm::alloc::host;
  }
};

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
