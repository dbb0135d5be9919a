// Top logprobs: the CPU op against a reference written out here (every id ranked by logit, ties
// to the lower id, NaNs last; each log-probability as token_logprob gives it), in every dtype,
// on odd sizes; and the CUDA op against the CPU (skipped without a GPU).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <tuple>
#include <vector>

#include "loraplex/core/dtype.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/model/sampler.h"
#include "loraplex/model/top_logprobs_ops.h"
#include "support/gpu_check.h"

namespace loraplex {
namespace {

// Rows of random logits with ties, -inf and NaN mixed in.
std::vector<float> random_rows(int64_t rows, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v;
  for (int64_t i = 0; i < rows * vocab; ++i) {
    const uint64_t u = rng() % 50;
    v.push_back(u == 0   ? std::numeric_limits<float>::quiet_NaN()
                : u == 1 ? -std::numeric_limits<float>::infinity()
                : u < 6  ? 1.5f  // ties
                         : normal(rng));
  }
  return v;
}

// float32 rows of `logits` into `ids` and `lps` ([rows, k] each).
model::ops::TopLogprobsArgs args_for(const std::vector<float>& logits, int64_t rows, int64_t vocab,
                                     int k, std::vector<int32_t>& ids, std::vector<float>& lps) {
  model::ops::TopLogprobsArgs a;
  a.num_rows = rows;
  a.vocab = vocab;
  a.row_stride = vocab;
  a.logits = logits.data();
  a.k = k;
  a.ids = ids.data();
  a.logprobs = lps.data();
  return a;
}

TEST(TopLogprobs, CpuRanksEveryRowAndGivesTokenLogprob) {
  for (const auto& [rows, vocab, k] :
       std::vector<std::tuple<int64_t, int64_t, int>>{{1, 1, 1}, {3, 77, 5}, {5, 1000, 20}}) {
    const std::vector<float> logits = random_rows(rows, vocab, static_cast<uint64_t>(vocab));
    std::vector<int32_t> ids(static_cast<size_t>(rows * k));
    std::vector<float> lps(ids.size());
    model::ops::TopLogprobsArgs a = args_for(logits, rows, vocab, k, ids, lps);
    ASSERT_TRUE(model::ops::cpu::top_logprobs(a).ok());
    for (int64_t r = 0; r < rows; ++r) {
      const std::span<const float> row(logits.data() + r * vocab, static_cast<size_t>(vocab));
      std::vector<int32_t> order(static_cast<size_t>(vocab));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
        const float vx = row[static_cast<size_t>(x)];
        const float vy = row[static_cast<size_t>(y)];
        if (std::isnan(vx) || std::isnan(vy)) return !std::isnan(vx) && std::isnan(vy);
        return vx > vy;
      });
      for (int t = 0; t < k; ++t) {
        const size_t i = static_cast<size_t>(r * k + t);
        EXPECT_EQ(ids[i], order[static_cast<size_t>(t)]) << "row " << r << " rank " << t;
        const float want = model::token_logprob(row, ids[i]);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(lps[i])) << "row " << r << " rank " << t;
        } else {
          EXPECT_EQ(lps[i], want) << "row " << r << " rank " << t;
        }
      }
    }
    // The same rows in bf16: ranked as their bf16 values.
    std::vector<uint16_t> bf(logits.size());
    std::vector<float> rounded(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) {
      bf[i] = float_to_bf16_bits(logits[i]);
      rounded[i] = bf16_bits_to_float(bf[i]);
    }
    std::vector<int32_t> ids_bf(ids.size());
    std::vector<float> lps_bf(ids.size());
    model::ops::TopLogprobsArgs b = a;
    b.dtype = DType::kBF16;
    b.logits = bf.data();
    b.ids = ids_bf.data();
    b.logprobs = lps_bf.data();
    ASSERT_TRUE(model::ops::cpu::top_logprobs(b).ok());
    a.logits = rounded.data();
    ASSERT_TRUE(model::ops::cpu::top_logprobs(a).ok());
    EXPECT_EQ(ids_bf, ids);
    for (size_t i = 0; i < lps.size(); ++i) {
      EXPECT_TRUE(lps_bf[i] == lps[i] || (std::isnan(lps_bf[i]) && std::isnan(lps[i]))) << i;
    }
  }
  model::ops::TopLogprobsArgs bad;
  bad.num_rows = 1;
  bad.vocab = 3;
  bad.row_stride = 3;
  bad.k = 4;
  EXPECT_FALSE(model::ops::cpu::top_logprobs(bad).ok());
}

TEST(TopLogprobs, CudaMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const Stream stream = Stream::create(gpu);
  for (const auto& [rows, vocab, k] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {1, 1, 1}, {3, 77, 5}, {19, 1999, 20}, {64, 128256, 20}}) {
    const std::vector<float> logits = random_rows(rows, vocab, static_cast<uint64_t>(rows + vocab));
    std::vector<int32_t> ids(static_cast<size_t>(rows * k));
    std::vector<float> lps(ids.size());
    model::ops::TopLogprobsArgs a = args_for(logits, rows, vocab, k, ids, lps);
    ASSERT_TRUE(model::ops::cpu::top_logprobs(a).ok());
    const Tensor d_logits = Tensor::from_vector(logits, {rows * vocab}).to(gpu, stream);
    Tensor d_ids = Tensor::empty({rows * k}, DType::kI32, gpu);
    Tensor d_lps = Tensor::empty({rows * k}, DType::kF32, gpu);
    model::ops::TopLogprobsArgs g = a;
    g.logits = d_logits.data_ptr();
    g.ids = d_ids.data<int32_t>();
    g.logprobs = d_lps.data<float>();
    ASSERT_TRUE(model::ops::cuda::top_logprobs(g, stream).ok());
    stream.synchronize();
    const Tensor h_ids = d_ids.to(Device::cpu(), stream);
    const Tensor h_lps = d_lps.to(Device::cpu(), stream);
    stream.synchronize();
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_EQ(h_ids.data<int32_t>()[i], ids[i]) << "rows " << rows << ", vocab " << vocab;
      const float want = lps[i];
      const float got = h_lps.data<float>()[i];
      if (std::isinf(want)) {
        EXPECT_EQ(got, want);
      } else {
        EXPECT_NEAR(got, want, 1e-5 * std::max(1.0f, std::fabs(want))) << i;
      }
    }
  }
}

}  // namespace
}  // namespace loraplex
