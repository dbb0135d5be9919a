#include "loraplex/layers/linear_base.h"

#include <algorithm>

#include "loraplex/core/error.h"
#include "loraplex/punica/op_dispatch.h"

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

}  // namespace

void linear_base(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                 const Stream& stream, bool accumulate) {
  LORAPLEX_CHECK(w.defined() && w.dim() == 2 && w.is_contiguous(),
                 "linear_base: weight must be contiguous [out, in], got ",
                 w.defined() ? w.describe() : "undefined");
  const DType dtype = w.dtype();
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
  a.accumulate = accumulate;
  throw_if_error(dispatch_gemm_xwt(a, stream));
}

}  // namespace loraplex
