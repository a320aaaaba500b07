#include "slots.h"

#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "thread_scratch.h"

namespace kvlayout {
namespace {

// Open-addressing set of destination slots (linear time): which token wrote
// a slot first.
class SlotSet {
 public:
  // The table lives in this thread's scratch memory (thread_scratch.h); one
  // SlotSet per thread at a time.
  explicit SlotSet(int64_t n)
      : slot_(ThreadScratch::mine().seen_slot), token_(ThreadScratch::mine().seen_token) {
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
  std::vector<int64_t>& slot_;
  std::vector<int64_t>& token_;
};

}  // namespace

SlotArray slot_array(const std::optional<at::Tensor>& t, int64_t length, const char* name,
                     const char* length_name, bool prefix) {
  if (!t.has_value()) return SlotArray::identity_slots();
  return index_array(*t, length, name, length_name, prefix);
}

SlotArray index_array(const at::Tensor& x, int64_t length, const char* name,
                      const char* length_name, bool prefix) {
  TORCH_CHECK_VALUE(x.defined(), "kvlayout: ", name,
                    " is an undefined tensor (pass None for no slots)");
  TORCH_CHECK_VALUE(!x.is_meta(), "kvlayout: ", name,
                    " is a meta tensor: it holds no values to read");
  TORCH_CHECK_VALUE(x.dim() == 1, "kvlayout: ", name, " must be 1-D, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kInt || x.scalar_type() == at::kLong, "kvlayout: ",
                   name, " must be int32 or int64, got ", x.scalar_type());
  TORCH_CHECK_VALUE(prefix ? x.size(0) >= length : x.size(0) == length, "kvlayout: ", name,
                    " has ", x.size(0), " entries but ", length_name, " is ", length);
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

namespace {

// How a slot array is read: no tensor, or int32 / int64 elements. The read
// loop is instantiated per pair of kinds, so its loads do not branch.
enum SlotKind { kIdentity = 0, kInt32 = 1, kInt64 = 2 };

SlotKind kind_of(const SlotArray& a) {
  return a.identity ? kIdentity : a.elem_bytes == 8 ? kInt64 : kInt32;
}

// Reads slots [begin, end) of `a` into out[begin, end), each exactly once
// (plain loads: the loop may be vectorized; nothing reads the tensor again,
// the checks and the copy use `out`).
template <int K>
void copy_slots(const SlotArray& a, int64_t begin, int64_t end, int64_t* out) {
  if (begin >= end) return;
  if constexpr (K == kInt64) {
    const int64_t* in = static_cast<const int64_t*>(a.data);
    if (a.stride == 1) {
      std::memcpy(out + begin, in + begin, static_cast<size_t>(end - begin) * sizeof(int64_t));
      return;
    }
    for (int64_t t = begin; t < end; ++t) out[t] = in[t * a.stride];
  } else {
    const int32_t* in = static_cast<const int32_t*>(a.data);
    for (int64_t t = begin; t < end; ++t) out[t] = in[t * a.stride];
  }
}

// The tokens with a row to move, where the copies show at once that every
// slot is in range and no destination slot repeats: the destination slots
// fall into few runs of consecutive values (page-granular slots: a run per
// page), and the runs, sorted by their first slot, do not overlap. nullopt
// where that is not shown (a slot out of range, a repeat, or more runs than
// sorting them beats hashing every slot): the token-by-token check decides,
// and raises for the first bad token in token order.
template <int S>
std::optional<TokenRange> unique_by_runs(const CopyPlan& p, const int64_t* src_copy,
                                         const int64_t* dst_copy) {
  std::vector<std::pair<int64_t, int64_t>>& runs = ThreadScratch::mine().runs;
  runs.clear();
  const size_t most = static_cast<size_t>((p.num_tokens - p.skip_prefix) / 4 + 16);
  TokenRange active{p.num_tokens, p.num_tokens};
  int64_t first = -1, next = -1;  // the current run: [first, next)
  for (int64_t t = p.skip_prefix; t < p.num_tokens; ++t) {
    const int64_t s = S == kIdentity ? t : src_copy[t];
    const int64_t d = dst_copy[t];
    if (s < 0 || d < 0) continue;
    if (s >= p.src_geom.num_slots || d >= p.dst_geom.num_slots) return std::nullopt;
    if (d != next) {
      if (first >= 0) {
        if (runs.size() == most) return std::nullopt;
        runs.emplace_back(first, next);
      }
      first = d;
    }
    if (active.first == p.num_tokens) active.first = t;
    // the tokens after t that continue the run, their source slot in range, taken at once
    int64_t more = detail::counting_up(dst_copy + t + 1, d + 1,
                                       std::min(p.num_tokens - t, p.dst_geom.num_slots - d) - 1);
    more = S == kIdentity ? std::min(more, p.src_geom.num_slots - t - 1)
                          : detail::in_range(src_copy + t + 1, p.src_geom.num_slots, more);
    t += more;
    next = d + more + 1;
    active.end = t + 1;
  }
  if (first >= 0) runs.emplace_back(first, next);
  std::sort(runs.begin(), runs.end());
  for (size_t i = 1; i < runs.size(); ++i)  // (sorted: an overlap shows between neighbours)
    if (runs[i].first < runs[i - 1].second) return std::nullopt;
  return active;
}

template <int S, int D>
TokenRange read_loop(CopyPlan& p, HostSlots& copy, bool check_unique) {
  TokenRange active{p.num_tokens, p.num_tokens};
  int64_t* src_copy = S == kIdentity ? nullptr : copy.src.data();
  int64_t* dst_copy = D == kIdentity ? nullptr : copy.dst.data();
  if constexpr (S != kIdentity) copy_slots<S>(p.src_slots, p.skip_prefix, p.num_tokens, src_copy);
  if constexpr (D != kIdentity) copy_slots<D>(p.dst_slots, p.skip_prefix, p.num_tokens, dst_copy);
  if constexpr (D != kIdentity) {
    if (check_unique) {
      if (const std::optional<TokenRange> shown = unique_by_runs<S>(p, src_copy, dst_copy))
        return *shown;
    }
  }
  SlotSet seen(check_unique ? p.num_tokens - p.skip_prefix : 0);
  for (int64_t t = p.skip_prefix; t < p.num_tokens; ++t) {
    const int64_t s = S == kIdentity ? t : src_copy[t];
    const int64_t d = D == kIdentity ? t : dst_copy[t];
    if (s < 0 || d < 0) continue;
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", S == kIdentity, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", D == kIdentity, t, d, p.dst_geom.num_slots);
    if (check_unique) {
      const int64_t first = seen.insert(d, t);
      TORCH_CHECK_VALUE(first < 0, "kvlayout: dst_slots repeats slot ", d, " (dst_slots[", first,
                        "] and dst_slots[", t, "]): a destination slot may be written by one "
                        "token only");
    }
    if (active.first == p.num_tokens) active.first = t;
    active.end = t + 1;
  }
  return active;
}

template <int S>
TokenRange read_loop_for(SlotKind d, CopyPlan& p, HostSlots& copy, bool check_unique) {
  switch (d) {
    case kIdentity: return read_loop<S, kIdentity>(p, copy, check_unique);
    case kInt32: return read_loop<S, kInt32>(p, copy, check_unique);
    default: return read_loop<S, kInt64>(p, copy, check_unique);
  }
}

}  // namespace

TokenRange read_slots_once(CopyPlan& p, HostSlots& copy, bool unique_dst) {
  if (p.empty()) return TokenRange{p.num_tokens, p.num_tokens};
  const SlotKind s = kind_of(p.src_slots), d = kind_of(p.dst_slots);
  // (every token the loop reads is written; the skipped prefix holds -1)
  if (s != kIdentity) {
    copy.src.resize(p.num_tokens);
    std::fill_n(copy.src.begin(), p.skip_prefix, -1);
  }
  if (d != kIdentity) {
    copy.dst.resize(p.num_tokens);
    std::fill_n(copy.dst.begin(), p.skip_prefix, -1);
  }
  const bool check_unique = unique_dst && d != kIdentity;
  const TokenRange active = s == kIdentity ? read_loop_for<kIdentity>(d, p, copy, check_unique)
                            : s == kInt32  ? read_loop_for<kInt32>(d, p, copy, check_unique)
                                           : read_loop_for<kInt64>(d, p, copy, check_unique);
  if (s != kIdentity) p.src_slots = SlotArray{copy.src.data(), 1, 8, 0};
  if (d != kIdentity) p.dst_slots = SlotArray{copy.dst.data(), 1, 8, 0};
  return active;
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
  const ScratchScope scope;
  HostSlots copy;
  read_slots_once(q, copy, /*unique_dst=*/true);
}

}  // namespace kvlayout
