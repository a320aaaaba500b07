// kvlayout._C: loading it registers the ops (torch.ops.kvlayout.*); its
// Python names are the direct, dispatcher-free entry points of copy
// programs (torch_ext/program.h), which a layer-wise pipeline calls once per
// layer: the op dispatcher costs more host time than the launch itself.
//
//   register_program, drop_program the planner's output, registered once
//   PreparedCopy                   a program bound to tensors, run per call
//   TensorGroup                    a cache's tensors, made once per bound cache
//   run_program                    a program run on these tensors (bindings
//                                  cached by address); False when the call
//                                  must go through the dispatcher instead
#include <torch/csrc/utils/pybind.h>  // pybind11 with the at::Tensor casters (lighter than torch/extension.h)

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "copy_list.h"
#include "kvlayout/status.h"
#include "program.h"
#include "slots.h"
#include "staged.h"
#include "thread_scratch.h"

namespace py = pybind11;

namespace kvlayout {
namespace {

using Geometry5 = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;
// A StrideSum as (plane, layer, head, constant).
using StrideSum4 = std::tuple<int64_t, int64_t, int64_t, int64_t>;
// A launch side as (piece stride, [(tensor index, offset), ...]).
using Side = std::tuple<StrideSum4, std::vector<std::pair<int64_t, StrideSum4>>>;
// A launch as (num_pieces, piece_elems, src side, dst side).
using Launch = std::tuple<int64_t, int64_t, Side, Side>;
// TensorAxes as (plane, layer, page, in_page, head).
using Axes5 = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

StrideSum to_sum(const StrideSum4& s) {
  return StrideSum{std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s)};
}

LaunchSide to_side(const Side& side) {
  LaunchSide out;
  out.piece_stride = to_sum(std::get<0>(side));
  for (const auto& [tensor, offset] : std::get<1>(side))
    out.segments.push_back(Segment{tensor, to_sum(offset)});
  return out;
}

std::vector<TensorAxes> to_axes(const std::vector<Axes5>& axes) {
  std::vector<TensorAxes> out;
  for (const auto& [plane, layer, page, in_page, head] : axes)
    out.push_back(TensorAxes{plane, layer, page, in_page, head});
  return out;
}

Geometry5 from_geometry(const RowGeometry& g) {
  return {g.num_slots, g.page_size, g.stride_page, g.stride_in_page, g.stride_piece};
}

std::vector<std::pair<int64_t, int64_t>> pairs(const std::vector<int64_t>& tensors,
                                               const std::vector<int64_t>& offsets) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i < tensors.size(); ++i) out.emplace_back(tensors[i], offsets[i]);
  return out;
}

int64_t register_from_python(const std::vector<std::vector<Launch>>& steps,
                             const std::vector<Axes5>& src_axes,
                             const std::vector<Axes5>& dst_axes) {
  CopyProgram p;
  for (const auto& step : steps) {
    p.steps.emplace_back();
    for (const auto& [num_pieces, piece_elems, src, dst] : step)
      p.steps.back().push_back(LaunchSpec{num_pieces, piece_elems, to_side(src), to_side(dst)});
  }
  p.src_axes = to_axes(src_axes);
  p.dst_axes = to_axes(dst_axes);
  return register_program(std::move(p));
}

// The launches of step `step` resolved against these tensors, in bytes and
// not yet checked: (src_geometry, dst_geometry, num_pieces, piece_bytes,
// src_segments, dst_segments) with segments as (tensor index, byte offset).
py::list resolve_program(int64_t handle, int64_t step, const std::vector<at::Tensor>& src,
                         const std::vector<at::Tensor>& dst) {
  const auto program = registered_program(handle);
  check_program_call(*program, step, src.size(), dst.size(), "kvlayout");
  py::list out;
  for (const LaunchSpec& launch : program->steps[static_cast<size_t>(step)]) {
    const CopyPlan p = resolve_launch(launch, *program, src, dst);
    out.append(py::make_tuple(from_geometry(p.src_geom), from_geometry(p.dst_geom), p.num_pieces,
                              p.piece_bytes, pairs(p.src_tensor, p.src_offset),
                              pairs(p.dst_tensor, p.dst_offset)));
  }
  return out;
}

// Tensors the direct path must leave to the dispatcher: meta and fake
// tensors, tensor subclasses, and any call under a TorchDispatchMode.
bool needs_dispatcher(at::TensorList ts) {
  for (const at::Tensor& t : ts) {
    if (!t.defined()) continue;
    if (t.is_meta() || t.key_set().has(c10::DispatchKey::Python)) return true;
  }
  return false;
}

bool needs_dispatcher(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() && needs_dispatcher(at::TensorList(*t));
}

// Autograd's part of an in-place write, as the op's Autograd kernel does it.
void check_written(const BoundProgram& bound, int64_t step, at::TensorList dst) {
  if (step < 0 || step >= bound.num_steps()) return;  // run() raises the error
  for (int64_t j : bound.written(step))
    check_writable(dst[j], "kvlayout", "dst", j);
}

void bump_written(const BoundProgram& bound, int64_t step, at::TensorList dst) {
  for (int64_t j : bound.written(step))
    if (!dst[j].is_inference()) dst[j].unsafeGetTensorImpl()->bump_version();
}

// A host copy of at least this many bytes releases the GIL while it runs
// (below it, releasing and taking it back would cost more than the copy).
constexpr int64_t kReleaseGilBytes = 64 << 10;

// `args` is the caller's own copy: the run owns every tensor it reads, even
// while the GIL is released and another thread replaces the arguments it was
// copied from.
void run_bound(const BoundProgram& bound, int64_t step, at::TensorList dst, const RunArgs& args) {
  check_written(bound, step, dst);
  const bool long_host_copy =
      bound.device().is_cpu() && step >= 0 && step < bound.num_steps() &&
      (args.num_tokens - args.skip_prefix) * bound.bytes_per_token(step) >= kReleaseGilBytes;
  if (long_host_copy) {
    py::gil_scoped_release release;  // other Python threads run meanwhile
    bound.run(step, args);
  } else {
    bound.run(step, args);
  }
  bump_written(bound, step, dst);
}

