#pragma once
// y = x W^T (+ bias) through cuBLASLt. Built only with the CUDA backend; linear_base() is the
// public entry point.

#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::cuda_blas {

struct GemmXwtArgs {
  DType dtype = DType::kBF16;  // of x, w, bias, y: f32 (TF32 off), f16 or bf16 (f32 accumulate)
  int64_t m = 0;               // rows of x and y
  int64_t n = 0;               // rows of w, columns of y
  int64_t k = 0;               // columns of x and w
  const void* x = nullptr;     // [m, ldx] in, device
  int64_t ldx = 0;
  const void* w = nullptr;  // [n, ldw] in, device
  int64_t ldw = 0;
  const void* bias = nullptr;  // [n] in, device, or nullptr
  void* y = nullptr;           // [m, ldy] out (in/out with accumulate), device
  int64_t ldy = 0;
  bool accumulate = false;
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
};

/// Plans (cached per thread and problem) and runs the GEMM; never throws.
Status gemm_xwt(const GemmXwtArgs& args);

}  // namespace loraplex::cuda_blas
