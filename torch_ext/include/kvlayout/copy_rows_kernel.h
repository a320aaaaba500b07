// kvlayout/copy_rows_kernel.h — parameters and the per-thread work walk of
// the copy_rows device kernel, shared by the CUDA and SYCL backends (they
// differ only in how they launch, where the segment table lives, which
// load/store instructions they use and how they record an error). Plain C++;
// KVL_D marks device code under CUDA/HIP.
//
// Work decomposition. The work of a launch is the flat space of items
// (token, segment, vector): item i is vector v of segment `seg`'s row for
// token t, with i = (t * num_segments + seg) * vecs_per_row + v. Threads walk
// it in *lane groups* of kWalkLanes consecutive threads (a CUDA warp); lane
// group g owns one contiguous range of items, of equal length for every
// group, and its lanes take the items of that range kWalkLanes apart. (On an
// H200 this order moved 256 B and MLA rows 20-30 % faster than (segment,
// token, vector), and contiguous ranges matched a grid-stride sweep.) So:
//   * neighbouring lanes move neighbouring vectors of one row (coalesced);
//   * a lane's position advances by a constant step; the (t, seg, v) of the
//     next item comes from additions and one compare (no division in the
//     loop, except a precomputed multiply-shift one when a step crosses
//     several segments or a row has several pieces);
//   * a token's slot pair is loaded and its row offsets computed once per
//     lane per token, not once per (token, segment) row;
//   * every lane keeps UNROLL loads in flight before it stores (the device
//     variant sizes UNROLL for HBM, the host variant for PCIe latency).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvlayout/address.h"
#include "kvlayout/status.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVL_D __device__
#else
#define KVL_D
#endif

namespace kvlayout {

constexpr int kCopyThreadsPerBlock = 256;
// Lanes that walk one contiguous range together (a CUDA warp; on SYCL just a
// grouping of consecutive work-items, any sub-group size is correct).
constexpr int kWalkLanes = 32;
// Loads in flight per thread. Device variant: 4 keeps the 16-byte kernel at
// 70 registers (80 before TokenRows kept only what the copy needs), so 3
// CTAs of 256 threads are resident per SM (48 KiB in
// flight per SM, about twice what HBM needs by Little's law; 8 in flight
// cost a CTA per SM and measured slower). Host variant (one side is pinned
// host memory, reached over PCIe with a few microseconds of latency): 16 x
// 16 B x 256 threads = 64 KiB per CTA, so that few CTAs keep PCIe busy.
constexpr int kDeviceUnroll = 4;
constexpr int kHostUnroll = 16;
// Under an SM budget (CUDA's max_ctas = n: n CTAs of 1024 threads), a thread
// has 64 registers, and each variant keeps the loads in flight that fit them
// without spilling (nvcc 13.0, `scripts/cuda_compile_check.py --registers`):
// 2 for the device variant, 3 for the host variant (1024 x 3 x 16 B = 48 KiB
// in flight per SM). The host variant's 4 spilled 16-32 bytes; the walk alone
// on an H100 (scripts/walk_grid_probe.cu, L32 H8 / H1 / MLA at T = 4096)
// moved 9-10 points more of the pinned copy's rate to the host with 3 at one
// SM, 2-4 points less from the host, and within 2.5 points at 2 and 4 SMs.
constexpr int kBudgetDeviceUnroll = 2;
constexpr int kBudgetHostUnroll = 3;
// Every UNROLL a launch of any backend walks with (what the walk's tests cover).
inline constexpr int kWalkUnrolls[] = {kDeviceUnroll, kHostUnroll, kBudgetDeviceUnroll, kBudgetHostUnroll};

// The walk keeps a row's vector index, the vector count of a row and a
// launch's segment index in 32 bits, and advances them by up to kWalkLanes + 1
// past their bound before it wraps them. So a row holds at most kMaxWalkCount
// vectors and a launch at most kMaxWalkCount segments. The host checks the
// row at one place, for every backend (check_copy_plan in copy_plan.cpp: at
// most kMaxWalkCount bytes, so at most that many vectors of any width); the
// launchers split segments into tables far smaller than this (static_assert
// in copy_rows_launch.h).
constexpr int64_t kMaxWalkCount = (int64_t(1) << 31) - 2 * int64_t(kWalkLanes) - 2;

// Which out-of-range slots a launch records in the status word: a token
// whose source slot s or destination slot d is out of range is recorded when
// s < src_recorded_from and d < dst_recorded_from. The launches of one program
// step read the same slots, each with its own slot counts, and each bad token
// is counted once: an earlier launch recorded the tokens with a slot at or
// past its counts, so a launch gets the smallest counts of the earlier ones
// (kRecordEverything where there are none; 0: it records nothing, as the
// later launches of a split call). One rule, two compares: the walk inlines
// it at every unrolled item.
constexpr int64_t kRecordEverything = INT64_MAX;


// n / d and n % d for a divisor fixed at launch: a multiply-high and a shift
// when every dividend is below 2^31 (the round-up method: with l =
// ceil(log2 d) and m = ceil(2^(31+l) / d), n / d = (n * m) >> (31 + l) for
// n < 2^31), the identity for d == 1, 64-bit division otherwise.
// Fields of 32 bits and more: 16-bit ones (8 bytes less each in every
// launch's parameters) took the 16-byte device variant from 78 to 86
// registers, two resident 256-thread CTAs per SM instead of three (see
// docs/performance.md, "Against 7d5fbfc, on one machine").
struct FastDivmod {
  int64_t divisor;
  uint32_t multiplier;
  uint32_t shift;  // total right shift after the 32-bit multiply-high
  int32_t kind;    // kOne, kMulShift or kWide
  int32_t pad_;