// None, or a 1-D int32/int64 tensor on the launch device or the host (into `out`).
bool plain_slots(py::handle h, c10::Device device, std::optional<at::Tensor>& out) {
  if (h.is_none()) return true;
  if (!THPVariable_Check(h.ptr())) return false;
  const at::Tensor& t = THPVariable_Unpack(h.ptr());
  const auto dtype = t.scalar_type();
  if (t.dim() != 1 || (dtype != at::kInt && dtype != at::kLong) ||
      !(t.device().is_cpu() || t.device() == device))
    return false;
  out = t;
  return true;
}

// The token count T of the common call, its slot tensors into `src`/`dst`: each slot argument
// None or a 1-D int32/int64 tensor on the launch device or the host, of one length T when both
// are given; a side without slots holding at least T positions (`*_positions`, -1: not known);
// 0 <= skip_prefix <= T. -1 for anything else, which the caller checks the long way (its errors
// name the argument).
int64_t plain_call_tokens(py::handle src_slots, py::handle dst_slots, int64_t skip_prefix,
                          c10::Device device, int64_t src_positions, int64_t dst_positions,
                          std::optional<at::Tensor>& src, std::optional<at::Tensor>& dst) {
  if (!plain_slots(src_slots, device, src) || !plain_slots(dst_slots, device, dst)) return -1;
  int64_t T = -1;
  if (src.has_value()) {
    T = src->size(0);
    if (dst.has_value() ? dst->size(0) != T : (dst_positions < 0 || T > dst_positions)) return -1;
  } else if (dst.has_value()) {
    T = dst->size(0);
    if (src_positions < 0 || T > src_positions) return -1;
  } else {
    return -1;
  }
  return skip_prefix < 0 || skip_prefix > T ? -1 : T;
}

// A program bound to tensors it keeps alive.
class PreparedCopy {
 public:
  // src_positions/dst_positions: how many slots each side holds (a side
  // without slot tensor reads or writes positions 0..T-1); -1: not known.
  PreparedCopy(int64_t handle, std::vector<at::Tensor> src, std::vector<at::Tensor> dst,
               std::optional<at::Tensor> status, int64_t src_positions = -1,
               int64_t dst_positions = -1)
      : src_(std::move(src)),
        dst_(std::move(dst)),
        status_(status.value_or(at::Tensor())),
        src_positions_(src_positions),
        dst_positions_(dst_positions) {
    device_ = program_device(src_, dst_, std::nullopt, std::nullopt);
    // from the binding cache: the same tensors bound again (a cache bound anew at every call, a staged
    // transfer's device side beside a fresh host chunk) share one checked binding (which holds no tensors);
    // one made for other storages at these addresses (a freed tensor's memory handed out again) is not
    // this copy's, whose runs check that its tensors are the ones bound
    bound_ = bound_program(handle, src_, dst_, device_, status_);
    if (!bound_->still_bound(0, src_, dst_))
      bound_ = std::make_shared<const BoundProgram>(handle, src_, dst_, device_, status_);
  }

  // The per-call arguments, kept until the next set_call: a layer call then
  // passes only its step.
  void set_call(std::optional<at::Tensor> src_slots, std::optional<at::Tensor> dst_slots,
                int64_t num_tokens, int64_t skip_prefix, int64_t max_ctas, bool validate,
                bool dependent_launch, bool early_loads) {
    RunArgs next{std::move(src_slots), std::move(dst_slots), num_tokens, skip_prefix, max_ctas,
                 validate, dependent_launch, early_loads};
    // Swapped in whole, then the old arguments are released: releasing a tensor may run Python
    // code (and let another thread run), which must never see half of the new arguments.
    std::swap(args_, next);
  }

  void run(int64_t step) const {
    bound_->check_still_bound(step, src_, dst_, "kvlayout: prepared transfer");
    const RunArgs args = args_;  // owned by this call (taken while the GIL is held)
    run_bound(*bound_, step, dst_, args);
  }

  // Runs step `step` with these per-call arguments, as run_program would;
  // false (nothing done) where run_program would not serve the call from
  // this binding: the call needs the dispatcher, or a bound tensor moved.
  bool run_with(int64_t step, const std::optional<at::Tensor>& src_slots,
                const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                int64_t skip_prefix, int64_t max_ctas, bool validate) const {
    if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || needs_dispatcher(src_slots) ||
        needs_dispatcher(dst_slots) || step < 0 || step >= bound_->num_steps() ||
        !bound_->still_bound(step, src_, dst_))
      return false;
    run_bound(*bound_, step, dst_,
              RunArgs{src_slots, dst_slots, num_tokens, skip_prefix, max_ctas, validate});
    return true;
  }

  // run_with for slots not checked yet: the common call (each slot argument
  // None or a 1-D int32/int64 tensor on the launch device or the host, of
  // one length T when both are given; a side without slots holding T
  // positions; 0 <= skip_prefix <= T) runs here with T from the slots; false
  // (nothing done) for anything else, which the caller checks the long way
  // (its errors name the argument).
  bool run_checking(int64_t step, py::handle src_slots, py::handle dst_slots, int64_t skip_prefix,
                    int64_t max_ctas, bool validate) const {
    std::optional<at::Tensor> ss, ds;
    const int64_t T = plain_call_tokens(src_slots, dst_slots, skip_prefix, device_, src_positions_,
                                        dst_positions_, ss, ds);
    return T >= 0 && run_with(step, ss, ds, T, skip_prefix, max_ctas, validate);
  }

  int64_t num_steps() const { return bound_->num_steps(); }
  std::string device() const { return device_.str(); }
  const std::shared_ptr<const BoundProgram>& bound() const { return bound_; }
  const std::vector<at::Tensor>& src() const { return src_; }
  const std::vector<at::Tensor>& dst() const { return dst_; }

 private:
  std::vector<at::Tensor> src_, dst_;
  at::Tensor status_;
  int64_t src_positions_ = -1, dst_positions_ = -1;
  c10::Device device_{c10::kCPU};
  std::shared_ptr<const BoundProgram> bound_;
  RunArgs args_;
};

