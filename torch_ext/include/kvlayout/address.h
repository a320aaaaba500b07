// kvlayout/address.h — the one row-address formula shared by every backend.
//
// Every KV-cache layout known to kvlayout reduces (in Python) to per-(layer,
// plane) base pointers plus one RowGeometry per side. A row is the data of one
// slot in one segment; it consists of `num_pieces` pieces of `piece_bytes`
// bytes each (a piece is e.g. one head in an HND cache, or the whole row when
// the row is contiguous). All strides are in BYTES and are non-negative.
//
//   row_offset(slot)          = (slot / page_size) * stride_page
//                             + (slot % page_size) * stride_in_page
//   piece_offset(slot, piece) = row_offset(slot) + piece * stride_piece
//
// This header is host/device portable: plain C++ (CPU, SYCL device code) and
// CUDA/HIP (__host__ __device__). Backends never switch on layout names.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVL_HD __host__ __device__
#else
#define KVL_HD
#endif

namespace kvlayout {

struct RowGeometry {
  int64_t num_slots;       // valid slots are [0, num_slots)
  int64_t page_size;       // >= 1
  int64_t stride_page;     // bytes between pages
  int64_t stride_in_page;  // bytes between consecutive slots of one page
  int64_t stride_piece;    // bytes between consecutive pieces of one row
};

// Quotient and remainder of non-negative a / b, b >= 1. Uses 32-bit division
// when both operands fit (much cheaper on GPUs); int64 otherwise.
KVL_HD inline void divmod_nonneg(int64_t a, int64_t b, int64_t& q, int64_t& r) {
  if (((a | b) >> 32) == 0) {
    const uint32_t ua = static_cast<uint32_t>(a);
    const uint32_t ub = static_cast<uint32_t>(b);
    const uint32_t uq = ua / ub;
    q = static_cast<int64_t>(uq);
    r = static_cast<int64_t>(ua - uq * ub);
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// Byte offset of a slot's row from its segment's base. slot must be valid.
KVL_HD inline int64_t row_offset(const RowGeometry& g, int64_t slot) {
  int64_t page, in_page;
  divmod_nonneg(slot, g.page_size, page, in_page);
  return page * g.stride_page + in_page * g.stride_in_page;
}

// Byte offset of piece `piece` of a slot's row from its segment's base.
KVL_HD inline int64_t piece_offset(const RowGeometry& g, int64_t slot, int64_t piece) {
  return row_offset(g, slot) + piece * g.stride_piece;
}

KVL_HD inline bool slot_in_range(const RowGeometry& g, int64_t slot) {
  return slot >= 0 && slot < g.num_slots;
}

// Largest row_offset over all valid slots (strides are non-negative, so the
// maximum sits at the last slot of the last page or of the last full page).
// Returns -1 when the geometry holds no slot. Host-side bounds checks use it
// with overflow-checked arithmetic of their own; this version is for callers
// that already know the values are small.
KVL_HD inline int64_t max_row_offset(const RowGeometry& g) {
  if (g.num_slots <= 0) return -1;
  int64_t best = row_offset(g, g.num_slots - 1);
  const int64_t num_pages = (g.num_slots + g.page_size - 1) / g.page_size;
  if (num_pages >= 2) {
    const int64_t end_of_full_page = (num_pages - 1) * g.page_size - 1;
    const int64_t o = row_offset(g, end_of_full_page);
    if (o > best) best = o;
  }
  return best;
}

// Slot array: an optional 1-D int32/int64 index vector with any element
// stride, or the identity (slot t for token t) when `identity` is set. "No
// slots" is that explicit flag, never a null pointer: a slot tensor whose
// storage was freed is refused on the host before it becomes a SlotArray.
//
// Rule for every kernel: load a slot once, check that value, use that value
// (never load it again after the check: the tensor may be rewritten while
// the op runs). On the host the load is volatile, so the compiler cannot
// split one load in the source into two reads of memory.
struct SlotArray {
  const void* data;
  int64_t stride;     // in elements
  int32_t elem_bytes; // 4 or 8
  int32_t identity;   // 1: no slot tensor, token t uses slot t (`data` unused)

  static SlotArray identity_slots() { return SlotArray{nullptr, 1, 8, 1}; }

  KVL_HD inline int64_t load(int64_t t) const {
    if (identity) return t;
#if defined(__CUDA_ARCH__) || defined(__SYCL_DEVICE_ONLY__)
    if (elem_bytes == 8) return static_cast<const int64_t*>(data)[t * stride];
    return static_cast<int64_t>(static_cast<const int32_t*>(data)[t * stride]);
#else
    if (elem_bytes == 8) return static_cast<const volatile int64_t*>(data)[t * stride];
    return static_cast<int64_t>(static_cast<const volatile int32_t*>(data)[t * stride]);
#endif
  }
};

// ---------------------------------------------------------------------------
// Run detection (coalescing consecutive tokens into one contiguous copy).
//
// A side's rows are "run-capable" when a row is one contiguous block of
// row_bytes (num_pieces == 1 after the pieces were merged, see
// pieces_mergeable). Token t+1 continues the run of token t on that side when
// its row starts exactly where the row of token t ends: this covers the same
// page, page-contiguous caches (stride_page == page_size * stride_in_page) and
// any other arrangement that happens to be adjacent in memory.
// ---------------------------------------------------------------------------

// Pieces of a row can be treated as one piece of num_pieces * piece_bytes when
// they are back to back on this side.
KVL_HD inline bool pieces_contiguous(const RowGeometry& g, int64_t num_pieces,
                                     int64_t piece_bytes) {
  return num_pieces == 1 || g.stride_piece == piece_bytes;
}

// A side's position while a run is scanned: its last slot, where that slot
// sits in its page and its row offset, so that the next slot of the same page
// (the common case) costs no division.
struct RunCursor {
  int64_t slot, in_page, offset;

  KVL_HD static RunCursor at(const RowGeometry& g, int64_t slot) {
    int64_t page, in_page;
    divmod_nonneg(slot, g.page_size, page, in_page);
    return RunCursor{slot, in_page, page * g.stride_page + in_page * g.stride_in_page};
  }

  // The cursor at slot + 1, by addition: the next row of this page, or the
  // first row of the next page.
  KVL_HD RunCursor successor(const RowGeometry& g) const {
    return in_page + 1 < g.page_size
               ? RunCursor{slot + 1, in_page + 1, offset + g.stride_in_page}
               : RunCursor{slot + 1, 0, offset - in_page * g.stride_in_page + g.stride_page};
  }

  // Whether the row of slot `next` (valid) starts exactly where this slot's
  // row of `row_bytes` ends; if so, the cursor moves to `next`. Consecutive
  // slots (the common case) cost no division.
  KVL_HD bool advance(const RowGeometry& g, int64_t next, int64_t row_bytes) {
    const RunCursor n = next == slot + 1 ? successor(g) : at(g, next);
    if (n.offset != offset + row_bytes) return false;
    *this = n;
    return true;
  }
};

// Length of the run starting at token `first`, whose valid slots put the
// cursors at `a` (source) and `b` (destination), within [first, end): the
// number of consecutive tokens whose rows continue contiguously on both sides
// (row_offset(next) == row_offset(last) + row_bytes on each). Stops at a
// negative or out-of-range slot. Only meaningful when both sides' rows are
// contiguous (num_pieces == 1 after merging); callers with num_pieces > 1
// must not coalesce. Identity slot arrays are handled by SlotArray::load.
KVL_HD inline int64_t run_length(const SlotArray& src_slots, const SlotArray& dst_slots,
                                 const RowGeometry& src, const RowGeometry& dst,
                                 int64_t first, int64_t end, RunCursor a, RunCursor b,
                                 int64_t row_bytes) {
  int64_t n = 1;
  while (first + n < end) {
    const int64_t s = src_slots.load(first + n);
    const int64_t d = dst_slots.load(first + n);
    if (!slot_in_range(src, s) || !slot_in_range(dst, d)) break;
    if (!a.advance(src, s, row_bytes) || !b.advance(dst, d, row_bytes)) break;
    ++n;
  }
  return n;
}

}  // namespace kvlayout
