// What a device backend derives from a checked CopyPlan before it launches:
// the launch device, the status word, the kernel-visible segment bases and
// the vector width they allow.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "copy_plan.h"

namespace kvlayout {

// Validates the status tensor of device backends: int64, >= kStatusNumel
// elements, contiguous, on `device`.
void check_status_tensor(const at::Tensor& status, c10::Device device);

// The device of the first tensor of device type `type` among dst, then src:
// the device a copy between them runs on (nullopt: none is of that type).
std::optional<c10::Device> first_device_of_type(c10::DeviceType type, at::TensorList dst,
                                                at::TensorList src);

// The device a backend of device type `type` runs kvlayout::copy_rows on: the
// first tensor of that type among dst, src, src_slots, dst_slots, status
// (the others may be pinned host tensors). Raises when there is none.
c10::Device copy_rows_device(c10::DeviceType type, at::TensorList src, at::TensorList dst,
                             const std::optional<at::Tensor>& src_slots,
                             const std::optional<at::Tensor>& dst_slots,
                             const at::Tensor& status);

// Where a device kernel finds each segment's rows, and the vector width it
// moves them in: the widest of 16, 8, 4, 2, 1 bytes dividing the piece size,
// every stride the launch uses and every segment base.
struct SegmentBases {
  std::vector<const char*> src;
  std::vector<char*> dst;
  int vec_bytes = 16;
};

int widest_vector_bytes(const CopyPlan& plan, const SegmentBases& bases);

// The segment bases of `plan` on a device backend. address(tensor, is_src,
// index) is the address the kernel sees for tensor `index` of src or dst
// (a device pointer, or a pinned host tensor's device alias); it is called
// once per tensor a segment uses.
template <class Address>
SegmentBases segment_bases(const CopyPlan& plan, at::TensorList src, at::TensorList dst,
                           const Address& address) {
  std::vector<const char*> src_ptr(src.size(), nullptr);
  std::vector<char*> dst_ptr(dst.size(), nullptr);
  std::vector<bool> src_seen(src.size(), false), dst_seen(dst.size(), false);
  SegmentBases b;
  for (int64_t g = 0; g < plan.num_segments; ++g) {
    const int64_t si = plan.src_tensor[g], di = plan.dst_tensor[g];
    if (!src_seen[si]) {
      src_ptr[si] = address(src[si], true, si);
      src_seen[si] = true;
    }
    if (!dst_seen[di]) {
      dst_ptr[di] = address(dst[di], false, di);
      dst_seen[di] = true;
    }
    b.src.push_back(src_ptr[si] + plan.src_offset[g]);
    b.dst.push_back(dst_ptr[di] + plan.dst_offset[g]);
  }
  b.vec_bytes = widest_vector_bytes(plan, b);
  return b;
}

}  // namespace kvlayout
