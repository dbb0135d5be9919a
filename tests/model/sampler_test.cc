// The CPU sampler (sample_row and the batched ops::cpu::sample) against the naive reference of
// sampling_reference.h over random rows, every parameter combination, ties, NaNs, -inf and
// banned ids; the sampling exp against std::exp; sampled frequencies against the filtered
// softmax (chi-square).

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "loraplex/core/dtype.h"
#include "loraplex/core/error.h"
#include "loraplex/model/sampler.h"
#include "loraplex/model/sampling_ops.h"
#include "sampling_reference.h"

namespace loraplex {
namespace {

using model::SamplingParams;
constexpr float kInf = std::numeric_limits<float>::infinity();

std::string describe(int64_t vocab, test::RowKind kind, const SamplingParams& p, double u) {
  return "vocab " + std::to_string(vocab) + " " + test::row_kind_name(kind) + " T " +
         std::to_string(p.temperature) + " top_k " + std::to_string(p.top_k) + " top_p " +
         std::to_string(p.top_p) + " min_p " + std::to_string(p.min_p) + " u " + std::to_string(u);
}

TEST(SamplingExp, WithinFewUlpsOfStdExpAndExactAtZero) {
  EXPECT_EQ(model::sampling_exp(0.0f), 1.0f);
  EXPECT_EQ(model::sampling_exp(-0.0f), 1.0f);
  EXPECT_EQ(model::sampling_exp(-kInf), 0.0f);
  EXPECT_EQ(model::sampling_exp(-104.5f), 0.0f);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> dist(-110.0f, 0.0f);
  double worst_normal = 0.0;
  double worst_subnormal = 0.0;
  for (int i = 0; i < 400000; ++i) {
    // Half uniform over the range, half close to 0 where the weights that matter live.
    const float x = i % 2 == 0 ? dist(rng) : dist(rng) / 1000.0f;
    const double want = std::exp(static_cast<double>(x));
    const double got = model::sampling_exp(x);
    ASSERT_LE(got, 1.0) << x;
    if (want >= 0x1p-126) {
      worst_normal = std::max(worst_normal, std::abs(got - want) / want);
    } else {
      worst_subnormal = std::max(worst_subnormal, std::abs(got - want));
    }
  }
  EXPECT_LT(worst_normal, 3 * 0x1p-24) << "relative error on normal results";
  EXPECT_LE(worst_subnormal, 0x1p-149) << "absolute error on subnormal results";
}

// Every parameter combination of the task over the vocabularies 1, 2, 77, 1000 and 32000.
TEST(Sampler, SampleRowMatchesTheReferenceEverywhere) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  int rows = 0;
  int unclear = 0;
  for (int64_t vocab : {1, 2, 77, 1000, 32000}) {
    const int repeats = vocab >= 32000 ? 1 : 3;
    const std::vector<int> top_ks = {0, 1, 5, static_cast<int>(vocab), static_cast<int>(vocab) + 3};
    for (float temperature : {0.0f, 0.3f, 1.0f, 2.5f}) {
      for (int top_k : top_ks) {
        for (float top_p : {0.1f, 0.9f, 1.0f}) {
          for (int rep = 0; rep < repeats; ++rep) {
            const test::RowKind kind = test::kAllRowKinds[(rows + rep) % 5];
            const std::vector<float> logits = test::random_logits(vocab, kind, rng);
            const std::vector<int32_t> banned = test::random_banned(vocab, rng);
            // min_p off, moderate and strict, in turn.
            const float min_p = std::array{0.0f, 0.05f, 0.6f}[static_cast<size_t>(rows % 3)];
            const SamplingParams p{temperature, top_k, top_p, min_p};
            const double u = unit(rng);
            const test::ReferencePick ref = test::reference_sample(logits, p, u, banned);
            const int32_t got = model::sample_row(logits, p, u, banned);
            ++rows;
            if (!ref.clear(1e-12)) {
              ++unclear;
              continue;
            }
            ASSERT_EQ(got, ref.id) << describe(vocab, kind, p, u);
          }
        }
      }
    }
  }
  // Both sides sum the same float weights; only rows within 1e-12 of a boundary are skipped.
  EXPECT_LE(unclear, rows / 100) << unclear << " of " << rows << " rows near a boundary";
}

TEST(Sampler, SpecialRows) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const SamplingParams hot{1.0f, 0, 1.0f};
  const SamplingParams greedy{0.0f, 0, 1.0f};
  // Every id banned: the argmax of the raw logits, ties to the lowest id.
  const std::vector<float> a = {0.5f, 2.0f, nan, 2.0f};
  const std::vector<int32_t> all = {0, 1, 2, 3};
  EXPECT_EQ(model::sample_row(a, hot, 0.7, all), 1);
  EXPECT_EQ(model::sample_row(a, greedy, 0.7, all), 1);
  // Every logit -inf or NaN: the first non-NaN one; all NaN: 0.
  const std::vector<float> b = {nan, -kInf, -kInf, nan};
  EXPECT_EQ(model::sample_row(b, hot, 0.3, {}), 1);
  const std::vector<float> c = {nan, nan, nan};
  EXPECT_EQ(model::sample_row(c, hot, 0.3, {}), 0);
  // +inf logits share all the mass (uniform over them), other ids get none.
  const std::vector<float> d = {3.0f, kInf, 1.0f, kInf, 0.0f};
  EXPECT_EQ(model::sample_row(d, hot, 0.2, {}), 1);
  EXPECT_EQ(model::sample_row(d, hot, 0.7, {}), 3);
  EXPECT_EQ(model::sample_row(d, hot, 0.7, std::vector<int32_t>{3}), 1);
  // Greedy skips a banned maximum.
  const std::vector<float> e = {1.0f, 4.0f, 3.0f, 4.0f};
  EXPECT_EQ(model::sample_row(e, greedy, 0.0, std::vector<int32_t>{1}), 3);
  EXPECT_EQ(model::sample_row(e, greedy, 0.0, std::vector<int32_t>{1, 3}), 2);
  // Ties at the top-k threshold are all kept: top_k 2 of {4, 4, 4, 1} keeps three ids.
  const std::vector<float> f = {4.0f, 4.0f, 4.0f, 1.0f};
  std::vector<int> seen(4, 0);
  for (double u : {0.1, 0.5, 0.9})
    ++seen[static_cast<size_t>(model::sample_row(f, {1.0f, 2, 1.0f}, u))];
  EXPECT_EQ(seen, (std::vector<int>{1, 1, 1, 0}));
  // log-probabilities with infinite maxima.
  EXPECT_EQ(model::token_logprob(d, 0), -kInf);
  EXPECT_NEAR(model::token_logprob(d, 3), -std::log(2.0), 1e-7);
  EXPECT_NEAR(model::token_logprob(b, 2), -std::log(2.0), 1e-7);
}

