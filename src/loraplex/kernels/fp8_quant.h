#pragma once
// Activation quantisation for the FP8 base GEMM on CUDA (W8A8): x rows to float8_e4m3 with
// float32 scales, dynamic (scale = amax / 448 over a group of columns: the whole row, or 128
// columns with 128x128 block weights) or static (the checkpoint's input scale). The CPU version
// defines the values (and lets the CUDA kernel be tested against it); the CPU GEMM itself never
// quantises x.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels {

/// q[t, c] = e4m3(x[t, c] / s), s = scale[g * m + t] for column group g = c / group: the
/// static scale static_scale[0] when given, else amax over the group's columns of the row / 448
/// (1 for a group of zeros). Each row's scales are written, static ones included (cuBLASLt's
/// per-token scale vector).
struct QuantizeRowsFp8Args {
  DType dtype = DType::kBF16;  // of x: f32, f16 or bf16
  int64_t m = 0;
  int64_t k = 0;
  const void* x = nullptr;  // [m, x_row_stride] in
  int64_t x_row_stride = 0;
  int64_t group = 0;                    // columns per scale: >= k (per token) or 128
  const float* static_scale = nullptr;  // [1] in, or nullptr (dynamic)
  uint8_t* q = nullptr;                 // [m, k] out, e4m3 codes, contiguous
  float* scale = nullptr;               // [ceil(k / group), m] out, tokens fastest
};

Status check_quantize_rows_fp8_args(const QuantizeRowsFp8Args& a);

namespace cpu {
Status quantize_rows_fp8(const QuantizeRowsFp8Args& a);
}  // namespace cpu

namespace cuda {
Status quantize_rows_fp8(const QuantizeRowsFp8Args& a, cuda_rt::StreamHandle stream);
}  // namespace cuda

}  // namespace loraplex::kernels
