// linear_base_fp8: on the CPU equal to linear_base on the dequantized weights (the same floats
// through the same GEMM); on CUDA (W8A8 through cuBLASLt, skipped without a GPU) within e4m3's
// error of the CPU result for every scale layout cuBLASLt takes.
//
// The CUDA bound: quantizing x to e4m3 moves each x_j by at most 2^-4 |x_j| (plus 2^-10 of its
// scale below the normal range), independently and about uniformly, so the error of a dot
// product is about sqrt(sum (x_j w_j)^2) * 2^-4 / sqrt(3) and stays within 6 times that; the
// bfloat16 output adds half an ulp. Wrong scales (a transposed or unpadded block layout, a
// scale vector on the wrong operand) miss it by far: the weights' scales vary 8-fold.

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "layers/layer_test_util.h"
#include "loraplex/core/error.h"
#include "loraplex/layers/linear_base.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

struct Fp8Problem {
  Tensor x;     // [m, k] activations
  Tensor w;     // [n, k] float8_e4m3
  Fp8Scales s;  // CPU
  Tensor deq;   // [n, k] float32: the dequantized weight
  Tensor bias;  // [n] or undefined
};

// Layouts: "row" (per output row), "blocks" (128x128, rows padded to 4 groups), "row128" (per
// row and 128 columns, rows fastest).
Fp8Problem make_problem(const std::string& layout, int64_t m, int64_t n, int64_t k, DType dt,
                        bool bias, bool static_scale, std::mt19937_64& rng) {
  Fp8Problem p;
  p.x = test::random_tensor({m, k}, dt, rng, 2.0f);
  p.w = test::random_e4m3_codes({n, k}, rng);
  const uint8_t* q = static_cast<const uint8_t*>(p.w.data_ptr());
  kernels::Fp8WeightScales& l = p.s.layout;
  const int64_t kg = (k + 127) / 128;
  int64_t count = n;
  if (layout == "row") {
    l = {nullptr, 1, k, 1, 0};
  } else if (layout == "blocks") {
    const int64_t pitch = (kg + 3) / 4 * 4;
    l = {nullptr, 128, 128, pitch, 1};
    count = (n + 127) / 128 * pitch;
  } else {
    l = {nullptr, 1, 128, 1, n};
    count = kg * n;
  }
  std::vector<float> sv(static_cast<size_t>(count));
  std::uniform_real_distribution<float> sd(1.0f / 4096, 1.0f / 512);
  for (float& v : sv) v = sd(rng);
  p.s.scale = Tensor::from_vector(sv, {count});
  if (static_scale) {
    // The largest |x| maps to 448: no saturation.
    const std::vector<double> xv = p.x.to_double_vector();
    const float amax = static_cast<float>(test::max_abs(xv));
    p.s.input_scale = Tensor::from_vector(std::vector<float>{amax / 448.0f}, {1});
  }
  p.deq = Tensor::empty({n, k}, DType::kF32);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float s =
          sv[static_cast<size_t>((r / l.group_n) * l.stride_n + (c / l.group_k) * l.stride_k)];
      p.deq.data<float>()[r * k + c] = e4m3_bits_to_float(q[r * k + c]) * s;
    }
  }
  if (bias) p.bias = test::random_tensor({n}, dt, rng);
  return p;
}

TEST(LinearBaseFp8, CpuEqualsTheFloatGemmOnTheDequantizedWeights) {
  std::mt19937_64 rng(51);
  for (const char* layout : {"row", "blocks", "row128"}) {
    for (int64_t m : {1, 9, 70}) {
      const Fp8Problem p = make_problem(layout, m, 96, 300, DType::kF32, true, false, rng);
      Tensor y = Tensor::empty({m, 96}, DType::kF32);
      Tensor want = Tensor::empty({m, 96}, DType::kF32);
      linear_base_fp8(p.x, p.w, p.s, p.bias, y, Tensor(), Stream());
      linear_base(p.x, p.deq, p.bias, want, Stream());
      EXPECT_EQ(test::values_of(y), test::values_of(want)) << layout << " m " << m;
    }
  }
}

