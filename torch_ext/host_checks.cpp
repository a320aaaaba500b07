#include "host_checks.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <utility>

namespace kvlayout {
namespace {

// Overflow-checked int64 arithmetic for the bounds proofs.
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &r), "kvlayout: ", what,
              " overflows 64-bit byte offsets");
  return r;
}

int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!__builtin_add_overflow(a, b, &r), "kvlayout: ", what,
              " overflows 64-bit byte offsets");
  return r;
}

RowGeometry parse_geometry(c10::IntArrayRef g, const char* name) {
  TORCH_CHECK(g.size() == 5, "kvlayout::copy_rows: ", name,
              " must be [num_slots, page_size, stride_page, stride_in_page, stride_piece], got ",
              g.size(), " values");
  RowGeometry r{g[0], g[1], g[2], g[3], g[4]};
  TORCH_CHECK(r.num_slots >= 0, "kvlayout::copy_rows: ", name, " num_slots must be >= 0, got ",
              r.num_slots);
  TORCH_CHECK(r.page_size >= 1, "kvlayout::copy_rows: ", name, " page_size must be >= 1, got ",
              r.page_size);
  TORCH_CHECK(r.stride_page >= 0 && r.stride_in_page >= 0 && r.stride_piece >= 0,
              "kvlayout::copy_rows: ", name, " strides must be >= 0 bytes, got stride_page=",
              r.stride_page, " stride_in_page=", r.stride_in_page,
              " stride_piece=", r.stride_piece);
  return r;
}

// Overflow-checked row offset of a valid slot.
int64_t checked_row_offset(const RowGeometry& g, int64_t slot, const char* name) {
  const int64_t page = slot / g.page_size;
  const int64_t in_page = slot % g.page_size;
  return checked_add(checked_mul(page, g.stride_page, name),
                     checked_mul(in_page, g.stride_in_page, name), name);
}

// Bytes past a segment's base that the geometry can address (0 if none).
int64_t addressable_extent(const RowGeometry& g, int64_t num_pieces, int64_t piece_bytes,
                           const char* name) {
  if (g.num_slots == 0) return 0;
  int64_t max_row = checked_row_offset(g, g.num_slots - 1, name);
  const int64_t num_pages = (g.num_slots - 1) / g.page_size + 1;
  if (num_pages >= 2) {
    const int64_t o = checked_row_offset(g, (num_pages - 1) * g.page_size - 1, name);
    if (o > max_row) max_row = o;
  }
  const int64_t last_piece = checked_mul(num_pieces - 1, g.stride_piece, name);
  return checked_add(checked_add(max_row, last_piece, name), piece_bytes, name);
}

void parse_segments(at::TensorList tensors, c10::IntArrayRef segments, const char* list_name,
                    const char* seg_name, const RowGeometry& g, int64_t num_pieces,
                    int64_t piece_bytes, const char* geom_name, std::vector<int64_t>& tensor_of,
                    std::vector<int64_t>& offset_of) {
  const int64_t num = static_cast<int64_t>(segments.size()) / 2;
  const int64_t extent = addressable_extent(g, num_pieces, piece_bytes, geom_name);
  tensor_of.resize(num);
  offset_of.resize(num);
  for (int64_t s = 0; s < num; ++s) {
    const int64_t ti = segments[2 * s];
    const int64_t off = segments[2 * s + 1];
    TORCH_CHECK(ti >= 0 && ti < static_cast<int64_t>(tensors.size()), "kvlayout::copy_rows: ",
                seg_name, "[", 2 * s, "] = ", ti, " is not a valid index into ", list_name,
                " (", tensors.size(), " tensors)");
    TORCH_CHECK(off >= 0, "kvlayout::copy_rows: ", seg_name, "[", 2 * s + 1,
                "] (byte offset of segment ", s, ") must be >= 0, got ", off);
    const at::Tensor& t = tensors[ti];
    TORCH_CHECK(t.defined(), "kvlayout::copy_rows: ", list_name, "[", ti, "] is undefined");
    if (extent == 0) {
      tensor_of[s] = ti;
      offset_of[s] = off;
      continue;
    }
    TORCH_CHECK(t.has_storage(), "kvlayout::copy_rows: ", list_name, "[", ti,
                "] has no storage");
    const int64_t storage_bytes = static_cast<int64_t>(t.storage().nbytes());
    const int64_t start = checked_add(t.storage_offset() * t.element_size(), off, seg_name);
    const int64_t end = checked_add(start, extent, seg_name);
    TORCH_CHECK(end <= storage_bytes, "kvlayout::copy_rows: segment ", s, " of ", list_name,
                " (", list_name, "[", ti, "] + ", off,
                " bytes) addresses bytes up to ", end,
                " of its storage, which holds only ", storage_bytes, " bytes (", geom_name,
                ": num_slots=", g.num_slots, " page_size=", g.page_size,
                " stride_page=", g.stride_page, " stride_in_page=", g.stride_in_page,
                " stride_piece=", g.stride_piece, "; num_pieces=", num_pieces,
                " piece_bytes=", piece_bytes, ")");
    tensor_of[s] = ti;
    offset_of[s] = off;
  }
}



