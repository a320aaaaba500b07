// A copy, resolved to bytes: the form every backend runs, and the checks that
// make it safe.
//
// A CopyPlan is one launch of the row mover: per segment a (tensor, byte
// offset) base on each side, one RowGeometry per side, and the pieces of a
// row. check_copy_plan() proves that every address a valid slot can produce
// lies inside the storage of the tensor it is based on, and that the copy
// reads no byte it writes and writes no row twice. Together with the slot
// range check (slots.h: on the host for CPU, in the kernel for devices) no
// index value can make a kernel touch memory outside the given tensors.
//
// Two producers fill a CopyPlan: a copy program bound to tensors (program.h,
// the library's one route) and the raw kvlayout::copy_rows op
// (plan_copy_rows, the op's flat argument list).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kvlayout/address.h"

namespace kvlayout {

struct CopyPlan {
  int64_t num_tokens = 0;
  int64_t skip_prefix = 0;
  int64_t num_segments = 0;
  // One entry per segment: which tensor of src/dst and the byte offset from
  // that tensor's data pointer.
  std::vector<int64_t> src_tensor, src_offset, dst_tensor, dst_offset;
  RowGeometry src_geom{};
  RowGeometry dst_geom{};
  // After check_copy_plan merged back-to-back pieces (both sides stride_piece
  // == piece_bytes) into one: num_pieces == 1 means every row is one
  // contiguous block.
  int64_t num_pieces = 0;
  int64_t piece_bytes = 0;
  SlotArray src_slots = SlotArray::identity_slots();
  SlotArray dst_slots = SlotArray::identity_slots();

  bool empty() const { return num_segments == 0 || skip_prefix >= num_tokens; }
  int64_t row_bytes() const { return num_pieces * piece_bytes; }
};

// Checks a plan whose segments, geometries and pieces are filled in against
// its tensors (see the top of this file), sets num_segments and merges
// back-to-back pieces. `src_slots`/`dst_slots`: the slot tensors the plan's
// runs read (nullopt at bind time), which no written tensor may overlap.
void check_copy_plan(CopyPlan& p, at::TensorList src, at::TensorList dst,
                     const std::optional<at::Tensor>& src_slots,
                     const std::optional<at::Tensor>& dst_slots);

// The raw kvlayout::copy_rows arguments as a checked plan (its slot arrays
// parsed from the slot tensors).
//
// The op's argument list is written out once more in each implementation
// (cpu/copy_rows.cpp, copy_rows_launch.h for the device backends,
// cuda/copy_runs.cu), deliberately: torch.library binds each backend by that
// exact signature, and each passes the arguments straight here.
CopyPlan plan_copy_rows(at::TensorList src, at::TensorList dst,
                        const std::optional<at::Tensor>& src_slots,
                        const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                        int64_t skip_prefix, c10::IntArrayRef src_segments,
                        c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                        c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes,
                        int64_t max_ctas);

// Bytes [begin, end) a tensor's elements can occupy (empty for no elements).
struct ByteRange {
  uintptr_t begin = 0, end = 0;
};
ByteRange byte_range(const at::Tensor& t);
bool ranges_meet(const ByteRange& a, const ByteRange& b);

// The address ranges of the tensors an op writes. Address ranges, not
// storage identity: two storages over one buffer (torch.from_numpy of one
// array twice, torch.frombuffer) are caught too.
class WrittenRanges {
 public:
  void add(const at::Tensor& t, int64_t index);  // then finish() before find()
  void finish();
  // Index of a written tensor whose range meets `t`'s (on t's device), or -1.
  int64_t find(const at::Tensor& t) const;
  // Two distinct written tensors (indices into `tensors`, the list the
  // indices name; smaller first) that may share a byte, or {-1, -1}. The same
  // view given twice is not counted; interleaved views of one buffer that
  // provably share no byte (planes of one page) are not either.
  std::pair<int64_t, int64_t> first_shared_bytes(at::TensorList tensors) const;

 private:
  struct Item {
    ByteRange range;
    int64_t index;
    c10::Device device;
  };
  std::vector<Item> items_;
  std::vector<uintptr_t> max_end_;
};

// Raises ValueError naming dst[i] and dst[j] when two distinct written
// tensors may share bytes (one address would be written through both, by two
// (layer, slot) pairs: last writer wins on the CPU, a race on a device).
void check_written_disjoint(const WrittenRanges& written, at::TensorList dst, const char* op);

// ValueError when num_tokens tokens of bytes_per_token bytes each overflow
// the walk's 64-bit item count.
void check_run_size(int64_t num_tokens, int64_t bytes_per_token);

// Raises ValueError when a slot tensor overlaps a written tensor.
void check_slots_not_written(const WrittenRanges& written, const std::optional<at::Tensor>& slots,
                             const char* name, const char* op);

// Written tensors: no element may be written through two indices (torch
// refuses in-place writes into expanded tensors for the same reason);
// `name`, or `name[index]` for index >= 0, names it in the error.
void check_no_internal_overlap(const at::Tensor& t, const char* op, const char* name,
                               int64_t index);

}  // namespace kvlayout