  enum : int32_t { kOne = 0, kMulShift = 1, kWide = 2 };

  // d >= 1; every dividend passed to divmod() is in [0, max_dividend].
  static FastDivmod make(int64_t d, int64_t max_dividend) {
    FastDivmod f{};
    f.divisor = d;
    constexpr int64_t k31 = int64_t(1) << 31;
    if (d == 1) {
      f.kind = kOne;
    } else if (d < k31 && max_dividend < k31) {
      uint32_t l = 0;
      while ((int64_t(1) << l) < d) ++l;
      const uint64_t m = ((uint64_t(1) << (31 + l)) + uint64_t(d) - 1) / uint64_t(d);
      f.kind = kMulShift;
      f.multiplier = static_cast<uint32_t>(m);  // < 2^32 because d > 2^(l-1)
      f.shift = l - 1;                          // 31 + l - 32
    } else {
      f.kind = kWide;
    }
    return f;
  }

  KVL_HD inline void divmod(int64_t n, int64_t& q, int64_t& r) const {
    if (kind == kOne) {
      q = n;
      r = 0;
    } else if (kind == kMulShift) {
      const uint32_t hi =
          static_cast<uint32_t>((uint64_t(static_cast<uint32_t>(n)) * multiplier) >> 32);
      q = static_cast<int64_t>(hi >> shift);
      r = n - q * divisor;
    } else {
      q = n / divisor;
      r = n - q * divisor;
    }
  }
};

// Row offset of a valid slot with the page division precomputed.
KVL_HD inline int64_t row_offset(const RowGeometry& g, const FastDivmod& by_page, int64_t slot) {
  int64_t page, in_page;
  by_page.divmod(slot, page, in_page);
  return page * g.stride_page + in_page * g.stride_in_page;
}

// When a CUDA grid lets the next kernel of its stream start, if that kernel
// was launched with programmatic dependent launch (the trigger works whatever
// this grid's own launch attributes; other backends ignore it).
enum NextStart : int32_t {
  kNextAfterEnd = 0,   // not before this grid ends (an ordinary kernel)
  kNextAfterWait = 1,  // once every thread waited for the previous kernel
  kNextAtOnce = 2,     // at once (early-loads launches of a layer pipeline)
};

// The cache operators of a launch's loads and stores, where its backend can
// choose them (CUDA; other backends ignore the field): streaming hints
// (evict-first, ld/st.global.cs) by default; a host launch (either side in
// pinned host memory) takes host_cache_hints() (program.h), which may pick
// the default operators instead, as LMCache's and sgl-kernel's copy kernels
// use them.
enum CacheHints : int32_t {
  kStreamingHints = 0,
  kDefaultHints = 1,
};

// Everything of one launch except its segment table.
struct CopyRowsArgs {
  RowGeometry src_geom;
  RowGeometry dst_geom;
  SlotArray src_slots;
  SlotArray dst_slots;
  int64_t skip_prefix;     // first token handled
  int64_t tokens;          // tokens handled: num_tokens - skip_prefix (> 0)
  int64_t num_segments;    // segments in this launch (> 0)
  int64_t vecs_per_row;    // num_pieces * vecs_per_piece
  FastDivmod by_piece;     // vector of a row -> (piece, vector in piece)
  FastDivmod by_segments;  // segment overflow of a step -> (tokens, segment)
  FastDivmod src_by_page;  // slot -> (page, slot in page), per side
  FastDivmod dst_by_page;
  int64_t* status;         // device-visible int64[kStatusNumel]
  int64_t src_recorded_from;  // which out-of-range slots are recorded (see kRecordEverything)
  int64_t dst_recorded_from;
  int32_t cache_hints;     // CacheHints (in the slot that kept the layout the kernels' registers were measured with)
  int32_t next_start;      // NextStart: when the next kernel of the stream may start (CUDA)
};

// One launch: its arguments and up to kMaxSegments segment bases.
template <int N>
struct CopyRowsParams {
  static constexpr int kMaxSegments = N;
  CopyRowsArgs a;
  const char* src_base[N];
  char* dst_base[N];
};

// Fills the divisions of `a` from its geometry (host side, once per launch).
// The walk keeps segment and vector indices in 32 bits: num_segments and
// vecs_per_row must be at most kMaxWalkCount (checked by the host, see there).
inline void prepare_copy_rows_args(CopyRowsArgs& a, int64_t num_pieces, int64_t vecs_per_piece) {
  a.vecs_per_row = num_pieces * vecs_per_piece;
  a.by_piece = FastDivmod::make(vecs_per_piece, a.vecs_per_row - 1);
  // A step moves kWalkLanes vectors: at most kWalkLanes / vecs_per_row + 1
  // segments past the last one.
  a.by_segments = FastDivmod::make(a.num_segments, a.num_segments + kWalkLanes + 1);
  a.src_by_page = FastDivmod::make(a.src_geom.page_size, a.src_geom.num_slots - 1);
  a.dst_by_page = FastDivmod::make(a.dst_geom.page_size, a.dst_geom.num_slots - 1);
}

// The row offsets of the slot pair (s, d) from a segment's base, or false
// where it has no row: a negative slot (skipped) or an out-of-range one
// (skipped, and passed to on_bad(value, bound, which) when `owner` and the
// launch's recorded_from bounds say it is recorded).
template <class OnBad>
KVL_D inline bool resolve_slot_pair(const CopyRowsArgs& a, int64_t s, int64_t d, bool owner,
                                    const OnBad& on_bad, int64_t& src_row, int64_t& dst_row) {
  if (s < 0 || d < 0) return false;
  if (s >= a.src_geom.num_slots || d >= a.dst_geom.num_slots) {
    if (owner && s < a.src_recorded_from && d < a.dst_recorded_from) {
      const bool src_bad = s >= a.src_geom.num_slots;
      on_bad(src_bad ? s : d, src_bad ? a.src_geom.num_slots : a.dst_geom.num_slots,
             src_bad ? int64_t(kStatusSrcSlots) : int64_t(kStatusDstSlots));
    }
    return false;
  }
  src_row = row_offset(a.src_geom, a.src_by_page, s);
  dst_row = row_offset(a.dst_geom, a.dst_by_page, d);
  return true;
}

// Rows of one token on both sides: the row offsets from a segment's base, or
// no row (a negative slot: skipped; an out-of-range slot: skipped and, as the
// launch's recorded_from bounds say, recorded once, by the lane that owns
// the token's first item, when it resolves the token).
// The slot pair of the lane's next token is loaded ahead (each slot is still
// loaded once, checked, and that value used).
// The walk keeps one in every thread across its loads in flight: its fields
// are what the copy needs (an error is recorded where it is found, not
// kept), so that four 16-byte loads in flight fit 256-thread CTAs at 70
// registers and the 1024-thread budget walk spills little at 64.
struct TokenRows {
  int64_t src_row, dst_row;
  int64_t next_src, next_dst;  // the slots of the token after the last resolved one
  bool has_next;       // next_src/next_dst hold them (that token is handled too)
  bool live;           // both slots valid: the rows are copied

