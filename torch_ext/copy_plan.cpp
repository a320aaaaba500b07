// CopyPlan checks: every address a valid slot can produce lies inside the
// storage of the tensor it is based on, and no written byte is also read or
// written twice. See copy_plan.h.
#include "copy_plan.h"

#include "slots.h"
#include "kvlayout/copy_rows_kernel.h"

#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
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
  return RowGeometry{g[0], g[1], g[2], g[3], g[4]};
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

// Every segment of one side: its tensor exists and the bytes the geometry can
// address from the segment's base lie inside that tensor's storage.
void check_segments_in_storage(at::TensorList tensors, const std::vector<int64_t>& tensor_of,
                               const std::vector<int64_t>& offset_of, const RowGeometry& g,
                               int64_t num_pieces, int64_t piece_bytes, const char* list_name,
                               const char* seg_name, const char* geom_name) {
  const int64_t extent = addressable_extent(g, num_pieces, piece_bytes, geom_name);
  for (size_t s = 0; s < tensor_of.size(); ++s) {
    const int64_t ti = tensor_of[s];
    const int64_t off = offset_of[s];
    TORCH_CHECK(ti >= 0 && ti < static_cast<int64_t>(tensors.size()), "kvlayout: ", seg_name, "[",
                2 * s, "] = ", ti, " is not a valid index into ", list_name, " (", tensors.size(),
                " tensors)");
    TORCH_CHECK(off >= 0, "kvlayout: ", seg_name, "[", 2 * s + 1, "] (byte offset of segment ", s,
                ") must be >= 0, got ", off);
    const at::Tensor& t = tensors[ti];
    TORCH_CHECK(t.defined(), "kvlayout: ", list_name, "[", ti, "] is undefined");
    if (extent == 0) continue;
    TORCH_CHECK(t.has_storage(), "kvlayout: ", list_name, "[", ti, "] has no storage");
    const int64_t storage_bytes = static_cast<int64_t>(t.storage().nbytes());
    const int64_t start = checked_add(t.storage_offset() * t.element_size(), off, seg_name);
    const int64_t end = checked_add(start, extent, seg_name);
    TORCH_CHECK(end <= storage_bytes, "kvlayout: segment ", s, " of ", list_name, " (",
                list_name, "[", ti, "] + ", off, " bytes) addresses bytes up to ", end,
                " of its storage, which holds only ", storage_bytes, " bytes (", geom_name,
                ": num_slots=", g.num_slots, " page_size=", g.page_size,
                " stride_page=", g.stride_page, " stride_in_page=", g.stride_in_page,
                " stride_piece=", g.stride_piece, "; num_pieces=", num_pieces,
                " piece_bytes=", piece_bytes, ")");
  }
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
  check_written_disjoint(written, dst, "kvlayout::copy_rows");
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

}  // namespace

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

namespace {

// A tensor's bytes as blocks of `block` bytes, `period` bytes apart, from
// `begin` on (period 0: one block): its outermost dimension (the largest
// stride among dimensions of more than one element) gives the period, the
// others span the block.
struct Blocks {
  uintptr_t begin = 0;
  int64_t period = 0;
  int64_t block = 0;
};

Blocks blocks_of(const at::Tensor& t) {
  const int64_t isz = static_cast<int64_t>(t.element_size());
  int64_t outer = -1;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1 && (outer < 0 || t.stride(d) > t.stride(outer))) outer = d;
  int64_t inner = 1;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (d != outer && t.size(d) > 1) inner += (t.size(d) - 1) * t.stride(d);
  return {reinterpret_cast<uintptr_t>(t.data_ptr()), outer < 0 ? 0 : t.stride(outer) * isz,
          inner * isz};
}

// Whether two tensors whose byte ranges meet still share no byte: the planes
// of one page, e.g. K = cache[:, 0] and V = cache[:, 1] of a [pages, 2, ...]
// cache, interleave blocks of one period. A sufficient test (false: not
// proven disjoint).
bool interleave_disjointly(const at::Tensor& a, const at::Tensor& b) {
  const Blocks x = blocks_of(a), y = blocks_of(b);
  if (x.period <= 0 || x.period != y.period || x.block > x.period || y.block > y.period)
    return false;
  const int64_t P = x.period;
  int64_t delta = static_cast<int64_t>(y.begin - x.begin) % P;  // y's blocks start delta past x's
  if (delta < 0) delta += P;
  return delta >= x.block && delta + y.block <= P;
}

