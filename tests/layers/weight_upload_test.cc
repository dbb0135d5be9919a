// WeightUpload, the fast path of loading base weights: every copy is bit-identical to the plain
// path (Tensor conversion on the host), for strided sources, every float dtype pair, and chunks
// that split a tensor over several ring buffers. The device half runs where there is a GPU.

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/layers/weight_upload.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

// A strided [rows, cols] view of a wider random source: rows not contiguous with each other.
Tensor strided_source(int64_t rows, int64_t cols, DType dtype, std::mt19937_64& rng) {
  const Tensor wide = test::random_tensor({rows, cols + 13}, dtype, rng);
  return wide.narrow(1, 5, cols);
}

void expect_bits_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const Tensor g = got.contiguous();
  const Tensor w = want.contiguous();
  const size_t bytes = static_cast<size_t>(w.numel()) * dtype_size(w.dtype());
  EXPECT_EQ(std::memcmp(g.data_ptr(), w.data_ptr(), bytes), 0) << what;
}

TEST(WeightUpload, CpuCopiesEqualPlainConversion) {
  std::mt19937_64 rng(5);
  WeightUpload upload(Device::cpu());
  for (DType from : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType to : {DType::kF32, DType::kBF16, DType::kF16}) {
      const Tensor src = strided_source(77, 33, from, rng);
      Tensor dst = Tensor::empty({77, 33}, to);
      upload.copy(dst, src);
      upload.finish();
      expect_bits_equal(dst, src.to(to), "cpu copy");
    }
  }
  EXPECT_THROW(upload.copy(Tensor::empty({3, 4}, DType::kF32), Tensor::empty({4, 3}, DType::kF32)),
               Error);
}

TEST(WeightUploadCuda, ChunkedUploadsAreBitIdenticalToThePlainPath) {
  LORAPLEX_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  std::mt19937_64 rng(6);
  // 4 KB buffers: a 199 x 61 bf16 source is split over many chunks and reuses every buffer.
  WeightUpload upload(dev, 4096, 3);
  std::vector<std::pair<Tensor, Tensor>> pairs;
  for (DType from : {DType::kF32, DType::kBF16}) {
    for (DType to : {DType::kBF16, DType::kF32, DType::kF16}) {
      const Tensor src = strided_source(199, 61, from, rng);
      // A destination with a row stride wider than its columns (a layer's slice).
      Tensor whole = Tensor::empty({199, 80}, to, dev);
      Tensor dst = whole.narrow(1, 0, 61);
      upload.copy(dst, src);
      pairs.emplace_back(dst, src.to(to));
    }
  }
  // A 1-D source (a norm weight) and a device source.
  const Tensor norm = test::random_tensor({1000}, DType::kF32, rng);
  Tensor norm_dst = Tensor::empty({1000}, DType::kBF16, dev);
  upload.copy(norm_dst, norm);
  pairs.emplace_back(norm_dst, norm.to(DType::kBF16));
  const Tensor on_device = test::random_tensor({31, 17}, DType::kBF16, rng).to(dev);
  Tensor dev_dst = Tensor::empty({31, 17}, DType::kBF16, dev);
  upload.copy(dev_dst, on_device);
  pairs.emplace_back(dev_dst, on_device.to(Device::cpu()));
  upload.finish();
  for (const auto& [got, want] : pairs) expect_bits_equal(got.to(Device::cpu()), want, "upload");
  EXPECT_GT(upload.bytes(), 0);
}

}  // namespace
}  // namespace loraplex
