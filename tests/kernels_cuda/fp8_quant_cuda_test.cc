// The CUDA activation quantisation (kernels/fp8_quant.h) against the CPU: both compute the
// same float expression (amax / 448, x / scale, round to nearest even with saturation), so the
// codes and scales must be equal bit for bit. Skipped without a GPU.

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "cuda_test_util.h"
#include "loraplex/kernels/fp8_quant.h"

namespace loraplex {
namespace {

TEST(QuantizeRowsFp8Cuda, EqualsTheCpuBitForBit) {
  LORAPLEX_REQUIRE_GPU();
  const Stream stream = Stream::create(test::gpu());
  std::mt19937_64 rng(41);
  struct Case {
    int64_t m, k, pad, group;
    bool static_scale;
  };
  const Case cases[] = {{1, 16, 0, 16, false},    {37, 4096, 8, 4096, false},
                        {5, 640, 0, 128, false},  {300, 1024, 0, 128, false},
                        {64, 512, 16, 512, true}, {3, 14336, 0, 128, false}};
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (const Case& c : cases) {
      const std::string what = std::string(dtype_name(dt)) + " m" + std::to_string(c.m) + " k" +
                               std::to_string(c.k) + " group " + std::to_string(c.group);
      const Tensor x = test::random_tensor({c.m, c.k + c.pad}, dt, rng, 5.0f);
      const int64_t groups = (c.k + c.group - 1) / c.group;
      const Tensor fixed = Tensor::from_vector(std::vector<float>{0.02f}, {1});
      kernels::QuantizeRowsFp8Args a;
      a.dtype = dt;
      a.m = c.m;
      a.k = c.k;
      a.x_row_stride = c.k + c.pad;
      a.group = c.group;
      // CPU.
      std::vector<uint8_t> q_cpu(static_cast<size_t>(c.m * c.k));
      std::vector<float> s_cpu(static_cast<size_t>(groups * c.m));
      a.x = x.data_ptr();
      a.static_scale = c.static_scale ? fixed.data<float>() : nullptr;
      a.q = q_cpu.data();
      a.scale = s_cpu.data();
      ASSERT_TRUE(kernels::cpu::quantize_rows_fp8(a).ok()) << what;
      // GPU.
      const Tensor xg = test::on_gpu(x, stream);
      const Tensor fixed_g = test::on_gpu(fixed, stream);
      Tensor qg = Tensor::empty({c.m * c.k}, DType::kU8, test::gpu());
      Tensor sg = Tensor::empty({groups * c.m}, DType::kF32, test::gpu());
      a.x = xg.data_ptr();
      a.static_scale = c.static_scale ? fixed_g.data<float>() : nullptr;
      a.q = qg.data<uint8_t>();
      a.scale = sg.data<float>();
      ASSERT_TRUE(kernels::cuda::quantize_rows_fp8(a, stream.handle()).ok()) << what;
      const Tensor q_back = test::on_cpu(qg, stream);
      const Tensor s_back = test::on_cpu(sg, stream);
      EXPECT_EQ(std::memcmp(q_back.data_ptr(), q_cpu.data(), q_cpu.size()), 0) << what;
      EXPECT_EQ(std::memcmp(s_back.data_ptr(), s_cpu.data(), s_cpu.size() * 4), 0) << what;
    }
  }
}

}  // namespace
}  // namespace loraplex
