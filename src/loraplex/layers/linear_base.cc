#include "loraplex/layers/linear_base.h"

#include <algorithm>

#include "loraplex/core/error.h"
#include "loraplex/kernels/dispatch/base_ops.h"

namespace loraplex {
namespace {

// The row pitch; a single row may carry any stride(0), so never report less than its width.
int64_t row_stride(const Tensor& t) { return std::max(t.stride(0), t.size(1)); }

void check_rows(const Tensor& t, const char* name, DType dtype, Device device) {
  LORAPLEX_CHECK(t.defined(), "linear_base: ", name, " is undefined");
  LORAPLEX_CHECK(t.dim() == 2, "linear_base: ", name, " must be 2-D, got ", t.describe());
  LORAPLEX_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "linear_base: ", name,
                 " needs contiguous rows, got strides ", shape_str(t.strides()));
  LORAPLEX_CHECK(t.dtype() == dtype && t.device() == device, "linear_base: ", name, " is ",
                 t.describe(), ", expected ", dtype, " on ", device);
}

// The checks and arguments both entry points share; the weight's dtype is checked by each.
kernels::GemmArgs gemm_args(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                            DType dtype, const Stream& stream) {
  LORAPLEX_CHECK(w.defined() && w.dim() == 2 && w.is_contiguous(),
                 "linear_base: weight must be contiguous [out, in], got ",
                 w.defined() ? w.describe() : "undefined");
  const Device device = w.device();
  LORAPLEX_CHECK(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16,
                 "linear_base: dtype ", dtype, ", expected float32, float16 or bfloat16");
  check_rows(x, "x", dtype, device);
  check_rows(y, "y", dtype, device);
  const int64_t m = x.size(0);
  const int64_t n = w.size(0);
  const int64_t k = w.size(1);
  LORAPLEX_CHECK(x.size(1) == k, "linear_base: x has ", x.size(1), " columns, the weight has in ",
                 k);
  LORAPLEX_CHECK(y.size(0) == m && y.size(1) == n, "linear_base: y is ", shape_str(y.shape()),
                 ", expected [", m, ", ", n, "]");
  if (bias.defined()) {
    LORAPLEX_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous() &&
                       bias.dtype() == dtype && bias.device() == device,
                   "linear_base: bias must be contiguous ", dtype, " [", n, "] on ", device,
                   ", got ", bias.describe());
  }
  LORAPLEX_CHECK(stream.device() == device, "linear_base: the weight is on ", device,
                 ", the stream on ", stream.device());
  kernels::GemmArgs a;
  a.dtype = dtype;
  a.w_dtype = w.dtype();
  a.m = m;
  a.n = n;
  a.k = k;
  a.x = x.data_ptr();
  a.x_row_stride = row_stride(x);
  a.w = w.data_ptr();
  a.w_row_stride = k;
  a.bias = bias.defined() ? bias.data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.y_row_stride = row_stride(y);
  return a;
}

}  // namespace

void linear_base(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                 const Stream& stream, bool accumulate) {
  LORAPLEX_CHECK(w.defined() && w.dtype() != DType::kF8E4M3,
                 "linear_base: a float8_e4m3 weight goes through linear_base_fp8 with its scales");
  kernels::GemmArgs a = gemm_args(x, w, bias, y, w.dtype(), stream);
  a.accumulate = accumulate;
  throw_if_error(kernels::dispatch_gemm_xwt(a, stream));
}

void linear_base_fp8(const Tensor& x, const Tensor& w, const Fp8Scales& scales, const Tensor& bias,
                     Tensor& y, const Tensor& scratch, const Stream& stream) {
  LORAPLEX_CHECK(w.defined() && w.dtype() == DType::kF8E4M3 && x.defined(),
                 "linear_base_fp8: the weight must be float8_e4m3, got ",
                 w.defined() ? w.describe() : "undefined");
  kernels::GemmArgs a = gemm_args(x, w, bias, y, x.dtype(), stream);
  const Device device = w.device();
  LORAPLEX_CHECK(scales.scale.defined() && scales.scale.dtype() == DType::kF32 &&
                     scales.scale.device() == device && scales.scale.is_contiguous(),
                 "linear_base_fp8: scales must be contiguous float32 on ", device, ", got ",
                 scales.scale.defined() ? scales.scale.describe() : "undefined");
  const kernels::Fp8WeightScales& l = scales.layout;
  const int64_t groups_n = (a.n + l.group_n - 1) / std::max<int64_t>(l.group_n, 1);
  const int64_t groups_k = (a.k + l.group_k - 1) / std::max<int64_t>(l.group_k, 1);
  const int64_t last = (groups_n - 1) * l.stride_n + (groups_k - 1) * l.stride_k;
  LORAPLEX_CHECK(l.group_n >= 1 && l.group_k >= 1 && last < scales.scale.numel(),
                 "linear_base_fp8: scales ", scales.scale.describe(), " are too small for a [", a.n,
                 ", ", a.k, "] weight in groups of ", l.group_n, " x ", l.group_k);
  a.w_scales = l;
  a.w_scales.scale = scales.scale.data<float>();
  if (scales.input_scale.defined()) {
    LORAPLEX_CHECK(scales.input_scale.numel() == 1 && scales.input_scale.dtype() == DType::kF32 &&
                       scales.input_scale.device() == device,
                   "linear_base_fp8: the input scale must be one float32 on ", device, ", got ",
                   scales.input_scale.describe());
    a.input_scale = scales.input_scale.data<float>();
  }
  if (device.is_cuda()) {
    const size_t need = kernels::fp8_gemm_scratch_bytes(a.m, a.k);
    LORAPLEX_CHECK(
        scratch.defined() && scratch.device() == device &&
            static_cast<size_t>(scratch.numel()) * dtype_size(scratch.dtype()) >= need,
        "linear_base_fp8: the activation scratch holds ",
        scratch.defined() ? scratch.numel() * static_cast<int64_t>(dtype_size(scratch.dtype())) : 0,
        " bytes, ", need, " needed for ", a.m, " x ", a.k, " activations");
    a.fp8_scratch = scratch.data_ptr();
    a.fp8_scratch_bytes = need;
  }
  throw_if_error(kernels::dispatch_gemm_xwt(a, stream));
}

}  // namespace loraplex
