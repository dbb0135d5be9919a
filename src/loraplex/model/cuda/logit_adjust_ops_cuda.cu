// The logits adjustment on the GPU: one block per row. The block first computes each entry's
// new value from the logit as it is (into scratch), then, for rows with only_listed, sets the
// whole row to -inf, then writes the entries back; barriers separate the three phases. Each
// value is adjusted_logit() of logit_adjust_ops.h, the CPU's arithmetic (an add, a divide or
// multiply, a subtract, each rounded once: the _rn intrinsics are never fused), so both versions
// write the same floats, then round them to the logits' dtype the same way (to nearest even).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/model/logit_adjust_ops.h"

namespace loraplex::model::ops::cuda {
namespace {

using kernels::cuda::bf16;
using kernels::cuda::f16;
using kernels::cuda::from_float;
using kernels::cuda::launch_status;
using kernels::cuda::to_float;

constexpr int kThreads = 256;

__device__ __forceinline__ float adjust(float logit, const LogitAdjustment& e) {
  float l = __fadd_rn(logit, e.bias);
  l = l > 0.0f ? __fdiv_rn(l, e.repetition) : __fmul_rn(l, e.repetition);
  return __fsub_rn(l, e.subtract);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) adjust_logits_kernel(AdjustLogitsArgs a) {
  const int64_t r = blockIdx.x;
  T* row = static_cast<T*>(a.logits) + r * a.row_stride;
  const int32_t begin = a.row_begin[r];
  const int32_t end = a.row_begin[r + 1];
  for (int32_t k = begin + static_cast<int32_t>(threadIdx.x); k < end; k += kThreads) {
    const LogitAdjustment e = a.entries[k];
    a.scratch[k] = adjust(to_float(row[e.id]), e);
  }
  __syncthreads();
  if (a.only_listed[r] != 0) {
    for (int64_t j = threadIdx.x; j < a.vocab; j += kThreads) row[j] = from_float<T>(-INFINITY);
  }
  __syncthreads();
  for (int32_t k = begin + static_cast<int32_t>(threadIdx.x); k < end; k += kThreads) {
    row[a.entries[k].id] = from_float<T>(a.scratch[k]);
  }
}

}  // namespace

Status adjust_logits(const AdjustLogitsArgs& a, const Stream& stream) {
  LORAPLEX_RETURN_IF_ERROR(check_adjust_logits_args(a));
  if (a.num_rows == 0) return Status();
  LORAPLEX_ENSURE(a.entries != nullptr && a.scratch != nullptr,
                  "adjust_logits: entries or scratch is null");
  const auto s = static_cast<cudaStream_t>(stream.handle());
  const dim3 grid(static_cast<unsigned>(a.num_rows));
  switch (a.dtype) {
    case DType::kF16:
      adjust_logits_kernel<f16><<<grid, kThreads, 0, s>>>(a);
      break;
    case DType::kBF16:
      adjust_logits_kernel<bf16><<<grid, kThreads, 0, s>>>(a);
      break;
    default:
      adjust_logits_kernel<float><<<grid, kThreads, 0, s>>>(a);
  }
  return launch_status("adjust_logits_kernel");
}

}  // namespace loraplex::model::ops::cuda
