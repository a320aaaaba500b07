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
// the new one continues it on both sides. A thread keeps one and refills it
// call after call (thread_list()): its vectors keep their capacity, so it
// allocates only when a list outgrows the ones before it; trim() after a
// call gives back what a list longer than kKeptCopies took (a one-off call of
// millions of copies must not hold its memory for the life of the thread).
struct CopyList {
  static constexpr size_t kKeptCopies = size_t(1) << 16;  // 1.5 MiB of vectors
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  static CopyList& thread_list() {
    thread_local CopyList list;
    return list;
  }

  void clear() {
    dsts.clear();
    srcs.clear();
    sizes.clear();
  }

  void trim() {
    if (sizes.capacity() <= kKeptCopies) return;
    std::vector<void*>().swap(dsts);
    std::vector<const void*>().swap(srcs);
    std::vector<size_t>().swap(sizes);
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

// build_copy_list with segment g's bases at address(side tensor, "src" or
// "dst", index) + the segment's offset: where a copy reaches the tensor (its
// data pointer, or on CUDA a pinned host tensor's device alias). The list is
// this thread's (CopyList::thread_list()), valid until its next call; the
// caller trims it when done.
template <class Address>
CopyList& copy_list_at(const CopyPlan& checked, at::TensorList src, at::TensorList dst,
                       const Address& address) {
  std::vector<const char*> src_base(checked.num_segments);
  std::vector<char*> dst_base(checked.num_segments);
  for (int64_t g = 0; g < checked.num_segments; ++g) {
    const int64_t i = checked.src_tensor[g], j = checked.dst_tensor[g];
    src_base[g] = address(src[i], "src", i) + checked.src_offset[g];
    dst_base[g] = address(dst[j], "dst", j) + checked.dst_offset[g];
  }
  CopyList& copies = CopyList::thread_list();
  build_copy_list(checked, src_base, dst_base, copies);
  return copies;
}

}  // namespace kvlayout
