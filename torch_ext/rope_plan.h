// rope_reposition's arguments, checked and turned into the kernel's RopeParams.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kvlayout/rope_kernel.h"

namespace kvlayout {

// Validates rope_reposition's arguments and fills the parameters (pointers
// are the tensors' own data pointers; status is left null).
RopeParams plan_rope_reposition(const at::Tensor& key, const at::Tensor& old_positions,
                                const at::Tensor& new_positions,
                                const at::Tensor& cos_sin_cache, bool is_neox,
                                int64_t max_ctas);

// Raises IndexError for the first out-of-range position (host-readable only).
void check_positions_in_range_on_host(const RopeParams& p);

// Reads every position once into `old_copy` / `new_copy`, points the params
// at the copies and checks them (IndexError naming the argument, token,
// value and bound): what is checked is what the rotation uses.
void read_positions_once(RopeParams& p, std::vector<int64_t>& old_copy,
                         std::vector<int64_t>& new_copy);

}  // namespace kvlayout
