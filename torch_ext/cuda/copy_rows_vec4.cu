// The copy_rows kernels of vector width 4 (see copy_rows_cuda.cuh).
#include "copy_rows_cuda.cuh"

namespace kvlayout {
namespace cuda_rows {

KVLAYOUT_CUDA_ROWS_INSTANCES(, 4);

}  // namespace cuda_rows
}  // namespace kvlayout