  // Resolves token t (an index into the slot arrays, skip_prefix included)
  // and loads the slots of t + 1 ahead when it is handled too. after_last: t
  // is the token after the one resolved before. An out-of-range slot this
  // launch records is passed to on_bad(value, bound, which) when `owner`.
  template <class OnBad>
  KVL_D inline void resolve(const CopyRowsArgs& a, int64_t t, bool after_last, bool owner,
                            const OnBad& on_bad) {
    int64_t s, d;
    if (after_last && has_next) {
      s = next_src;
      d = next_dst;
    } else {
      s = a.src_slots.load(t);
      d = a.dst_slots.load(t);
    }
    has_next = t + 1 < a.skip_prefix + a.tokens;
    if (has_next) {
      next_src = a.src_slots.load(t + 1);
      next_dst = a.dst_slots.load(t + 1);
    }
    live = resolve_slot_pair(a, s, d, owner, on_bad, src_row, dst_row);
  }
};

// Offsets of vector v of a row from the row's start on both sides: rows of
// one piece are contiguous; others hold vecs_per_row / by_piece.divisor
// pieces, stride_piece apart on each side.
template <int VEC>
KVL_D inline void vector_offsets(const CopyRowsArgs& a, bool one_piece, int32_t v, int64_t& src,
                                 int64_t& dst) {
  if (one_piece) {
    src = int64_t(v) * VEC;
    dst = src;
  } else {
    int64_t h, w;
    a.by_piece.divmod(v, h, w);
    src = h * a.src_geom.stride_piece + w * VEC;
    dst = h * a.dst_geom.stride_piece + w * VEC;
  }
}

// The type a backend moves one VEC-byte vector in (VEC = 16, 8, 4, 2 or 1):
// Wide16 and Wide8 are the backend's 16- and 8-byte vector types (CUDA
// uint4/uint2, SYCL sycl::vec<uint32_t, 4/2>), the narrower widths plain
// unsigned integers. A backend's Mem (copy_rows_walk below) wraps it with
// its own load and store.
template <int VEC, class Wide16, class Wide8>
using VecOf = std::conditional_t<
    VEC == 16, Wide16,
    std::conditional_t<VEC == 8, Wide8,
                       std::conditional_t<VEC == 4, uint32_t,
                                          std::conditional_t<VEC == 2, uint16_t, uint8_t>>>>;

// The body of thread `thread` of `num_threads` (a multiple of kWalkLanes).
// src_base/dst_base: the launch's segment table (num_segments entries), in
// whatever memory the backend finds fastest. Mem provides: using vec_type;
// static vec_type load(const vec_type*); static void store(vec_type*,
// vec_type). Record is called as record(token, value, bound, which) for an
// out-of-range slot.
//
// before_write() is called before the thread's first store and its first
// error record (and may be called again: it must act once). A kernel that
// loads before the previous kernel of its stream has finished (early loads,
// see copy_rows_cuda.cuh) waits there; the others pass NoWait.
template <int VEC, int UNROLL, class Mem, class Record, class BeforeWrite>
KVL_D inline void copy_rows_walk(const CopyRowsArgs& a, const char* const* src_base,
                                 char* const* dst_base, int64_t thread, int64_t num_threads,
                                 const Record& record, BeforeWrite& before_write) {
  using V = typename Mem::vec_type;
  const int64_t lane = thread % kWalkLanes;
  const int64_t group = thread / kWalkLanes;
  const int64_t num_groups = num_threads / kWalkLanes;
  const int64_t V_row = a.vecs_per_row;
  const int64_t per_token = a.num_segments * V_row;
  const int64_t total = a.tokens * per_token;
  // Equal contiguous ranges, each a multiple of kWalkLanes items long: a
  // small launch spreads over every lane group rather than filling a few.
  // (The only divisions of the walk are these few, once per thread, in 32
  // bits when the operands fit: divmod_nonneg.)
  int64_t range, unused;
  divmod_nonneg(total + num_groups - 1, num_groups, range, unused);
  range = (range + kWalkLanes - 1) / kWalkLanes * kWalkLanes;
  const int64_t begin = group * range;
  const int64_t end = begin + range < total ? begin + range : total;
  const int64_t i = begin + lane;
  if (i >= end) return;
  // this lane's items: i, i + kWalkLanes, ... below end (a count, not the two
  // bounds: registers are what limits the loads in flight)
  int64_t left = (end - i + kWalkLanes - 1) / kWalkLanes;

  // Position of item i. Segment and vector indices fit 32 bits
  // (prepare_copy_rows_args).
  int64_t t, in_token, seg64, v64;
  divmod_nonneg(i, per_token, t, in_token);
  divmod_nonneg(in_token, V_row, seg64, v64);
  int32_t seg = static_cast<int32_t>(seg64);
  int32_t v = static_cast<int32_t>(v64);
  const int32_t num_segments = static_cast<int32_t>(a.num_segments);
  const int32_t vecs = static_cast<int32_t>(V_row);
  // Advance of one step (kWalkLanes items).
  const int32_t step_seg = kWalkLanes / vecs;
  const int32_t step_v = kWalkLanes % vecs;
  const bool one_piece = a.by_piece.divisor == V_row;  // rows are one contiguous piece

  // an out-of-range slot of the token whose first item this lane holds
  const auto on_bad = [&](int64_t value, int64_t bound, int64_t which) {
    before_write();
    record(a.skip_prefix + t, value, bound, which);
  };
  TokenRows rows;
  rows.has_next = false;
  rows.resolve(a, a.skip_prefix + t, false, seg == 0 && v == 0, on_bad);
  bool stale = false;          // t moved past the token of `rows`
  bool next_adjacent = false;  // by one token: its slots were loaded ahead

  while (left > 0) {
    V buf[UNROLL];
    char* out[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      out[k] = nullptr;
      if (left > 0) {
        if (stale) {
          rows.resolve(a, a.skip_prefix + t, next_adjacent, seg == 0 && v == 0, on_bad);
          stale = false;
        }
        if (rows.live) {
          int64_t so, dof;
          vector_offsets<VEC>(a, one_piece, v, so, dof);
          buf[k] = Mem::load(reinterpret_cast<const V*>(src_base[seg] + rows.src_row + so));
          out[k] = dst_base[seg] + rows.dst_row + dof;
        }
        // Next item of this lane: kWalkLanes further.
        --left;
        v += step_v;
        seg += step_seg;
        if (v >= vecs) {
          v -= vecs;
          ++seg;
        }
        if (seg >= num_segments) {
          int64_t dt, s;
          a.by_segments.divmod(seg, dt, s);
          t += dt;
          next_adjacent = dt == 1;
          stale = true;
          seg = static_cast<int32_t>(s);
        }
      }
    }
    before_write();
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      if (out[k] != nullptr) Mem::store(reinterpret_cast<V*>(out[k]), buf[k]);
    }
  }
}