// Written tensors: no element may be written through two indices (torch
// refuses in-place writes into expanded tensors for the same reason).
void check_no_internal_overlap(const at::Tensor& t, const char* op, const char* name,
                               int64_t index) {
  if (at::has_internal_overlap(t) != at::MemOverlap::Yes) return;
  if (index >= 0) {
    TORCH_CHECK_VALUE(false, op, ": ", name, "[", index, "] has internal overlap (more than one element ",
                "refers to a single memory location, e.g. an expanded tensor with strides ",
                t.strides(), "); it cannot be written in place");
  }
  TORCH_CHECK_VALUE(false, op, ": ", name, " has internal overlap (more than one element refers to a ",
              "single memory location, e.g. an expanded tensor with strides ", t.strides(),
              "); it cannot be written in place");
}

void check_copy_aliasing(at::TensorList src, at::TensorList dst,
                         const std::optional<at::Tensor>& src_slots,
                         const std::optional<at::Tensor>& dst_slots, const CopyPlan& p) {
  std::vector<char> src_used(src.size(), 0), dst_used(dst.size(), 0);
  for (int64_t g = 0; g < p.num_segments; ++g) {
    src_used[p.src_tensor[g]] = 1;
    dst_used[p.dst_tensor[g]] = 1;
  }
  WrittenRanges written;
  for (size_t j = 0; j < dst.size(); ++j) {
    if (!dst_used[j]) continue;
    check_no_internal_overlap(dst[j], "kvlayout::copy_rows", "dst", static_cast<int64_t>(j));
    written.add(dst[j], static_cast<int64_t>(j));
  }
  written.finish();
  for (size_t i = 0; i < src.size(); ++i) {
    if (!src_used[i]) continue;
    const int64_t j = written.find(src[i]);
    TORCH_CHECK_VALUE(j < 0, "kvlayout::copy_rows: src[", i, "] and dst[", j,
                "] overlap in memory (the copy would read bytes it writes); within one cache ",
                "use move()");
  }
  check_slots_not_written(written, src_slots, "src_slots", "kvlayout::copy_rows");
  check_slots_not_written(written, dst_slots, "dst_slots", "kvlayout::copy_rows");
  // Two segments writing the same rows (a layer or plane chosen twice).
  std::vector<std::pair<uintptr_t, int64_t>> bases(p.num_segments);
  for (int64_t g = 0; g < p.num_segments; ++g)
    bases[g] = {reinterpret_cast<uintptr_t>(dst[p.dst_tensor[g]].data_ptr()) +
                    static_cast<uintptr_t>(p.dst_offset[g]),
                g};
  std::sort(bases.begin(), bases.end());
  for (size_t k = 1; k < bases.size(); ++k) {
    TORCH_CHECK_VALUE(bases[k].first != bases[k - 1].first, "kvlayout::copy_rows: dst_segments ",
                std::min(bases[k].second, bases[k - 1].second), " and ",
                std::max(bases[k].second, bases[k - 1].second),
                " address the same destination rows (a destination layer or plane chosen "
                "twice); each row may be written once");
  }
}

