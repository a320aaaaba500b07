// The copy_rows launcher of every device backend, written once and templated
// on a small backend policy: the launch bound to tensors that prepared copy
// programs run (RowsLaunch, a BoundLaunch; see program.h), its factory, and
// the raw op kvlayout::copy_rows (copy_rows_impl). A backend's files
// (cuda/copy_rows*.cu and .cuh, sycl/copy_rows.sycl) keep only its kernel, its policy,
// the factory registration and TORCH_LIBRARY_IMPL. This header needs ATen, so
// it lives beside program.h, not in the torch-free include/kvlayout/.
//
// What a launch does, for every backend: resolve the segment bases once
// (segment_bases: kernel-visible addresses, and the widest vector width every
// base, stride and width allows), split the segments into launches of at
// most kMaxSegmentsPerLaunch (only the first records slot errors), and per
// run fill in the slot addresses and token counts, pick the table size, the
// vector width (16/8/4/2/1) and the variant (kHostUnroll when either side is
// host memory, else kDeviceUnroll), and launch.
//
// The policy `Backend` provides (cuda::Backend and xpu::Backend in the
// backends' common headers hold the device part):
//   kDeviceType            c10::DeviceType of the backend's tensors
//   Guard                  device guard, constructed from a c10::Device
//   Stream, stream(dev)    the type of, and the current, stream of `dev`
//                          (passed by value: cudaStream_t, sycl::queue&)
//   device_address(t, dev, name, index) -> char*
//                          the address a kernel on `dev` sees for tensor
//                          `index` of side `name` (its own, or a pinned host
//                          tensor's device alias); raises for a tensor the
//                          kernel cannot reach
//   index_address(slots, dev, name) -> const void*
//                          the same for an optional slot tensor (nullptr: none)
//   host_alias_valid(t, dev, alias) -> bool
//                          whether host tensor `t`, bound at device alias
//                          `alias`, still is pinned there (still_valid)
//   supports_dependent_launch(dev) -> bool
//                          whether RunArgs::dependent_launch can be honoured
//   LaunchOrder            made from the stream and RunArgs::early_loads before
//                          the launches of a dependent run (they are made
//                          while it lives): may_load_early() says whether it
//                          can tell what precedes a launch on the stream,
//                          early_start(reads, writes) how a launch reading
//                          and writing these kernel-visible byte ranges may
//                          start (EarlyStart: whether it may issue loads
//                          before the previous kernels end, none of which
//                          still running writes `reads`), launched(writes,
//                          start) records each launch made (NoLaunchOrder:
//                          never early)
//   kMaxSegmentsPerLaunch  segments of one launch's table
//   kFewSegments           a smaller table for launches of at most that many
//                          segments (its parameter block costs less host time
//                          per launch); 0: one table size only
//   kMaxParamBytes         the kernel parameter limit the largest table obeys
//   (its kernel hands copy_rows_walk a vector load/store: VecOf<VEC, ...> with
//   the backend's instructions, picked by params.a.cache_hints where the
//   backend has a choice; run() sets the hints: host_cache_hints() for a
//   launch that touches host memory)
//   launch<VEC, UNROLL>(params, max_ctas, host, dependent, early_loads, stream)
//                          one kernel launch of CopyRowsParams<N>, N one of
//                          the table sizes: the grid from max_ctas (0: the
//                          backend's default for the host or device variant)
//                          and the launch's items; early_loads (only for a
//                          dependent launch of the host variant that
//                          LaunchOrder allowed): loads may precede the wait.
//                          params.a.next_start (set here) says when the next
//                          kernel of the stream may start
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "copy_plan.h"
#include "device_args.h"
#include "slots.h"
#include "kvlayout/copy_rows_kernel.h"
#include "program.h"

namespace kvlayout {

// The LaunchOrder of a backend whose launches never overlap the previous kernel.
struct NoLaunchOrder {
  template <class Stream>
  NoLaunchOrder(const Stream&, bool) {}
  bool may_load_early() const { return false; }
  EarlyStart early_start(const std::vector<ByteRange>&, const std::vector<ByteRange>&) const {
    return EarlyStart::kNone;
  }
  void launched(const std::vector<ByteRange>&, EarlyStart) {}
};

// A launch bound to tensors: kernel-visible addresses, vector width and the
// segment bases of each <= kMaxSegmentsPerLaunch chunk are resolved once; a
// run fills in the slots and token counts and launches.
template <class Backend>
class RowsLaunch final : public BoundLaunch {
  static_assert(sizeof(CopyRowsParams<Backend::kMaxSegmentsPerLaunch>) <= Backend::kMaxParamBytes,
                "copy_rows parameters exceed the backend's kernel parameter limit");
  static_assert(Backend::kFewSegments < Backend::kMaxSegmentsPerLaunch,
                "the small segment table must be smaller than the large one");
  static_assert(Backend::kMaxSegmentsPerLaunch <= kMaxWalkCount,
                "the walk keeps a launch's segment index in 32 bits");

