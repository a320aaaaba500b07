// Copy programs: a transfer planned once, bound to tensors once, run many
// times, with any token count.
//
// A *copy program* is what the Python planner (ops/plan.py) makes of a choice
// (source layout, destination layout, layers, planes): a list of *steps*,
// each a list of launches. Step 0 moves every chosen layer; step 1 + i moves
// only the i-th chosen layer (a layer-wise pipeline calls it once per layer).
//
// A program is free of the token count and of every size and stride: it says
// where in each tensor the canonical axes are (TensorAxes) and expresses every
// byte quantity as a StrideSum of the tensor's plane, layer and head strides.
// Binding it to tensors (BoundProgram) resolves those into a CopyPlan per
// launch (copy_plan.h: segment bases, one RowGeometry per side, pieces), so a
// chunk of any length T, whose strides and slot count follow from T, runs the
// same program; T, the slots and skip_prefix are per-call arguments.
//
// A program holds no tensors; its segments name a tensor by its index in the
// cache's flat tensor list (KVCache.tensors). It is registered under an
// integer handle (what a call, a prepared transfer and a compiled graph refer
// to); handles are never reused, and the Python side keeps the registry
// bounded (ops/programs.py): an evicted handle raises instead of running
// another program. A binding keeps its program alive while it lives.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "copy_plan.h"
#include "kvlayout/address.h"
#include "kvlayout/copy_rows_kernel.h"