// PreparedCopy's hot calls as builtin functions bound to one PreparedCopy
// (which each keeps alive), without pybind11's overload dispatch and argument
// casters: run(step), a layer call's, and run_checking(...), a repeated
// ops.transfer's. Each call costs about as much as the checks it runs. Errors
// become the Python exceptions pybind11 would raise.
constexpr const char* kPreparedCapsule = "kvlayout.PreparedCopy";

const PreparedCopy* prepared_of(PyObject* capsule) {
  return static_cast<const PreparedCopy*>(PyCapsule_GetPointer(capsule, kPreparedCapsule));
}

// `x` as an int64; false with a Python error set where it is not an int that fits.
bool int64_of(PyObject* x, int64_t& out) {
  const long long v = PyLong_AsLongLong(x);
  if (v == -1 && PyErr_Occurred()) return false;
  out = v;
  return true;
}

PyObject* run_step(PyObject* capsule, PyObject* step) {
  HANDLE_TH_ERRORS
  const PreparedCopy* prepared = prepared_of(capsule);
  int64_t s = 0;
  if (prepared == nullptr || !int64_of(step, s)) return nullptr;
  prepared->run(s);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// run_checking(step, src_slots, dst_slots, skip_prefix, max_ctas, validate), positional.
PyObject* run_checking_step(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) {
    PyErr_Format(PyExc_TypeError,
                 "run_checking(step, src_slots, dst_slots, skip_prefix, max_ctas, validate) takes 6 "
                 "positional arguments, got %zd",
                 nargs);
    return nullptr;
  }
  const PreparedCopy* prepared = prepared_of(capsule);
  int64_t step = 0, skip_prefix = 0, max_ctas = 0;
  if (prepared == nullptr || !int64_of(args[0], step) || !int64_of(args[3], skip_prefix) ||
      !int64_of(args[4], max_ctas))
    return nullptr;
  const int validate = PyObject_IsTrue(args[5]);
  if (validate < 0) return nullptr;
  const bool done =
      prepared->run_checking(step, args[1], args[2], skip_prefix, max_ctas, validate != 0);
  return PyBool_FromLong(done);
  END_HANDLE_TH_ERRORS
}

PyMethodDef run_step_def = {
    "run", run_step, METH_O,
    "Runs step `step` (0: all layers, 1 + i: the i-th layer) with the set_call arguments."};
PyMethodDef run_checking_step_def = {
    "run_checking", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(run_checking_step)),
    METH_FASTCALL, "PreparedCopy.run_checking, positional arguments only."};

void release_prepared_owner(PyObject* capsule) {
  Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(capsule)));
}

// The builtin function of `def` bound to `self` (a PreparedCopy object), which it keeps alive.
py::object prepared_function(const py::object& self, PyMethodDef* def) {
  auto* prepared = self.cast<PreparedCopy*>();
  py::object capsule = py::reinterpret_steal<py::object>(
      PyCapsule_New(prepared, kPreparedCapsule, &release_prepared_owner));
  if (!capsule) throw py::error_already_set();
  PyCapsule_SetContext(capsule.ptr(), self.inc_ref().ptr());  // the capsule owns a reference
  PyObject* fn = PyCFunction_New(def, capsule.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

// A PreparedCopy for ops.transfer to keep per (caches, choice), or null
// where the tensors must go through the dispatcher on every call.
std::unique_ptr<PreparedCopy> bind_program(int64_t handle, std::vector<at::Tensor> src,
                                           std::vector<at::Tensor> dst, const at::Tensor& status,
                                           int64_t src_positions, int64_t dst_positions) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || needs_dispatcher(src) ||
      needs_dispatcher(dst))
    return nullptr;
  return std::make_unique<PreparedCopy>(handle, std::move(src), std::move(dst), status,
                                        src_positions, dst_positions);
}

// Whether a call with these arguments must go through the dispatcher (a
// dispatch mode, fake or meta tensors, subclasses).
bool call_needs_dispatcher(at::TensorList src, at::TensorList dst,
                           const std::optional<at::Tensor>& src_slots,
                           const std::optional<at::Tensor>& dst_slots) {
  return c10::impl::TorchDispatchModeTLS::stack_len() > 0 || needs_dispatcher(src) ||
         needs_dispatcher(dst) || needs_dispatcher(src_slots) || needs_dispatcher(dst_slots);
}

bool run_program(int64_t handle, const std::vector<at::Tensor>& src,
                 const std::vector<at::Tensor>& dst, const std::optional<at::Tensor>& src_slots,
                 const std::optional<at::Tensor>& dst_slots, int64_t step, int64_t num_tokens,
                 int64_t skip_prefix, int64_t max_ctas, const at::Tensor& status, bool validate) {
  if (call_needs_dispatcher(src, dst, src_slots, dst_slots)) return false;
  const c10::Device device = program_device(src, dst, src_slots, dst_slots);
  const auto bound = bound_program(handle, src, dst, device, status);
  run_bound(*bound, step, dst,
            RunArgs{src_slots, dst_slots, num_tokens, skip_prefix, max_ctas, validate});
  return true;
}

// One side's tensors of a call: a cache's TensorGroup, or a sequence of
// tensors passed for this call.
struct SideTensors {
  explicit SideTensors(py::handle h) {
    if (py::isinstance<TensorGroup>(h))
      group = h.cast<const TensorGroup*>();
    else
      tensors = h.cast<std::vector<at::Tensor>>();
  }
  at::TensorList list() const { return group != nullptr ? group->tensors() : tensors; }
  const TensorGroup* group = nullptr;
  std::vector<at::Tensor> tensors;
};