 public:
  using Stream = typename Backend::Stream;

  RowsLaunch(const CopyPlan& plan, at::TensorList src, at::TensorList dst, c10::Device dev,
             const at::Tensor& status)
      : dev_(dev), dependent_ok_(Backend::supports_dependent_launch(dev)) {
    check_status_tensor(status, dev);
    // Kernel-visible addresses of every tensor (pinned host memory through its
    // device alias, which still_valid checks again on reuse).
    SegmentBases bases =
        segment_bases(plan, src, dst, [&](const at::Tensor& t, bool is_src, int64_t i) {
          char* address = Backend::device_address(t, dev, is_src ? "src" : "dst", i);
          if (t.device().type() != Backend::kDeviceType)
            (is_src ? host_src_ : host_dst_).emplace_back(i, address);
          (is_src ? reads_ : writes_).push_back(kernel_range(t, address));
          return address;
        });
    touches_host_ = !host_src_.empty() || !host_dst_.empty();
    vec_ = bases.vec_bytes;
    src_bases_ = std::move(bases.src);
    dst_bases_ = std::move(bases.dst);
    for (int64_t first = 0; first < plan.num_segments; first += Backend::kMaxSegmentsPerLaunch) {
      CopyRowsArgs a{};
      a.src_geom = plan.src_geom;
      a.dst_geom = plan.dst_geom;
      a.num_segments =
          std::min<int64_t>(Backend::kMaxSegmentsPerLaunch, plan.num_segments - first);
      a.status = status.data_ptr<int64_t>();
      prepare_copy_rows_args(a, plan.num_pieces, plan.piece_bytes / vec_);
      chunks_.push_back({a, first});
    }
  }

  void run(const CopyPlan& plan, const SlotArray& src_slots, const SlotArray& dst_slots,
           const RunArgs& args, const RecordedBefore& before) const override {
    const typename Backend::Guard guard(dev_);
    if (args.validate) {
      validate_slots_on_host(plan_for_run(plan, src_slots, dst_slots, args), args.src_slots,
                             args.dst_slots);
    }
    SlotArray ss = src_slots, ds = dst_slots;
    ss.data = Backend::index_address(args.src_slots, dev_, "src_slots");
    ds.data = Backend::index_address(args.dst_slots, dev_, "dst_slots");
    const bool dependent = args.dependent_launch && dependent_ok_;
    Stream stream = Backend::stream(dev_);
    // A dependent run records its launches in the stream's order; where that
    // order tells what precedes a launch, a host-variant launch may load
    // early. What this run reads: the bound sources and the slots.
    std::optional<typename Backend::LaunchOrder> order;
    std::vector<ByteRange> reads;
    if (dependent) order.emplace(stream, args.early_loads);
    const bool may_load_early = touches_host_ && order.has_value() && order->may_load_early();
    if (may_load_early) {
      reads = reads_;
      if (!ss.identity) reads.push_back(kernel_range(*args.src_slots, ss.data));
      if (!ds.identity) reads.push_back(kernel_range(*args.dst_slots, ds.data));
    }
    for (const Chunk& chunk : chunks_) {
      CopyRowsArgs a = chunk.args;  // a bound launch may run on several threads at once
      a.src_slots = ss;
      a.dst_slots = ds;
      a.skip_prefix = args.skip_prefix;
      a.tokens = args.num_tokens - args.skip_prefix;
      a.cache_hints = touches_host_ ? host_cache_hints() : kStreamingHints;
      // only the first launch of a split call records (the others read the same slots)
      a.src_recorded_from = chunk.first == 0 ? before.src_from : 0;
      a.dst_recorded_from = chunk.first == 0 ? before.dst_from : 0;
      const EarlyStart start =
          may_load_early ? order->early_start(reads, writes_) : EarlyStart::kNone;
      // A launch without programmatic dependent launch is an ordinary kernel
      // to the launches after it: it never lets them start before it ends.
      a.next_start = !dependent                          ? kNextAfterEnd
                     : start == EarlyStart::kLoadsAndNext ? kNextAtOnce
                                                          : kNextAfterWait;
      if (start != EarlyStart::kNone) count_early_load_launch();
      launch_chunk(a, chunk.first, args.max_ctas, dependent, start != EarlyStart::kNone, stream);
      if (order.has_value()) order->launched(writes_, start);
    }
  }

  // A host tensor at the same address must still be pinned with the same
  // device alias (it may have been freed and its address reused).
  bool still_valid(at::TensorList src, at::TensorList dst) const override {
    for (const auto& [i, alias] : host_src_)
      if (!Backend::host_alias_valid(src[i], dev_, alias)) return false;
    for (const auto& [j, alias] : host_dst_)
      if (!Backend::host_alias_valid(dst[j], dev_, alias)) return false;
    return true;
  }

