// kvlayout/rope_kernel.h — parameters and per-row body of rope_reposition,
// shared by the CPU, CUDA and SYCL backends.
//
// Work decomposition on devices: a task is one (token, head); heads are the
// inner index so neighbouring groups share the token's cos/sin rows. A group
// of R = 2^log2_group lanes walks the rot_dim/2 pairs of its head.
#pragma once

#include <cstdint>

#include "kvlayout/address.h"
#include "kvlayout/copy_rows_kernel.h"
#include "kvlayout/rope.h"

namespace kvlayout {

constexpr int kRopeThreadsPerBlock = 256;

struct RopeParams {
  void* key;                  // element [t, h, e] at key + t*stride_token + h*stride_head + e
  const void* cos_sin;        // element [pos, c] at cos_sin + pos*cache_stride_pos + c*cache_stride_col
  SlotArray old_positions;
  SlotArray new_positions;
  int64_t stride_token;       // in elements
  int64_t stride_head;        // in elements
  int64_t num_tokens;
  int64_t num_heads;
  int64_t half_rot;           // rot_dim / 2
  int64_t max_pos;            // rows of the cos/sin cache
  int64_t cache_stride_pos;   // in elements
  int64_t cache_stride_col;   // in elements
  int64_t* status;
  int32_t is_neox;
  int32_t log2_group;
};

// Rotates pairs lane, lane + R, ... of head `head` of token `t` from old to
// new position (both valid). scalar_t: key element type; cache_t: cos/sin
// element type. Conversions go through float.
template <class scalar_t, class cache_t>
KVL_D inline void rope_reposition_head(const RopeParams& p, int64_t t, int64_t head,
                                       int64_t old_pos, int64_t new_pos, int64_t lane,
                                       int64_t R) {
  scalar_t* k = static_cast<scalar_t*>(p.key) + t * p.stride_token + head * p.stride_head;
  const cache_t* c = static_cast<const cache_t*>(p.cos_sin);
  const cache_t* co_row = c + old_pos * p.cache_stride_pos;
  const cache_t* cn_row = c + new_pos * p.cache_stride_pos;
  const int64_t sin_col = p.half_rot * p.cache_stride_col;
  for (int64_t i = lane; i < p.half_rot; i += R) {
    const int64_t col = i * p.cache_stride_col;
    const float co = static_cast<float>(co_row[col]);
    const float so = static_cast<float>(co_row[sin_col + col]);
    const float cn = static_cast<float>(cn_row[col]);
    const float sn = static_cast<float>(cn_row[sin_col + col]);
    int64_t dx, dy;
    rope_pair_dims(i, p.half_rot, p.is_neox != 0, dx, dy);
    float x = static_cast<float>(k[dx]);
    float y = static_cast<float>(k[dy]);
    rope_reposition_pair(x, y, co, so, cn, sn);
    k[dx] = static_cast<scalar_t>(x);
    k[dy] = static_cast<scalar_t>(y);
  }
}

inline int32_t rope_log2_group(int64_t half_rot) {
  int32_t lg = 0;
  while ((int64_t(1) << lg) < half_rot && lg < 5) ++lg;
  return lg;
}

// Device body: grid-stride over (token, head) tasks. Record is called as
// record(token, value, bound, which) for an out-of-range position.
template <class scalar_t, class cache_t, class Record>
KVL_D inline void rope_reposition_thread(const RopeParams& p, int64_t thread,
                                         int64_t num_threads, const Record& record) {
  const int64_t R = int64_t(1) << p.log2_group;
  const int64_t lane = thread & (R - 1);
  const int64_t num_groups = num_threads >> p.log2_group;
  const int64_t num_tasks = p.num_tokens * p.num_heads;
  for (int64_t task = thread >> p.log2_group; task < num_tasks; task += num_groups) {
    int64_t t, head;
    divmod_nonneg(task, p.num_heads, t, head);
    const int64_t op = p.old_positions.load(t);
    const int64_t np = p.new_positions.load(t);
    if (op < 0 || np < 0) continue;
    if (op >= p.max_pos || np >= p.max_pos) {
      if (head == 0 && lane == 0) {
        if (op >= p.max_pos)
          record(t, op, p.max_pos, int64_t(kStatusOldPositions));
        else
          record(t, np, p.max_pos, int64_t(kStatusNewPositions));
      }
      continue;
    }
    rope_reposition_head<scalar_t, cache_t>(p, t, head, op, np, lane, R);
  }
}

}  // namespace kvlayout
