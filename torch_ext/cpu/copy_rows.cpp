// CPU implementation of kvlayout::copy_rows (and copy_runs, the same on CPU).
//
// All slots are read once and validated before anything is written (range,
// and no destination slot written by two tokens). Tokens are split over
// threads with at::parallel_for; inside a thread's range, consecutive tokens
// whose rows are adjacent on both sides are coalesced into one run (address.h
// run detection, slots.h for_each_block) and moved with one memmove per
// segment. memmove (not memcpy)
// keeps a copy within one tensor defined when a row is copied onto itself.
#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../copy_plan.h"
#include "../device_args.h"
#include "../program.h"
#include "../slots.h"
#include "../thread_scratch.h"
#include "kvlayout/address.h"

namespace kvlayout {
namespace {

void check_on_cpu(at::TensorList ts, const char* name) {
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK_VALUE(ts[i].device().is_cpu(), "kvlayout::copy_rows (CPU): ", name, "[", i,
                "] is on ", ts[i].device());
  }
}

// A launch bound to CPU tensors: base pointers resolved once.
class CpuLaunch final : public BoundLaunch {
 public:
  // `src`/`dst`: CPU tensors (checked by the caller).
  CpuLaunch(const CopyPlan& plan, at::TensorList src, at::TensorList dst) : walk_(plan) {
    src_base_.resize(plan.num_segments);
    dst_base_.resize(plan.num_segments);
    for (int64_t g = 0; g < plan.num_segments; ++g) {
      src_base_[g] = static_cast<const char*>(src[plan.src_tensor[g]].data_ptr()) + plan.src_offset[g];
      dst_base_[g] = static_cast<char*>(dst[plan.dst_tensor[g]].data_ptr()) + plan.dst_offset[g];
    }
    // the walk needs the geometry, not the segment lists (the bases replace them): a run copies no vector
    walk_.src_tensor.clear();
    walk_.src_offset.clear();
    walk_.dst_tensor.clear();
    walk_.dst_offset.clear();
  }

  void run(const CopyPlan& plan, const SlotArray& src_slots, const SlotArray& dst_slots,
           const RunArgs& args, const RecordedBefore& before) const override {
    (void)plan;    // the CPU checks every slot and raises; no CTA budget
    (void)before;  // (and records nothing)
    CopyPlan p = plan_for_run(walk_, src_slots, dst_slots, args);
    run_plan(p);
  }

  // Each slot is read once into the op's own copy, checked there (range, and
  // no destination slot twice: two tokens writing one row would race), and
  // the copy is what the walk uses. The copy is this thread's scratch memory
  // (thread_scratch.h), reused from call to call.
  void run_plan(CopyPlan& p) const {
    if (p.empty()) return;
    const ScratchScope scope;
    const TokenRange active = read_slots_once(p, ThreadScratch::mine().slots, /*unique_dst=*/true);
    if (active.first >= active.end) return;  // no token has a row to move
    const int64_t bytes_per_token = std::max<int64_t>(1, p.num_segments * p.row_bytes());
    const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 18) / bytes_per_token);
    at::parallel_for(active.first, active.end, grain, [&](int64_t begin, int64_t end) {
      for_each_block(p, begin, end, [&](int64_t g, int64_t so, int64_t dof, int64_t bytes) {
        std::memmove(dst_base_[g] + dof, src_base_[g] + so, static_cast<size_t>(bytes));
      });
    });
  }

 private:
  CopyPlan walk_;  // the bound plan without its segment lists
  std::vector<const char*> src_base_;
  std::vector<char*> dst_base_;
};

std::unique_ptr<BoundLaunch> make_cpu_launch(const CopyPlan& plan, at::TensorList src,
                                             at::TensorList dst, c10::Device device,
                                             const at::Tensor& status) {
  (void)device;
  (void)status;  // CPU raises instead of recording
  check_on_cpu(src, "src");
  check_on_cpu(dst, "dst");
  return std::make_unique<CpuLaunch>(plan, src, dst);
}

const bool registered = (register_bound_launch_factory(c10::DeviceType::CPU, &make_cpu_launch), true);

void copy_rows_cpu(at::TensorList src, at::TensorList dst,
                   const std::optional<at::Tensor>& src_slots,
                   const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                   int64_t skip_prefix, c10::IntArrayRef src_segments,
                   c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                   c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes,
                   int64_t max_ctas, const at::Tensor& status, bool validate) {
  (void)status;    // CPU raises instead of recording
  (void)validate;  // CPU always validates every slot
  check_on_cpu(src, "src");
  check_on_cpu(dst, "dst");
  CopyPlan p =
      plan_copy_rows(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                     dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, max_ctas);
  if (p.empty()) return;
  CpuLaunch launch(p, src, dst);
  launch.run_plan(p);
}

// The copy-engine op on CPU is the same host walk: one memmove per block.
void copy_runs_cpu(at::TensorList src, at::TensorList dst,
                   const std::optional<at::Tensor>& src_slots,
                   const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                   int64_t skip_prefix, c10::IntArrayRef src_segments,
                   c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                   c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes) {
  copy_rows_cpu(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, 0, at::Tensor(),
                /*validate=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CPU, m) {
  m.impl("copy_rows", &copy_rows_cpu);
  m.impl("copy_runs", &copy_runs_cpu);
}

}  // namespace kvlayout
