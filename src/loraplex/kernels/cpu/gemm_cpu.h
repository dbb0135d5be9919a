#pragma once
// The CPU backend's matmul: y = x W^T (+ bias), the layout of every linear layer (W stored
// [out, in] as in checkpoints). Blocked and threaded over output tiles, with the operands
// packed to float so that the inner loop is a vectorisable outer-product update; f32
// accumulation for f32, f16 and bf16.

#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels::cpu {

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
};

/// y = x W^T (+ bias). Threaded over the pool (parallel_for); never throws.
Status gemm_xwt(const GemmArgs& args);

}  // namespace loraplex::kernels::cpu