// The binding of a call's two sides: by their groups' words where a side has
// one (the other side's few tensors grouped for this call), else by the
// tensors' words as bound_program reads them.
std::shared_ptr<const BoundProgram> bound_sides(int64_t handle, const SideTensors& src,
                                                const SideTensors& dst, c10::Device device,
                                                const at::Tensor& status) {
  if (src.group == nullptr && dst.group == nullptr)
    return bound_program(handle, src.tensors, dst.tensors, device, status);
  std::optional<TensorGroup> src_now, dst_now;
  if (src.group == nullptr) src_now.emplace(src.tensors, /*kept=*/false);
  if (dst.group == nullptr) dst_now.emplace(dst.tensors, /*kept=*/false);
  return bound_program(handle, src_now ? *src_now : *src.group, dst_now ? *dst_now : *dst.group,
                       device, status);
}

// run_program of step 0 for slots not checked yet, as PreparedCopy::run_checking: the common
// call (plain_call_tokens) runs with T from its slots; false (nothing done) for anything else
// and where the call needs the dispatcher. Each side's tensors are a TensorGroup (a cache used
// before: KVCache.native_tensors) or a sequence.
bool run_program_checking(int64_t handle, py::handle src_tensors, py::handle dst_tensors,
                          py::handle src_slots, py::handle dst_slots, int64_t skip_prefix,
                          int64_t max_ctas, const at::Tensor& status, bool validate,
                          int64_t src_positions, int64_t dst_positions) {
  const SideTensors src(src_tensors), dst(dst_tensors);
  const at::TensorList src_list = src.list(), dst_list = dst.list();
  if (src_list.empty() || dst_list.empty()) return false;
  const c10::Device device = program_device(src_list, dst_list, std::nullopt, std::nullopt);
  std::optional<at::Tensor> ss, ds;
  const int64_t T = plain_call_tokens(src_slots, dst_slots, skip_prefix, device, src_positions,
                                      dst_positions, ss, ds);
  if (T < 0 || call_needs_dispatcher(src_list, dst_list, ss, ds)) return false;
  const auto bound = bound_sides(handle, src, dst, device, status);
  run_bound(*bound, 0, dst_list, RunArgs{ss, ds, T, skip_prefix, max_ctas, validate});
  return true;
}

// The copy engine's run list for these arguments (those of copy_runs), built
// as copy_runs builds it and not issued: its length, or with `entries` the
// copies themselves (what a test checks them against). Slots must be on the
// host. Host addresses stand for pinned memory's device alias (which keeps
// every adjacency), so the list is the one the CUDA op issues.
py::object copy_run_list(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                         const std::optional<at::Tensor>& src_slots,
                         const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                         int64_t skip_prefix, const std::vector<int64_t>& src_segments,
                         const std::vector<int64_t>& dst_segments,
                         const std::vector<int64_t>& src_geometry,
                         const std::vector<int64_t>& dst_geometry, int64_t num_pieces,
                         int64_t piece_bytes, bool entries) {
  for (const auto* slots : {&src_slots, &dst_slots})
    TORCH_CHECK_VALUE(!slots->has_value() || !(*slots)->defined() || (*slots)->device().is_cpu(),
                      "kvlayout: the copy engine reads the slots on the host: pass CPU tensors");
  CopyPlan checked =
      plan_copy_rows(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                     dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, 0);
  if (checked.empty()) return entries ? py::object(py::list()) : py::object(py::int_(0));
  const ScratchScope scope;
  ThreadScratch& scratch = ThreadScratch::mine();
  run_list_at(
      checked, src, dst,
      [](const at::Tensor& t, const char*, int64_t) { return static_cast<char*>(t.data_ptr()); },
      scratch.slots, scratch.copies);
  const CopyList& copies = scratch.copies;
  if (!entries) return py::int_(copies.sizes.size());
  py::list out;  // (source address, destination address, bytes) per copy, in issue order
  for (size_t i = 0; i < copies.sizes.size(); ++i)
    out.append(py::make_tuple(reinterpret_cast<uintptr_t>(copies.srcs[i]),
                              reinterpret_cast<uintptr_t>(copies.dsts[i]), copies.sizes[i]));
  return out;
}

