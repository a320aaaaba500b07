// The copy engine's run list (kvlayout::copy_runs): the copies that move a
// checked plan's rows, built on the host from slots read once. Host code
// only: the CUDA op issues the list, and _C.copy_run_list builds it alone so
// that its cost can be told apart from the driver's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "copy_plan.h"
#include "slots.h"

namespace kvlayout {

// std::allocator whose resize() leaves new elements uninitialized: the run
// list's arrays are grown before they are written, and zeroing them first
// would cost as much as writing them.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <class T>
using UninitializedVector = std::vector<T, UninitializedAllocator<T>>;

// The copies of one call, in issue order, as the three arrays
// cudaMemcpyBatchAsync takes. A thread keeps one in its scratch
// (ThreadScratch::copies, thread_scratch.h) and refills it call after call
// through a CopyWriter.
struct CopyList {
  UninitializedVector<void*> dsts;
  UninitializedVector<const void*> srcs;
  UninitializedVector<size_t> sizes;

  void clear() {
    dsts.clear();
    srcs.clear();
    sizes.clear();
  }
};

// Fills a CopyList (cleared first): each copy extends the one before it when
// it continues it on both sides, else is appended. The list holds exactly
// the copies added once the writer is gone, also when a check throws midway.
class CopyWriter {
 public:
  explicit CopyWriter(CopyList& copies) : copies_(copies) { copies_.clear(); }
  CopyWriter(const CopyWriter&) = delete;
  CopyWriter& operator=(const CopyWriter&) = delete;
  ~CopyWriter() { resize(n_); }

  void add(char* dst, const char* src, size_t bytes) {
    if (n_ > 0 && dst == dst_end_ && src == src_end_) {
      copies_.sizes[n_ - 1] += bytes;
    } else {
      reserve(n_ + 1);
      copies_.dsts[n_] = dst;
      copies_.srcs[n_] = src;
      copies_.sizes[n_] = bytes;
      ++n_;
    }
    dst_end_ = dst + bytes;
    src_end_ = src + bytes;
  }

  // `bytes` at offsets src_offset / dst_offset from each segment's bases
  // src_at[g] / dst_at[g], segment by segment: the first may extend the copy
  // before it; where `segments_may_chain` is false no two segments' copies
  // can continue each other, and the rest are written without the test.
  void add_in_every_segment(const char* const* src_at, char* const* dst_at, int64_t segments,
                            int64_t src_offset, int64_t dst_offset, size_t bytes,
                            bool segments_may_chain) {
    if (segments <= 0) return;
    add(dst_at[0] + dst_offset, src_at[0] + src_offset, bytes);
    if (segments_may_chain) {
      for (int64_t g = 1; g < segments; ++g) add(dst_at[g] + dst_offset, src_at[g] + src_offset, bytes);
      return;
    }
    const size_t first = n_, count = static_cast<size_t>(segments - 1);
    reserve(first + count);
    void** d = copies_.dsts.data() + first;
    const void** s = copies_.srcs.data() + first;
    size_t* z = copies_.sizes.data() + first;
    for (size_t k = 0; k < count; ++k) {
      d[k] = dst_at[k + 1] + dst_offset;
      s[k] = src_at[k + 1] + src_offset;
      z[k] = bytes;
    }
    n_ = first + count;
    dst_end_ = dst_at[segments - 1] + dst_offset + bytes;
    src_end_ = src_at[segments - 1] + src_offset + bytes;
  }

 private:
  void resize(size_t n) {
    copies_.dsts.resize(n);
    copies_.srcs.resize(n);
    copies_.sizes.resize(n);
  }
  // At least n elements in each array (doubling; the new ones uninitialized).
  void reserve(size_t n) {
    if (n <= copies_.sizes.size()) return;
    resize(std::max({n, 2 * copies_.sizes.size(), size_t(256)}));
  }

  CopyList& copies_;
  size_t n_ = 0;
  const char* dst_end_ = nullptr;  // where the last copy ends on each side
  const char* src_end_ = nullptr;
};

// Whether a block's copies in two consecutive segments can continue each
// other: the segments' bases lie equally far apart on both sides (a copy of
// any length then starts where the previous segment's ends when that length
// is the distance).
inline bool segments_may_chain(const std::vector<const char*>& src_base,
                               const std::vector<char*>& dst_base) {
  for (size_t g = 1; g < src_base.size(); ++g) {
    const auto src_step = reinterpret_cast<uintptr_t>(src_base[g]) -
                          reinterpret_cast<uintptr_t>(src_base[g - 1]);
    const auto dst_step = reinterpret_cast<uintptr_t>(dst_base[g]) -
                          reinterpret_cast<uintptr_t>(dst_base[g - 1]);
    if (src_step == dst_step) return true;
  }
  return false;
}

// The copies of `checked` (slots already read once and checked: read_slots_once)
// between segment bases `src_base` / `dst_base`, into `copies` (cleared
// first): consecutive tokens whose rows are adjacent on both sides coalesced
// (for_each_row_block), a block's copies in segment order, copies that
// continue each other merged.
inline void build_copy_list(const CopyPlan& checked, const std::vector<const char*>& src_base,
                            const std::vector<char*>& dst_base, CopyList& copies) {
  CopyWriter out(copies);
  const char* const* src_at = src_base.data();
  char* const* dst_at = dst_base.data();
  const int64_t segments = checked.num_segments;
  const bool may_chain = segments_may_chain(src_base, dst_base);
  for_each_row_block(
      checked, checked.skip_prefix, checked.num_tokens,
      [&](int64_t src_offset, int64_t dst_offset, int64_t bytes) {
        out.add_in_every_segment(src_at, dst_at, segments, src_offset, dst_offset,
                                 static_cast<size_t>(bytes), may_chain);
      },
      [&](int64_t s, int64_t d) {
        for_each_piece(checked, s, d, [&](int64_t g, int64_t so, int64_t dof, int64_t bytes) {
          out.add(dst_at[g] + dof, src_at[g] + so, static_cast<size_t>(bytes));
        });
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