// The batched op: f32, f16 and bf16 rows with a stride, mixed parameters, against sample_row on
// the same float values and log-probabilities against a long-double log-softmax.
TEST(SampleOpCpu, MatchesSampleRowAndReferenceLogprobs) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const std::vector<SamplingParams> params = {
      {0.0f, 0, 1.0f},    {0.7f, 0, 1.0f},       {1.3f, 40, 1.0f},
      {1.0f, 0, 0.85f},   {0.9f, 17, 0.5f},      {2.0f, 1, 0.3f},
      {1.0f, 3000, 1.0f}, {1.0f, 0, 1.0f, 0.1f}, {0.8f, 20, 0.9f, 0.3f}};
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t vocab : {1, 77, 2053}) {
      const int64_t rows = 9;
      const int64_t stride = vocab + 5;
      std::vector<float> values(static_cast<size_t>(rows * stride), 1e30f);
      std::vector<uint16_t> bits(values.size(), 0);
      std::vector<float> temperature, top_p, min_p;
      std::vector<int32_t> top_k, banned(static_cast<size_t>(rows * model::kMaxBannedTokens), -1);
      std::vector<double> uniform;
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<float> row = test::random_logits(vocab, test::kAllRowKinds[r % 5], rng);
        for (int64_t j = 0; j < vocab; ++j) {
          float v = row[static_cast<size_t>(j)];
          const size_t at = static_cast<size_t>(r * stride + j);
          if (dtype == DType::kF16) {
            bits[at] = float_to_f16_bits(v);
            v = f16_bits_to_float(bits[at]);
          } else if (dtype == DType::kBF16) {
            bits[at] = float_to_bf16_bits(v);
            v = bf16_bits_to_float(bits[at]);
          }
          values[at] = v;
        }
        const SamplingParams& p = params[static_cast<size_t>(r) % params.size()];
        temperature.push_back(p.temperature);
        top_k.push_back(p.top_k);
        top_p.push_back(p.top_p);
        min_p.push_back(p.min_p);
        uniform.push_back(unit(rng));
        const std::vector<int32_t> b = test::random_banned(vocab, rng);
        std::copy(b.begin(), b.end(), banned.begin() + r * model::kMaxBannedTokens);
      }
      std::vector<int32_t> ids(static_cast<size_t>(rows), -7);
      std::vector<float> logprobs(static_cast<size_t>(rows), 0.0f);
      std::vector<char> workspace(model::ops::sample_workspace_bytes(rows, vocab));
      model::ops::SampleArgs a;
      a.dtype = dtype;
      a.num_rows = rows;
      a.vocab = vocab;
      a.logits = dtype == DType::kF32 ? static_cast<const void*>(values.data()) : bits.data();
      a.row_stride = stride;
      a.temperature = temperature.data();
      a.top_k = top_k.data();
      a.top_p = top_p.data();
      a.min_p = min_p.data();
      a.uniform = uniform.data();
      a.banned = banned.data();
      a.ids = ids.data();
      a.logprobs = logprobs.data();
      a.workspace = workspace.data();
      a.workspace_bytes = workspace.size();
      throw_if_error(model::ops::cpu::sample(a));
      for (int64_t r = 0; r < rows; ++r) {
        const std::span<const float> row(values.data() + r * stride, static_cast<size_t>(vocab));
        const std::span<const int32_t> b(banned.data() + r * model::kMaxBannedTokens,
                                         model::kMaxBannedTokens);
        const SamplingParams p{temperature[r], top_k[r], top_p[r], min_p[r]};
        const std::string what = std::string(dtype_name(dtype)) + " vocab " +
                                 std::to_string(vocab) + " row " + std::to_string(r);
        EXPECT_EQ(ids[r], model::sample_row(row, p, uniform[r], b)) << what;
        const double want = test::reference_logprob(row, ids[r]);
        EXPECT_NEAR(logprobs[r], want, 1e-6 + 1e-6 * std::abs(want)) << what;
      }
    }
  }
}

