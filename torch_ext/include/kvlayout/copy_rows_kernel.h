// kvlayout/copy_rows_kernel.h — parameters and per-thread body of the
// copy_rows device kernel, shared by the CUDA and SYCL backends (they differ
// only in how they launch, which load/store instructions they use and how
// they record an error). Plain C++; KVL_D marks device code under CUDA/HIP.
//
// Work decomposition. A *task* is one (token, segment) row. Rows are handled
// by groups of R = 2^log2_group consecutive threads ("lanes"); group k of the
// grid takes tasks k, k + num_groups, ... (grid-stride). Tokens are the inner
// index of a task, so neighbouring groups move neighbouring tokens of the same
// segment (coalesced slot loads, adjacent rows). Every thread keeps
// kCopyUnroll loads in flight before it stores: for rows of up to 32 vectors
// (512 B of 16-byte vectors) lane j moves vector j of kCopyUnroll different
// rows; for longer rows lane j moves vectors j, j+R, j+2R, ... of one row.
// Pieces are walked incrementally (no division per vector).
#pragma once

#include <cstdint>

#include "kvlayout/address.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVL_D __device__
#else
#define KVL_D
#endif

namespace kvlayout {

constexpr int kCopyThreadsPerBlock = 256;
constexpr int kCopyUnroll = 4;

// Meaning of status[4] when status[0] > 0 (first error recorded on device).
enum StatusWhich : int64_t {
  kStatusSrcSlots = 0,
  kStatusDstSlots = 1,
  kStatusOldPositions = 2,
  kStatusNewPositions = 3,
};
// status layout (int64): [0] error count, [1] token index, [2] value,
// [3] bound, [4] StatusWhich. At least kStatusNumel elements.
constexpr int64_t kStatusNumel = 5;

template <int kMaxSegments>
struct CopyRowsParams {
  const char* src_base[kMaxSegments];
  char* dst_base[kMaxSegments];
  RowGeometry src_geom;
  RowGeometry dst_geom;
  SlotArray src_slots;
  SlotArray dst_slots;
  int64_t skip_prefix;     // first token handled
  int64_t tokens;          // tokens handled: num_tokens - skip_prefix (> 0)
  int64_t num_segments;    // segments in this launch (> 0)
  int64_t num_tasks;       // tokens * num_segments
  int64_t num_pieces;      // after merging back-to-back pieces
  int64_t vecs_per_piece;  // piece_bytes / VEC
  int64_t vecs_per_row;    // num_pieces * vecs_per_piece
  int64_t* status;         // device-visible int64[kStatusNumel]
  int32_t log2_group;      // lanes per row
  int32_t record_errors;   // only one launch of a split call records
};

// Lanes per row: one lane per vector for rows of up to 32 vectors (those
// rows are then batched kCopyUnroll at a time per lane, see below); longer rows
// get 32 lanes, each walking several vectors of the row.
inline int32_t copy_rows_log2_group(int64_t vecs_per_row, int vec_bytes) {
  (void)vec_bytes;
  int32_t lg = 0;
  while ((int64_t(1) << lg) < vecs_per_row && lg < 5) ++lg;
  return lg;
}

// Resolves task -> (source row, destination row) addresses; nullptr when the
// token has no row (negative slot) or an out-of-range slot (recorded once).
template <class Params, class Record>
KVL_D inline bool copy_rows_task(const Params& p, int64_t task, int64_t lane, const Record& record,
                                 const char*& src_row, char*& dst_row) {
  int64_t seg, tt;
  divmod_nonneg(task, p.tokens, seg, tt);
  const int64_t t = p.skip_prefix + tt;
  const int64_t s = p.src_slots.load(t);
  const int64_t d = p.dst_slots.load(t);
  if (s < 0 || d < 0) return false;
  if (s >= p.src_geom.num_slots || d >= p.dst_geom.num_slots) {
    if (p.record_errors && seg == 0 && lane == 0) {
      if (s >= p.src_geom.num_slots)
        record(t, s, p.src_geom.num_slots, int64_t(kStatusSrcSlots));
      else
        record(t, d, p.dst_geom.num_slots, int64_t(kStatusDstSlots));
    }
    return false;
  }
  src_row = p.src_base[seg] + row_offset(p.src_geom, s);
  dst_row = p.dst_base[seg] + row_offset(p.dst_geom, d);
  return true;
}

// Mem provides: using vec_type; static vec_type load(const vec_type*);
// static void store(vec_type*, vec_type). Record is called as
// record(token, value, bound, which) for an out-of-range slot.
template <int VEC, class Mem, class Record, class Params>
KVL_D inline void copy_rows_thread(const Params& p, int64_t thread, int64_t num_threads,
                                   const Record& record) {
  using V = typename Mem::vec_type;
  const int64_t R = int64_t(1) << p.log2_group;
  const int64_t lane = thread & (R - 1);
  const int64_t num_groups = num_threads >> p.log2_group;
  if (lane >= p.vecs_per_row) return;  // idle lane (no barriers are used)

  // Starting piece/vector of this lane and the per-step advance (R vectors).
  int64_t h0, w0, step_h, step_w;
  divmod_nonneg(lane, p.vecs_per_piece, h0, w0);
  divmod_nonneg(R, p.vecs_per_piece, step_h, step_w);
  const int64_t src_sp = p.src_geom.stride_piece;
  const int64_t dst_sp = p.dst_geom.stride_piece;

  if (p.vecs_per_row <= R) {
    // Short rows: each lane moves one vector of a row, so the loads in flight
    // come from kCopyUnroll different rows (tasks) instead.
    const int64_t so = h0 * src_sp + w0 * VEC;
    const int64_t dof = h0 * dst_sp + w0 * VEC;
    for (int64_t first = thread >> p.log2_group; first < p.num_tasks;
         first += num_groups * kCopyUnroll) {
      const char* sp[kCopyUnroll];
      char* dp[kCopyUnroll];
      bool live[kCopyUnroll];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        const int64_t task = first + k * num_groups;
        live[k] = task < p.num_tasks && copy_rows_task(p, task, lane, record, sp[k], dp[k]);
      }
      V buf[kCopyUnroll];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        if (live[k]) buf[k] = Mem::load(reinterpret_cast<const V*>(sp[k] + so));
      }
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        if (live[k]) Mem::store(reinterpret_cast<V*>(dp[k] + dof), buf[k]);
      }
    }
    return;
  }

  for (int64_t task = thread >> p.log2_group; task < p.num_tasks; task += num_groups) {
    const char* sp;
    char* dp;
    if (!copy_rows_task(p, task, lane, record, sp, dp)) continue;
    int64_t h = h0, w = w0;
    for (int64_t v = lane; v < p.vecs_per_row; v += R * kCopyUnroll) {
      int64_t so[kCopyUnroll], dof[kCopyUnroll];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        so[k] = h * src_sp + w * VEC;
        dof[k] = h * dst_sp + w * VEC;
        h += step_h;
        w += step_w;
        if (w >= p.vecs_per_piece) {
          w -= p.vecs_per_piece;
          ++h;
        }
      }
      V buf[kCopyUnroll];
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        if (v + k * R < p.vecs_per_row) buf[k] = Mem::load(reinterpret_cast<const V*>(sp + so[k]));
      }
#pragma unroll
      for (int k = 0; k < kCopyUnroll; ++k) {
        if (v + k * R < p.vecs_per_row) Mem::store(reinterpret_cast<V*>(dp + dof[k]), buf[k]);
      }
    }
  }
}

}  // namespace kvlayout
