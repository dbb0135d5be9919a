#include <cuda_runtime.h>

#include "loraplex/kernels/table_write.h"

namespace loraplex::kernels::cuda {
namespace {

__global__ void write_column_kernel(WriteColumnArgs a) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < a.count) a.table[(a.first_row + i) * a.row_stride + a.col] = a.values[i];
}

}  // namespace

Status write_column(const WriteColumnArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.count >= 0 && a.count <= kMaxColumnValues, "write_column: count ", a.count,
                  " outside [0, ", kMaxColumnValues, "]");
  LORAPLEX_ENSURE(a.table != nullptr && a.row_stride >= 1 && a.first_row >= 0 && a.col >= 0,
                  "write_column: bad table (row stride ", a.row_stride, ", first row ", a.first_row,
                  ", column ", a.col, ")");
  if (a.count == 0) return Status();
  write_column_kernel<<<1, kMaxColumnValues, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status();
  return Status(StatusCode::kCudaError,
                detail::concat("write_column_kernel: ", cudaGetErrorString(err)));
}

}  // namespace loraplex::kernels::cuda
