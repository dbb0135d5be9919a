#include "support/random_data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

namespace loraplex::test {

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, float scale) {
  std::uniform_real_distribution<float> mag(scale / 8, scale);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& v : values) v = negative(rng) ? -mag(rng) : mag(rng);
  return Tensor::from_vector(values, shape).to(dtype);
}

Tensor random_e4m3_codes(const Shape& shape, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape, DType::kF8E4M3);
  std::uniform_int_distribution<int> code(0, 253);
  uint8_t* q = static_cast<uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int c = code(rng);
    q[i] = static_cast<uint8_t>(c < 127 ? c : c + 1);  // skip 0x7f; 0xff is past 253 + 1
  }
  return t;
}

const char* distribution_name(SlotDistribution d) {
  switch (d) {
    case SlotDistribution::kOneAdapter:
      return "one_adapter";
    case SlotDistribution::kAllDistinct:
      return "all_distinct";
    case SlotDistribution::kUniform:
      return "uniform";
    case SlotDistribution::kZipf:
      return "zipf";
    case SlotDistribution::kSkewed:
      return "skewed";
  }
  return "?";
}

std::vector<int32_t> make_slots(SlotDistribution d, int num_tokens, int max_loras,
                                std::mt19937_64& rng, double none_fraction) {
  std::vector<int32_t> slots(static_cast<size_t>(num_tokens));
  std::uniform_int_distribution<int32_t> any(0, max_loras - 1);
  switch (d) {
    case SlotDistribution::kOneAdapter: {
      const int32_t s = any(rng);
      std::fill(slots.begin(), slots.end(), s);
      break;
    }
    case SlotDistribution::kAllDistinct: {
      const int distinct = std::max(1, std::min(num_tokens, max_loras));
      for (int t = 0; t < num_tokens; ++t) slots[static_cast<size_t>(t)] = t % distinct;
      break;
    }
    case SlotDistribution::kUniform:
      for (auto& s : slots) s = any(rng);
      break;
    case SlotDistribution::kZipf: {
      std::vector<double> weights(static_cast<size_t>(max_loras));
      for (int k = 0; k < max_loras; ++k)
        weights[static_cast<size_t>(k)] = 1.0 / std::pow(k + 1, 1.2);
      std::discrete_distribution<int32_t> zipf(weights.begin(), weights.end());
      for (auto& s : slots) s = zipf(rng);
      break;
    }
    case SlotDistribution::kSkewed: {
      const int32_t hot = any(rng);
      std::bernoulli_distribution is_hot(0.9);
      for (auto& s : slots) s = is_hot(rng) ? hot : any(rng);
      break;
    }
  }
  std::bernoulli_distribution none(none_fraction);
  for (auto& s : slots) {
    if (none_fraction > 0 && none(rng)) s = -1;
  }
  return slots;
}

double tolerance_ratio(const std::vector<double>& got, const std::vector<double>& ref, double rtol,
                       double atol) {
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    if (std::isnan(got[i]) != std::isnan(ref[i])) return INFINITY;
    worst = std::max(worst, err / (atol + rtol * std::fabs(ref[i])));
  }
  return worst;
}

void expect_close(const Tensor& got, const std::vector<double>& ref, double rtol, double atol,
                  const std::string& what) {
  const std::vector<double> g = got.to_double_vector();
  ASSERT_EQ(g.size(), ref.size()) << what;
  size_t worst_i = 0;
  double worst = -1.0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double ratio =
        std::isnan(g[i]) ? INFINITY : std::fabs(g[i] - ref[i]) / (atol + rtol * std::fabs(ref[i]));
    if (ratio > worst) {
      worst = ratio;
      worst_i = i;
    }
  }
  EXPECT_LE(worst, 1.0) << what << ": element " << worst_i << " is " << g[worst_i] << ", reference "
                        << ref[worst_i] << " (rtol " << rtol << ", atol " << atol << ")";
}

double default_rtol(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 1e-4;
    case DType::kF16:
      return 2e-3;
    case DType::kBF16:
      return 1.6e-2;
    default:
      return 1e-1;
  }
}

}  // namespace loraplex::test
