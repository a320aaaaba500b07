// Copy programs: a transfer planned once, checked once, run many times.
//
// A *copy program* is what the Python planner (ops/program.py) makes of a
// choice (source binding, destination binding, layers, planes): a list of
// *steps*, each a list of launches. Step 0 moves every chosen layer; step
// 1 + i moves only the i-th chosen layer (a layer-wise pipeline calls it once
// per layer). A launch is one row geometry per side plus its segments
// (per-(layer, plane, column block) base offsets into the caches' tensors):
// exactly the arguments of one kvlayout::copy_rows call, so everything
// address.h proves for copy_rows holds for a program.
//
// A program holds no tensors; its segments name a tensor by its index in the
// cache's flat tensor list (KVCache.tensors). It is registered once and
// referred to by an integer handle (the handle is what a compiled graph
// keeps). Binding a program to tensors (BoundProgram) does every check that
// does not depend on the slot values (storage bounds of every segment,
// overlaps between written and read tensors, two segments writing one row)
// and builds each backend's launch parameters; running a bound program only
// checks the per-call slot tensors and launches.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "host_checks.h"
#include "kvlayout/address.h"

namespace kvlayout {

// One base of a launch: tensor `tensor` of the side's tensor list, plus
// `offset` bytes from its data pointer.
struct Segment {
  int64_t tensor = 0;
  int64_t offset = 0;
};

// One copy_rows launch: all its rows share one geometry per side.
// Geometry fields are bytes; see RowGeometry in address.h.
struct LaunchSpec {
  RowGeometry src_geometry{};
  RowGeometry dst_geometry{};
  int64_t num_pieces = 1;   // pieces per row (a row whose heads lie apart on one side)
  int64_t piece_bytes = 0;  // bytes per piece
  std::vector<Segment> src_segments;
  std::vector<Segment> dst_segments;  // same length as src_segments
};

// steps[0]: every chosen layer; steps[1 + i]: the i-th chosen layer only.
struct CopyProgram {
  std::vector<std::vector<LaunchSpec>> steps;
  int64_t num_src_tensors = 0;  // length of the source cache's tensor list
  int64_t num_dst_tensors = 0;
};

// Registers a program (checked for well-formed fields) and returns its handle.
int64_t register_program(CopyProgram program);
// The program of a handle (IndexError for an unknown handle).
const CopyProgram& registered_program(int64_t handle);

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

// One launch bound to tensors, in a backend's own form.
class BoundLaunch {
 public:
  virtual ~BoundLaunch() = default;
  // `plan`: the launch's checked plan as bound (identity slots, one token);
  // this run's slots are `src_slots`/`dst_slots` (parsed from `args`, whose
  // num_tokens/skip_prefix hold, with skip_prefix < num_tokens).
  virtual void run(const CopyPlan& plan, const SlotArray& src_slots, const SlotArray& dst_slots,
                   const RunArgs& args) const = 0;
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

// A program bound to tensors: checked once, then run per call.
class BoundProgram {
 public:
  // `device`: where the launches run (the device of the first non-CPU tensor,
  // or the CPU). `status`: that device's status tensor (ignored on the CPU).
  BoundProgram(int64_t handle, at::TensorList src, at::TensorList dst, c10::Device device,
               const at::Tensor& status);

  int64_t num_steps() const { return static_cast<int64_t>(steps_.size()); }
  c10::Device device() const { return device_; }

  // Runs one step with this call's slots (checked here: dtype, shape,
  // device, no overlap with a written tensor).
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

 private:
  struct Step {
    std::vector<CopyPlan> plans;
    std::vector<std::unique_ptr<BoundLaunch>> launches;
    std::vector<int64_t> written;  // dst tensor indices this step writes
    std::vector<int64_t> read;     // src tensor indices this step reads
  };
  struct Fingerprint {
    const void* data = nullptr;
    const void* storage = nullptr;
    int64_t nbytes = 0;
    bool operator==(const Fingerprint& o) const {
      return data == o.data && storage == o.storage && nbytes == o.nbytes;
    }
  };
  static Fingerprint fingerprint(const at::Tensor& t);

  int64_t handle_;
  c10::Device device_;
  std::vector<Step> steps_;
  std::vector<Fingerprint> src_prints_, dst_prints_;
  WrittenRanges written_ranges_;  // dst tensors, for the per-call slot overlap check
};

// The bound program for these tensors, from a cache keyed by the handle and
// the tensors' addresses (bound and checked on a miss).
std::shared_ptr<const BoundProgram> bound_program(int64_t handle, at::TensorList src,
                                                  at::TensorList dst, c10::Device device,
                                                  const at::Tensor& status);

// The launch device of a program's tensors: the first non-CPU tensor among
// dst, src, the slots; else the CPU.
c10::Device program_device(at::TensorList src, at::TensorList dst,
                           const std::optional<at::Tensor>& src_slots,
                           const std::optional<at::Tensor>& dst_slots);

// What autograd requires of a tensor written in place (torch's own rules for
// in-place ops: no leaf that requires grad under grad mode, no inference
// tensor outside inference mode); `name`, or `name[index]` for index >= 0,
// names it in the error.
void check_writable(const at::Tensor& t, const std::string& op, const std::string& name,
                    int64_t index = -1);

// How many launches this process made in early-loads form (a dependent
// launch that may load before the previous kernel of its stream ends; see
// LaunchOrder in cuda/cuda_common.h), and the counter's increment.
int64_t early_load_launches();
void count_early_load_launch();

// The kvlayout::copy_program op (every backend): runs step `step` of the
// program `handle` on these tensors.
void copy_program(int64_t handle, at::TensorList src, at::TensorList dst,
                  const std::optional<at::Tensor>& src_slots,
                  const std::optional<at::Tensor>& dst_slots, int64_t step, int64_t num_tokens,
                  int64_t skip_prefix, int64_t max_ctas, const at::Tensor& status, bool validate);

}  // namespace kvlayout
