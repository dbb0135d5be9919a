#include <algorithm>

#include "loraplex/kernels/gemm.h"

namespace loraplex::kernels {
namespace {

constexpr size_t kScratchAlign = 256;
constexpr int64_t kActGroup = 128;  // columns of an activation scale with 128-column weight groups

size_t align_up(size_t v) { return (v + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

}  // namespace

size_t fp8_gemm_scales_offset(int64_t m, int64_t k) { return align_up(static_cast<size_t>(m * k)); }

size_t fp8_gemm_scratch_bytes(int64_t m, int64_t k) {
  const int64_t groups = (std::max<int64_t>(k, 1) + kActGroup - 1) / kActGroup;
  return fp8_gemm_scales_offset(m, k) + static_cast<size_t>(m * groups) * sizeof(float);
}

Status check_gemm_args(const GemmArgs& a) {
  const char* op = "gemm_xwt";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.w_dtype == a.dtype || a.w_dtype == DType::kF8E4M3, op, ": weight dtype ",
                  a.w_dtype, ", expected ", a.dtype, " (the activations') or float8_e4m3");
  LORAPLEX_ENSURE(a.m >= 0 && a.n >= 0 && a.k >= 0, op, ": negative size (m ", a.m, ", n ", a.n,
                  ", k ", a.k, ")");
  LORAPLEX_ENSURE(a.x_row_stride >= a.k && a.w_row_stride >= a.k && a.y_row_stride >= a.n, op,
                  ": row strides (x ", a.x_row_stride, ", w ", a.w_row_stride, ", y ",
                  a.y_row_stride, ") must cover k ", a.k, " and n ", a.n);
  if (a.w_dtype != DType::kF8E4M3) return Status();
  const Fp8WeightScales& s = a.w_scales;
  LORAPLEX_ENSURE(s.scale != nullptr, op, ": a float8_e4m3 weight needs its scales");
  LORAPLEX_ENSURE(s.group_n >= 1 && s.group_k >= 1 && s.stride_n >= 0 && s.stride_k >= 0, op,
                  ": weight scale groups ", s.group_n, " x ", s.group_k, " with strides ",
                  s.stride_n, ", ", s.stride_k, ", expected groups >= 1 and strides >= 0");
  return Status();
}

}  // namespace loraplex::kernels
