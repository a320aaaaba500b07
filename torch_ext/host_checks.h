// Host-side argument validation shared by every backend of kvlayout's ops.
//
// plan_copy_rows() parses and checks everything that does not depend on the
// values of the slot tensors, and proves that every address a valid slot can
// produce lies inside the storage of the tensor it is based on. Together with
// the slot range check (on the host for CPU, in the kernel for devices) no
// index value can make a kernel touch memory outside the given tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kvlayout/address.h"
#include "kvlayout/rope_kernel.h"

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
  // After merging back-to-back pieces (both sides stride_piece == piece_bytes)
  // into one: num_pieces == 1 means every row is one contiguous block.
  int64_t num_pieces = 0;
  int64_t piece_bytes = 0;
  SlotArray src_slots{nullptr, 1, 8, 0};
  SlotArray dst_slots{nullptr, 1, 8, 0};

  bool empty() const { return num_segments == 0 || skip_prefix >= num_tokens; }
  int64_t row_bytes() const { return num_pieces * piece_bytes; }
};

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

 private:
  struct Item {
    ByteRange range;
    int64_t index;
    c10::Device device;
  };
  std::vector<Item> items_;
  std::vector<uintptr_t> max_end_;
};

// A 1-D int32/int64 index tensor of `length` entries as a SlotArray (none:
// the identity); errors name the argument and the length's name.
SlotArray parse_index(const std::optional<at::Tensor>& t, int64_t length, const char* name,
                      const char* length_name);

// Raises ValueError when a slot tensor overlaps a written tensor.
void check_slots_not_written(const WrittenRanges& written, const std::optional<at::Tensor>& slots,
                             const char* name, const char* op);

// Validates the arguments of kvlayout::copy_rows (all but slot values and
// device placement) and returns the normalised plan. Slot tensors are read
// through SlotArray (data pointer + element stride); any stride is accepted.
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

// Reads the slot tensors on the host (they must be host-readable) and raises
// IndexError naming the argument, token, value and bound for the first token
// whose slot is >= the side's slot count. Negative slots are fine. A walk
// that reads the slots again (for_each_block) checks what it reads itself.
void check_slots_in_range_on_host(const CopyPlan& plan);

// Slot values read once on the host into memory of the op's own: the values
// that are checked are the values that are used, whatever happens to the
// slot tensors meanwhile (another thread, or a slot tensor that aliases a
// destination some other way than the checks can see).
struct HostSlots {
  std::vector<int64_t> src, dst;  // [num_tokens]; the skipped prefix holds -1
};

// Reads every slot of tokens [skip_prefix, num_tokens) exactly once into
// `copy`, points the plan's slot arrays at the copies (identity sides stay
// identity), and checks the copies: every slot < the side's slot count
// (IndexError naming the argument, token, value and bound) and, when
// `unique_dst`, no destination slot written by two tokens (ValueError naming
// both tokens). Linear time. Slots must be host-readable.
void read_slots_once(CopyPlan& plan, HostSlots& copy, bool unique_dst);

// validate=True of device backends: copies the slot tensors to the host (a
// synchronisation) and checks the copies as read_slots_once does (range and
// repeated destination slots), before anything is launched.
void validate_slots_on_host(const CopyPlan& plan, const std::optional<at::Tensor>& src_slots,
                            const std::optional<at::Tensor>& dst_slots);

// Raises IndexError for slot `value` of token t of `name` (src_slots or
// dst_slots; `identity` when the side has no slot tensor).
[[noreturn]] void raise_slot_out_of_range(const char* name, bool identity, int64_t t,
                                          int64_t value, int64_t bound);