// A staged host transfer (staged.h) built from bound programs: Python plans
// it once per transfer shape; each call is this one C++ call.
class StagedTransfer {
 public:
  StagedTransfer(bool host_is_dst, const std::vector<PreparedCopy*>& kernels,
                 const std::vector<PreparedCopy*>& keeps, std::vector<at::Tensor> ring_slots,
                 std::vector<at::Tensor> host_tensors,
                 const std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>>& groups,
                 int64_t tokens_per_chunk, int64_t device_num_slots, int64_t host_num_slots,
                 int64_t side_stream, int64_t ring_stream, std::vector<at::Tensor> written,
                 const PreparedCopy* direct = nullptr)
      : host_num_slots_(host_num_slots), device_(ring_slots.empty() ? c10::Device(c10::kCPU)
                                                                    : ring_slots.front().device()) {
    TORCH_CHECK_VALUE(!ring_slots.empty() && !kernels.empty() && tokens_per_chunk > 0 &&
                          host_num_slots > 0 && kernels.size() == groups.size() * ring_slots.size() &&
                          (keeps.empty() || keeps.size() == kernels.size()),
                      "kvlayout: inconsistent staged transfer plan");
    // Every copy the engine can issue stays inside its tensors: a segment's
    // rows of host slots [0, host_num_slots) inside its host tensor, and its
    // rows of ring rows [0, tokens_per_chunk) inside every ring slot.
    for (const at::Tensor& slot : ring_slots)
      TORCH_CHECK_VALUE(slot.device() == device_ && slot.scalar_type() == at::kByte && slot.dim() == 1 &&
                            slot.is_contiguous(),
                        "kvlayout: ring_slots must be contiguous uint8 tensors on one device");
    for (const auto& group : groups) {
      for (const auto& [tensor, host_offset, ring_offset, row_bytes] : group) {
        TORCH_CHECK_INDEX(tensor >= 0 && tensor < static_cast<int64_t>(host_tensors.size()),
                          "kvlayout: staged segment names host tensor ", tensor, " of ",
                          host_tensors.size());
        const at::Tensor& host = host_tensors[static_cast<size_t>(tensor)];
        const int64_t host_bytes = static_cast<int64_t>(host.storage().nbytes()) -
                                   host.storage_offset() * static_cast<int64_t>(host.element_size());
        TORCH_CHECK_VALUE(row_bytes > 0 && host_offset >= 0 && ring_offset >= 0 &&
                              host_offset + host_num_slots * row_bytes <= host_bytes,
                          "kvlayout: a staged segment's host rows lie outside host tensor ", tensor);
        for (const at::Tensor& slot : ring_slots)
          TORCH_CHECK_VALUE(ring_offset + tokens_per_chunk * row_bytes <= slot.numel(),
                            "kvlayout: a staged segment's rows lie outside a ring slot");
      }
    }
    StagedSetup setup;
    setup.host_is_dst = host_is_dst;
    for (const PreparedCopy* k : kernels) setup.kernels.push_back(k->bound());
    for (const PreparedCopy* k : keeps) setup.keeps.push_back(k->bound());
    for (const auto& group : groups) {
      setup.groups.emplace_back();
      for (const auto& [tensor, host_offset, ring_offset, row_bytes] : group)
        setup.groups.back().push_back(StagedSegment{tensor, host_offset, ring_offset, row_bytes});
    }
    setup.ring_slots = std::move(ring_slots);
    for (const at::Tensor& t : host_tensors) host_prints_.push_back(TensorFingerprint::of(t));
    host_ = host_tensors;
    setup.host_tensors = std::move(host_tensors);
    setup.tokens_per_chunk = tokens_per_chunk;
    setup.device_num_slots = device_num_slots;
    setup.device = setup.ring_slots.front().device();
    setup.side_stream = side_stream;
    setup.ring_stream = ring_stream;
    const StagedFactory factory = staged_factory(setup.device.type());
    TORCH_CHECK_VALUE(factory != nullptr, "kvlayout: no staged engine for ", setup.device,
                      " in this build");
    for (const auto* list : {&kernels, &keeps})
      for (const PreparedCopy* p : *list) bindings_.push_back(Binding{p->bound(), p->src(), p->dst()});
    if (direct != nullptr) {
      TORCH_CHECK_VALUE(direct->bound()->device() == setup.device && direct->num_steps() >= 1,
                        "kvlayout: a staged transfer's direct copy must run on its ring's device");
      setup.direct = direct->bound();
      bindings_.push_back(Binding{direct->bound(), direct->src(), direct->dst()});
    }
    written_ = std::move(written);
    engine_ = factory(std::move(setup));
  }

  // False (nothing done) when a bound tensor was resized, re-set or freed
  // since the plan was made: the caller plans again.
  bool run(std::optional<at::Tensor> device_slots, int64_t num_tokens, int64_t skip_prefix,
           int64_t max_ctas, bool validate) const {
    for (const Binding& b : bindings_)
      if (!b.bound->still_bound(0, b.src, b.dst)) return false;
    for (size_t i = 0; i < host_.size(); ++i)  // (the copy engine's side: no program binds it from host)
      if (!host_prints_[i].matches(host_[i])) return false;
    for (size_t j = 0; j < written_.size(); ++j) check_writable(written_[j], "kvlayout", "dst", j);
    TORCH_CHECK_VALUE(num_tokens >= 0 && num_tokens <= host_num_slots_, "kvlayout: num_tokens = ",
                      num_tokens, " must lie in [0, ", host_num_slots_, "] (the host cache's slots)");
    TORCH_CHECK_VALUE(skip_prefix >= 0 && skip_prefix <= num_tokens, "kvlayout: skip_prefix = ",
                      skip_prefix, " must lie in [0, num_tokens = ", num_tokens, "]");
    if (device_slots.has_value() && device_slots->defined()) {
      const at::Tensor& d = *device_slots;
      TORCH_CHECK_VALUE(d.dim() == 1 && d.size(0) == num_tokens &&
                            (d.scalar_type() == at::kInt || d.scalar_type() == at::kLong) &&
                            d.device() == device_,
                        "kvlayout: the device side's slots must be a 1-D int32/int64 tensor of ",
                        num_tokens, " entries on ", device_, ", got ", d.sizes(), " ",
                        d.scalar_type(), " on ", d.device());
      if (!d.is_contiguous()) device_slots = d.contiguous();
    }
    engine_->run(StagedArgs{std::move(device_slots), num_tokens, skip_prefix, max_ctas, validate});
    for (const at::Tensor& t : written_)
      if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
    return true;
  }

