// kvlayout::copy_rows on CUDA: registers the launcher of copy_rows_launch.h
// with the CudaRows policy (copy_rows_cuda.cuh). The kernels are compiled in
// copy_rows_vec*.cu.
#include <torch/library.h>

#include "../copy_rows_launch.h"
#include "../program.h"
#include "copy_rows_cuda.cuh"

namespace kvlayout {
namespace cuda_rows {

KVLAYOUT_CUDA_ROWS_INSTANCES(extern, 16);
KVLAYOUT_CUDA_ROWS_INSTANCES(extern, 8);
KVLAYOUT_CUDA_ROWS_INSTANCES(extern, 4);
KVLAYOUT_CUDA_ROWS_INSTANCES(extern, 2);
KVLAYOUT_CUDA_ROWS_INSTANCES(extern, 1);

namespace {
const bool registered =
    (register_bound_launch_factory(c10::DeviceType::CUDA, &make_rows_launch<CudaRows>), true);

}  // namespace
}  // namespace cuda_rows

TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("copy_rows", &copy_rows_impl<cuda_rows::CudaRows>); }

}  // namespace kvlayout