TEST(LinearBaseFp8, RefusesScalesTooSmallForTheWeight) {
  std::mt19937_64 rng(52);
  Fp8Problem p = make_problem("row", 2, 32, 64, DType::kF32, false, false, rng);
  p.s.scale = p.s.scale.narrow(0, 0, 31);
  Tensor y = Tensor::empty({2, 32}, DType::kF32);
  try {
    linear_base_fp8(p.x, p.w, p.s, Tensor(), y, Tensor(), Stream());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("are too small for a [32, 64] weight"), std::string::npos)
        << e.what();
  }
  try {
    linear_base(p.x, p.w, Tensor(), y, Stream());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("goes through linear_base_fp8"), std::string::npos)
        << e.what();
  }
}

// Disabled: cuBLASLt on an H200 had no algorithm for this with 128x128 block scales and gave
// wrong values with per-row ones; LoraLinear refuses FP8 weights on CUDA until this passes.
TEST(LinearBaseFp8, DISABLED_CublasLtW8A8WithinTheE4m3BoundOfTheCpu) {
  LORAPLEX_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const Stream stream = Stream::create(gpu);
  std::mt19937_64 rng(53);
  struct Case {
    const char* layout;
    int64_t m, n, k;
    bool bias, static_scale;
  };
  const Case cases[] = {
      {"row", 1, 256, 512, false, false},      {"row", 7, 384, 640, true, false},
      {"row", 300, 256, 1024, false, false},   {"row", 33, 256, 512, false, true},
      {"blocks", 1, 256, 512, false, false},   {"blocks", 64, 384, 640, false, false},
      {"blocks", 200, 512, 1024, true, false}, {"row128", 5, 256, 512, false, false},
      {"row128", 130, 384, 640, false, false},
  };
  for (const Case& c : cases) {
    const std::string what = std::string(c.layout) + " m" + std::to_string(c.m) + " n" +
                             std::to_string(c.n) + " k" + std::to_string(c.k) +
                             (c.static_scale ? " static" : "") + (c.bias ? " bias" : "");
    const Fp8Problem p =
        make_problem(c.layout, c.m, c.n, c.k, DType::kBF16, c.bias, c.static_scale, rng);
    Tensor ref = Tensor::empty({c.m, c.n}, DType::kF32);
    linear_base(p.x.to(DType::kF32), p.deq, p.bias.defined() ? p.bias.to(DType::kF32) : Tensor(),
                ref, Stream());
    Fp8Scales gs;
    gs.layout = p.s.layout;
    gs.scale = p.s.scale.to(gpu, stream);
    if (p.s.input_scale.defined()) gs.input_scale = p.s.input_scale.to(gpu, stream);
    Tensor scratch = Tensor::empty(
        {static_cast<int64_t>(kernels::fp8_gemm_scratch_bytes(c.m, c.k))}, DType::kU8, gpu);
    Tensor y = Tensor::empty({c.m, c.n}, DType::kBF16, gpu);
    linear_base_fp8(p.x.to(gpu, stream), p.w.to(gpu, stream), gs,
                    p.bias.defined() ? p.bias.to(gpu, stream) : Tensor(), y, scratch, stream);
    stream.synchronize();
    const std::vector<double> got = test::values_of(y);
    const std::vector<double> want = test::values_of(ref);
    const std::vector<double> xv = p.x.to_double_vector();
    const std::vector<double> wv = p.deq.to_double_vector();
    double err2 = 0.0;
    double ref2 = 0.0;
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double sq = 0.0;
        for (int64_t t = 0; t < c.k; ++t) {
          const double v = xv[i * c.k + t] * wv[j * c.k + t];
          sq += v * v;
        }
        const double r = want[i * c.n + j];
        const double bound = 6.0 * std::sqrt(sq) * 0.0625 / std::sqrt(3.0) +
                             std::fabs(r) * std::ldexp(1.0, -8) + 1e-6;
        const double e = got[i * c.n + j] - r;
        ASSERT_LE(std::fabs(e), bound)
            << what << " at (" << i << ", " << j << "): " << got[i * c.n + j] << " against " << r;
        err2 += e * e;
        ref2 += r * r;
      }
    }
    // Over the whole output the relative error is that of one e4m3 rounding, a few percent.
    EXPECT_LT(std::sqrt(err2 / ref2), 0.06) << what;
  }
}

}  // namespace
}  // namespace loraplex
