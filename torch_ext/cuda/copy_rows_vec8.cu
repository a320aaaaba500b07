// The copy_rows kernels of vector width 8 (see copy_rows_cuda.cuh).
#include "copy_rows_cuda.cuh"

namespace kvlayout {
namespace cuda_rows {

KVLAYOUT_CUDA_ROWS_INSTANCES(, 8);

}  // namespace cuda_rows
}  // namespace kvlayout
