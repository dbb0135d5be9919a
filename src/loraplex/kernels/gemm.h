#pragma once
// The base GEMM of every linear layer: y = x W^T (+ bias), W stored [out, in] as in checkpoints.
// The CPU version (cpu/gemm_cpu.h) is blocked and threaded with f32 accumulation; the CUDA
// version runs cuBLASLt (cuda/cublaslt_gemm.cc: fp32 compute, TF32 off for f32) on the current
// device. punica/op_dispatch routes between them.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels {

/// Which build of the CPU kernels runs: the best the CPU supports, or the portable baseline (so
/// tests cover both on machines with AVX2).
enum class GemmIsa { kAuto, kBaseline };

struct GemmArgs {
  DType dtype = DType::kF32;   // of x, w, bias and y: f32, f16 or bf16
  int64_t m = 0;               // rows of x and y (tokens)
  int64_t n = 0;               // rows of w, columns of y (out features)
  int64_t k = 0;               // columns of x and w (in features)
  const void* x = nullptr;     // [m, x_row_stride] in
  int64_t x_row_stride = 0;    // >= k
  const void* w = nullptr;     // [n, w_row_stride] in
  int64_t w_row_stride = 0;    // >= k
  const void* bias = nullptr;  // [n] in, or nullptr
  void* y = nullptr;           // [m, y_row_stride] out (in/out with accumulate)
  int64_t y_row_stride = 0;    // >= n
  // y += x W^T (+ bias) instead of y = ...; the sum is rounded once.
  bool accumulate = false;
  GemmIsa isa = GemmIsa::kAuto;  // the CPU's kernels
};

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
