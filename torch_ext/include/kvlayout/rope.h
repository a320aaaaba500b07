// kvlayout/rope.h — the shared pair math of RoPE key repositioning.
//
// A cached key was rotated for position `old`; repositioning rotates it back
// by the old angle and forward by the new one. All math is fp32:
//   undo old:  x' = x*co + y*so ;  y' = y*co - x*so
//   apply new: x'' = x'*cn - y'*sn ;  y'' = y'*cn + x'*sn
// with (co, so) = (cos, sin) at the old position and (cn, sn) at the new one.
//
// Pairing (i < rot_dim / 2; dims >= rot_dim are untouched):
//   NeoX:  (i, i + rot_dim/2)
//   GPT-J: (2i, 2i + 1)
// The cos/sin cache row of a position holds cos in columns [0, rot_dim/2) and
// sin in columns [rot_dim/2, rot_dim); pair i uses column i of each half.
#pragma once

#include <cstdint>

#include "kvlayout/address.h"

namespace kvlayout {

KVL_HD inline void rope_reposition_pair(float& x, float& y, float co, float so, float cn,
                                        float sn) {
  const float xu = x * co + y * so;
  const float yu = y * co - x * so;
  x = xu * cn - yu * sn;
  y = yu * cn + xu * sn;
}

// Element offsets (within one head) of the two members of pair i.
KVL_HD inline void rope_pair_dims(int64_t i, int64_t half_rot, bool is_neox, int64_t& dx,
                                  int64_t& dy) {
  if (is_neox) {
    dx = i;
    dy = i + half_rot;
  } else {
    dx = 2 * i;
    dy = 2 * i + 1;
  }
}

}  // namespace kvlayout