// Whether two views of one element size, sizes and strides whose data starts
// `delta` bytes apart (b minus a) share a byte: whether some index difference
// k (|k_d| < size_d) brings an element of b within an element of one of a.
// Searched over the dimensions by decreasing stride, each step keeping only
// the k_d that the smaller dimensions can still make up for (one or two for
// the strides of real layouts); a search that grows past its budget answers
// "shared" (so a refusal, never a missed overlap).
bool same_shape_views_share_bytes(const at::Tensor& a, int64_t delta) {
  const int64_t isz = static_cast<int64_t>(a.element_size());
  struct Dim {
    int64_t size, stride;  // stride in bytes
  };
  std::vector<Dim> dims;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) > 1) dims.push_back({a.size(d), a.stride(d) * isz});
  std::sort(dims.begin(), dims.end(), [](const Dim& x, const Dim& y) { return x.stride > y.stride; });
  // reach[i]: the farthest dimensions i.. can move an index (in bytes)
  std::vector<int64_t> reach(dims.size() + 1, 0);
  for (size_t i = dims.size(); i-- > 0;)
    reach[i] = reach[i + 1] + (dims[i].size - 1) * dims[i].stride;
  int64_t budget = 1 << 12;
  const auto floor_div = [](int64_t n, int64_t d) { return n / d - ((n % d != 0) && ((n < 0) != (d < 0))); };
  std::function<bool(size_t, int64_t)> search = [&](size_t i, int64_t rest) -> bool {
    if (--budget < 0) return true;
    if (i == dims.size()) return rest > -isz && rest < isz;
    const Dim& dim = dims[i];
    const int64_t slack = reach[i + 1] + isz - 1;  // what the smaller dimensions (and an element) cover
    if (dim.stride == 0) return search(i + 1, rest);
    const int64_t lo = std::max(-(dim.size - 1), -floor_div(rest + slack, dim.stride));
    const int64_t hi = std::min(dim.size - 1, floor_div(slack - rest, dim.stride));
    for (int64_t k = lo; k <= hi; ++k)
      if (search(i + 1, rest + k * dim.stride)) return true;
    return false;
  };
  return search(0, delta);
}

bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.element_size() == b.element_size() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

// The same view: one tensor given twice (its segments are told apart by
// their bases, see check_copy_aliasing).
bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.element_size() == b.element_size() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

std::pair<int64_t, int64_t> WrittenRanges::first_shared_bytes(at::TensorList tensors) const {
  for (size_t k = 1; k < items_.size(); ++k) {
    // every earlier item whose end lies past this one's begin (prefix maximum)
    for (size_t m = k; m > 0 && max_end_[m - 1] > items_[k].range.begin; --m) {
      const Item& a = items_[m - 1];
      const Item& b = items_[k];
      if (a.index == b.index || !ranges_meet(a.range, b.range) || a.device != b.device) continue;
      const at::Tensor& ta = tensors[a.index];
      const at::Tensor& tb = tensors[b.index];
      if (same_view(ta, tb) || interleave_disjointly(ta, tb)) continue;
      if (same_geometry(ta, tb) &&
          !same_shape_views_share_bytes(ta, static_cast<int64_t>(reinterpret_cast<uintptr_t>(tb.data_ptr()) -
                                                                 reinterpret_cast<uintptr_t>(ta.data_ptr()))))
        continue;
      return {std::min(a.index, b.index), std::max(a.index, b.index)};
    }
  }
  return {-1, -1};
}

void check_written_disjoint(const WrittenRanges& written, at::TensorList dst, const char* op) {
  const auto [i, j] = written.first_shared_bytes(dst);
  TORCH_CHECK_VALUE(i < 0, op, ": dst[", i, "] and dst[", j,
                    "] overlap in memory (two destination tensors share bytes, so one address "
                    "would be written through both); the destination tensors must be disjoint");
}

void check_slots_not_written(const WrittenRanges& written, const std::optional<at::Tensor>& slots,
                             const char* name, const char* op) {
  if (!slots.has_value() || !slots->defined()) return;
  const int64_t j = written.find(*slots);
  TORCH_CHECK_VALUE(j < 0, op, ": ", name, " overlaps dst[", j,
                    "] in memory (the copy would rewrite the slots it reads); pass a slot tensor "
                    "of its own");
}

void check_run_size(int64_t num_tokens, int64_t bytes_per_token) {
  int64_t total = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(num_tokens, bytes_per_token, &total),
                    "kvlayout: num_tokens = ", num_tokens, " tokens of ", bytes_per_token,
                    " bytes each would move more than 2^63 bytes");
}

void check_geometry(const RowGeometry& r, const char* name) {
  TORCH_CHECK(r.num_slots >= 0, "kvlayout: ", name, " num_slots must be >= 0, got ",
              r.num_slots);
  TORCH_CHECK(r.page_size >= 1, "kvlayout: ", name, " page_size must be >= 1, got ",
              r.page_size);
  TORCH_CHECK(r.stride_page >= 0 && r.stride_in_page >= 0 && r.stride_piece >= 0,
              "kvlayout: ", name, " strides must be >= 0 bytes, got stride_page=",
              r.stride_page, " stride_in_page=", r.stride_in_page,
              " stride_piece=", r.stride_piece);
}

