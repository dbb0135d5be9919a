#include <algorithm>
#include <cmath>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/fp8_quant.h"

namespace loraplex::kernels {

Status check_quantize_rows_fp8_args(const QuantizeRowsFp8Args& a) {
  const char* op = "quantize_rows_fp8";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.m >= 0 && a.k >= 1 && a.x_row_stride >= a.k && a.group >= 1, op, ": m ", a.m,
                  ", k ", a.k, ", row stride ", a.x_row_stride, ", group ", a.group,
                  " (expected k >= 1, a row stride >= k and group >= 1)");
  LORAPLEX_ENSURE(a.m == 0 || (a.x != nullptr && a.q != nullptr && a.scale != nullptr), op,
                  ": null operand");
  return Status();
}

namespace cpu {

Status quantize_rows_fp8(const QuantizeRowsFp8Args& a) {
  LORAPLEX_RETURN_IF_ERROR(check_quantize_rows_fp8_args(a));
  const int64_t groups = (a.k + a.group - 1) / a.group;
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.x);
    parallel_for(0, a.m, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const T* row = x + t * a.x_row_stride;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t c0 = g * a.group;
          const int64_t c1 = std::min(a.k, c0 + a.group);
          float s = 1.0f;
          if (a.static_scale != nullptr) {
            s = a.static_scale[0];
          } else {
            float amax = 0.0f;
            for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(load_float(row[c])));
            if (amax > 0.0f) s = std::max(amax / kE4M3Max, 1e-30f);
          }
          a.scale[g * a.m + t] = s;
          for (int64_t c = c0; c < c1; ++c)
            a.q[t * a.k + c] = float_to_e4m3_bits(load_float(row[c]) / s);
        }
      }
    });
  });
  return Status();
}

}  // namespace cpu
}  // namespace loraplex::kernels
