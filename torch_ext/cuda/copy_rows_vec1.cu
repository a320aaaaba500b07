// The copy_rows kernels of vector width 1 (see copy_rows_cuda.cuh).
#include "copy_rows_cuda.cuh"

namespace kvlayout {
namespace cuda_rows {

KVLAYOUT_CUDA_ROWS_INSTANCES(, 1);

}  // namespace cuda_rows
}  // namespace kvlayout
