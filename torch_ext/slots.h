// Slot tensors: parsed once into SlotArrays (address.h), read once, checked
// once. Every route to a kernel checks slots here: the CPU reads each slot
// once into memory of its own and checks the copy (what is checked is what is
// used); device backends check range in the kernel (status word) and, with
// validate=True, on the host before launching.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
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

namespace detail {

// A side's slots as read_slots_once leaves them (identity, or int64 values
// with stride 1 in memory of the op's own), or nullopt for anything else.
// (Values in private memory need no volatile load: nothing else writes them.)
inline std::optional<const int64_t*> plain_slots(const SlotArray& a) {
  if (a.identity) return static_cast<const int64_t*>(nullptr);
  if (a.elem_bytes == 8 && a.stride == 1) return static_cast<const int64_t*>(a.data);
  return std::nullopt;
}

// How many tokens from a slot at `in_page` a side's layout lets consecutive
// slots run on: without end where rows follow each other within a page and
// pages follow each other, to the page's end where only rows within a page
// do, 1 where rows of a page do not (other slots may still be adjacent:
// run_length asks the geometry).
inline int64_t consecutive_limit(const RowGeometry& g, int64_t in_page, int64_t row_bytes) {
  if (g.page_size > 1 && g.stride_in_page != row_bytes) return 1;
  if (g.stride_page == (g.page_size - 1) * g.stride_in_page + row_bytes) return INT64_MAX;
  return g.page_size - in_page;
}

// How many of x[0], x[1], ... (at most `most`) satisfy holds(k, x[k]) before
// the first that does not: eight entries at a time with no early exit inside
// the eight (eight compares without branches; vector compares where the
// target has 64-bit ones), then one at a time. A stretch of n entries costs
// about n / 8 branches.
template <class Holds>
inline int64_t leading(const int64_t* x, int64_t most, const Holds& holds) {
  int64_t k = 0;
  for (; k + 8 <= most; k += 8) {
    bool all = true;
    for (int j = 0; j < 8; ++j) all &= holds(k + j, x[k + j]);
    if (!all) break;
  }
  while (k < most && holds(k, x[k])) ++k;
  return k;
}
// The leading entries that hold first, first + 1, ... (a run of consecutive slots).
inline int64_t counting_up(const int64_t* x, int64_t first, int64_t most) {
  return leading(x, most, [first](int64_t k, int64_t v) { return v == first + k; });
}
// The leading entries in [0, bound) (one unsigned compare each).
inline int64_t in_range(const int64_t* x, int64_t bound, int64_t most) {
  return leading(x, most, [bound](int64_t, int64_t v) {
    return static_cast<uint64_t>(v) < static_cast<uint64_t>(bound);
  });
}

// The length of the run from token t (slots s, d valid, at cursors a, b) of
// consecutive slots on both sides (S[t+k] = s+k, D[t+k] = d+k; nullptr:
// identity), in range, within what both layouts let run on: every token of it
// continues the previous one. The destination side is scanned first and the
// source only as far as it reached, so a call reads each slot of the run at
// most once per side.
inline int64_t consecutive_run(const int64_t* S, const int64_t* D, const CopyPlan& p, int64_t t,
                               int64_t end, int64_t s, int64_t d, const RunCursor& a,
                               const RunCursor& b, int64_t row_bytes) {
  int64_t lim = std::min({end - t, p.src_geom.num_slots - s, p.dst_geom.num_slots - d,
                          consecutive_limit(p.src_geom, a.in_page, row_bytes),
                          consecutive_limit(p.dst_geom, b.in_page, row_bytes)});
  int64_t k = lim - 1;  // tokens after t that continue it (D identity: d = t; S identity: s = t)
  if (D != nullptr) k = counting_up(D + t + 1, d + 1, k);
  if (S != nullptr) k = counting_up(S + t + 1, s + 1, k);
  return 1 + k;
}

}  // namespace detail

// Walks tokens [begin, end) of a plan: run(src_offset, dst_offset, bytes) for
// each block of contiguous rows (num_pieces == 1: consecutive tokens whose
// rows are adjacent on both sides coalesced, address.h run detection), every
// segment to move it at those offsets from its base; token(s, d) for each
// token whose rows are in pieces (num_pieces > 1), slots s and d. Tokens with a
// negative slot are skipped. Slots must be host-readable. Each slot is loaded
// once and the loaded value is range-checked before it is used (run_length
// checks the tokens it adds), so slots rewritten after an earlier check raise
// IndexError instead of addressing memory outside the tensors.
template <class Run, class Token>
void for_each_row_block(const CopyPlan& p, int64_t begin, int64_t end, const Run& run,
                        const Token& token) {
  const int64_t row_bytes = p.row_bytes();
  const std::optional<const int64_t*> S = detail::plain_slots(p.src_slots);
  const std::optional<const int64_t*> D = detail::plain_slots(p.dst_slots);
  const bool plain = S.has_value() && D.has_value();
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
      RunCursor a = RunCursor::at(p.src_geom, s), b = RunCursor::at(p.dst_geom, d);
      const int64_t src_offset = a.offset, dst_offset = b.offset;
      // consecutive slots first (one compare per token), then the geometry's own test from the
      // run's last token on (rows adjacent without consecutive slots)
      int64_t n = 1;
      if (plain) {
        n = detail::consecutive_run(*S, *D, p, t, end, s, d, a, b, row_bytes);
        if (n > 1) {
          a = RunCursor::at(p.src_geom, s + n - 1);
          b = RunCursor::at(p.dst_geom, d + n - 1);
        }
      }
      n += run_length(p.src_slots, p.dst_slots, p.src_geom, p.dst_geom, t + n - 1, end, a, b,
                      row_bytes) - 1;
      run(src_offset, dst_offset, n * row_bytes);
      t += n;
    } else {
      token(s, d);
      ++t;
    }
  }
}

// The pieces of a token whose rows are in pieces (slots s and d, checked) as
// copy(segment, src_offset, dst_offset, bytes), segment by segment, piece by
// piece, offsets from the segment's base.
template <class Copy>
void for_each_piece(const CopyPlan& p, int64_t s, int64_t d, const Copy& copy) {
  for (int64_t g = 0; g < p.num_segments; ++g)
    for (int64_t h = 0; h < p.num_pieces; ++h)
      copy(g, piece_offset(p.src_geom, s, h), piece_offset(p.dst_geom, d, h), p.piece_bytes);
}

// for_each_row_block as copy(segment, src_offset, dst_offset, bytes) for each
// contiguous block to move, offsets from the segment's base: a block of rows
// in every segment in turn; a token in pieces as for_each_piece.
template <class Copy>
void for_each_block(const CopyPlan& p, int64_t begin, int64_t end, const Copy& copy) {
  for_each_row_block(
      p, begin, end,
      [&](int64_t src_offset, int64_t dst_offset, int64_t bytes) {
        for (int64_t g = 0; g < p.num_segments; ++g) copy(g, src_offset, dst_offset, bytes);
      },
      [&](int64_t s, int64_t d) { for_each_piece(p, s, d, copy); });
}

}  // namespace kvlayout