namespace kvlayout {

// An element count that follows a tensor's strides:
// plane * stride(plane axis) + layer * stride(layer axis)
//   + head * stride(head axis) + constant.
struct StrideSum {
  int64_t plane = 0, layer = 0, head = 0, constant = 0;
};

// Where a cache tensor keeps the canonical axes: a tensor dimension, or -1
// for an axis the tensor lacks. `in_page` is the slot within a page, or the
// flat slot axis when `page` is -1 (its elements are contiguous on the last
// dimension, which the planner checked when it bound the cache).
struct TensorAxes {
  int64_t plane = -1, layer = -1, page = -1, in_page = -1, head = -1;
};

// One base of a launch: tensor `tensor` of the side's tensor list, at
// `offset` elements from its data pointer.
struct Segment {
  int64_t tensor = 0;
  StrideSum offset;
};

// One side of a launch: the stride between a row's pieces, and its segments.
struct LaunchSide {
  StrideSum piece_stride;
  std::vector<Segment> segments;
};

// One launch: all its rows share one geometry per side (resolved from the
// tensors; binding refuses tensors of one launch that disagree).
struct LaunchSpec {
  int64_t num_pieces = 1;   // pieces per row (a row whose heads lie apart on one side)
  int64_t piece_elems = 0;  // elements per piece
  LaunchSide src, dst;      // dst.segments.size() == src.segments.size()
};

// steps[0]: every chosen layer; steps[1 + i]: the i-th chosen layer only.
struct CopyProgram {
  std::vector<std::vector<LaunchSpec>> steps;
  std::vector<TensorAxes> src_axes, dst_axes;  // one per tensor of each side's list
};

// Registers a program (checked for well-formed fields) and returns its handle.
int64_t register_program(CopyProgram program);
// Removes a handle from the registry (bindings made from it keep working).
void drop_program(int64_t handle);
// The program of a handle (IndexError for an unknown or dropped handle).
std::shared_ptr<const CopyProgram> registered_program(int64_t handle);
// How many programs are registered.
int64_t program_count();

// The one check of a call's step index and tensor counts against a program
// (resolve_program, binding, running a binding): IndexError for a step
// outside [0, num_steps) (kNoStep: no step to check), ValueError for a source
// or destination of another number of tensors than the program's.
constexpr int64_t kNoStep = INT64_MIN;
void check_program_call(int64_t num_steps, size_t program_src, size_t program_dst, int64_t step,
                        size_t num_src, size_t num_dst, const char* who);
void check_program_call(const CopyProgram& program, int64_t step, size_t num_src, size_t num_dst,
                        const char* who);

// Launch `launch` of `program` resolved against these tensors: its segment
// bases, geometries and pieces in bytes, for one token with identity slots,
// not yet checked (check_copy_plan does that).
CopyPlan resolve_launch(const LaunchSpec& launch, const CopyProgram& program, at::TensorList src,
                        at::TensorList dst);

// Slot arguments of one run, as the caller gave them (an aggregate:
// RunArgs{src_slots, dst_slots, num_tokens, skip_prefix, max_ctas, validate}).
struct RunArgs {
  std::optional<at::Tensor> src_slots, dst_slots;
  int64_t num_tokens = 0;
  int64_t skip_prefix = 0;
  int64_t max_ctas = 0;
  bool validate = false;
  bool dependent_launch = false;  // CUDA: may start before the previous kernel on the stream ends
  // CUDA, dependent launches outside graph capture: the caller promises that
  // between its calls the stream runs no kernel of other code that lets its
  // successor start early (programmatic dependent launch), so a launch may
  // load before the kvlayout launches before it end (see LaunchOrder in
  // cuda/cuda_common.h).
  bool early_loads = false;
  // Device backends: record out-of-range slots in the status word. A caller
  // that runs the same tokens' slots again (the staged engine's later layer
  // groups) turns it off, so that each bad token is counted once.
  bool record_errors = true;
  // The slot tensors may hold more than num_tokens entries; the first
  // num_tokens are read (the staged engine's chunks read prefixes of one
  // call's slots, without a view per chunk).
  bool slot_prefixes = false;
};

// How a dependent launch may start before the previous kernel of its stream
// ends (CUDA; LaunchOrder in cuda/cuda_common.h decides, per launch):
enum class EarlyStart {
  kNone,   // it touches memory only after that kernel has ended
  kLoads,  // it issues its first loads before (its writes still wait); the
           // next launch may start once this one has waited
  kLoadsAndNext,  // the same, and the next launch may start at once (a layer
                  // pipeline as deep as the SMs hold, all loading early)
};

// `plan` (a bound launch's plan) with this run's token counts and slots.
inline CopyPlan plan_for_run(const CopyPlan& plan, const SlotArray& src_slots,
                             const SlotArray& dst_slots, const RunArgs& args) {
  CopyPlan p = plan;
  p.num_tokens = args.num_tokens;
  p.skip_prefix = args.skip_prefix;
  p.src_slots = src_slots;
  p.dst_slots = dst_slots;
  return p;
}

// Which out-of-range slots the earlier launches of one run already recorded
// (device backends record instead of raising; the launches of a program step
// read the same slots, and each bad token is counted once): a token whose
// source slot is >= src_from or whose destination slot is >= dst_from. The
// smallest slot counts of the earlier launches; none for the first.
struct RecordedBefore {
  int64_t src_from = kRecordEverything;
  int64_t dst_from = kRecordEverything;
  // As if every out-of-range slot had been recorded already (a run that records nothing).
  static RecordedBefore everything() { return RecordedBefore{0, 0}; }
  // This launch's slot counts join the earlier ones.
  void add(const CopyPlan& plan) {
    src_from = std::min(src_from, plan.src_geom.num_slots);
    dst_from = std::min(dst_from, plan.dst_geom.num_slots);
  }
};

// One launch bound to tensors, in a backend's own form.
class BoundLaunch {
 public:
  virtual ~BoundLaunch() = default;
  // `plan`: the launch's checked plan as bound (identity slots, one token);
  // this run's slots are `src_slots`/`dst_slots` (parsed from `args`, whose
  // num_tokens/skip_prefix hold, with skip_prefix < num_tokens). `before`:
  // what the earlier launches of this run recorded (a backend that records
  // errors records only the others).
  virtual void run(const CopyPlan& plan, const SlotArray& src_slots, const SlotArray& dst_slots,
                   const RunArgs& args, const RecordedBefore& before) const = 0;
  // Whether what the launch derived from the tensors at bind time still
  // holds for these tensors at the same addresses (e.g. pinned host memory
  // still registered with the same device alias).
  virtual bool still_valid(at::TensorList src, at::TensorList dst) const {
    (void)src;
    (void)dst;
    return true;
  }
};

// Makes a backend's BoundLaunch from a checked plan (slots unset) and the
// tensors it was checked against (they outlive the launch's use).
using BoundLaunchFactory = std::unique_ptr<BoundLaunch> (*)(const CopyPlan& plan,
                                                           at::TensorList src,
                                                           at::TensorList dst, c10::Device device,
                                                           const at::Tensor& status);
// Backends register their factory at load time (one per device type).
void register_bound_launch_factory(c10::DeviceType type, BoundLaunchFactory factory);

// Where a tensor's data is: its storage, the storage's memory and size, the
// tensor's offset into it and its view, sizes and strides (read without the
// checks of data_ptr(): this runs for every bound tensor on every call, and a
// tensor whose storage was freed compares unequal instead of raising).
struct TensorFingerprint {
  static constexpr int kDims = 6;  // dimensions kept exactly; a hash of any beyond
  const void* storage = nullptr;
  const void* memory = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int64_t dim = 0;
  int64_t sizes[kDims] = {}, strides[kDims] = {};
  uint64_t beyond = 0;
  bool operator==(const TensorFingerprint& o) const;
  bool operator!=(const TensorFingerprint& o) const { return !(*this == o); }
  static TensorFingerprint of(const at::Tensor& t);
  // of(t) == *this, compared field by field as it is read (the per-call
  // check: building of(t) for 33 tensors, then comparing, cost a layer call
  // 0.5 µs more on the CPU).
  bool matches(const at::Tensor& t) const;
};

// A cache's tensors as one native object, made once per cache object used
// more than once (kvlayout.ops.views.KVCache.native_tensors): a call hands
// C++ the group instead of every tensor again, and the binding lookup checks
// the group's fingerprints in place instead of building its key from each
// tensor. Immutable: threads share it.
class TensorGroup {
 public:
  // `kept`: the group outlives this call (a cache's), so each use checks its
  // tensors against their fingerprints; a group of one call's tensors
  // (kept = false) is read as it was just made.
  explicit TensorGroup(std::vector<at::Tensor> tensors, bool kept = true);
  at::TensorList tensors() const { return tensors_; }
  // Whether every tensor is still where and as it was when the group was
  // made (a tensor resized, re-set or freed since is not).
  bool unchanged() const;
  // The binding key's words of the tensors as they were made (see
  // bound_program), and their hash.
  const std::vector<uintptr_t>& words() const { return words_; }
  uint64_t words_hash() const { return words_hash_; }
  size_t size() const { return tensors_.size(); }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<TensorFingerprint> prints_;
  std::vector<uintptr_t> words_;
  uint64_t words_hash_ = 0;
};

// A program bound to tensors: resolved and checked once, then run per call.
class BoundProgram {
 public:
  // `device`: where the launches run (the device of the first non-CPU tensor,
  // or the CPU). `status`: that device's status tensor (ignored on the CPU).
  BoundProgram(int64_t handle, at::TensorList src, at::TensorList dst, c10::Device device,
               const at::Tensor& status);

