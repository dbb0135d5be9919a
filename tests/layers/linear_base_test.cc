// linear_base on each backend: the CPU GEMM and cuBLASLt (skipped without a GPU), with strided
// inputs (row-parallel layers read a column window of x) and bias.

#include "loraplex/layers/linear_base.h"

#include <gtest/gtest.h>

#include <random>

#include "layers/layer_test_util.h"
#include "loraplex/core/device.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

void check_linear_base(Device device, DType dtype) {
  std::mt19937_64 rng(8);
  const Stream stream = Stream::default_for(device);
  const int64_t m = 45;
  const int64_t k = 72;
  const int64_t n = 40;
  const Tensor x_full = test::random_tensor({m, k + 8}, dtype, rng);
  const Tensor x = x_full.narrow(1, 8, k);  // a column window: row stride k + 8
  const Tensor w = test::random_tensor({n, k}, dtype, rng);
  const Tensor bias = test::random_tensor({n}, dtype, rng);
  std::vector<double> ref = test::xwt_double(x, w);
  const std::vector<double> bv = bias.to_double_vector();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) ref[i * n + j] += bv[j];
  Tensor y = Tensor::empty({m, n}, dtype, device);
  linear_base(x_full.to(device, stream).narrow(1, 8, k), w.to(device, stream),
              bias.to(device, stream), y, stream);
  stream.synchronize();
  const double atol = (dtype == DType::kF32 ? 1e-5 : 2e-2) * test::max_abs(ref);
  EXPECT_LE(test::tolerance_ratio(test::values_of(y), ref, test::default_rtol(dtype), atol), 1.0)
      << dtype << " on " << device;
}

TEST(LinearBase, CpuMatchesDoubleReference) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) check_linear_base(Device::cpu(), dt);
}

TEST(LinearBase, CublasLtMatchesDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) check_linear_base(Device::cuda(0), dt);
}

TEST(LinearBase, RejectsMismatchedShapes) {
  const Tensor x = Tensor::zeros({3, 4}, DType::kF32);
  const Tensor w = Tensor::zeros({5, 6}, DType::kF32);
  Tensor y = Tensor::zeros({3, 5}, DType::kF32);
  try {
    linear_base(x, w, Tensor(), y, Stream());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x has 4 columns"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loraplex