// Open-addressing set of destination slots (linear time): which token wrote
// a slot first.
class SlotSet {
 public:
  explicit SlotSet(int64_t n) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(2 * n)) cap <<= 1;
    mask_ = cap - 1;
    slot_.assign(cap, -1);
    token_.resize(cap);
  }
  // Inserts slot v (>= 0) of token t; returns the earlier token with v, or -1.
  int64_t insert(int64_t v, int64_t t) {
    size_t h = static_cast<size_t>((static_cast<uint64_t>(v) * 0x9E3779B97F4A7C15ull) >> 17) & mask_;
    while (slot_[h] >= 0) {
      if (slot_[h] == v) return token_[h];
      h = (h + 1) & mask_;
    }
    slot_[h] = v;
    token_[h] = t;
    return -1;
  }

 private:
  size_t mask_;
  std::vector<int64_t> slot_, token_;
};

}  // namespace

// Bytes [begin, end) a tensor's elements can occupy (empty for no elements).
ByteRange byte_range(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return {};
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>(extent * t.element_size())};
}

bool ranges_meet(const ByteRange& a, const ByteRange& b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

// Written tensors are sorted by start; a read range is tested against the
// ones that start before it ends (prefix maximum of their ends).
void WrittenRanges::add(const at::Tensor& t, int64_t index) {
  const ByteRange r = byte_range(t);
  if (r.begin < r.end) items_.push_back({r, index, t.device()});
}

void WrittenRanges::finish() {
  std::sort(items_.begin(), items_.end(),
            [](const Item& a, const Item& b) { return a.range.begin < b.range.begin; });
  max_end_.resize(items_.size());
  uintptr_t m = 0;
  for (size_t i = 0; i < items_.size(); ++i) max_end_[i] = m = std::max(m, items_[i].range.end);
}

int64_t WrittenRanges::find(const at::Tensor& t) const {
  const ByteRange r = byte_range(t);
  if (r.begin >= r.end || items_.empty()) return -1;
  size_t k = std::lower_bound(items_.begin(), items_.end(), r.end,
                              [](const Item& a, uintptr_t v) { return a.range.begin < v; }) -
             items_.begin();
  while (k > 0 && max_end_[k - 1] > r.begin) {
    --k;
    if (ranges_meet(items_[k].range, r) && items_[k].device == t.device()) return items_[k].index;
  }
  return -1;
}

void check_slots_not_written(const WrittenRanges& written, const std::optional<at::Tensor>& slots,
                             const char* name, const char* op) {
  if (!slots.has_value() || !slots->defined()) return;
  const int64_t j = written.find(*slots);
  TORCH_CHECK_VALUE(j < 0, op, ": ", name, " overlaps dst[", j,
                    "] in memory (the copy would rewrite the slots it reads); pass a slot tensor "
                    "of its own");
}

SlotArray parse_index(const std::optional<at::Tensor>& t, int64_t length, const char* name,
                      const char* length_name) {
  if (!t.has_value() || !t->defined()) return SlotArray{nullptr, 1, 8, 0};
  const at::Tensor& x = *t;
  TORCH_CHECK_VALUE(x.dim() == 1, "kvlayout: ", name, " must be 1-D, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kInt || x.scalar_type() == at::kLong, "kvlayout: ",
                   name, " must be int32 or int64, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(0) == length, "kvlayout: ", name, " has ", x.size(0),
                    " entries but ", length_name, " is ", length);
  return SlotArray{x.data_ptr(), x.size(0) > 1 ? x.stride(0) : 1,
                   static_cast<int32_t>(x.element_size()), 0};
}

[[noreturn]] void raise_slot_out_of_range(const char* name, bool identity, int64_t t,
                                          int64_t value, int64_t bound) {
  const char* what = name[0] == 's' ? "the source" : "the destination";
  if (identity) {
    TORCH_CHECK_INDEX(false, "kvlayout: ", name, " is None, so token ", t, " uses slot ", value,
                      ", which is out of range: ", what, " holds ", bound, " slots");
  }
  TORCH_CHECK_INDEX(false, "kvlayout: ", name, "[", t, "] = ", value, " is out of range: ", what,
                    " holds ", bound, " slots");
  __builtin_unreachable();
}

CopyPlan plan_copy_rows(at::TensorList src, at::TensorList dst,
                        const std::optional<at::Tensor>& src_slots,
                        const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                        int64_t skip_prefix, c10::IntArrayRef src_segments,
                        c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                        c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes,
                        int64_t max_ctas) {
  CopyPlan p;
  TORCH_CHECK_VALUE(num_tokens >= 0, "kvlayout::copy_rows: num_tokens must be >= 0, got ",
                    num_tokens);
  TORCH_CHECK_VALUE(skip_prefix >= 0 && skip_prefix <= num_tokens,
                    "kvlayout::copy_rows: skip_prefix must lie in [0, num_tokens = ", num_tokens,
                    "], got ", skip_prefix);
  TORCH_CHECK(num_pieces >= 1, "kvlayout::copy_rows: num_pieces must be >= 1, got ", num_pieces);
  TORCH_CHECK(piece_bytes >= 1, "kvlayout::copy_rows: piece_bytes must be >= 1, got ",
              piece_bytes);
  TORCH_CHECK_VALUE(max_ctas >= 0,
                    "kvlayout::copy_rows: max_ctas must be >= 0 (0 = default), got ", max_ctas);
  TORCH_CHECK(src_segments.size() % 2 == 0,
              "kvlayout::copy_rows: src_segments must hold [tensor_index, byte_offset] pairs, "
              "got ", src_segments.size(), " values");
  TORCH_CHECK(dst_segments.size() % 2 == 0,
              "kvlayout::copy_rows: dst_segments must hold [tensor_index, byte_offset] pairs, "
              "got ", dst_segments.size(), " values");
  TORCH_CHECK(src_segments.size() == dst_segments.size(),
              "kvlayout::copy_rows: src_segments and dst_segments must describe the same number "
              "of segments, got ", src_segments.size() / 2, " and ", dst_segments.size() / 2);
  p.num_tokens = num_tokens;
  p.skip_prefix = skip_prefix;
  p.num_segments = static_cast<int64_t>(src_segments.size()) / 2;
  p.src_geom = parse_geometry(src_geometry, "src_geometry");
  p.dst_geom = parse_geometry(dst_geometry, "dst_geometry");
  p.src_slots = parse_index(src_slots, num_tokens, "src_slots", "num_tokens");
  p.dst_slots = parse_index(dst_slots, num_tokens, "dst_slots", "num_tokens");

  parse_segments(src, src_segments, "src", "src_segments", p.src_geom, num_pieces, piece_bytes,
                 "src_geometry", p.src_tensor, p.src_offset);
  parse_segments(dst, dst_segments, "dst", "dst_segments", p.dst_geom, num_pieces, piece_bytes,
                 "dst_geometry", p.dst_tensor, p.dst_offset);

  // Merge back-to-back pieces into one (same bytes, fewer, larger copies).
  if (pieces_contiguous(p.src_geom, num_pieces, piece_bytes) &&
      pieces_contiguous(p.dst_geom, num_pieces, piece_bytes)) {
    p.piece_bytes = checked_mul(num_pieces, piece_bytes, "num_pieces * piece_bytes");
    p.num_pieces = 1;
    p.src_geom.stride_piece = p.piece_bytes;
    p.dst_geom.stride_piece = p.piece_bytes;
  } else {
    p.num_pieces = num_pieces;
    p.piece_bytes = piece_bytes;
  }
  if (!p.empty()) check_copy_aliasing(src, dst, src_slots, dst_slots, p);
  return p;
}

void check_slots_in_range_on_host(const CopyPlan& p) {
  if (p.empty()) return;
  const bool src_identity = p.src_slots.data == nullptr;
  const bool dst_identity = p.dst_slots.data == nullptr;
  for (int64_t t = p.skip_prefix; t < p.num_tokens; ++t) {
    const int64_t s = p.src_slots.load(t);
    const int64_t d = p.dst_slots.load(t);
    if (s < 0 || d < 0) continue;
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", src_identity, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", dst_identity, t, d, p.dst_geom.num_slots);
  }
}

