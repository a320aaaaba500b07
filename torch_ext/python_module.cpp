// kvlayout._C: loading it registers the ops (torch.ops.kvlayout.*); its
// Python names are the direct, dispatcher-free entry points of copy
// programs (torch_ext/program.h), which a layer-wise pipeline calls once per
// layer: the op dispatcher costs more host time than the launch itself.
//
//   LaunchSpec, register_program   the planner's output, registered once
//   PreparedCopy                   a program bound to tensors, run per call
//   run_program                    a program run on these tensors (bindings
//                                  cached by address); False when the call
//                                  must go through the dispatcher instead
#include <torch/csrc/utils/pybind.h>  // pybind11 with the at::Tensor casters (lighter than torch/extension.h)

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvlayout/status.h"
#include "program.h"

namespace py = pybind11;

namespace kvlayout {
namespace {

using Geometry5 = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

RowGeometry to_geometry(const Geometry5& g) {
  return RowGeometry{std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g),
                     std::get<4>(g)};
}

Geometry5 from_geometry(const RowGeometry& g) {
  return {g.num_slots, g.page_size, g.stride_page, g.stride_in_page, g.stride_piece};
}

std::vector<Segment> to_segments(const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  std::vector<Segment> out;
  out.reserve(pairs.size());
  for (const auto& [t, o] : pairs) out.push_back(Segment{t, o});
  return out;
}

std::vector<std::pair<int64_t, int64_t>> from_segments(const std::vector<Segment>& segs) {
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(segs.size());
  for (const Segment& s : segs) out.emplace_back(s.tensor, s.offset);
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

void run_bound(const BoundProgram& bound, int64_t step, at::TensorList dst, const RunArgs& args) {
  check_written(bound, step, dst);
  if (bound.device().is_cpu()) {
    py::gil_scoped_release release;  // a host copy may take a while
    bound.run(step, args);
  } else {
    bound.run(step, args);
  }
  bump_written(bound, step, dst);
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
    bound_ = std::make_shared<const BoundProgram>(handle, src_, dst_, device_, status_);
  }

  // The per-call arguments, kept until the next set_call: a layer call then
  // passes only its step.
  void set_call(std::optional<at::Tensor> src_slots, std::optional<at::Tensor> dst_slots,
                int64_t num_tokens, int64_t skip_prefix, int64_t max_ctas, bool validate,
                bool dependent_launch, bool early_loads) {
    args_ = RunArgs{std::move(src_slots), std::move(dst_slots), num_tokens, skip_prefix, max_ctas,
                    validate, dependent_launch, early_loads};
  }

  void run(int64_t step) const {
    bound_->check_still_bound(step, src_, dst_, "kvlayout: prepared transfer");
    run_bound(*bound_, step, dst_, args_);
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
    if (!plain_slots(src_slots, ss) || !plain_slots(dst_slots, ds)) return false;
    int64_t T = -1;
    if (ss.has_value()) {
      T = ss->size(0);
      if (ds.has_value() ? ds->size(0) != T : (dst_positions_ < 0 || T > dst_positions_))
        return false;
    } else if (ds.has_value()) {
      T = ds->size(0);
      if (src_positions_ < 0 || T > src_positions_) return false;
    } else {
      return false;
    }
    if (skip_prefix < 0 || skip_prefix > T) return false;
    return run_with(step, ss, ds, T, skip_prefix, max_ctas, validate);
  }

  int64_t num_steps() const { return bound_->num_steps(); }
  std::string device() const { return device_.str(); }

 private:
  // None, or a 1-D int32/int64 tensor on the launch device or the host (into `out`).
  bool plain_slots(py::handle h, std::optional<at::Tensor>& out) const {
    if (h.is_none()) return true;
    if (!THPVariable_Check(h.ptr())) return false;
    const at::Tensor& t = THPVariable_Unpack(h.ptr());
    const auto dtype = t.scalar_type();
    if (t.dim() != 1 || (dtype != at::kInt && dtype != at::kLong) ||
        !(t.device().is_cpu() || t.device() == device_))
      return false;
    out = t;
    return true;
  }

  std::vector<at::Tensor> src_, dst_;
  at::Tensor status_;
  int64_t src_positions_ = -1, dst_positions_ = -1;
  c10::Device device_{c10::kCPU};
  std::shared_ptr<const BoundProgram> bound_;
  RunArgs args_;
};

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

bool run_program(int64_t handle, const std::vector<at::Tensor>& src,
                 const std::vector<at::Tensor>& dst, const std::optional<at::Tensor>& src_slots,
                 const std::optional<at::Tensor>& dst_slots, int64_t step, int64_t num_tokens,
                 int64_t skip_prefix, int64_t max_ctas, const at::Tensor& status, bool validate) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || needs_dispatcher(src) ||
      needs_dispatcher(dst) || needs_dispatcher(src_slots) || needs_dispatcher(dst_slots))
    return false;
  const c10::Device device = program_device(src, dst, src_slots, dst_slots);
  const auto bound = bound_program(handle, src, dst, device, status);
  run_bound(*bound, step, dst,
            RunArgs{src_slots, dst_slots, num_tokens, skip_prefix, max_ctas, validate});
  return true;
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

  py::class_<LaunchSpec>(m, "LaunchSpec",
                         "One copy_rows launch of a copy program (see torch_ext/program.h).\n\n"
                         "Geometries are (num_slots, page_size, stride_page, stride_in_page, "
                         "stride_piece) in bytes; segments are (tensor index, byte offset) pairs.")
      .def(py::init([](Geometry5 src_geometry, Geometry5 dst_geometry, int64_t num_pieces,
                       int64_t piece_bytes, std::vector<std::pair<int64_t, int64_t>> src_segments,
                       std::vector<std::pair<int64_t, int64_t>> dst_segments) {
             LaunchSpec l;
             l.src_geometry = to_geometry(src_geometry);
             l.dst_geometry = to_geometry(dst_geometry);
             l.num_pieces = num_pieces;
             l.piece_bytes = piece_bytes;
             l.src_segments = to_segments(src_segments);
             l.dst_segments = to_segments(dst_segments);
             return l;
           }),
           py::arg("src_geometry"), py::arg("dst_geometry"), py::arg("num_pieces"),
           py::arg("piece_bytes"), py::arg("src_segments"), py::arg("dst_segments"))
      .def_property_readonly("src_geometry", [](const LaunchSpec& l) { return from_geometry(l.src_geometry); })
      .def_property_readonly("dst_geometry", [](const LaunchSpec& l) { return from_geometry(l.dst_geometry); })
      .def_readonly("num_pieces", &LaunchSpec::num_pieces)
      .def_readonly("piece_bytes", &LaunchSpec::piece_bytes)
      .def_property_readonly("src_segments", [](const LaunchSpec& l) { return from_segments(l.src_segments); })
      .def_property_readonly("dst_segments", [](const LaunchSpec& l) { return from_segments(l.dst_segments); });

  m.def(
      "register_program",
      [](std::vector<std::vector<LaunchSpec>> steps, int64_t num_src_tensors,
         int64_t num_dst_tensors) {
        CopyProgram p;
        p.steps = std::move(steps);
        p.num_src_tensors = num_src_tensors;
        p.num_dst_tensors = num_dst_tensors;
        return register_program(std::move(p));
      },
      py::arg("steps"), py::arg("num_src_tensors"), py::arg("num_dst_tensors"),
      "Registers a copy program (steps: [all layers, layer 0, layer 1, ...], each a list of "
      "LaunchSpec) and returns its handle.");

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
  m.def("early_load_launches", &early_load_launches,
        "How many copy launches this process made whose loads could start before the previous "
        "kernel of their stream ended (dependent launches, captured in a CUDA graph or on a "
        "stream promised by early_loads=True, where no launch that may still run writes what "
        "they read).");
  m.def("run_program", &run_program, py::arg("program"), py::arg("src"), py::arg("dst"),
        py::arg("src_slots"), py::arg("dst_slots"), py::arg("step"), py::arg("num_tokens"),
        py::arg("skip_prefix"), py::arg("max_ctas"), py::arg("status"), py::arg("validate"),
        "Runs a step of a program on these tensors without the dispatcher; False when the "
        "call needs the dispatcher (meta/fake tensors, subclasses, dispatch modes).");
}
