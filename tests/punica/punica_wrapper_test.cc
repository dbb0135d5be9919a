#include "loraplex/punica/punica_wrapper.h"

#include <gtest/gtest.h>

#include "support/random_data.h"

namespace loraplex {
namespace {

struct LinearCase {
  DType dtype;
  int num_tokens;
  int max_loras;
  int max_rank;
  int64_t hidden;
  std::vector<int64_t> widths;
  test::SlotDistribution dist;
};

// base + sum over slices of (scale * x A^T) B^T in double, written directly from the inputs.
std::vector<double> reference_linear(const Tensor& y0, const Tensor& x,
                                     const std::vector<Tensor>& a, const std::vector<Tensor>& b,
                                     const SlotRanks& ranks, const std::vector<int32_t>& slots,
                                     float scale) {
  std::vector<double> y = y0.to_double_vector();
  const int64_t width = y0.size(1);
  const auto xs = x.to_double_vector();
  const int64_t hidden = x.size(1);
  int64_t off = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    const auto av = a[s].to_double_vector();
    const auto bv = b[s].to_double_vector();
    const int64_t rmax = a[s].size(1);
    const int64_t n = b[s].size(1);
    for (size_t t = 0; t < slots.size(); ++t) {
      const int32_t k = slots[t];
      if (k < 0) continue;
      const int32_t rank = ranks.get(static_cast<int>(s), k);
      std::vector<double> mid(static_cast<size_t>(rank), 0.0);
      for (int32_t r = 0; r < rank; ++r) {
        for (int64_t i = 0; i < hidden; ++i) {
          mid[r] += xs[t * hidden + i] * av[(k * rmax + r) * hidden + i];
        }
        mid[r] *= scale;
      }
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0.0;
        for (int32_t r = 0; r < rank; ++r) acc += mid[r] * bv[(k * n + j) * rmax + r];
        y[t * width + off + j] += acc;
      }
    }
    off += n;
  }
  return y;
}

TEST(PunicaWrapper, AddLoraLinearMatchesDoubleReference) {
  const LinearCase cases[] = {
      {DType::kF32, 1, 1, 8, 33, {40}, test::SlotDistribution::kOneAdapter},
      {DType::kBF16, 77, 4, 16, 64, {48, 16, 16}, test::SlotDistribution::kZipf},
      {DType::kF16, 199, 32, 64, 96, {24, 40}, test::SlotDistribution::kUniform},
      {DType::kBF16, 3, 4, 128, 17, {5}, test::SlotDistribution::kAllDistinct},
  };
  std::mt19937_64 rng(42);
  for (const LinearCase& c : cases) {
    const std::string name = std::string(dtype_name(c.dtype)) + " tokens " +
                             std::to_string(c.num_tokens) + " " + test::distribution_name(c.dist);
    PunicaWrapper wrapper(c.max_loras, 256, 8, Device::cpu());
    Stream cpu;
    const int slices = static_cast<int>(c.widths.size());
    SlotRanks ranks(slices, c.max_loras, c.max_rank, Device::cpu());
    std::uniform_int_distribution<int32_t> rank_of(1, c.max_rank);
    for (int s = 0; s < slices; ++s)
      for (int k = 0; k < c.max_loras; ++k) ranks.set(s, k, rank_of(rng), cpu);
    std::vector<Tensor> a;
    std::vector<Tensor> b;
    int64_t width = 0;
    for (int64_t n : c.widths) {
      a.push_back(test::random_tensor({c.max_loras, c.max_rank, c.hidden}, c.dtype, rng));
      b.push_back(test::random_tensor({c.max_loras, n, c.max_rank}, c.dtype, rng));
      width += n;
    }
    const Tensor x = test::random_tensor({c.num_tokens, c.hidden}, c.dtype, rng);
    Tensor y = test::random_tensor({c.num_tokens, width}, c.dtype, rng);
    const Tensor y0 = y.clone();
    const auto slots = test::make_slots(c.dist, c.num_tokens, c.max_loras, rng, 0.2);
    wrapper.update_metadata(slots, {}, cpu);
    Tensor workspace = Tensor::empty({slices * 256 * c.max_rank}, DType::kF32);
    const float scale = 0.25f;
    wrapper.add_lora_linear(y, x, a, b, ranks, scale, workspace, cpu);
    const auto ref = reference_linear(y0, x, a, b, ranks, slots, scale);
    test::expect_close(y, ref, test::default_rtol(c.dtype), test::default_rtol(c.dtype) * 2, name);
    // Rows of slot -1 tokens are bit-identical to the input.
    for (size_t t = 0; t < slots.size(); ++t) {
      if (slots[t] != -1) continue;
      for (int64_t j = 0; j < width; ++j) {
        ASSERT_EQ(y.item({static_cast<int64_t>(t), j}), y0.item({static_cast<int64_t>(t), j}));
      }
    }
  }
}

TEST(PunicaWrapper, RejectsMismatchedShapesWithClearErrors) {
  PunicaWrapper wrapper(4, 16, 4, Device::cpu());
  Stream cpu;
  std::vector<int32_t> slots = {0, 1, -1};
  wrapper.update_metadata(slots, {}, cpu);
  std::mt19937_64 rng(1);
  SlotRanks ranks(1, 4, 8, Device::cpu());
  std::vector<Tensor> a = {test::random_tensor({4, 8, 32}, DType::kF32, rng)};
  std::vector<Tensor> b = {test::random_tensor({4, 16, 8}, DType::kF32, rng)};
  Tensor ws = Tensor::empty({1024}, DType::kF32);
  Tensor y = test::random_tensor({3, 16}, DType::kF32, rng);
  Tensor x_bad = test::random_tensor({3, 31}, DType::kF32, rng);
  try {
    wrapper.add_lora_linear(y, x_bad, a, b, ranks, 1.0f, ws, cpu);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("input size 32, x has 31"), std::string::npos) << e.what();
  }
  Tensor x_bf16 = test::random_tensor({3, 32}, DType::kBF16, rng);
  EXPECT_THROW(wrapper.add_lora_linear(y, x_bf16, a, b, ranks, 1.0f, ws, cpu), Error);
  std::vector<Tensor> a_wide = {test::random_tensor({5, 8, 32}, DType::kF32, rng)};
  EXPECT_THROW(wrapper.add_lora_linear(y, test::random_tensor({3, 32}, DType::kF32, rng), a_wide, b,
                                       ranks, 1.0f, ws, cpu),
               Error);
  Tensor small_ws = Tensor::empty({10}, DType::kF32);
  EXPECT_THROW(wrapper.add_lora_linear(y, test::random_tensor({3, 32}, DType::kF32, rng), a, b,
                                       ranks, 1.0f, small_ws, cpu),
               Error);
  EXPECT_THROW(ranks.set(0, 0, 9, cpu), Error);
}

}  // namespace
}  // namespace loraplex