void read_slots_once(CopyPlan& p, HostSlots& copy, bool unique_dst) {
  if (p.empty()) return;
  const bool src_identity = p.src_slots.data == nullptr;
  const bool dst_identity = p.dst_slots.data == nullptr;
  if (!src_identity) copy.src.assign(p.num_tokens, -1);
  if (!dst_identity) copy.dst.assign(p.num_tokens, -1);
  const bool check_unique = unique_dst && !dst_identity;
  SlotSet seen(check_unique ? p.num_tokens - p.skip_prefix : 0);
  for (int64_t t = p.skip_prefix; t < p.num_tokens; ++t) {
    const int64_t s = p.src_slots.load(t);  // the one load of each slot
    const int64_t d = p.dst_slots.load(t);
    if (!src_identity) copy.src[t] = s;
    if (!dst_identity) copy.dst[t] = d;
    if (s < 0 || d < 0) continue;
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", src_identity, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", dst_identity, t, d, p.dst_geom.num_slots);
    if (check_unique) {
      const int64_t first = seen.insert(d, t);
      TORCH_CHECK_VALUE(first < 0, "kvlayout: dst_slots repeats slot ", d, " (dst_slots[", first,
                        "] and dst_slots[", t, "]): a destination slot may be written by one "
                        "token only");
    }
  }
  if (!src_identity) p.src_slots = SlotArray{copy.src.data(), 1, 8, 0};
  if (!dst_identity) p.dst_slots = SlotArray{copy.dst.data(), 1, 8, 0};
}