TEST(SampleOpCpu, RejectsBadArguments) {
  std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  float t = 1.0f, p = 1.0f;
  int32_t k = 0, id = -1;
  double u = 0.5;
  std::vector<int32_t> banned(model::kMaxBannedTokens, -1);
  std::vector<char> ws(model::ops::sample_workspace_bytes(1, 3));
  model::ops::SampleArgs a;
  a.num_rows = 1;
  a.vocab = 3;
  a.logits = logits.data();
  a.row_stride = 3;
  a.temperature = &t;
  a.top_k = &k;
  a.top_p = &p;
  a.uniform = &u;
  a.banned = banned.data();
  a.ids = &id;
  a.workspace = ws.data();
  a.workspace_bytes = ws.size();
  EXPECT_TRUE(model::ops::cpu::sample(a).ok());
  t = -1.0f;
  EXPECT_EQ(model::ops::cpu::sample(a).code(), StatusCode::kInvalidArgument);
  t = 1.0f;
  p = 0.0f;
  EXPECT_EQ(model::ops::cpu::sample(a).code(), StatusCode::kInvalidArgument);
  p = 1.0f;
  float min_p = 1.5f;
  a.min_p = &min_p;
  EXPECT_EQ(model::ops::cpu::sample(a).code(), StatusCode::kInvalidArgument);
  min_p = 1.0f;  // keeps only the most probable ids
  EXPECT_TRUE(model::ops::cpu::sample(a).ok());
  EXPECT_EQ(id, 2);
  a.min_p = nullptr;
  u = 1.0;
  EXPECT_EQ(model::ops::cpu::sample(a).code(), StatusCode::kInvalidArgument);
  u = 0.5;
  a.workspace_bytes = 4;
  EXPECT_EQ(model::ops::cpu::sample(a).code(), StatusCode::kInvalidArgument);
  a.workspace_bytes = ws.size();
  a.dtype = DType::kI32;
  EXPECT_EQ(model::ops::cpu::sample(a).code(), StatusCode::kInvalidArgument);
}

