// The copy engine's run list (kvlayout::copy_runs): the copies that move a
// checked plan's rows, built on the host from slots read once. Host code
// only: the CUDA op issues the list, and _C.copy_run_list builds it alone so
// that its cost can be told apart from the driver's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "copy_plan.h"
#include "slots.h"

namespace kvlayout {

// The copies of one call, in issue order; add() extends the previous copy when
// the new one continues it on both sides. A thread keeps one in its scratch
// (ThreadScratch::copies, thread_scratch.h) and refills it call after call.
struct CopyList {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  void clear() {
    dsts.clear();
    srcs.clear();
    sizes.clear();
  }

  void add(char* dst, const char* src, size_t bytes) {
    if (!sizes.empty() && static_cast<char*>(dsts.back()) + sizes.back() == dst &&
        static_cast<const char*>(srcs.back()) + sizes.back() == src) {
      sizes.back() += bytes;
      return;
    }
    dsts.push_back(dst);
    srcs.push_back(src);
    sizes.push_back(bytes);
  }
};

// The copies of `checked` (slots already read once and checked: read_slots_once)
// between segment bases `src_base` / `dst_base`, into `copies` (cleared
// first): consecutive tokens whose rows are adjacent on both sides coalesced
// (for_each_block), copies that continue each other merged.
inline void build_copy_list(const CopyPlan& checked, const std::vector<const char*>& src_base,
                            const std::vector<char*>& dst_base, CopyList& copies) {
  copies.clear();
  for_each_block(checked, checked.skip_prefix, checked.num_tokens,
                 [&](int64_t g, int64_t so, int64_t dof, int64_t bytes) {
                   copies.add(dst_base[g] + dof, src_base[g] + so, static_cast<size_t>(bytes));
                 });
}

// build_copy_list into `copies` with segment g's bases at address(side
// tensor, "src" or "dst", index) + the segment's offset: where a copy reaches
// the tensor (its data pointer, or on CUDA a pinned host tensor's device
// alias).
template <class Address>
void copy_list_at(const CopyPlan& checked, at::TensorList src, at::TensorList dst,
                  const Address& address, CopyList& copies) {
  std::vector<const char*> src_base(checked.num_segments);
  std::vector<char*> dst_base(checked.num_segments);
  for (int64_t g = 0; g < checked.num_segments; ++g) {
    const int64_t i = checked.src_tensor[g], j = checked.dst_tensor[g];
    src_base[g] = address(src[i], "src", i) + checked.src_offset[g];
    dst_base[g] = address(dst[j], "dst", j) + checked.dst_offset[g];
  }
  build_copy_list(checked, src_base, dst_base, copies);
}

// The copy engine's run list for `checked` into `copies`: each slot read once
// into `slot_copies` (range and repeated destinations checked on those copies,
// which the runs are then built from), then copy_list_at.
template <class Address>
void run_list_at(CopyPlan& checked, at::TensorList src, at::TensorList dst,
                 const Address& address, HostSlots& slot_copies, CopyList& copies) {
  read_slots_once(checked, slot_copies, /*unique_dst=*/true);
  copy_list_at(checked, src, dst, address, copies);
}

}  // namespace kvlayout
