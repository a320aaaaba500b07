#include "slots.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

namespace kvlayout {
namespace {

// Open-addressing set of destination slots (linear time): which token wrote
// a slot first.
class SlotSet {
 public:
  explicit SlotSet(int64_t n) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(2 * n)) cap <<= 1;
    mask_ = cap - 1;
    slot_.assign(cap, -1);
    token_.resize(cap);
  }
  // Inserts slot v (>= 0) of token t; returns the earlier token with v, or -1.
  int64_t insert(int64_t v, int64_t t) {
    size_t h = static_cast<size_t>((static_cast<uint64_t>(v) * 0x9E3779B97F4A7C15ull) >> 17) & mask_;
    while (slot_[h] >= 0) {
      if (slot_[h] == v) return token_[h];
      h = (h + 1) & mask_;
    }
    slot_[h] = v;
    token_[h] = t;
    return -1;
  }

 private:
  size_t mask_;
  std::vector<int64_t> slot_, token_;
};

}  // namespace

SlotArray slot_array(const std::optional<at::Tensor>& t, int64_t length, const char* name,
                     const char* length_name) {
  if (!t.has_value()) return SlotArray::identity_slots();
  return index_array(*t, length, name, length_name);
}

SlotArray index_array(const at::Tensor& x, int64_t length, const char* name,
                      const char* length_name) {
  TORCH_CHECK_VALUE(x.defined(), "kvlayout: ", name,
                    " is an undefined tensor (pass None for no slots)");
  TORCH_CHECK_VALUE(!x.is_meta(), "kvlayout: ", name,
                    " is a meta tensor: it holds no values to read");
  TORCH_CHECK_VALUE(x.dim() == 1, "kvlayout: ", name, " must be 1-D, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kInt || x.scalar_type() == at::kLong, "kvlayout: ",
                   name, " must be int32 or int64, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(0) == length, "kvlayout: ", name, " has ", x.size(0),
                    " entries but ", length_name, " is ", length);
  const int64_t stride = x.size(0) > 1 ? x.stride(0) : 1;
  if (length > 0) {
    // The storage must still hold every entry: a tensor whose storage was
    // freed (resize_(0)) has a null data pointer, which must never read as
    // "no slots".
    const bool stored = x.has_storage() && x.data_ptr() != nullptr && stride >= 0;
    const int64_t needed =
        (x.storage_offset() + (length - 1) * stride + 1) * static_cast<int64_t>(x.element_size());
    TORCH_CHECK_VALUE(stored && needed <= static_cast<int64_t>(x.storage().nbytes()),
                      "kvlayout: ", name, " has ", length,
                      " entries but its storage does not hold them (it was freed or resized to ",
                      stored ? std::to_string(x.storage().nbytes()) : std::string("0"),
                      " bytes); pass a slot tensor that holds its values");
  }
  return SlotArray{x.data_ptr(), stride, static_cast<int32_t>(x.element_size()), 0};
}

[[noreturn]] void raise_slot_out_of_range(const char* name, bool identity, int64_t t,
                                          int64_t value, int64_t bound) {
  const char* what = name[0] == 's' ? "the source" : "the destination";
  if (identity) {
    TORCH_CHECK_INDEX(false, "kvlayout: ", name, " is None, so token ", t, " uses slot ", value,
                      ", which is out of range: ", what, " holds ", bound, " slots");
  }
  TORCH_CHECK_INDEX(false, "kvlayout: ", name, "[", t, "] = ", value, " is out of range: ", what,
                    " holds ", bound, " slots");
  __builtin_unreachable();
}

void check_slots_in_range_on_host(const CopyPlan& p) {
  if (p.empty()) return;
  const bool src_identity = p.src_slots.identity != 0;
  const bool dst_identity = p.dst_slots.identity != 0;
  for (int64_t t = p.skip_prefix; t < p.num_tokens; ++t) {
    const int64_t s = p.src_slots.load(t);
    const int64_t d = p.dst_slots.load(t);
    if (s < 0 || d < 0) continue;
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", src_identity, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", dst_identity, t, d, p.dst_geom.num_slots);
  }
}

void read_slots_once(CopyPlan& p, HostSlots& copy, bool unique_dst) {
  if (p.empty()) return;
  const bool src_identity = p.src_slots.identity != 0;
  const bool dst_identity = p.dst_slots.identity != 0;
  if (!src_identity) copy.src.assign(p.num_tokens, -1);
  if (!dst_identity) copy.dst.assign(p.num_tokens, -1);
  const bool check_unique = unique_dst && !dst_identity;
  SlotSet seen(check_unique ? p.num_tokens - p.skip_prefix : 0);
  for (int64_t t = p.skip_prefix; t < p.num_tokens; ++t) {
    const int64_t s = p.src_slots.load(t);  // the one load of each slot
    const int64_t d = p.dst_slots.load(t);
    if (!src_identity) copy.src[t] = s;
    if (!dst_identity) copy.dst[t] = d;
    if (s < 0 || d < 0) continue;
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", src_identity, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", dst_identity, t, d, p.dst_geom.num_slots);
    if (check_unique) {
      const int64_t first = seen.insert(d, t);
      TORCH_CHECK_VALUE(first < 0, "kvlayout: dst_slots repeats slot ", d, " (dst_slots[", first,
                        "] and dst_slots[", t, "]): a destination slot may be written by one "
                        "token only");
    }
  }
  if (!src_identity) p.src_slots = SlotArray{copy.src.data(), 1, 8, 0};
  if (!dst_identity) p.dst_slots = SlotArray{copy.dst.data(), 1, 8, 0};
}

void validate_slots_on_host(const CopyPlan& p, const std::optional<at::Tensor>& src_slots,
                            const std::optional<at::Tensor>& dst_slots) {
  if (p.empty()) return;
  CopyPlan q = p;
  at::Tensor hs, hd;  // host copies, alive while q points at them
  if (q.src_slots.identity == 0) {
    hs = src_slots->to(at::kCPU, at::kLong).contiguous();
    q.src_slots = SlotArray{hs.data_ptr(), 1, 8, 0};
  }
  if (q.dst_slots.identity == 0) {
    hd = dst_slots->to(at::kCPU, at::kLong).contiguous();
    q.dst_slots = SlotArray{hd.data_ptr(), 1, 8, 0};
  }
  HostSlots copy;
  read_slots_once(q, copy, /*unique_dst=*/true);
}

}  // namespace kvlayout
