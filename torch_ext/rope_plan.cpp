#include "rope_plan.h"

#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <c10/util/Exception.h>

#include <utility>

#include "copy_plan.h"
#include "slots.h"

namespace kvlayout {

RopeParams plan_rope_reposition(const at::Tensor& key, const at::Tensor& old_positions,
                                const at::Tensor& new_positions,
                                const at::Tensor& cos_sin_cache, bool is_neox,
                                int64_t max_ctas) {
  TORCH_CHECK_VALUE(key.dim() == 3,
                    "kvlayout::rope_reposition: key must be [T, H, D], got shape ", key.sizes());
  const auto kt = key.scalar_type();
  TORCH_CHECK_TYPE(kt == at::kFloat || kt == at::kHalf || kt == at::kBFloat16,
                   "kvlayout::rope_reposition: key must be float32, float16 or bfloat16, got ", kt);
  TORCH_CHECK_VALUE(key.numel() == 0 || key.size(2) <= 1 || key.stride(2) == 1,
                    "kvlayout::rope_reposition: key's last dimension must be contiguous ",
                    "(stride 1), got strides ", key.strides());
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2,
                    "kvlayout::rope_reposition: cos_sin_cache must be [max_pos, rot_dim], ",
                    "got shape ", cos_sin_cache.sizes());
  const auto ct = cos_sin_cache.scalar_type();
  TORCH_CHECK_TYPE(ct == at::kFloat || ct == kt,
                   "kvlayout::rope_reposition: cos_sin_cache must be float32 or the key's dtype (",
                   kt, "), got ", ct);
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK_VALUE(rot_dim % 2 == 0 && rot_dim <= key.size(2),
                    "kvlayout::rope_reposition: rot_dim (cos_sin_cache.size(1) = ", rot_dim,
                    ") must be even and <= head size ", key.size(2));
  TORCH_CHECK_VALUE(max_ctas >= 0,
                    "kvlayout::rope_reposition: max_ctas must be >= 0 (0 = default), got ",
                    max_ctas);
  TORCH_CHECK_VALUE(old_positions.device() == new_positions.device(),
                    "kvlayout::rope_reposition: old_positions and new_positions must be on one ",
                    "device");
  check_no_internal_overlap(key, "kvlayout::rope_reposition", "key", -1);
  {
    WrittenRanges written;
    written.add(key, 0);
    written.finish();
    for (const auto& [t, name] : {std::make_pair(&old_positions, "old_positions"),
                                  std::make_pair(&new_positions, "new_positions"),
                                  std::make_pair(&cos_sin_cache, "cos_sin_cache")}) {
      TORCH_CHECK_VALUE(written.find(*t) < 0, "kvlayout::rope_reposition: ", name,
                  " overlaps key in memory (the rotation would rewrite what it reads); pass a "
                  "tensor of its own");
    }
  }
  const int64_t T = key.size(0);
  RopeParams p{};
  p.old_positions = index_array(old_positions, T, "old_positions", "key.size(0)");
  p.new_positions = index_array(new_positions, T, "new_positions", "key.size(0)");
  p.key = key.data_ptr();
  p.cos_sin = cos_sin_cache.data_ptr();
  p.stride_token = key.stride(0);
  p.stride_head = key.stride(1);
  p.num_tokens = T;
  p.num_heads = key.size(1);
  p.half_rot = rot_dim / 2;
  p.max_pos = cos_sin_cache.size(0);
  p.cache_stride_pos = cos_sin_cache.stride(0);
  p.cache_stride_col = cos_sin_cache.stride(1);
  p.status = nullptr;
  p.is_neox = is_neox ? 1 : 0;
  p.log2_group = rope_log2_group(p.half_rot);
  return p;
}

void check_positions_in_range_on_host(const RopeParams& p) {
  if (p.num_heads == 0 || p.half_rot == 0) return;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t o = p.old_positions.load(t);
    const int64_t n = p.new_positions.load(t);
    if (o < 0 || n < 0) continue;
    TORCH_CHECK_INDEX(o < p.max_pos, "kvlayout: old_positions[", t, "] = ", o,
                      " is out of range: cos_sin_cache holds ", p.max_pos, " positions");
    TORCH_CHECK_INDEX(n < p.max_pos, "kvlayout: new_positions[", t, "] = ", n,
                      " is out of range: cos_sin_cache holds ", p.max_pos, " positions");
  }
}

void read_positions_once(RopeParams& p, std::vector<int64_t>& old_copy,
                         std::vector<int64_t>& new_copy) {
  old_copy.resize(p.num_tokens);
  new_copy.resize(p.num_tokens);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t o = p.old_positions.load(t);  // the one load of each position
    const int64_t n = p.new_positions.load(t);
    old_copy[t] = o;
    new_copy[t] = n;
    if (o < 0 || n < 0) continue;
    TORCH_CHECK_INDEX(o < p.max_pos, "kvlayout: old_positions[", t, "] = ", o,
                      " is out of range: cos_sin_cache holds ", p.max_pos, " positions");
    TORCH_CHECK_INDEX(n < p.max_pos, "kvlayout: new_positions[", t, "] = ", n,
                      " is out of range: cos_sin_cache holds ", p.max_pos, " positions");
  }
  p.old_positions = SlotArray{old_copy.data(), 1, 8, 0};
  p.new_positions = SlotArray{new_copy.data(), 1, 8, 0};
}

}  // namespace kvlayout
