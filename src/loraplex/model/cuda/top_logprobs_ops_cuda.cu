// Top logprobs on the GPU: one block per row. The row's maximum and its sum of exp(l - max)
// (in double, as the CPU) come first; then k rounds, each a block-wide search for the best
// logit ranked after the previous round's pick (larger first, ties to the lower id), so no
// list of picked ids is needed. O(k * vocab) per row: meant for k <= 20.

#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/model/top_logprobs_ops.h"

namespace loraplex::model::ops::cuda {
namespace {

using kernels::cuda::bf16;
using kernels::cuda::f16;
using kernels::cuda::launch_status;
using kernels::cuda::to_float;

constexpr int kThreads = 256;

// Whether (va, ia) ranks before (vb, ib); NaN ranks after everything.
__device__ __forceinline__ bool before(float va, int32_t ia, float vb, int32_t ib) {
  if (isnan(va) != isnan(vb)) return isnan(vb);
  return va > vb || (va == vb && ia < ib) || (isnan(va) && ia < ib);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) top_logprobs_kernel(TopLogprobsArgs a) {
  __shared__ double dsum[kThreads];
  __shared__ float val[kThreads];
  __shared__ int32_t idx[kThreads];
  const int64_t r = blockIdx.x;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  const int tid = static_cast<int>(threadIdx.x);

  float m = -INFINITY;
  for (int64_t j = tid; j < a.vocab; j += kThreads) {
    const float v = to_float(row[j]);
    if (!isnan(v)) m = fmaxf(m, v);
  }
  val[tid] = m;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (tid < s) val[tid] = fmaxf(val[tid], val[tid + s]);
    __syncthreads();
  }
  m = val[0];
  __syncthreads();
  double sum = 0.0;
  for (int64_t j = tid; j < a.vocab; j += kThreads) {
    const float v = to_float(row[j]);
    if (!isnan(v)) sum += v == m ? 1.0 : exp(static_cast<double>(v) - static_cast<double>(m));
  }
  dsum[tid] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (tid < s) dsum[tid] += dsum[tid + s];
    __syncthreads();
  }
  const double log_sum = log(dsum[0]);

  float prev_v = 0.0f;
  int32_t prev_i = -1;  // none yet: every element is eligible
  for (int t = 0; t < a.k; ++t) {
    float best_v = NAN;
    int32_t best_i = INT32_MAX;
    for (int64_t j = tid; j < a.vocab; j += kThreads) {
      const float v = to_float(row[j]);
      const int32_t i = static_cast<int32_t>(j);
      if (prev_i >= 0 && !before(prev_v, prev_i, v, i)) continue;
      if (best_i == INT32_MAX || before(v, i, best_v, best_i)) {
        best_v = v;
        best_i = i;
      }
    }
    val[tid] = best_v;
    idx[tid] = best_i;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s /= 2) {
      if (tid < s && idx[tid + s] != INT32_MAX &&
          (idx[tid] == INT32_MAX || before(val[tid + s], idx[tid + s], val[tid], idx[tid]))) {
        val[tid] = val[tid + s];
        idx[tid] = idx[tid + s];
      }
      __syncthreads();
    }
    prev_v = val[0];
    prev_i = idx[0];
    if (tid == 0) {
      const double x = prev_v;
      a.ids[r * a.k + t] = prev_i;
      a.logprobs[r * a.k + t] = static_cast<float>((x == m ? 0.0 : x - m) - log_sum);
    }
    __syncthreads();
  }
}

}  // namespace

Status top_logprobs(const TopLogprobsArgs& a, const Stream& stream) {
  LORAPLEX_RETURN_IF_ERROR(check_top_logprobs_args(a));
  if (a.num_rows == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream.handle());
  const dim3 grid(static_cast<unsigned>(a.num_rows));
  switch (a.dtype) {
    case DType::kF16:
      top_logprobs_kernel<f16><<<grid, kThreads, 0, s>>>(a);
      break;
    case DType::kBF16:
      top_logprobs_kernel<bf16><<<grid, kThreads, 0, s>>>(a);
      break;
    default:
      top_logprobs_kernel<float><<<grid, kThreads, 0, s>>>(a);
  }
  return launch_status("top_logprobs_kernel");
}

}  // namespace loraplex::model::ops::cuda