  // run() for a caller that kept this plan and did not look its ring up:
  // false (nothing done) unless the current stream is the ring's, no graph is
  // being captured, no dispatch mode is active and the device slots are a 1-D
  // int32/int64 tensor of this device that run() takes as it is; the caller
  // then takes the long way, which raises where the arguments are wrong.
  bool run_kept(const at::Tensor& device_slots, int64_t skip_prefix, int64_t max_ctas,
                bool validate) const {
    if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || !device_slots.defined() ||
        needs_dispatcher(at::TensorList(device_slots)) || device_slots.dim() != 1 ||
        device_slots.device() != device_ ||
        (device_slots.scalar_type() != at::kInt && device_slots.scalar_type() != at::kLong) ||
        !device_slots.is_contiguous())
      return false;
    const int64_t num_tokens = device_slots.size(0);
    if (num_tokens > host_num_slots_ || skip_prefix < 0 || skip_prefix > num_tokens ||
        !engine_->on_ring_stream())
      return false;
    return run(device_slots, num_tokens, skip_prefix, max_ctas, validate);
  }

  int64_t replayed_calls() const { return engine_->replayed_calls(); }
  int64_t kept_graphs() const { return engine_->kept_graphs(); }
  std::tuple<int64_t, bool, int64_t> kept_graph(int64_t num_tokens, int64_t skip_prefix, int64_t max_ctas,
                                                int64_t slot_bytes) const {
    const KeptGraph kept = engine_->kept_graph(
        StagedArgs{std::nullopt, num_tokens, skip_prefix, max_ctas, false}, slot_bytes);
    return {kept.nodes, kept.on_device, kept.tokens};
  }

 private:
  int64_t host_num_slots_;
  c10::Device device_;
  std::vector<at::Tensor> host_;
  std::vector<TensorFingerprint> host_prints_;
  struct Binding {  // a program run by the engine and the tensors it was bound to
    std::shared_ptr<const BoundProgram> bound;
    std::vector<at::Tensor> src, dst;
  };
  std::vector<Binding> bindings_;
  std::vector<at::Tensor> written_;
  std::unique_ptr<StagedEngine> engine_;
};

// What binding a cache reads of its tensors (kvlayout.ops.views): per tensor
// its dimensions, sizes, strides, element type and device, packed as bytes,
// equal exactly when those are equal. None where an item is not a strided
// tensor of concrete sizes (the binding then reads them the long way, and
// says what is wrong). One call for the whole list: an engine binds fresh
// views of its buffers call after call, and reading a tensor's shape from
// Python costs about 0.3 us. A tensor of the structure of the one before it
// is one word (kSameAsBefore: a record starts with its dimension count, never
// negative), so the bytes of a per-layer list stay short: Python hashes them
// for every binding, about 0.25 ns a byte.
py::object tensors_structure(const py::sequence& items) {
  constexpr int64_t kSameAsBefore = -1;
  std::vector<int64_t> words, record, before;
  words.reserve(32);
  for (const py::handle item : items) {
    if (!THPVariable_Check(item.ptr())) return py::none();
    const at::Tensor& t = THPVariable_Unpack(item.ptr());
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return py::none();
    record.clear();
    record.push_back(t.dim());
    for (const int64_t size : t.sizes()) record.push_back(size);
    for (const int64_t stride : t.strides()) record.push_back(stride);
    record.push_back(static_cast<int64_t>(t.scalar_type()));
    record.push_back(static_cast<int64_t>(t.device().type()));
    record.push_back(static_cast<int64_t>(t.device().index()));
    if (record == before) {
      words.push_back(kSameAsBefore);
    } else {
      words.insert(words.end(), record.begin(), record.end());
      std::swap(before, record);
    }
  }
  return py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
}

}  // namespace
}  // namespace kvlayout