// The before_write of a walk that may write from its start.
struct NoWait {
  KVL_D void operator()() const {}
};

template <int VEC, int UNROLL, class Mem, class Record>
KVL_D inline void copy_rows_walk(const CopyRowsArgs& a, const char* const* src_base,
                                 char* const* dst_base, int64_t thread, int64_t num_threads,
                                 const Record& record) {
  const NoWait no_wait;
  copy_rows_walk<VEC, UNROLL, Mem>(a, src_base, dst_base, thread, num_threads, record, no_wait);
}

// One row of a launch moved by `lanes` cooperating threads, of which this is
// lane `lane`: segment `seg`'s row of token t (0 <= t < a.tokens;
// skip_prefix not included), words lane, lane + lanes, ... The peers' shape
// (one row per CTA), which moves rows of 1 KiB and more faster than the walk
// on the device, and small host transfers' rows in 8-byte words
// (scripts/walk_grid_probe.cu); a backend that uses it runs every (token,
// segment) row once. src_base/dst_base: the segment's bases. A word is
// Mem::vec_type, of VEC bytes or a fraction of them: the launch's VEC-byte
// vectors (whose offsets vector_offsets gives) are VEC / sizeof(word) words
// each, at consecutive addresses. The token's out-of-range slot is recorded
// by lane 0 of segment 0, as record(token, value, bound, which). The caller
// has waited for whatever its writes must follow.
template <int VEC, class Mem, class Record>
KVL_D inline void copy_one_row(const CopyRowsArgs& a, const char* src_base, char* dst_base,
                               int64_t t, int64_t seg, int64_t lane, int64_t lanes,
                               const Record& record) {
  using W = typename Mem::vec_type;
  constexpr int64_t kWordsPerVec = VEC / int64_t(sizeof(W));
  static_assert(kWordsPerVec >= 1 && kWordsPerVec * int64_t(sizeof(W)) == VEC &&
                    (kWordsPerVec & (kWordsPerVec - 1)) == 0,
                "a row's words must divide its vectors");
  const int64_t token = a.skip_prefix + t;
  const auto on_bad = [&](int64_t value, int64_t bound, int64_t which) {
    record(token, value, bound, which);
  };
  int64_t src_row, dst_row;
  if (!resolve_slot_pair(a, a.src_slots.load(token), a.dst_slots.load(token),
                         seg == 0 && lane == 0, on_bad, src_row, dst_row))
    return;
  const bool one_piece = a.by_piece.divisor == a.vecs_per_row;
  const int64_t words = a.vecs_per_row * kWordsPerVec;
  for (int64_t w = lane; w < words; w += lanes) {
    // (kWordsPerVec is a power of two: a shift and a mask)
    const int64_t v = w / kWordsPerVec;
    const int64_t in_vec = (w % kWordsPerVec) * int64_t(sizeof(W));
    int64_t so, dof;
    vector_offsets<VEC>(a, one_piece, static_cast<int32_t>(v), so, dof);
    Mem::store(reinterpret_cast<W*>(dst_base + dst_row + dof + in_vec),
               Mem::load(reinterpret_cast<const W*>(src_base + src_row + so + in_vec)));
  }
}

}  // namespace kvlayout
