#pragma once
// Writes a few int32 entries of a device table (slot ranks, per-slot flags) in stream order,
// with the values carried by the kernel's arguments. Unlike a host-to-device copy, nothing on
// the host is read when the work runs, so the host may change its own copy of the table at
// once and never waits: an adapter upload can be enqueued on a copy stream and publish the
// slot's ranks after its weights without synchronising.
// In a build without CUDA the launcher returns an "unsupported" Status.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels::cuda {

inline constexpr int kMaxColumnValues = 8;

/// Up to kMaxColumnValues values, passed to the kernel by value.
struct ColumnValues {
  int32_t count = 0;
  int32_t values[kMaxColumnValues] = {};
};

/// table[(first_row + i) * row_stride + col] = values.values[i] for i < values.count, on
/// `stream`. table: int32 device memory of the current device, out.
Status write_column(int32_t* table, int64_t row_stride, int64_t first_row, int64_t col,
                    const ColumnValues& values, cuda_rt::StreamHandle stream);

}  // namespace loraplex::kernels::cuda