PYBIND11_MODULE(_C, m) {
  using namespace kvlayout;
  m.doc() = "kvlayout native ops (torch.ops.kvlayout) and copy programs";
  // The status word's layout (kvlayout/status.h), for the host reader.
  m.attr("STATUS_NUMEL") = kStatusNumel;
  py::tuple arguments(std::size(kStatusArguments));
  for (size_t i = 0; i < std::size(kStatusArguments); ++i) arguments[i] = kStatusArguments[i];
  m.attr("STATUS_ARGUMENTS") = arguments;

  m.def("register_program", &register_from_python, py::arg("steps"), py::arg("src_axes"),
        py::arg("dst_axes"),
        "Registers a copy program and returns its handle. steps: [all layers, layer 0, layer 1, "
        "...], each a list of launches (num_pieces, piece_elems, src side, dst side); a side is "
        "(piece stride, [(tensor index, offset), ...]) with strides and offsets as element "
        "counts (plane, layer, head, constant) of the tensor's strides; src_axes/dst_axes give "
        "per tensor the dimensions of its (plane, layer, page, in_page, head) axes (-1: absent).");
  m.def("drop_program", &drop_program, py::arg("program"),
        "Removes a program from the registry (its handle is never reused).");
  m.def("program_count", &program_count, "How many copy programs are registered.");
  m.def("resolve_program", &resolve_program, py::arg("program"), py::arg("step"), py::arg("src"),
        py::arg("dst"),
        "The launches of a step resolved against these tensors, in bytes, unchecked: "
        "(src_geometry, dst_geometry, num_pieces, piece_bytes, src_segments, dst_segments).");
  m.def("set_binding_cache_capacity", &set_binding_cache_capacity, py::arg("capacity"),
        "How many bindings (programs bound to tensor addresses) the native cache keeps.");
  m.def("binding_cache_capacity", &binding_cache_capacity);
  m.def("binding_cache_size", &binding_cache_size);
  m.def(
      "thread_scratch_bytes", [] { return static_cast<int64_t>(ThreadScratch::mine().bytes()); },
      "Bytes the calling thread's scratch (slot checks, slot copies, copy lists) holds between "
      "calls: at most ThreadScratch::kKeptBytes per vector.");
  m.attr("thread_scratch_kept_bytes") = static_cast<int64_t>(ThreadScratch::kKeptBytes);

  py::class_<PreparedCopy>(m, "PreparedCopy",
                           "A copy program bound to tensors (checked once, kept alive).")
      .def(py::init<int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::optional<at::Tensor>>(),
           py::arg("program"), py::arg("src"), py::arg("dst"), py::arg("status"))
      .def("set_call", &PreparedCopy::set_call, py::arg("src_slots"), py::arg("dst_slots"),
           py::arg("num_tokens"), py::arg("skip_prefix"), py::arg("max_ctas"), py::arg("validate"),
           py::arg("dependent_launch"), py::arg("early_loads") = false,
           "The slots and counts of the next runs.")
      .def("run", &PreparedCopy::run, py::arg("step"),
           "Runs step `step` (0: all layers, 1 + i: the i-th layer) with the set_call arguments.")
      .def(
          "runner", [](const py::object& self) { return prepared_function(self, &run_step_def); },
          "run as a builtin function of the step, bound to this object (a layer call's hot path).")
      .def(
          "checker",
          [](const py::object& self) { return prepared_function(self, &run_checking_step_def); },
          "run_checking as a builtin function of its positional arguments, bound to this object (a "
          "repeated ops.transfer's hot path).")
      .def("run_with", &PreparedCopy::run_with, py::arg("step"), py::arg("src_slots"),
           py::arg("dst_slots"), py::arg("num_tokens"), py::arg("skip_prefix"), py::arg("max_ctas"),
           py::arg("validate"),
           "Runs step `step` with these arguments; False (nothing done) when the call needs the "
           "dispatcher or a bound tensor was resized, re-set or freed.")
      .def("run_checking", &PreparedCopy::run_checking, py::arg("step"), py::arg("src_slots"),
           py::arg("dst_slots"), py::arg("skip_prefix"), py::arg("max_ctas"), py::arg("validate"),
           "run_with for slots not checked yet: runs the common call (plain slot tensors, T "
           "from their length); False (nothing done) for anything else.")
      .def_property_readonly("num_steps", &PreparedCopy::num_steps)
      .def_property_readonly("device", &PreparedCopy::device);

  m.def("bind_program", &bind_program, py::arg("program"), py::arg("src"), py::arg("dst"),
        py::arg("status"), py::arg("src_positions") = -1, py::arg("dst_positions") = -1,
        "A PreparedCopy of a program bound to these tensors (checked now), or None when they "
        "need the dispatcher (meta/fake tensors, subclasses, dispatch modes).");
  py::class_<StagedTransfer>(
      m, "StagedTransfer",
      "A staged host transfer (engine='staged'): the copy kernel between the device cache and a "
      "bounded staging ring, the copy engine between the ring and a pinned host chunk.")
      .def(py::init<bool, const std::vector<PreparedCopy*>&, const std::vector<PreparedCopy*>&,
                    std::vector<at::Tensor>, std::vector<at::Tensor>,
                    const std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>>&,
                    int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<at::Tensor>,
                    const PreparedCopy*>(),
           py::arg("host_is_dst"), py::arg("kernels"), py::arg("keeps"), py::arg("ring_slots"),
           py::arg("host_tensors"), py::arg("groups"), py::arg("tokens_per_chunk"),
           py::arg("device_num_slots"), py::arg("host_num_slots"), py::arg("side_stream"),
           py::arg("ring_stream"), py::arg("written"), py::arg("direct") = nullptr,
           "kernels/keeps: PreparedCopy per (group, ring slot); groups: "
           "per layer group, (host tensor, host byte offset, ring byte offset, row bytes) per "
           "segment; direct: the PreparedCopy between the caches themselves, which moves the tokens "
           "past a replayed prefix (None: they are issued staged).")
      .def("run", &StagedTransfer::run, py::arg("device_slots"), py::arg("num_tokens"),
           py::arg("skip_prefix"), py::arg("max_ctas"), py::arg("validate"),
           "Issues the transfer on the current stream; False (nothing done) when a bound tensor "
           "changed since the plan was made.")
      .def("run_kept", &StagedTransfer::run_kept, py::arg("device_slots"), py::arg("skip_prefix"),
           py::arg("max_ctas"), py::arg("validate"),
           "run() for a caller that kept the plan: False (nothing done) unless the current stream "
           "is the ring's (no capture, no dispatch mode) and the device slots a 1-D int32/int64 "
           "tensor of the ring's device; the number of tokens is their length.")
      .def_property_readonly("replayed_calls", &StagedTransfer::replayed_calls,
                             "Calls replayed from a captured graph so far.")
      .def_property_readonly("kept_graphs", &StagedTransfer::kept_graphs,
                             "Captured call shapes kept now (at most the staged graph capacity).")
      .def("kept_graph", &StagedTransfer::kept_graph, py::arg("num_tokens"), py::arg("skip_prefix"),
           py::arg("max_ctas"), py::arg("slot_bytes"),
           "(nodes, on_device, tokens) of the graph kept for this call shape (slot_bytes: the device "
           "slots' element size, 0 for none), which a call of it that does not validate replays: its "
           "captured nodes (0: none kept), whether it runs as a conditional node's body, and the token "
           "count of the call it was captured from (fewer than num_tokens: the call's reuse prefix, "
           "the rest moved by the direct kernel).");
  m.def("set_staged_graph_capacity", &set_staged_graph_capacity, py::arg("graphs"),
        "Captured call shapes each staged transfer keeps (0: every call issued directly).");
  m.def("staged_graph_capacity", &staged_graph_capacity);
  m.def("set_staged_graph_on_device", &set_staged_graph_on_device, py::arg("on"),
        "Whether a kept staged graph runs as the body of an always-true conditional node (the host's "
        "launch carries one node) instead of as it is.");
  m.def("staged_graph_on_device", &staged_graph_on_device);
  m.def("set_staged_graph_prefixes", &set_staged_graph_prefixes, py::arg("on"),
        "Whether a staged call of a token count with no graph of its own may replay the graph kept for "
        "its reuse prefix (staged_reuse_prefix) and move only the rest with the direct kernel.");
  m.def("staged_graph_prefixes", &staged_graph_prefixes);
  m.def("staged_reuse_prefix", &staged_reuse_prefix, py::arg("num_tokens"), py::arg("skip_prefix"),
        "skip_prefix plus the call's n tokens rounded down to a multiple of the largest power of two "
        "<= n / 8, or 0 where that is no proper prefix of the call (n < 16, or a multiple).");
  m.def("set_host_cache_hints", &set_host_cache_hints, py::arg("hints"),
        "The CacheHints of launches that touch pinned host memory (0: streaming, 1: default).");
  m.def("host_cache_hints", &host_cache_hints);
  m.def("set_host_launch_shape", &set_host_launch_shape, py::arg("shape"),
        "The shape of launches that touch pinned host memory without an SM budget (0: one row per "
        "CTA where the rows allow, 1: the walk, one CTA per SM).");
  m.def("host_launch_shape", &host_launch_shape);
  m.attr("HOST_ROW_PER_CTA_MAX_BYTES") = kHostRowPerCtaMaxBytes;
  m.def("set_staged_chunks", &set_staged_chunks, py::arg("chunks"),
        "The chunks a staged call aims at without an SM budget (twice as many under one; 1: chunks of "
        "a ring slot's capacity).");
  m.def("staged_chunks", &staged_chunks);
  m.def("staged_chunk_tokens", &staged_chunk_tokens, py::arg("capacity"), py::arg("groups"),
        py::arg("tokens"), py::arg("bytes_per_token"), py::arg("max_ctas"),
        "Tokens per chunk of a staged call of `tokens` tokens (past skip_prefix), `bytes_per_token` "
        "bytes each in all `groups` layer groups, through ring slots of `capacity` tokens, under an "
        "SM budget of `max_ctas` (0: none).");
  m.def(
      "staged_cut",
      [](int64_t tokens, int64_t groups, int64_t per_chunk, bool to_host, int64_t max_ctas) {
        const StagedCut cut = staged_cut(tokens, per_chunk, to_host, max_ctas);
        const int64_t chunks = cut.chunks(tokens) + (groups - 1) * StagedCut::whole(per_chunk).chunks(tokens);
        return py::make_tuple(cut.first, cut.per_chunk, cut.short_tokens, chunks);
      },
      py::arg("tokens"), py::arg("groups"), py::arg("per_chunk"), py::arg("to_host"), py::arg("max_ctas"),
      "How a staged call of `tokens` tokens (past skip_prefix) in `groups` layer groups and chunks of "
      "`per_chunk` tokens under an SM budget of `max_ctas` (0: none) is cut: (tokens of the first chunk "
      "of the group at the pipeline's idle end, of each later one but the last, of the call's short "
      "chunk (0: none), the call's chunks in all groups).");
  m.def(
      "staged_copies",
      [](const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>& segments, int64_t t0,
         int64_t n, bool fold_blocks) {
        std::vector<StagedSegment> group;
        for (const auto& [tensor, host_offset, ring_offset, row_bytes] : segments)
          group.push_back(StagedSegment{tensor, host_offset, ring_offset, row_bytes});
        std::vector<py::tuple> out;
        for (const StagedCopy& c : staged_copies(group, t0, n, fold_blocks))
          out.push_back(py::make_tuple(c.host_tensor, c.host_offset, c.ring_offset, c.bytes, c.count,
                                       c.host_step, c.ring_step, c.blocks, c.host_block_step,
                                       c.ring_block_step));
        return out;
      },
      py::arg("segments"), py::arg("t0"), py::arg("n"), py::arg("fold_blocks") = true,
      "The copy-engine calls of a staged chunk (tokens [t0, t0 + n)) of one layer group's "
      "segments (host tensor, host byte offset, ring byte offset, row bytes): (host tensor, host "
      "offset, ring offset, bytes, count, host step, ring step, blocks, host block step, ring block "
      "step), count > 1 a 2-D copy, blocks > 1 a 3-D copy (none without fold_blocks).");
  m.def("copy_run_list", &copy_run_list, py::arg("src"), py::arg("dst"), py::arg("src_slots"),
        py::arg("dst_slots"), py::arg("num_tokens"), py::arg("skip_prefix"),
        py::arg("src_segments"), py::arg("dst_segments"), py::arg("src_geometry"),
        py::arg("dst_geometry"), py::arg("num_pieces"), py::arg("piece_bytes"),
        py::arg("entries") = false,
        "The copy engine's run list for copy_runs' arguments, built and not issued: its length "
        "(slots on the host; the time of this call is the list's host cost), or with entries=True "
        "the list itself, (source address, destination address, bytes) per copy in issue order.");
  m.def("early_load_launches", &early_load_launches,
        "How many copy launches this process made whose loads could start before the previous "
        "kernel of their stream ended (dependent launches, captured in a CUDA graph or on a "
        "stream promised by early_loads=True, where no launch that may still run writes what "
        "they read).");
  m.def("tensors_structure", &tensors_structure, py::arg("tensors"),
        "Per tensor its dimensions, sizes, strides, element type and device, as bytes (equal "
        "exactly when those are equal); None where an item is not a strided tensor of concrete "
        "sizes.");
  py::class_<TensorGroup>(m, "TensorGroup",
                          "A cache's tensors as one native object (KVCache.native_tensors): what the "
                          "binding lookup reads, made once.")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("tensors"))
      .def("unchanged", &TensorGroup::unchanged,
           "Whether every tensor is where and as it was when the group was made.")
      .def("__len__", &TensorGroup::size);
  m.def("run_program_checking", &run_program_checking, py::arg("program"), py::arg("src"),
        py::arg("dst"), py::arg("src_slots"), py::arg("dst_slots"), py::arg("skip_prefix"),
        py::arg("max_ctas"), py::arg("status"), py::arg("validate"), py::arg("src_positions"),
        py::arg("dst_positions"),
        "run_program of step 0 for slots not checked yet, each side's tensors a TensorGroup or a "
        "sequence: runs the common call (plain slot tensors, T from their length); False "
        "(nothing done) for anything else.");
  m.def("run_program", &run_program, py::arg("program"), py::arg("src"), py::arg("dst"),
        py::arg("src_slots"), py::arg("dst_slots"), py::arg("step"), py::arg("num_tokens"),
        py::arg("skip_prefix"), py::arg("max_ctas"), py::arg("status"), py::arg("validate"),
        "Runs a step of a program on these tensors without the dispatcher; False when the "
        "call needs the dispatcher (meta/fake tensors, subclasses, dispatch modes).");
}
