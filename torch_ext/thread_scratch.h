// Each thread's scratch memory for the host's slot checks, its copies of the
// slots and the copy engine's run list: reused call after call (a layer call
// must not pay for allocations) and bounded. A vector that one large call grew
// past kKeptBytes is given back when that call ends (a ScratchScope's end),
// so what a thread keeps between calls is at most kKeptBytes per vector,
// whatever the largest call of a weeks-long process was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "copy_list.h"
#include "slots.h"

namespace kvlayout {

struct ThreadScratch {
  static constexpr size_t kKeptBytes = size_t(1) << 20;

  std::vector<int64_t> seen_slot, seen_token;     // the repeated-destination table
  std::vector<std::pair<int64_t, int64_t>> runs;  // destination runs (first slot, end slot)
  HostSlots slots;                                // the slots of a CPU run, read once
  CopyList copies;                                // the copy engine's list

  static ThreadScratch& mine() {
    thread_local ThreadScratch scratch;
    return scratch;
  }

  // Bytes this thread's scratch holds now (its vectors' capacities).
  size_t bytes() const {
    size_t total = 0;
    each_vector(*this, [&](const auto& v) { total += capacity_bytes(v); });
    return total;
  }

  // Gives back every vector holding more than kKeptBytes.
  void trim() {
    each_vector(*this, [](auto& v) {
      if (capacity_bytes(v) > kKeptBytes) std::decay_t<decltype(v)>().swap(v);
    });
  }

 private:
  // f(v) for every vector of `scratch` (the one list of them, for bytes() and trim())
  template <class Self, class F>
  static void each_vector(Self& scratch, F&& f) {
    f(scratch.seen_slot);
    f(scratch.seen_token);
    f(scratch.runs);
    f(scratch.slots.src);
    f(scratch.slots.dst);
    f(scratch.copies.dsts);
    f(scratch.copies.srcs);
    f(scratch.copies.sizes);
  }
  template <class T, class Allocator>
  static size_t capacity_bytes(const std::vector<T, Allocator>& v) {
    return v.capacity() * sizeof(T);
  }
};

// One call's use of this thread's scratch: whatever the call grew past the
// bound is given back when it ends, by a return or an exception. Opened once
// by each op that reaches the scratch, around everything that points into it
// (never deeper: its end frees what the op may still be reading).
class ScratchScope {
 public:
  ScratchScope() = default;
  ScratchScope(const ScratchScope&) = delete;
  ScratchScope& operator=(const ScratchScope&) = delete;
  ~ScratchScope() { ThreadScratch::mine().trim(); }
};

}  // namespace kvlayout