 private:
  // One launch with the smallest segment table that holds a.num_segments.
  void launch_chunk(const CopyRowsArgs& a, int64_t first, int64_t max_ctas, bool dependent,
                    bool early, Stream stream) const {
    if constexpr (Backend::kFewSegments > 0) {
      if (a.num_segments <= Backend::kFewSegments) {
        launch_table<Backend::kFewSegments>(a, first, max_ctas, dependent, early, stream);
        return;
      }
    }
    launch_table<Backend::kMaxSegmentsPerLaunch>(a, first, max_ctas, dependent, early, stream);
  }

  // One launch with a segment table of N entries: `a` and segments
  // [first, first + a.num_segments) of the bound bases.
  template <int N>
  void launch_table(const CopyRowsArgs& a, int64_t first, int64_t max_ctas, bool dependent,
                    bool early, Stream stream) const {
    CopyRowsParams<N> p;
    p.a = a;
    std::copy_n(src_bases_.begin() + first, a.num_segments, p.src_base);
    std::copy_n(dst_bases_.begin() + first, a.num_segments, p.dst_base);
    switch (vec_) {
      case 16: launch_variant<16>(p, max_ctas, dependent, early, stream); break;
      case 8: launch_variant<8>(p, max_ctas, dependent, early, stream); break;
      case 4: launch_variant<4>(p, max_ctas, dependent, early, stream); break;
      case 2: launch_variant<2>(p, max_ctas, dependent, early, stream); break;
      default: launch_variant<1>(p, max_ctas, dependent, early, stream); break;
    }
  }

  // The host variant when either side is host memory, else the device variant.
  template <int VEC, class P>
  void launch_variant(const P& p, int64_t max_ctas, bool dependent, bool early,
                      Stream stream) const {
    if (touches_host_)
      Backend::template launch<VEC, kHostUnroll>(p, max_ctas, true, dependent, early, stream);
    else
      Backend::template launch<VEC, kDeviceUnroll>(p, max_ctas, false, dependent, false, stream);
  }

  // The bytes tensor `t` spans, at its kernel-visible address `address`.
  static ByteRange kernel_range(const at::Tensor& t, const void* address) {
    const ByteRange r = byte_range(t);
    const uintptr_t at = reinterpret_cast<uintptr_t>(address);
    const uintptr_t data = reinterpret_cast<uintptr_t>(t.data_ptr());
    return r.begin < r.end ? ByteRange{r.begin - data + at, r.end - data + at} : ByteRange{};
  }

  c10::Device dev_;
  // Launches of at most kMaxSegmentsPerLaunch segments each: their slot-free
  // arguments and the index of their first segment in src_bases_/dst_bases_.
  struct Chunk {
    CopyRowsArgs args;
    int64_t first;
  };
  std::vector<Chunk> chunks_;
  std::vector<const char*> src_bases_;
  std::vector<char*> dst_bases_;
  std::vector<std::pair<int64_t, const char*>> host_src_, host_dst_;
  // Kernel-visible bytes of the bound tensors (whole tensors: a coarse but
  // sure answer to what a launch may read or write).
  std::vector<ByteRange> reads_, writes_;
  bool touches_host_ = false;
  bool dependent_ok_ = false;  // the device supports programmatic dependent launch
  int vec_ = 16;
};

// The backend's BoundLaunchFactory (register_bound_launch_factory).
template <class Backend>
std::unique_ptr<BoundLaunch> make_rows_launch(const CopyPlan& plan, at::TensorList src,
                                              at::TensorList dst, c10::Device device,
                                              const at::Tensor& status) {
  const typename Backend::Guard guard(device);
  return std::make_unique<RowsLaunch<Backend>>(plan, src, dst, device, status);
}

// kvlayout::copy_rows on the backend: no host synchronisation (unless
// `validate`) and no allocation, so the op can be captured in a graph.
template <class Backend>
void copy_rows_impl(at::TensorList src, at::TensorList dst,
                    const std::optional<at::Tensor>& src_slots,
                    const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                    int64_t skip_prefix, c10::IntArrayRef src_segments,
                    c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                    c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes,
                    int64_t max_ctas, const at::Tensor& status, bool validate) {
  const CopyPlan plan =
      plan_copy_rows(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                     dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, max_ctas);
  const c10::Device dev =
      copy_rows_device(Backend::kDeviceType, src, dst, src_slots, dst_slots, status);
  const typename Backend::Guard guard(dev);
  check_status_tensor(status, dev);
  if (plan.empty()) return;
  const RunArgs args{src_slots, dst_slots, plan.num_tokens, plan.skip_prefix, max_ctas, validate};
  RowsLaunch<Backend>(plan, src, dst, dev, status)
      .run(plan, plan.src_slots, plan.dst_slots, args, RecordedBefore{});
}

}  // namespace kvlayout