// Walks tokens [begin, end) of a plan and calls copy(segment, src_offset,
// dst_offset, bytes) for each contiguous block to move, offsets from the
// segment's base. Contiguous rows (num_pieces == 1) of consecutive tokens that
// are adjacent on both sides are coalesced into one block (address.h run
// detection); otherwise every piece is one block. Tokens with a negative slot
// are skipped. Slots must be host-readable. Each slot is loaded once and the
// loaded value is range-checked before it is used (run_length checks the
// tokens it adds), so slots rewritten after an earlier check raise
// IndexError instead of addressing memory outside the tensors.
template <class Copy>
void for_each_block(const CopyPlan& p, int64_t begin, int64_t end, const Copy& copy) {
  const int64_t row_bytes = p.row_bytes();
  int64_t t = begin;
  while (t < end) {
    const int64_t s = p.src_slots.load(t);
    const int64_t d = p.dst_slots.load(t);
    if (s < 0 || d < 0) {
      ++t;
      continue;
    }
    if (s >= p.src_geom.num_slots)
      raise_slot_out_of_range("src_slots", p.src_slots.data == nullptr, t, s, p.src_geom.num_slots);
    if (d >= p.dst_geom.num_slots)
      raise_slot_out_of_range("dst_slots", p.dst_slots.data == nullptr, t, d, p.dst_geom.num_slots);
    if (p.num_pieces == 1) {
      const int64_t n =
          run_length(p.src_slots, p.dst_slots, p.src_geom, p.dst_geom, t, end, s, d, row_bytes);
      for (int64_t g = 0; g < p.num_segments; ++g)
        copy(g, row_offset(p.src_geom, s), row_offset(p.dst_geom, d), n * row_bytes);
      t += n;
    } else {
      for (int64_t g = 0; g < p.num_segments; ++g)
        for (int64_t h = 0; h < p.num_pieces; ++h)
          copy(g, piece_offset(p.src_geom, s, h), piece_offset(p.dst_geom, d, h), p.piece_bytes);
      ++t;
    }
  }
}

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

// Validates the status tensor of device backends: int64, >= kStatusNumel
// elements, contiguous, on `device`.
void check_status_tensor(const at::Tensor& status, c10::Device device);

// The device of the first tensor of device type `type` among dst, then src:
// the device a copy between them runs on (nullopt: none is of that type).
std::optional<c10::Device> first_device_of_type(c10::DeviceType type, at::TensorList dst,
                                                at::TensorList src);

// The device a backend of device type `type` runs kvlayout::copy_rows on: the
// first tensor of that type among dst, src, src_slots, dst_slots, status
// (the others may be pinned host tensors). Raises when there is none.
c10::Device copy_rows_device(c10::DeviceType type, at::TensorList src, at::TensorList dst,
                             const std::optional<at::Tensor>& src_slots,
                             const std::optional<at::Tensor>& dst_slots,
                             const at::Tensor& status);

// Where a device kernel finds each segment's rows, and the vector width it
// moves them in: the widest of 16, 8, 4, 2, 1 bytes dividing the piece size,
// every stride the launch uses and every segment base.
struct SegmentBases {
  std::vector<const char*> src;
  std::vector<char*> dst;
  int vec_bytes = 16;
};

int widest_vector_bytes(const CopyPlan& plan, const SegmentBases& bases);

// The segment bases of `plan` on a device backend. address(tensor, is_src,
// index) is the address the kernel sees for tensor `index` of src or dst
// (a device pointer, or a pinned host tensor's device alias); it is called
// once per tensor a segment uses.
template <class Address>
SegmentBases segment_bases(const CopyPlan& plan, at::TensorList src, at::TensorList dst,
                           const Address& address) {
  std::vector<const char*> src_ptr(src.size(), nullptr);
  std::vector<char*> dst_ptr(dst.size(), nullptr);
  std::vector<bool> src_seen(src.size(), false), dst_seen(dst.size(), false);
  SegmentBases b;
  for (int64_t g = 0; g < plan.num_segments; ++g) {
    const int64_t si = plan.src_tensor[g], di = plan.dst_tensor[g];
    if (!src_seen[si]) {
      src_ptr[si] = address(src[si], true, si);
      src_seen[si] = true;
    }
    if (!dst_seen[di]) {
      dst_ptr[di] = address(dst[di], false, di);
      dst_seen[di] = true;
    }
    b.src.push_back(src_ptr[si] + plan.src_offset[g]);
    b.dst.push_back(dst_ptr[di] + plan.dst_offset[g]);
  }
  b.vec_bytes = widest_vector_bytes(plan, b);
  return b;
}

}  // namespace kvlayout
