#include "device_args.h"

#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <c10/util/Exception.h>

#include "kvlayout/status.h"

namespace kvlayout {

int widest_vector_bytes(const CopyPlan& plan, const SegmentBases& bases) {
  uint64_t align = static_cast<uint64_t>(plan.piece_bytes);
  auto strides_in_use = [&](const RowGeometry& g) {
    if (g.num_slots > g.page_size) align |= static_cast<uint64_t>(g.stride_page);
    if (g.page_size > 1 && g.num_slots > 1) align |= static_cast<uint64_t>(g.stride_in_page);
    if (plan.num_pieces > 1) align |= static_cast<uint64_t>(g.stride_piece);
  };
  strides_in_use(plan.src_geom);
  strides_in_use(plan.dst_geom);
  for (const char* p : bases.src) align |= reinterpret_cast<uintptr_t>(p);
  for (const char* p : bases.dst) align |= reinterpret_cast<uintptr_t>(p);
  int vec = 16;
  while (vec > 1 && (align % static_cast<uint64_t>(vec)) != 0) vec /= 2;
  return vec;
}

void check_status_tensor(const at::Tensor& status, c10::Device device) {
  TORCH_CHECK(status.defined() && status.scalar_type() == at::kLong &&
                  status.numel() >= kStatusNumel && status.is_contiguous(),
              "kvlayout: status must be a contiguous int64 tensor of at least ", kStatusNumel,
              " elements (use kvlayout.ops._native.status_tensor(device))");
  TORCH_CHECK(status.device() == device, "kvlayout: status is on ", status.device(),
              " but the operation runs on ", device,
              " (use kvlayout.ops._native.status_tensor(device))");
}

std::optional<c10::Device> first_device_of_type(c10::DeviceType type, at::TensorList dst,
                                                at::TensorList src) {
  for (const at::TensorList side : {dst, src})
    for (const at::Tensor& t : side)
      if (t.defined() && t.device().type() == type) return t.device();
  return std::nullopt;
}

c10::Device copy_rows_device(c10::DeviceType type, at::TensorList src, at::TensorList dst,
                             const std::optional<at::Tensor>& src_slots,
                             const std::optional<at::Tensor>& dst_slots,
                             const at::Tensor& status) {
  if (const auto dev = first_device_of_type(type, dst, src)) return *dev;
  for (const auto* slots : {&src_slots, &dst_slots})
    if (slots->has_value() && (*slots)->defined() && (*slots)->device().type() == type)
      return (*slots)->device();
  TORCH_CHECK(status.defined() && status.device().type() == type, "kvlayout::copy_rows: no ",
              c10::DeviceTypeName(type), " tensor among the arguments");
  return status.device();
}

}  // namespace kvlayout
