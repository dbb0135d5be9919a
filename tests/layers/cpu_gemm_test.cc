// The CPU backend's GEMM (y = x W^T + bias) against a double loop: odd sizes around the tile
// edges, strided rows, every activation dtype, accumulate mode.

#include "loraplex/kernels/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>

#include "support/random_data.h"

namespace loraplex {
namespace {

struct GemmCase {
  int64_t m, n, k;
  bool bias;
  bool accumulate;
  int64_t pad;  // extra columns in every row stride
};

void check_gemm(DType dtype, const GemmCase& c, kernels::GemmIsa isa, std::mt19937_64& rng) {
  const std::string name = std::string(isa == kernels::GemmIsa::kAuto ? "auto " : "baseline ") +
                           std::string(dtype_name(dtype)) + " m" + std::to_string(c.m) + " n" +
                           std::to_string(c.n) + " k" + std::to_string(c.k);
  const Tensor x = test::random_tensor({c.m, c.k + c.pad}, dtype, rng);
  const Tensor w = test::random_tensor({c.n, c.k + c.pad}, dtype, rng);
  const Tensor bias = test::random_tensor({c.n}, dtype, rng);
  Tensor y = test::random_tensor({c.m, c.n + c.pad}, dtype, rng);
  const std::vector<double> xv = x.to_double_vector();
  const std::vector<double> wv = w.to_double_vector();
  const std::vector<double> bv = bias.to_double_vector();
  const std::vector<double> y0 = y.to_double_vector();
  const int64_t xs = c.k + c.pad;
  const int64_t ys = c.n + c.pad;
  std::vector<double> ref;
  double scale = 1.0;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double acc = c.bias ? bv[j] : 0.0;
      double mag = std::fabs(acc);
      for (int64_t p = 0; p < c.k; ++p) {
        acc += xv[i * xs + p] * wv[j * xs + p];
        mag += std::fabs(xv[i * xs + p] * wv[j * xs + p]);
      }
      if (c.accumulate) acc += y0[i * ys + j];
      ref.push_back(acc);
      scale = std::max(scale, mag);
    }
  }
  kernels::GemmArgs a;
  a.dtype = dtype;
  a.w_dtype = dtype;
  a.m = c.m;
  a.n = c.n;
  a.k = c.k;
  a.x = x.data_ptr();
  a.x_row_stride = xs;
  a.w = w.data_ptr();
  a.w_row_stride = xs;
  a.bias = c.bias ? bias.data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.y_row_stride = ys;
  a.accumulate = c.accumulate;
  a.isa = isa;
  ASSERT_TRUE(kernels::cpu::gemm_xwt(a).ok()) << name;
  test::expect_close(y.narrow(1, 0, c.n), ref, test::default_rtol(dtype),
                     (dtype == DType::kF32 ? 1e-6 : 4e-3) * scale, name);
  // The padding columns of y are never written.
  const std::vector<double> after = y.to_double_vector();
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = c.n; j < ys; ++j) ASSERT_EQ(after[i * ys + j], y0[i * ys + j]) << name;
  }
}

TEST(CpuGemm, MatchesDoubleLoop) {
  const GemmCase cases[] = {
      {1, 1, 1, false, false, 0},     {1, 64, 64, true, false, 0},   {3, 17, 5, true, false, 3},
      {37, 130, 300, true, false, 0}, {70, 65, 257, false, true, 7}, {33, 1, 512, true, true, 1},
      {129, 96, 64, true, false, 0},
  };
  std::mt19937_64 rng(3);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const GemmCase& c : cases) {
      check_gemm(dtype, c, kernels::GemmIsa::kAuto, rng);
      check_gemm(dtype, c, kernels::GemmIsa::kBaseline, rng);
    }
  }
}

// An fp8 weight with scales in one of the layouts of kernels::Fp8WeightScales.
struct Fp8Case {
  int64_t m, n, k;
  kernels::Fp8WeightScales layout;  // scale pointer set by the test
  const char* name;
};

