#pragma once
// The base GEMM of every linear layer: y = x W^T (+ bias), W stored [out, in] as in checkpoints,
// in the activation dtype or in fp8 (float8_e4m3) with float32 scales (FP8 checkpoints).
// The CPU version (cpu/gemm_cpu.h) is blocked and threaded with f32 accumulation and dequantises
// fp8 weights as it packs them (the dequantised model, x never quantised); the CUDA version runs
// cuBLASLt (cuda/cublaslt_gemm.cc: fp32 compute, TF32 off for f32; fp8 weights as W8A8, x
// quantised to e4m3 first) on the current device. kernels/dispatch/base_ops.h routes between them.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels {

/// Which build of the CPU kernels runs: the best the CPU supports, or the portable baseline (so
/// tests cover both on machines with AVX2).
enum class GemmIsa { kAuto, kBaseline };

/// The scales of an fp8 weight: w[r, c] = q[r, c] * scale[(r / group_n) * stride_n +
/// (c / group_k) * stride_k]. The layouts a layer uses (layers/fp8_weight.h):
///   per output row:  group_n 1, group_k >= k, stride_n 1, stride_k 0     ([n])
///   blocks:          group_n = bn, group_k = bk, stride_n >= ceil(k / bk), stride_k 1
///                    ([ceil(n / bn), stride_n], row-major as checkpoints store them; cuBLASLt
///                    wants stride_n = ceil(k / 128) rounded up to a multiple of 4)
///   row x k-group:   group_n 1, group_k = bk, stride_n 1, stride_k n
///                    ([ceil(k / bk), n]: a block scale repeated on each of its rows, rows
///                    fastest, for merged layers whose slices do not start on a block)
/// On CUDA: per row -> cuBLASLt's OUTER_VEC_32F with x scaled per token (OUTER_VEC_32F);
/// 128x128 blocks -> BLK128x128_32F with x scaled per token and 128 columns (VEC128_32F);
/// row x 128 columns -> VEC128_32F with the same x scales. Other layouts run on the CPU only.
struct Fp8WeightScales {
  const float* scale = nullptr;
  int64_t group_n = 1;
  int64_t group_k = 0;
  int64_t stride_n = 1;
  int64_t stride_k = 0;
};

/// Bytes of CUDA scratch an fp8-weight GEMM of m x k activations needs: x quantised to e4m3
/// [m, k] and, from fp8_gemm_scales_offset(m, k) on, its float32 scales (per token, or per
/// token and 128-column group).
size_t fp8_gemm_scratch_bytes(int64_t m, int64_t k);
size_t fp8_gemm_scales_offset(int64_t m, int64_t k);

struct GemmArgs {
  DType dtype = DType::kF32;    // of x, bias and y: f32, f16 or bf16
  int64_t m = 0;                // rows of x and y (tokens)
  int64_t n = 0;                // rows of w, columns of y (out features)
  int64_t k = 0;                // columns of x and w (in features)
  const void* x = nullptr;      // [m, x_row_stride] in
  int64_t x_row_stride = 0;     // >= k
  DType w_dtype = DType::kF32;  // of w: `dtype`, or float8_e4m3 with w_scales
  const void* w = nullptr;      // [n, w_row_stride] in
  int64_t w_row_stride = 0;     // >= k
  Fp8WeightScales w_scales;     // fp8 w only, in
  const void* bias = nullptr;   // [n] in, or nullptr
  void* y = nullptr;            // [m, y_row_stride] out (in/out with accumulate)
  int64_t y_row_stride = 0;     // >= n
  // y += x W^T (+ bias) instead of y = ...; the sum is rounded once.
  bool accumulate = false;
  GemmIsa isa = GemmIsa::kAuto;  // the CPU's kernels
  // fp8 w on CUDA (W8A8): x is quantised to e4m3 into `fp8_scratch` first, with the static
  // scale input_scale[0] when given, else per token (per token and 128-column group when the
  // weight's scales are per 128 columns). The CPU ignores these: it multiplies x as it is.
  const float* input_scale = nullptr;  // [1] in, or nullptr (dynamic)
  void* fp8_scratch = nullptr;         // [fp8_scratch_bytes] scratch
  size_t fp8_scratch_bytes = 0;        // >= fp8_gemm_scratch_bytes(m, k)
};

/// The argument checks both versions share (sizes, dtypes, strides and the scale layout).
Status check_gemm_args(const GemmArgs& args);

namespace cpu {
/// Threaded over the pool (parallel_for); never throws.
Status gemm_xwt(const GemmArgs& args);
}  // namespace cpu

namespace cuda {
/// cuBLASLt on the current device; plans are cached per thread and problem, workspaces per
/// thread, device and stream. Never throws.
Status gemm_xwt(const GemmArgs& args, cuda_rt::StreamHandle stream);
}  // namespace cuda

}  // namespace loraplex::kernels
