#pragma once
// Writes a few int32 entries of a device table (slot ranks, per-slot flags) in stream order,
// with the values carried by the kernel's arguments. Unlike a host-to-device copy, nothing on
// the host is read when the work runs, so the host may change its own copy of the table at
// once and never waits: an adapter upload can be enqueued on a copy stream and publish the
// slot's ranks after its weights without synchronising.
// The CPU version writes at once; kernels/dispatch/base_ops.h routes between them. In a build
// without CUDA the CUDA launcher returns an "unsupported" Status.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels {

inline constexpr int kMaxColumnValues = 8;

/// table[(first_row + i) * row_stride + col] = values[i] for i < count.
struct WriteColumnArgs {
  int32_t* table = nullptr;  // int32 [rows, row_stride] out
  int64_t row_stride = 0;
  int64_t first_row = 0;
  int64_t col = 0;
  int32_t count = 0;  // at most kMaxColumnValues
  int32_t values[kMaxColumnValues] = {};
};

namespace cpu {
Status write_column(const WriteColumnArgs& args);
}  // namespace cpu

namespace cuda {
/// On `stream`, with the values in the kernel's arguments (device memory of the current device).
Status write_column(const WriteColumnArgs& args, cuda_rt::StreamHandle stream);
}  // namespace cuda

}  // namespace loraplex::kernels