// Random e4m3 codes (no NaN) and positive scales; the reference multiplies x by each element's
// e4m3 value times its scale, the product rounded to float as torch's q.float() * scale is.
void check_fp8_gemm(DType dtype, const Fp8Case& c, kernels::GemmIsa isa, std::mt19937_64& rng) {
  const std::string name = std::string(c.name) + " " + std::string(dtype_name(dtype)) + " m" +
                           std::to_string(c.m) + " n" + std::to_string(c.n) + " k" +
                           std::to_string(c.k);
  const Tensor x = test::random_tensor({c.m, c.k}, dtype, rng);
  const Tensor w = test::random_e4m3_codes({c.n, c.k}, rng);
  const uint8_t* wq = static_cast<const uint8_t*>(w.data_ptr());
  const kernels::Fp8WeightScales& l = c.layout;
  const int64_t gn = (c.n + l.group_n - 1) / l.group_n;
  const int64_t gk = (c.k + l.group_k - 1) / l.group_k;
  const int64_t count = (gn - 1) * l.stride_n + (gk - 1) * l.stride_k + 1;
  std::vector<float> scales(static_cast<size_t>(count));
  std::uniform_real_distribution<float> sd(1.0f / 4096, 1.0f / 256);
  for (float& v : scales) v = sd(rng);
  const Tensor bias = test::random_tensor({c.n}, dtype, rng);
  Tensor y = Tensor::empty({c.m, c.n}, dtype);
  const std::vector<double> xv = x.to_double_vector();
  const std::vector<double> bv = bias.to_double_vector();
  std::vector<double> ref;
  double mag_max = 1e-30;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double acc = bv[j];
      double mag = std::fabs(acc);
      for (int64_t p = 0; p < c.k; ++p) {
        const float s = scales[(j / l.group_n) * l.stride_n + (p / l.group_k) * l.stride_k];
        const float wf = e4m3_bits_to_float(wq[j * c.k + p]) * s;
        acc += xv[i * c.k + p] * wf;
        mag += std::fabs(xv[i * c.k + p] * wf);
      }
      ref.push_back(acc);
      mag_max = std::max(mag_max, mag);
    }
  }
  kernels::GemmArgs a;
  a.dtype = dtype;
  a.w_dtype = DType::kF8E4M3;
  a.m = c.m;
  a.n = c.n;
  a.k = c.k;
  a.x = x.data_ptr();
  a.x_row_stride = c.k;
  a.w = w.data_ptr();
  a.w_row_stride = c.k;
  a.w_scales = l;
  a.w_scales.scale = scales.data();
  a.bias = bias.data_ptr();
  a.y = y.data_ptr();
  a.y_row_stride = c.n;
  a.isa = isa;
  ASSERT_TRUE(kernels::cpu::gemm_xwt(a).ok()) << name;
  test::expect_close(y, ref, test::default_rtol(dtype),
                     (dtype == DType::kF32 ? 1e-6 : 4e-3) * mag_max, name);
}

TEST(CpuGemm, Fp8WeightsMatchDoubleLoopOnTheirDequantisedValues) {
  std::mt19937_64 rng(11);
  std::vector<Fp8Case> cases;
  for (const auto& [m, n, k] : std::vector<std::array<int64_t, 3>>{
           {1, 77, 200}, {5, 130, 257}, {40, 67, 300}, {3, 256, 384}}) {
    cases.push_back({m, n, k, {nullptr, 1, k, 1, 0}, "per row"});
    // Blocks as checkpoints store them, with partial blocks at both edges.
    const int64_t kb = (k + 127) / 128;
    cases.push_back({m, n, k, {nullptr, 128, 128, kb, 1}, "128x128 blocks"});
    cases.push_back({m, n, k, {nullptr, 5, 7, (k + 6) / 7, 1}, "5x7 blocks"});
    // One scale per row and 128 columns, rows fastest.
    cases.push_back({m, n, k, {nullptr, 1, 128, 1, n}, "row x 128 columns"});
  }
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Fp8Case& c : cases) {
      check_fp8_gemm(dtype, c, kernels::GemmIsa::kAuto, rng);
      check_fp8_gemm(dtype, c, kernels::GemmIsa::kBaseline, rng);
    }
  }
}

TEST(CpuGemm, Fp8WeightsNeedScalesAndMatchingActivations) {
  kernels::GemmArgs a;
  a.dtype = DType::kBF16;
  a.w_dtype = DType::kF8E4M3;
  a.m = a.n = a.k = 4;
  a.x_row_stride = a.w_row_stride = a.y_row_stride = 4;
  Status s = kernels::cpu::gemm_xwt(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs its scales"), std::string::npos) << s.message();
  a.w_dtype = DType::kF16;  // neither the activations' dtype nor e4m3
  s = kernels::cpu::gemm_xwt(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("weight dtype float16"), std::string::npos) << s.message();
}

TEST(CpuGemm, EmptyInnerDimensionGivesBias) {
  std::mt19937_64 rng(4);
  const Tensor bias = test::random_tensor({5}, DType::kF32, rng);
  Tensor y = test::random_tensor({2, 5}, DType::kF32, rng);
  kernels::GemmArgs a;
  a.dtype = DType::kF32;
  a.m = 2;
  a.n = 5;
  a.k = 0;
  a.bias = bias.data_ptr();
  a.y = y.data_ptr();
  a.y_row_stride = 5;
  ASSERT_TRUE(kernels::cpu::gemm_xwt(a).ok());
  const std::vector<double> b = bias.to_double_vector();
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(y.item({i, j}), b[j]);
}

TEST(CpuGemm, RejectsBadArguments) {
  kernels::GemmArgs a;
  a.dtype = DType::kI32;
  a.m = a.n = a.k = 1;
  a.x_row_stride = a.w_row_stride = a.y_row_stride = 1;
  EXPECT_EQ(kernels::cpu::gemm_xwt(a).code(), StatusCode::kInvalidArgument);
  a.dtype = DType::kF32;
  a.x_row_stride = 0;
  const Status s = kernels::cpu::gemm_xwt(a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("row strides"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace loraplex
