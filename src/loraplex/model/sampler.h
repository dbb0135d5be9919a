#pragma once
// Token sampling from one row of logits: greedy (temperature 0, ties to the lowest token id),
// or temperature with optional top-k and top-p. Each sequence owns its random generator, seeded
// from the run's seed and the request's index, so a request samples the same tokens whatever
// else shares its batch.

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace loraplex::model {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = all tokens
  float top_p = 1.0f;        // 1 = all tokens
};

/// A sequence's generator, seeded from (seed, request index) by splitmix64.
std::mt19937_64 make_sequence_rng(uint64_t seed, uint64_t request_index);

/// Index of the largest logit; ties go to the lowest index; NaNs never win (0 if all are NaN).
int32_t argmax_lowest(std::span<const float> logits);

/// Picks one token. Greedy ignores `rng`. Throws loraplex::Error on invalid params.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params,
                     std::mt19937_64& rng);

}  // namespace loraplex::model
