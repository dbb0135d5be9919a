// Activation quantisation for the FP8 GEMM (kernels/fp8_quant.h) on the CPU: the scale layout
// (column groups, tokens fastest), dynamic and static scales, against a loop written from the
// definition, and every code within e4m3's rounding bound of its input.

#include "loraplex/kernels/fp8_quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "support/random_data.h"

namespace loraplex {
namespace {

struct Case {
  int64_t m, k, pad, group;
  bool static_scale;
};

TEST(QuantizeRowsFp8, CpuMatchesTheDefinitionAndE4m3Bound) {
  const Case cases[] = {{1, 1, 0, 1, false},     {3, 200, 5, 200, false}, {7, 300, 0, 128, false},
                        {5, 256, 3, 128, false}, {4, 130, 0, 130, true},  {9, 77, 2, 1000, false}};
  std::mt19937_64 rng(31);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : cases) {
      const std::string what = std::string(dtype_name(dt)) + " m" + std::to_string(c.m) + " k" +
                               std::to_string(c.k) + " group " + std::to_string(c.group);
      Tensor x = test::random_tensor({c.m, c.k + c.pad}, dt, rng, 3.0f);
      // A zero row: its scale is 1 and its codes 0.
      for (int64_t j = 0; j < c.k; ++j) x.narrow(0, 0, 1).narrow(1, j, 1).zero_();
      const std::vector<double> xv = x.to_double_vector();
      const int64_t groups = (c.k + c.group - 1) / c.group;
      std::vector<uint8_t> q(static_cast<size_t>(c.m * c.k), 0xaa);
      std::vector<float> scale(static_cast<size_t>(groups * c.m), -1.0f);
      const float fixed = 0.0125f;
      kernels::QuantizeRowsFp8Args a;
      a.dtype = dt;
      a.m = c.m;
      a.k = c.k;
      a.x = x.data_ptr();
      a.x_row_stride = c.k + c.pad;
      a.group = c.group;
      a.static_scale = c.static_scale ? &fixed : nullptr;
      a.q = q.data();
      a.scale = scale.data();
      ASSERT_TRUE(kernels::cpu::quantize_rows_fp8(a).ok()) << what;
      for (int64_t t = 0; t < c.m; ++t) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t c0 = g * c.group;
          const int64_t c1 = std::min(c.k, c0 + c.group);
          double amax = 0.0;
          for (int64_t j = c0; j < c1; ++j)
            amax = std::max(amax, std::fabs(xv[t * a.x_row_stride + j]));
          const float want = c.static_scale ? fixed
                             : amax > 0.0   ? static_cast<float>(amax) / kE4M3Max
                                            : 1.0f;
          const float got = scale[static_cast<size_t>(g * c.m + t)];
          ASSERT_EQ(got, want) << what << " row " << t << " group " << g;
          for (int64_t j = c0; j < c1; ++j) {
            const double v = xv[t * a.x_row_stride + j];
            const uint8_t code = q[static_cast<size_t>(t * c.k + j)];
            ASSERT_EQ(code, float_to_e4m3_bits(static_cast<float>(v) / got)) << what;
            // e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value, 2^-10 of the
            // scale below the normal range; static scales may saturate, dynamic ones never.
            const double back = static_cast<double>(e4m3_bits_to_float(code)) * got;
            const double clipped = std::clamp(v, -448.0 * got, 448.0 * got);
            EXPECT_LE(std::fabs(back - clipped),
                      std::fabs(clipped) * 0.0625 + got * std::ldexp(1.0, -10) + 1e-30)
                << what << " row " << t << " column " << j;
          }
        }
      }
    }
  }
}

TEST(QuantizeRowsFp8, RefusesBadArguments) {
  kernels::QuantizeRowsFp8Args a;
  a.dtype = DType::kF8E4M3;
  a.m = 1;
  a.k = 4;
  a.x_row_stride = 4;
  a.group = 4;
  Status s = kernels::cpu::quantize_rows_fp8(a);
  EXPECT_NE(s.message().find("dtype float8_e4m3"), std::string::npos) << s.message();
  a.dtype = DType::kBF16;
  a.x_row_stride = 3;
  s = kernels::cpu::quantize_rows_fp8(a);
  EXPECT_NE(s.message().find("row stride 3"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace loraplex