void validate_slots_on_host(const CopyPlan& p, const std::optional<at::Tensor>& src_slots,
                            const std::optional<at::Tensor>& dst_slots) {
  if (p.empty()) return;
  CopyPlan q = p;
  at::Tensor hs, hd;  // host copies, alive while q points at them
  if (q.src_slots.data != nullptr) {
    hs = src_slots->to(at::kCPU, at::kLong).contiguous();
    q.src_slots = SlotArray{hs.data_ptr(), 1, 8, 0};
  }
  if (q.dst_slots.data != nullptr) {
    hd = dst_slots->to(at::kCPU, at::kLong).contiguous();
    q.dst_slots = SlotArray{hd.data_ptr(), 1, 8, 0};
  }
  HostSlots copy;
  read_slots_once(q, copy, /*unique_dst=*/true);
}

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
  p.old_positions = parse_index(old_positions, T, "old_positions", "key.size(0)");
  p.new_positions = parse_index(new_positions, T, "new_positions", "key.size(0)");
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

int widest_vector_bytes(const CopyPlan& plan, const SegmentBases& bases) {
  uint64_t align = static_cast<uint64_t>(plan.piece_bytes);
  auto strides_in_use = [&](const RowGeometry& g) {
    if (g.num_slots > g.page_size) align |= static_cast<uint64_t>(g.stride_page);
    if (g.page_size > 1 && g.num_slots > 1) align |= static_cast<uint64_t>(g.stride_in_page);
    if (plan.num_pieces > 1) align |= static_cast<uint64_t>(g.stride_piece);
  };
  strides_in_use(plan.src_geom);
  strides_in_use(plan.dst_geom);
  for (const char* p : bases.src) align |= reinterpret_cast<uintptr_t>(p);
  for (const char* p : bases.dst) align |= reinterpret_cast<uintptr_t>(p);
  int vec = 16;
  while (vec > 1 && (align % static_cast<uint64_t>(vec)) != 0) vec /= 2;
  return vec;
}

void check_status_tensor(const at::Tensor& status, c10::Device device) {
  TORCH_CHECK(status.defined() && status.scalar_type() == at::kLong &&
                  status.numel() >= kStatusNumel && status.is_contiguous(),
              "kvlayout: status must be a contiguous int64 tensor of at least ", kStatusNumel,
              " elements (use kvlayout.ops._native.status_tensor(device))");
  TORCH_CHECK(status.device() == device, "kvlayout: status is on ", status.device(),
              " but the operation runs on ", device,
              " (use kvlayout.ops._native.status_tensor(device))");
}

std::optional<c10::Device> first_device_of_type(c10::DeviceType type, at::TensorList dst,
                                                at::TensorList src) {
  for (const at::TensorList side : {dst, src})
    for (const at::Tensor& t : side)
      if (t.defined() && t.device().type() == type) return t.device();
  return std::nullopt;
}

c10::Device copy_rows_device(c10::DeviceType type, at::TensorList src, at::TensorList dst,
                             const std::optional<at::Tensor>& src_slots,
                             const std::optional<at::Tensor>& dst_slots,
                             const at::Tensor& status) {
  if (const auto dev = first_device_of_type(type, dst, src)) return *dev;
  for (const auto* slots : {&src_slots, &dst_slots})
    if (slots->has_value() && (*slots)->defined() && (*slots)->device().type() == type)
      return (*slots)->device();
  TORCH_CHECK(status.defined() && status.device().type() == type, "kvlayout::copy_rows: no ",
              c10::DeviceTypeName(type), " tensor among the arguments");
  return status.device();
}

}  // namespace kvlayout
