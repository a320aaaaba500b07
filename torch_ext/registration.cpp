// Operator schemas of kvlayout and the Python module stub kvlayout._C.
//
// Importing kvlayout._C loads this library, whose static initialisers register
// the schemas below and every backend's implementations (TORCH_LIBRARY_IMPL in
// torch_ext/{cpu,cuda,sycl}). No Python bindings are needed: the ops are
// reached as torch.ops.kvlayout.*.
#include <Python.h>
#include <torch/library.h>

#include <string>
#include <vector>

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
      "int max_ctas, Tensor(b!) status) -> ()");
  // The same copy done by the copy engine (no SMs): the host reads the slots
  // (CPU tensors), coalesces runs and issues one memory copy per block.
  // Not capturable in a CUDA graph.
  m.def(
      "copy_runs(Tensor[] src, Tensor(a!)[] dst, Tensor? src_slots, Tensor? dst_slots, "
      "int num_tokens, int skip_prefix, int[] src_segments, int[] dst_segments, "
      "int[] src_geometry, int[] dst_geometry, int num_pieces, int piece_bytes) -> ()");
  // Rotates cached keys from old to new RoPE positions (see kvlayout/rope.h).
  m.def(
      "rope_reposition(Tensor(a!) key, Tensor old_positions, Tensor new_positions, "
      "Tensor cos_sin_cache, bool is_neox, int max_ctas, Tensor(b!) status) -> ()");
  // Which backends this build contains ("cpu", "cuda", "xpu").
  m.def("built_backends() -> str[]", &built_backends);
}

}  // namespace kvlayout

static struct PyModuleDef kvlayout_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                               "kvlayout native ops (torch.ops.kvlayout)", -1,
                                               nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvlayout_c_module); }