// Chi-square of sampled counts against the filtered softmax (std::exp in double) for a small
// vocabulary, per parameter set; fixed seeds make the statistics reproducible. The bound is
// the 1e-6 upper quantile of chi-square (Wilson-Hilferty), so a correct sampler never fails.
TEST(Sampler, FrequenciesFollowTheFilteredSoftmax) {
  std::mt19937_64 rng(17);
  const int64_t vocab = 23;
  std::vector<float> logits = test::random_logits(vocab, test::RowKind::kNormal, rng);
  logits[4] = logits[9];  // a tie
  const std::vector<int32_t> banned = {2, -1, 40};
  const std::vector<SamplingParams> params = {
      {1.0f, 0, 1.0f}, {0.6f, 0, 1.0f},       {2.5f, 0, 1.0f},
      {1.0f, 6, 1.0f}, {1.0f, 0, 0.7f},       {1.7f, 9, 0.9f},
      {0.8f, 4, 0.5f}, {1.0f, 0, 1.0f, 0.2f}, {1.2f, 0, 0.8f, 0.05f}};
  const int draws = 60000;
  for (size_t c = 0; c < params.size(); ++c) {
    const SamplingParams& p = params[c];
    std::mt19937_64 seq = model::make_sequence_rng(123, c);
    std::vector<int> counts(vocab, 0);
    for (int i = 0; i < draws; ++i) {
      ++counts[static_cast<size_t>(model::sample_row(logits, p, model::next_uniform(seq), banned))];
    }
    const test::ReferencePick ref = test::reference_sample(logits, p, 0.5, banned);
    ASSERT_FALSE(ref.kept.empty());
    std::vector<double> prob(vocab, 0.0);
    for (const auto& [id, q] : ref.kept) prob[static_cast<size_t>(id)] = q;
    double chi2 = 0.0;
    for (int64_t j = 0; j < vocab; ++j) {
      if (prob[j] == 0.0) {
        EXPECT_EQ(counts[j], 0) << "case " << c << ": id " << j << " is filtered out";
        continue;
      }
      const double expect = prob[j] * draws;
      chi2 += (counts[j] - expect) * (counts[j] - expect) / expect;
    }
    const double dof = static_cast<double>(ref.kept.size()) - 1.0;
    if (dof < 1.0) continue;
    const double z = 4.753;  // the normal's 1e-6 upper quantile
    const double a = 2.0 / (9.0 * dof);
    const double bound = dof * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
    EXPECT_LT(chi2, bound) << "case " << c << " (" << ref.kept.size() << " kept ids)";
  }
}

}  // namespace
}  // namespace loraplex