  int64_t num_steps() const { return static_cast<int64_t>(steps_.size()); }
  c10::Device device() const { return device_; }

  // Runs one step with this call's slots (checked here: dtype, shape,
  // storage, device, no overlap with a written tensor). `args` is the
  // caller's own copy (it owns the slot tensors it names), so nothing another
  // thread does to the caller's arguments can free what a run reads.
  void run(int64_t step, const RunArgs& args) const;

  // Whether the tensors step `step` uses are still the tensors this program
  // was bound to, at the same addresses and storage sizes (a resized or
  // re-set tensor is not).
  void check_still_bound(int64_t step, at::TensorList src, at::TensorList dst,
                         const char* who) const;
  // The same question without raising: false when a tensor of step `step`
  // (a valid step) has moved, changed size or gone.
  bool still_bound(int64_t step, at::TensorList src, at::TensorList dst) const;

  // Whether every launch's bind-time facts still hold for these tensors.
  bool still_valid(at::TensorList src, at::TensorList dst) const;

  // Written tensors of a step (for autograd's version counters).
  const std::vector<int64_t>& written(int64_t step) const { return steps_[step].written; }
  // Bytes one token of step `step` moves (every segment's row).
  int64_t bytes_per_token(int64_t step) const { return steps_[step].bytes_per_token; }

