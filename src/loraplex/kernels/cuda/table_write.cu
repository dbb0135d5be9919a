#include <cuda_runtime.h>

#include "loraplex/kernels/cuda/table_write.h"

namespace loraplex::kernels::cuda {
namespace {

__global__ void write_column_kernel(int32_t* table, int64_t row_stride, int64_t first_row,
                                    int64_t col, ColumnValues values) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < values.count) table[(first_row + i) * row_stride + col] = values.values[i];
}

}  // namespace

Status write_column(int32_t* table, int64_t row_stride, int64_t first_row, int64_t col,
                    const ColumnValues& values, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(values.count >= 0 && values.count <= kMaxColumnValues, "write_column: count ",
                  values.count, " outside [0, ", kMaxColumnValues, "]");
  LORAPLEX_ENSURE(table != nullptr && row_stride >= 1 && first_row >= 0 && col >= 0,
                  "write_column: bad table (row stride ", row_stride, ", first row ", first_row,
                  ", column ", col, ")");
  if (values.count == 0) return Status();
  write_column_kernel<<<1, kMaxColumnValues, 0, static_cast<cudaStream_t>(stream)>>>(
      table, row_stride, first_row, col, values);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status();
  return Status(StatusCode::kCudaError,
                detail::concat("write_column_kernel: ", cudaGetErrorString(err)));
}

}  // namespace loraplex::kernels::cuda
