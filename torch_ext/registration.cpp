// Operator schemas of kvlayout.
//
// Importing kvlayout._C (torch_ext/python_module.cpp) loads this library,
// whose static initialisers register the schemas below and every backend's
// implementations (TORCH_LIBRARY_IMPL in torch_ext/{cpu,cuda,sycl} and
// torch_ext/program.cpp). The ops are reached as torch.ops.kvlayout.*.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "program.h"

namespace kvlayout {
namespace {

std::vector<std::string> built_backends() {
  std::vector<std::string> out{"cpu"};
#ifdef KVLAYOUT_WITH_CUDA
  out.emplace_back("cuda");
#endif
#ifdef KVLAYOUT_WITH_SYCL
  out.emplace_back("xpu");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(kvlayout, m) {
  // Byte mover between two strided row layouts; see ops/_native.py and
  // torch_ext/include/kvlayout/address.h for the semantics.
  m.def(
      "copy_rows(Tensor[] src, Tensor(a!)[] dst, Tensor? src_slots, Tensor? dst_slots, "
      "int num_tokens, int skip_prefix, int[] src_segments, int[] dst_segments, "
      "int[] src_geometry, int[] dst_geometry, int num_pieces, int piece_bytes, "
      "int max_ctas, Tensor(b!) status, bool validate=False) -> ()");
  // validate: devices copy the slots to the host (a synchronisation) and check
  // them there (range, repeated destination slots) before launching; the CPU
  // always checks. Inside the op, so a compiled call keeps the check.
  // The same copy done by the copy engine (no SMs): the host reads the slots
  // (CPU tensors), coalesces runs and issues one memory copy per block.
  // Not capturable in a CUDA graph.
  m.def(
      "copy_runs(Tensor[] src, Tensor(a!)[] dst, Tensor? src_slots, Tensor? dst_slots, "
      "int num_tokens, int skip_prefix, int[] src_segments, int[] dst_segments, "
      "int[] src_geometry, int[] dst_geometry, int num_pieces, int piece_bytes) -> ()");
  // Runs step `step` of the registered copy program `program` (see
  // torch_ext/program.h) on the caches' tensor lists: step 0 copies every
  // chosen layer, step 1 + i the i-th chosen layer. The per-call arguments
  // are the slot tensors and counts; the geometry lives in the program.
  m.def(
      "copy_program(int program, Tensor[] src, Tensor(a!)[] dst, Tensor? src_slots, "
      "Tensor? dst_slots, int step, SymInt num_tokens, SymInt skip_prefix, int max_ctas, "
      "Tensor(b!) status, bool validate=False) -> ()");
  // Rotates cached keys from old to new RoPE positions (see kvlayout/rope.h).
  m.def(
      "rope_reposition(Tensor(a!) key, Tensor old_positions, Tensor new_positions, "
      "Tensor cos_sin_cache, bool is_neox, int max_ctas, Tensor(b!) status) -> ()");
  // Which backends this build contains ("cpu", "cuda", "xpu").
  m.def("built_backends() -> str[]", &built_backends);
}

// The ops write their (a!)/(b!) arguments in place; autograd must see them as
// it sees torch's own in-place ops. This Autograd kernel, run before any
// backend, refuses what torch refuses (a leaf that requires grad while grad
// mode is on; an inference tensor outside inference mode), runs the op, then
// bumps the version counter of every written tensor, so a tensor saved for
// backward notices the write. Without it the dispatcher falls through to the
// backend and writes behind autograd's back.
namespace {

template <class F>
void for_each_written(const c10::OperatorHandle& op, torch::jit::Stack* stack, const F& f) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  for (size_t i = 0; i < n; ++i) {
    if (!args[i].alias_info() || !args[i].alias_info()->isWrite()) continue;
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isTensor()) {
      f(v.toTensor(), args[i].name(), int64_t(-1));
    } else if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) f(list.get(j), args[i].name(), int64_t(j));
    }
  }
}

void inplace_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack) {
  const std::string op_name = op.schema().name();
  std::vector<at::Tensor> written;
  for_each_written(op, stack, [&](const at::Tensor& t, const std::string& name, int64_t j) {
    if (!t.defined()) return;
    check_writable(t, op_name.c_str(), name.c_str(), j);
    written.push_back(t);
  });
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written)
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, Autograd, m) {
  m.impl("copy_rows", torch::CppFunction::makeFromBoxedFunction<&inplace_autograd>());
  m.impl("copy_runs", torch::CppFunction::makeFromBoxedFunction<&inplace_autograd>());
  m.impl("copy_program", torch::CppFunction::makeFromBoxedFunction<&inplace_autograd>());
  m.impl("rope_reposition", torch::CppFunction::makeFromBoxedFunction<&inplace_autograd>());
}

}  // namespace kvlayout