 private:
  struct Step {
    std::vector<CopyPlan> plans;
    std::vector<std::unique_ptr<BoundLaunch>> launches;
    std::vector<int64_t> written;  // dst tensor indices this step writes
    std::vector<int64_t> read;     // src tensor indices this step reads
    int64_t bytes_per_token = 0;
  };
  // check_program_call with this binding's tensor counts.
  void check_step(int64_t step, size_t num_src, size_t num_dst, const char* who) const;

  int64_t handle_;
  c10::Device device_;
  std::vector<Step> steps_;
  std::vector<TensorFingerprint> src_prints_, dst_prints_;
  size_t num_src_ = 0, num_dst_ = 0;  // the program's tensor counts
  WrittenRanges written_ranges_;  // dst tensors, for the per-call slot overlap check
};

// The bound program for these tensors, from a least-recently-used cache keyed
// by the handle and the tensors' addresses, sizes and strides (bound and
// checked on a miss). The cache holds at most binding_cache_capacity()
// bindings (they hold no tensors: data pointers and checked plans only).
std::shared_ptr<const BoundProgram> bound_program(int64_t handle, at::TensorList src,
                                                  at::TensorList dst, c10::Device device,
                                                  const at::Tensor& status);
// The same for two groups' tensors, the key made from the words each group
// kept (its tensors as they are now where one changed since).
std::shared_ptr<const BoundProgram> bound_program(int64_t handle, const TensorGroup& src,
                                                  const TensorGroup& dst, c10::Device device,
                                                  const at::Tensor& status);
void set_binding_cache_capacity(int64_t capacity);
int64_t binding_cache_capacity();

// The CacheHints (copy_rows_kernel.h) of launches that read or write pinned
// host memory: kStreamingHints unless set. Process-wide, read by every run
// of a launch (a captured launch keeps the hints it was captured with).
void set_host_cache_hints(int32_t hints);
int32_t host_cache_hints();
// How a backend that has the choice (CUDA) launches a copy that reads or
// writes pinned host memory without an SM budget: kHostRowPerCta (unless
// set) one CTA per (token, segment) row where its rows allow, or kHostWalk
// one CTA per SM walking every row (see copy_rows_cuda.cuh). Process-wide,
// read by every run of a launch (a captured launch keeps its shape).
enum HostLaunchShape : int32_t { kHostRowPerCta = 0, kHostWalk = 1 };
// The largest launch (bytes moved) that kHostRowPerCta moves one row per CTA.
constexpr int64_t kHostRowPerCtaMaxBytes = int64_t(64) << 20;
void set_host_launch_shape(int32_t shape);
int32_t host_launch_shape();
int64_t binding_cache_size();

// The launch device of a program's tensors: the first non-CPU tensor among
// dst, src, the slots; else the CPU.
c10::Device program_device(at::TensorList src, at::TensorList dst,
                           const std::optional<at::Tensor>& src_slots,
                           const std::optional<at::Tensor>& dst_slots);

// What autograd requires of a tensor written in place (torch's own rules for
// in-place ops: no leaf that requires grad under grad mode, no inference
// tensor outside inference mode); `name`, or `name[index]` for index >= 0,
// names it in the error. Inline, its error out of line: a call checks every
// tensor it writes (64 for an all-layer scatter into a vLLM cache), and
// almost every check passes.
void refuse_write(const at::Tensor& t, const char* op, const char* name, int64_t index);
inline void check_writable(const at::Tensor& t, const char* op, const char* name,
                           int64_t index = -1) {
  if (t.is_inference() || (t.requires_grad() && c10::GradMode::is_enabled()))
    refuse_write(t, op, name, index);  // (raises where the rules above say so)
}

// How many launches this process made in early-loads form (a dependent
// launch that may load before the previous kernel of its stream ends; see
// LaunchOrder in cuda/cuda_common.h), and the counter's increment.
int64_t early_load_launches();
void count_early_load_launch();

// The kvlayout::copy_program op (every backend): runs step `step` of the
// program `handle` on these tensors.
void copy_program(int64_t handle, at::TensorList src, at::TensorList dst,
                  const std::optional<at::Tensor>& src_slots,
                  const std::optional<at::Tensor>& dst_slots, int64_t step, c10::SymInt num_tokens,
                  c10::SymInt skip_prefix, int64_t max_ctas, const at::Tensor& status,
                  bool validate);

}  // namespace kvlayout
