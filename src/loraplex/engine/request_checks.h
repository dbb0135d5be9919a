#pragma once
// What Engine::submit refuses, as pure functions: each RequestError names the value and the
// limit it broke.

#include <cstdint>
#include <vector>

#include "loraplex/engine/engine.h"
#include "loraplex/model/step_batch.h"

namespace loraplex::engine {

struct RequestLimits {
  int64_t max_model_len = 0;
  int64_t kv_cache_tokens = 0;  // blocks x block size: one sequence can never hold more
  int32_t vocab_size = 0;       // the model's
  bool has_tokenizer = true;
  std::vector<int32_t> eos_token_ids;
};

/// Sampling values, stop conditions and min_tokens' ban list.
void check_request_options(const RequestOptions& options, const RequestLimits& limits);
/// The prompt's ids (after tokenization) and its length with max_tokens.
void check_prompt(const std::vector<int32_t>& prompt_ids, const RequestOptions& options,
                  const RequestLimits& limits);
/// vLLM's _SAMPLING_EPS: a temperature below it samples greedily (logits divided by it would
/// overflow to inf, and the pick would be random).
inline constexpr float kGreedyTemperatureBelow = 1e-5f;

/// How the model samples for these options: greedy (temperature 0, no top-k or top-p) when
/// the temperature is below kGreedyTemperatureBelow, as vLLM does.
model::SamplingParams sampling_params_of(const RequestOptions& options);

/// The ids min_tokens bans until it is reached: EOS (unless ignore_eos) and stop_token_ids,
/// without repeats.
std::vector<int32_t> min_tokens_banned_ids(const RequestOptions& options,
                                           const std::vector<int32_t>& eos_token_ids);

}  // namespace loraplex::engine