void check_copy_plan(CopyPlan& p, at::TensorList src, at::TensorList dst,
                     const std::optional<at::Tensor>& src_slots,
                     const std::optional<at::Tensor>& dst_slots) {
  TORCH_CHECK(p.num_pieces >= 1, "kvlayout: num_pieces must be >= 1, got ", p.num_pieces);
  TORCH_CHECK(p.piece_bytes >= 1, "kvlayout: piece_bytes must be >= 1, got ", p.piece_bytes);
  // The device walk counts a row's vectors in 32 bits (copy_rows_kernel.h):
  // checked here, once for every backend and route.
  const int64_t row_bytes = checked_mul(p.num_pieces, p.piece_bytes, "num_pieces * piece_bytes");
  TORCH_CHECK_VALUE(row_bytes <= kMaxWalkCount, "kvlayout: a row of num_pieces * piece_bytes = ",
                    p.num_pieces, " * ", p.piece_bytes, " = ", row_bytes,
                    " bytes is longer than the ", kMaxWalkCount,
                    " bytes a row may hold (piece_bytes: the bytes of one piece of a row)");
  check_geometry(p.src_geom, "src_geometry");
  check_geometry(p.dst_geom, "dst_geometry");
  p.num_segments = static_cast<int64_t>(p.src_tensor.size());
  TORCH_CHECK(p.dst_tensor.size() == p.src_tensor.size() &&
                  p.src_offset.size() == p.src_tensor.size() &&
                  p.dst_offset.size() == p.dst_tensor.size(),
              "kvlayout: a copy has ", p.src_tensor.size(), " source and ", p.dst_tensor.size(),
              " destination segments");
  check_segments_in_storage(src, p.src_tensor, p.src_offset, p.src_geom, p.num_pieces,
                            p.piece_bytes, "src", "src_segments", "src_geometry");
  check_segments_in_storage(dst, p.dst_tensor, p.dst_offset, p.dst_geom, p.num_pieces,
                            p.piece_bytes, "dst", "dst_segments", "dst_geometry");
  // Merge back-to-back pieces into one (same bytes, fewer, larger copies).
  if (p.num_pieces > 1 && pieces_contiguous(p.src_geom, p.num_pieces, p.piece_bytes) &&
      pieces_contiguous(p.dst_geom, p.num_pieces, p.piece_bytes)) {
    p.piece_bytes = checked_mul(p.num_pieces, p.piece_bytes, "num_pieces * piece_bytes");
    p.num_pieces = 1;
  }
  if (p.num_pieces == 1) {
    p.src_geom.stride_piece = p.piece_bytes;
    p.dst_geom.stride_piece = p.piece_bytes;
  }
  if (!p.empty()) check_copy_aliasing(src, dst, src_slots, dst_slots, p);
}

CopyPlan plan_copy_rows(at::TensorList src, at::TensorList dst,
                        const std::optional<at::Tensor>& src_slots,
                        const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                        int64_t skip_prefix, c10::IntArrayRef src_segments,
                        c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                        c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes,
                        int64_t max_ctas) {
  TORCH_CHECK_VALUE(num_tokens >= 0, "kvlayout::copy_rows: num_tokens must be >= 0, got ",
                    num_tokens);
  TORCH_CHECK_VALUE(skip_prefix >= 0 && skip_prefix <= num_tokens,
                    "kvlayout::copy_rows: skip_prefix must lie in [0, num_tokens = ", num_tokens,
                    "], got ", skip_prefix);
  TORCH_CHECK_VALUE(max_ctas >= 0,
                    "kvlayout::copy_rows: max_ctas must be >= 0 (0 = default), got ", max_ctas);
  for (const auto& [segs, name] : {std::make_pair(src_segments, "src_segments"),
                                   std::make_pair(dst_segments, "dst_segments")}) {
    TORCH_CHECK(segs.size() % 2 == 0, "kvlayout::copy_rows: ", name,
                " must hold [tensor_index, byte_offset] pairs, got ", segs.size(), " values");
  }
  TORCH_CHECK(src_segments.size() == dst_segments.size(),
              "kvlayout::copy_rows: src_segments and dst_segments must describe the same number "
              "of segments, got ", src_segments.size() / 2, " and ", dst_segments.size() / 2);
  CopyPlan p;
  p.num_tokens = num_tokens;
  p.skip_prefix = skip_prefix;
  p.src_geom = parse_geometry(src_geometry, "src_geometry");
  p.dst_geom = parse_geometry(dst_geometry, "dst_geometry");
  p.num_pieces = num_pieces;
  p.piece_bytes = piece_bytes;
  for (size_t k = 0; k + 1 < src_segments.size(); k += 2) {
    p.src_tensor.push_back(src_segments[k]);
    p.src_offset.push_back(src_segments[k + 1]);
    p.dst_tensor.push_back(dst_segments[k]);
    p.dst_offset.push_back(dst_segments[k + 1]);
  }
  p.src_slots = slot_array(src_slots, num_tokens, "src_slots", "num_tokens");
  p.dst_slots = slot_array(dst_slots, num_tokens, "dst_slots", "num_tokens");
  check_copy_plan(p, src, dst, src_slots, dst_slots);
  if (!p.empty())
    check_run_size(num_tokens, checked_mul(p.num_segments, p.row_bytes(), "a token's rows"));
  return p;
}

}  // namespace kvlayout
