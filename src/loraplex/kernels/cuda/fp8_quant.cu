// Activation quantisation for the FP8 base GEMM (kernels/fp8_quant.h): one block per (row,
// column group) finds the group's amax, then writes the codes. Plain and memory-bound: it reads
// x once and writes a byte per element, next to a GEMM that reads the whole weight.

#include <cuda_fp8.h>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/fp8_quant.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(QuantizeRowsFp8Args a) {
  const int64_t t = blockIdx.x;
  const int64_t g = blockIdx.y;
  const int64_t c0 = g * a.group;
  const int64_t c1 = min(a.k, c0 + a.group);
  const T* row = static_cast<const T*>(a.x) + t * a.x_row_stride;
  __shared__ float warp_amax[kThreads / 32];
  __shared__ float group_scale;
  if (a.static_scale != nullptr) {
    if (threadIdx.x == 0) group_scale = a.static_scale[0];
  } else {
    float m = 0.0f;
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) m = fmaxf(m, fabsf(to_float(row[c])));
    m = warp_max(m);
    const int warp = static_cast<int>(threadIdx.x) >> 5;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    if (lane == 0) warp_amax[warp] = m;
    __syncthreads();
    if (warp == 0) {
      float v = lane < kThreads / 32 ? warp_amax[lane] : 0.0f;
      v = warp_max(v);
      // The CPU's expression, operation for operation (IEEE division on both).
      if (lane == 0) group_scale = v > 0.0f ? fmaxf(v / 448.0f, 1e-30f) : 1.0f;
    }
  }
  __syncthreads();
  const float s = group_scale;
  if (threadIdx.x == 0) a.scale[g * a.m + t] = s;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) {
    a.q[t * a.k + c] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(to_float(row[c]) / s, __NV_SATFINITE, __NV_E4M3));
  }
}

}  // namespace

Status quantize_rows_fp8(const QuantizeRowsFp8Args& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_quantize_rows_fp8_args(a));
  if (a.m == 0) return Status();
  const int64_t groups = ceil_div(a.k, a.group);
  LORAPLEX_ENSURE(groups <= 65535 && a.m <= 0x7fffffff, "quantize_rows_fp8: ", a.m, " rows of ",
                  groups, " column groups exceed the launch grid");
  const dim3 grid(static_cast<unsigned>(a.m), static_cast<unsigned>(groups));
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    quantize_rows_kernel<T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  });
  return launch_status("quantize_rows_kernel");
}

}  // namespace loraplex::kernels::cuda
