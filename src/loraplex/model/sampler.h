#pragma once
// Token sampling from one row of logits by the rule of step_batch.h (SamplingParams): greedy,
// or temperature with top-k and top-p, driven by one uniform draw per sequence and step. Each
// sequence owns its random generator, seeded from the run's seed and the request's index, and
// the host draws the uniform from it, so a request samples the same tokens whatever else
// shares its batch, on the CPU and on the GPU alike.

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "loraplex/model/step_batch.h"

namespace loraplex::model {

/// A sequence's generator, seeded from (seed, request index) by splitmix64.
std::mt19937_64 make_sequence_rng(uint64_t seed, uint64_t request_index);
/// The next uniform draw in [0, 1) of a sequence's generator.
double next_uniform(std::mt19937_64& rng);

/// Index of the largest logit; ties go to the lowest index; NaNs never win (0 if all are NaN).
int32_t argmax_lowest(std::span<const float> logits);

/// Throws loraplex::Error naming the field when `params` are out of range.
void check_sampling_params(const SamplingParams& params);

/// Picks one token by the rule of SamplingParams. `uniform` in [0, 1) is unused when greedy;
/// `banned` ids (outside the vocabulary: ignored) are never picked unless every id is banned;
/// then, and when every logit is NaN or -inf, the pick is argmax_lowest(logits).
int32_t sample_row(std::span<const float> logits, const SamplingParams& params, double uniform,
                   std::span<const int32_t> banned = {});

/// sample_row without allocating: `scratch` holds at least 2 * logits.size() floats.
int32_t sample_row(std::span<const float> logits, const SamplingParams& params, double uniform,
                   std::span<const int32_t> banned, std::span<float> scratch);

/// The exponential of the sampling rule, exp(x) for x <= 0, bit for bit what the GPU sampler
/// computes (sampling_math.h); within a few 1e-8 relative of the exact value.
float sampling_exp(float x);

/// What log_softmax needs of a row, in double precision, NaNs left out: its largest value and
/// log(sum of exp(v - max)), where the maximum itself weighs 1 (so an infinite maximum gives
/// no NaN). log_softmax(v) = (v == max ? 0 : v - max) - log_sum.
struct LogSoftmaxNorm {
  double max = 0.0;
  double log_sum = 0.0;
};
LogSoftmaxNorm log_softmax_norm(std::span<const float> logits);

/// log softmax(logits)[id], in double precision, NaNs left out of the softmax. Where the
/// largest logit is infinite (+inf, or -inf when every other logit is NaN) each id equal to it
/// weighs 1 (+inf ids share the mass, finite ones get -inf).
float token_logprob(std::span<const float> logits, int32_t id);

}  // namespace loraplex::model
