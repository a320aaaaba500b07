// Slot tensors: parsed once into SlotArrays (address.h), read once, checked
// once. Every route to a kernel checks slots here: the CPU reads each slot
// once into memory of its own and checks the copy (what is checked is what is
// used); device backends check range in the kernel (status word) and, with
// validate=True, on the host before launching.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "copy_plan.h"
#include "kvlayout/address.h"

namespace kvlayout {

// A slot argument as a SlotArray. nullopt is "no slots" (the identity, the
// explicit flag); a tensor must be a defined, 1-D int32/int64 tensor of
// `length` entries whose storage holds them: an undefined or meta tensor, or
// one whose storage was freed or resized away, is refused (never read as
// "no slots"). Errors name the argument and the length's name. With
// `prefix`, the tensor may hold more entries: its first `length` are read.
SlotArray slot_array(const std::optional<at::Tensor>& t, int64_t length, const char* name,
                     const char* length_name, bool prefix = false);

// The same for a required index tensor (RoPE positions).
SlotArray index_array(const at::Tensor& t, int64_t length, const char* name,
                      const char* length_name, bool prefix = false);

// Slot values read once on the host into memory of the op's own: the values
// that are checked are the values that are used, whatever happens to the
// slot tensors meanwhile (another thread, or a slot tensor that aliases a
// destination some other way than the checks can see).
struct HostSlots {
  std::vector<int64_t> src, dst;  // [num_tokens]; the skipped prefix holds -1
};

// Reads every slot of tokens [skip_prefix, num_tokens) exactly once into
// `copy`, points the plan's slot arrays at the copies (identity sides stay
// identity), and checks the copies: every slot < the side's slot count
// (IndexError naming the argument, token, value and bound) and, when
// `unique_dst`, no destination slot written by two tokens (ValueError naming
// both tokens). Linear time. Slots must be host-readable. Returns the tokens
// [first, end) that have a row to move (both slots >= 0; empty when none):
// a walk over the rest would find nothing.
struct TokenRange {
  int64_t first = 0, end = 0;
};
TokenRange read_slots_once(CopyPlan& plan, HostSlots& copy, bool unique_dst);

// validate=True of device backends: copies the slot tensors to the host (a
// synchronisation) and checks the copies as read_slots_once does (range and
// repeated destination slots), before anything is launched.
void validate_slots_on_host(const CopyPlan& plan, const std::optional<at::Tensor>& src_slots,
                            const std::optional<at::Tensor>& dst_slots);

// Raises IndexError for slot `value` of token t of `name` (src_slots or
// dst_slots; `identity` when the side has no slot tensor).
[[noreturn]] void raise_slot_out_of_range(const char* name, bool identity, int64_t t,
                                          int64_t value, int64_t bound);

// Walks tokens [begin, end) of a plan and calls copy(segment, src_offset,
// dst_offset, bytes) for each contiguous block to move, offsets from the
// segment's base. Contiguous rows (num_pieces == 1) of consecutive tokens that
// are adjacent on both sides are coalesced into one block (address.h run
// detection); otherwise every piece is one block. Tokens with a negative slot
// are skipped. Slots must be host-readable. Each slot is loaded once and the
// loaded value is range-checked before it is used (run_length checks the
// tokens it adds), so slots rewritten after an earlier check raise
// IndexError instead of addressing memory outside the tensors.
template <class Copy>
void for_each_block(const CopyPlan& p, int64_t begin, int64_t end, const Copy& copy) {
  const int64_t row_bytes = p.row_bytes();
  int64_t t = begin;
  while (t < end) {
    const int64_t s = p.src_slots.load(t);
    const int64_t d = p.dst_slots.load(t);
    if (s < 0 || d < 0) {
      ++t;
      continue;
    }
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", p.src_slots.identity != 0, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", p.dst_slots.identity != 0, t, d, p.dst_geom.num_slots);
    if (p.num_pieces == 1) {
      const RunCursor a = RunCursor::at(p.src_geom, s), b = RunCursor::at(p.dst_geom, d);
      const int64_t n =
          run_length(p.src_slots, p.dst_slots, p.src_geom, p.dst_geom, t, end, a, b, row_bytes);
      for (int64_t g = 0; g < p.num_segments; ++g) copy(g, a.offset, b.offset, n * row_bytes);
      t += n;
    } else {
      for (int64_t g = 0; g < p.num_segments; ++g)
        for (int64_t h = 0; h < p.num_pieces; ++h)
          copy(g, piece_offset(p.src_geom, s, h), piece_offset(p.dst_geom, d, h), p.piece_bytes);
      ++t;
    }
  }
}

}  // namespace kvlayout
