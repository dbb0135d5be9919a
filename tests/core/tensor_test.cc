#include "loraplex/core/tensor.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <numeric>

#include "loraplex/core/device.h"
#include "support/gpu_check.h"

namespace loraplex {
namespace {

Tensor iota_tensor(const Shape& shape) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 1.0f);
  return Tensor::from_vector(v, shape);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = iota_tensor({3, 4});
  Tensor row = t.select(0, 1);
  EXPECT_EQ(row.shape(), (Shape{4}));
  EXPECT_EQ(row.item({2}), 7.0);
  Tensor cols = t.narrow(1, 1, 2);
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.item({2, 1}), 11.0);
  cols.fill_(0.5);
  EXPECT_EQ(t.item({0, 1}), 0.5);
  EXPECT_EQ(t.item({0, 0}), 1.0);
  EXPECT_EQ(t.item({0, 3}), 4.0);
}

TEST(Tensor, PermuteAndContiguous) {
  Tensor t = iota_tensor({2, 3, 4});
  Tensor p = t.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_FALSE(p.is_contiguous());
  Tensor c = p.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(c.item({i, j, k}), t.item({j, k, i}));
  EXPECT_EQ(t.transpose(0, 2).shape(), (Shape{4, 3, 2}));
}

TEST(Tensor, ViewAndReshape) {
  Tensor t = iota_tensor({2, 6});
  EXPECT_EQ(t.view({3, -1}).shape(), (Shape{3, 4}));
  EXPECT_THROW(t.view({5, -1}), Error);
  Tensor nc = t.transpose(0, 1);
  EXPECT_THROW(nc.view({12}), Error);
  Tensor r = nc.reshape({12});
  EXPECT_EQ(r.item({1}), 7.0);
  EXPECT_EQ(t.unsqueeze(0).shape(), (Shape{1, 2, 6}));
  EXPECT_EQ(t.unsqueeze(-1).shape(), (Shape{2, 6, 1}));
}

TEST(Tensor, ErrorsNameTheValues) {
  Tensor t = iota_tensor({2, 3});
  try {
    t.narrow(1, 2, 5);
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("start 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("size 3"), std::string::npos) << msg;
  }
  EXPECT_THROW(t.select(2, 0), Error);
  EXPECT_THROW(t.data<Half>(), Error);
  EXPECT_THROW(t.permute({0, 0}), Error);
}

TEST(Tensor, DTypeConversionIsCorrectlyRounded) {
  Tensor t = Tensor::from_vector<float>({1.0f, 2049.0f, -0.1f, 1e6f}, {4});
  Tensor h = t.to(DType::kF16);
  EXPECT_EQ(h.item({1}), 2048.0);
  Tensor b = t.to(DType::kBF16);
  EXPECT_EQ(b.item({0}), 1.0);
  EXPECT_EQ(b.item({2}), static_cast<double>(bf16_bits_to_float(float_to_bf16_bits(-0.1f))));
  Tensor q = t.to(DType::kF8E4M3);
  EXPECT_EQ(q.item({3}), 448.0);
  Tensor back = q.to(DType::kF32);
  EXPECT_EQ(back.item({0}), 1.0);
  Tensor i = Tensor::from_vector<int32_t>({-3, 7}, {2}).to(DType::kI64);
  EXPECT_EQ(i.item({0}), -3.0);
}

// Contiguous float conversions run typed loops, strided ones convert element by element: the
// two give the same bits, specials and rounding ties included.
TEST(Tensor, ContiguousAndStridedConversionsAgree) {
  const std::vector<float> values = {0.0f,
                                     -0.0f,
                                     1.0f,
                                     -2.5f,
                                     1.0f / 3.0f,
                                     65504.0f,
                                     65520.0f,
                                     1e-8f,
                                     3.0e38f,
                                     1.00390625f,
                                     std::numeric_limits<float>::infinity(),
                                     -std::numeric_limits<float>::infinity(),
                                     std::numeric_limits<float>::quiet_NaN(),
                                     2049.0f};
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<float> wide;
  for (float v : values) wide.insert(wide.end(), {v, 7.0f});
  for (DType sd : {DType::kF32, DType::kF16, DType::kBF16}) {
    const Tensor pairs = Tensor::from_vector<float>(wide, {n, 2}).to(sd);
    const Tensor strided = pairs.select(1, 0);  // every other element
    const Tensor contiguous = strided.contiguous();
    ASSERT_FALSE(strided.is_contiguous());
    for (DType dd : {DType::kF32, DType::kF16, DType::kBF16}) {
      Tensor a = Tensor::empty({n}, dd);
      Tensor b = Tensor::empty({n}, dd);
      a.copy_from(contiguous);
      b.copy_from(strided);
      EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0)
          << dtype_name(sd) << " -> " << dtype_name(dd);
    }
  }
}

