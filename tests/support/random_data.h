#pragma once
// Shared test data: random tensors (never zeros) and the named adapter distributions of the
// Punica/FlashInfer tests, plus comparison against double-precision references.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "loraplex/core/tensor.h"

namespace loraplex::test {

/// Uniform in [-scale, -scale/8] U [scale/8, scale], rounded to `dtype`: no zeros, both signs.
Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, float scale = 1.0f);

/// float8_e4m3 codes drawn uniformly from all 254 that are not NaN (zeros, subnormals and
/// both signs included): what FP8 weights hold.
Tensor random_e4m3_codes(const Shape& shape, std::mt19937_64& rng);

enum class SlotDistribution { kOneAdapter, kAllDistinct, kUniform, kZipf, kSkewed };
const char* distribution_name(SlotDistribution d);
inline constexpr SlotDistribution kAllDistributions[] = {
    SlotDistribution::kOneAdapter, SlotDistribution::kAllDistinct, SlotDistribution::kUniform,
    SlotDistribution::kZipf, SlotDistribution::kSkewed};

/// One slot per token: one adapter (a random slot), all distinct (round-robin over
/// min(tokens, max_loras) slots), uniform, zipf (p ~ 1/(k+1)^1.2) or skewed (90% on one slot).
/// Then a fraction `none_fraction` of the tokens is set to -1 (base model only).
std::vector<int32_t> make_slots(SlotDistribution d, int num_tokens, int max_loras,
                                std::mt19937_64& rng, double none_fraction = 0.0);

/// Max over elements of |got - ref| / (atol + rtol * |ref|); <= 1 means within tolerance.
double tolerance_ratio(const std::vector<double>& got, const std::vector<double>& ref, double rtol,
                       double atol);

/// Expects `got` (any float dtype, CPU) to equal `ref` within rtol/atol, reporting the
/// worst element. `what` names the case in the failure message.
void expect_close(const Tensor& got, const std::vector<double>& ref, double rtol, double atol,
                  const std::string& what);

/// Relative tolerance that fits the rounding of one value to `dtype` plus fp32 accumulation.
double default_rtol(DType dtype);

}  // namespace loraplex::test