TEST(Tensor, StridedCopyConvertsDType) {
  Tensor src = iota_tensor({3, 4}).transpose(0, 1);  // [4, 3], non-contiguous
  Tensor dst = Tensor::empty({4, 3}, DType::kBF16);
  dst.copy_from(src);
  EXPECT_EQ(dst.item({3, 2}), 12.0);
  EXPECT_EQ(dst.item({1, 0}), 2.0);
  EXPECT_THROW(dst.copy_from(iota_tensor({3, 4})), Error);
}

TEST(Tensor, CudaRoundTrip) {
  LORAPLEX_REQUIRE_GPU();
  Tensor t = iota_tensor({5, 7});
  Stream stream = Stream::create(Device::cuda(0));
  Tensor d = t.to(Device::cuda(0), stream);
  EXPECT_TRUE(d.device().is_cuda());
  Tensor part = d.narrow(1, 2, 3);  // rows of 3 elements, pitch 7
  Tensor back = part.to(Device::cpu(), stream);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(back.item({i, j}), t.item({i, j + 2}));
  Tensor z = Tensor::zeros({9}, DType::kF16, Device::cuda(0), stream).to(Device::cpu(), stream);
  for (int64_t i = 0; i < 9; ++i) EXPECT_EQ(z.item({i}), 0.0);
  Tensor conv = d.to(DType::kBF16, stream).to(Device::cpu(), stream);
  EXPECT_EQ(conv.item({4, 6}), 35.0);
}

TEST(Tensor, CudaCachingAllocatorReusesBlocks) {
  LORAPLEX_REQUIRE_GPU();
  { Tensor a = Tensor::empty({1 << 20}, DType::kF32, Device::cuda(0)); }
  const int64_t before = cuda_allocator_stats(0).driver_allocations;
  for (int i = 0; i < 10; ++i) {
    Tensor a = Tensor::empty({1 << 20}, DType::kF32, Device::cuda(0));
  }
  EXPECT_EQ(cuda_allocator_stats(0).driver_allocations, before);
}

TEST(Tensor, CopyFromAsyncWithinTheCpuCopiesAtOnce) {
  const Tensor src = iota_tensor({3, 5}).narrow(1, 1, 3);
  Tensor dst = Tensor::zeros({3, 3}, DType::kBF16);
  dst.copy_from_async(src, Stream());
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(dst.item({i, j}), src.item({i, j}));
  EXPECT_FALSE(src.is_pinned());
  EXPECT_FALSE(Tensor().is_pinned());
}

TEST(Tensor, PinnedViewsUploadWithoutWaiting) {
  LORAPLEX_REQUIRE_GPU();
  Tensor pinned = Tensor::empty_with({4, 6}, DType::kF32, Device::cpu(), pinned_host_allocator());
  pinned.copy_from(iota_tensor({4, 6}));
  const Tensor block = pinned.narrow(0, 1, 2).narrow(1, 2, 3);
  EXPECT_TRUE(pinned.is_pinned());
  EXPECT_TRUE(block.is_pinned());
  const Stream stream = Stream::create(Device::cuda(0));
  // Zeroed on the copy's stream: a zero_ on the legacy default stream is not ordered before
  // work on a non-blocking stream.
  Tensor dev = Tensor::zeros({4, 8}, DType::kF32, Device::cuda(0), stream);
  Tensor dst = dev.narrow(0, 2, 2).narrow(1, 1, 3);  // pitched rows on the device
  dst.copy_from_async(block, stream);
  Tensor back = Tensor::empty_with({4, 8}, DType::kF32, Device::cpu(), pinned_host_allocator());
  back.copy_from_async(dev, stream);
  stream.synchronize();
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 8; ++j) {
      const bool inside = i >= 2 && j >= 1 && j < 4;
      EXPECT_EQ(back.item({i, j}), inside ? block.item({i - 2, j - 1}) : 0.0) << i << "," << j;
    }
  }
  // Pageable host memory or a dtype change needs copy_from.
  EXPECT_THROW(dst.copy_from_async(iota_tensor({2, 3}), stream), Error);
  EXPECT_THROW(dst.copy_from_async(block.to(DType::kBF16), stream), Error);
}

TEST(Device, ParseAndPrint) {
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::parse("cpu").str(), "cpu");
  EXPECT_THROW(Device::parse("cuda:x"), Error);
  EXPECT_THROW(Device::parse("tpu"), Error);
}

}  // namespace
}  // namespace loraplex
