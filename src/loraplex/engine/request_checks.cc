#include "loraplex/engine/request_checks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "loraplex/core/error.h"
#include "loraplex/model/step_batch.h"
#include "loraplex/model/top_logprobs_ops.h"

namespace loraplex::engine {
namespace {

template <typename... Args>
[[noreturn]] void refuse(RequestError::Kind kind, const Args&... args) {
  throw RequestError(kind, detail::concat(args...));
}

constexpr RequestError::Kind kInvalid = RequestError::Kind::kInvalid;

// "len + max_tokens = total" where the sum is representable; max_tokens may be near 2^63.
std::string length_sum(int64_t len, int64_t max_tokens) {
  std::string s = detail::concat("the prompt (", len, " tokens) + max_tokens (", max_tokens, ")");
  if (max_tokens <= std::numeric_limits<int64_t>::max() - len) {
    s += detail::concat(" = ", len + max_tokens, " tokens");
  }
  return s;
}

}  // namespace

model::SamplingParams sampling_params_of(const RequestOptions& o) {
  if (o.temperature < kGreedyTemperatureBelow) return model::SamplingParams{0.0f, 0, 1.0f};
  return model::SamplingParams{o.temperature, o.top_k < 0 ? 0 : o.top_k, o.top_p, o.min_p};
}

std::vector<int32_t> min_tokens_banned_ids(const RequestOptions& o,
                                           const std::vector<int32_t>& eos_token_ids) {
  std::vector<int32_t> ids;
  if (!o.ignore_eos) ids = eos_token_ids;
  ids.insert(ids.end(), o.stop_token_ids.begin(), o.stop_token_ids.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

void check_request_options(const RequestOptions& o, const RequestLimits& limits) {
  if (o.max_tokens < 1) refuse(kInvalid, "max_tokens ", o.max_tokens, ", expected >= 1");
  if (o.min_tokens < 0 || o.min_tokens > o.max_tokens) {
    refuse(kInvalid, "min_tokens ", o.min_tokens, ", expected 0 ..", " max_tokens (", o.max_tokens,
           ")");
  }
  if (!std::isfinite(o.temperature) || o.temperature < 0.0f) {
    refuse(kInvalid, "temperature ", o.temperature, ", expected a finite value >= 0");
  }
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) {
    refuse(kInvalid, "top_p ", o.top_p, ", expected a value in (0, 1]");
  }
  if (o.top_k < -1) refuse(kInvalid, "top_k ", o.top_k, ", expected -1 or 0 (off) or >= 1");
  if (!(o.min_p >= 0.0f && o.min_p <= 1.0f)) {
    refuse(kInvalid, "min_p ", o.min_p, ", expected a value in [0, 1]");
  }
  for (size_t i = 0; i < o.stop.size(); ++i) {
    if (!limits.has_tokenizer) {
      refuse(kInvalid, "stop strings need a tokenizer, and this engine has none");
    }
    if (o.stop[i].empty()) refuse(kInvalid, "stop string ", i, " is empty");
  }
  for (int32_t id : o.stop_token_ids) {
    if (id < 0 || id >= limits.vocab_size) {
      refuse(kInvalid, "stop token id ", id, " is outside the vocabulary [0, ", limits.vocab_size,
             ")");
    }
  }
  if (o.top_logprobs < 0 || o.top_logprobs > model::ops::kMaxTopLogprobs) {
    refuse(kInvalid, "top_logprobs ", o.top_logprobs, ", expected 0 .. ",
           model::ops::kMaxTopLogprobs);
  }
  // vLLM's ranges.
  if (!(o.presence_penalty >= -2.0f && o.presence_penalty <= 2.0f)) {
    refuse(kInvalid, "presence_penalty ", o.presence_penalty, ", expected -2 .. 2");
  }
  if (!(o.frequency_penalty >= -2.0f && o.frequency_penalty <= 2.0f)) {
    refuse(kInvalid, "frequency_penalty ", o.frequency_penalty, ", expected -2 .. 2");
  }
  if (!(o.repetition_penalty > 0.0f && o.repetition_penalty <= 2.0f)) {
    refuse(kInvalid, "repetition_penalty ", o.repetition_penalty, ", expected (0, 2]");
  }
  for (const auto& [id, bias] : o.logit_bias) {
    if (id < 0 || id >= limits.vocab_size) {
      refuse(kInvalid, "logit_bias token id ", id, " is outside the vocabulary [0, ",
             limits.vocab_size, ")");
    }
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      refuse(kInvalid, "logit_bias ", bias, " for token id ", id, ", expected -100 .. 100");
    }
  }
  for (int32_t id : o.allowed_token_ids) {
    if (id < 0 || id >= limits.vocab_size) {
      refuse(kInvalid, "allowed_token_ids: token id ", id, " is outside the vocabulary [0, ",
             limits.vocab_size, ")");
    }
  }
  if (!o.bad_words.empty() && !limits.has_tokenizer) {
    refuse(kInvalid, "bad_words need a tokenizer, and this engine has none");
  }
  const bool structured = o.structured.kind != StructuredOutput::Kind::kNone;
  if (structured && !limits.has_tokenizer) {
    refuse(kInvalid, "structured output needs a tokenizer, and this engine has none");
  }
  const bool processing = o.presence_penalty != 0.0f || o.frequency_penalty != 0.0f ||
                          o.repetition_penalty != 1.0f || !o.logit_bias.empty() ||
                          !o.allowed_token_ids.empty() || !o.bad_words.empty() || structured;
  if (processing && o.logprobs) {
    // vLLM returns the raw model's log-probabilities; the sampler here computes them from the
    // logits it samples from, which these fields have changed.
    refuse(kInvalid,
           "logprobs together with penalties, logit_bias, allowed_token_ids, bad_words or "
           "structured output are not supported (they would be of the adjusted logits, not the "
           "model's)");
  }
  if (o.min_tokens > 0) {
    const size_t banned = min_tokens_banned_ids(o, limits.eos_token_ids).size();
    if (banned > static_cast<size_t>(model::kMaxBannedTokens)) {
      refuse(kInvalid, "min_tokens ", o.min_tokens, " would ban ", banned,
             " token ids (EOS and stop_token_ids) until it is reached, at most ",
             model::kMaxBannedTokens);
    }
  }
}

void check_prompt(const std::vector<int32_t>& ids, const RequestOptions& o,
                  const RequestLimits& limits) {
  if (ids.empty()) refuse(kInvalid, "the prompt is empty");
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
      refuse(kInvalid, "prompt token ", i, " is id ", ids[i], ", outside the vocabulary [0, ",
             limits.vocab_size, ")");
    }
  }
  // Compared without adding: max_tokens may be anything up to 2^63 - 1.
  const int64_t len = static_cast<int64_t>(ids.size());
  if (len > limits.max_model_len || o.max_tokens > limits.max_model_len - len) {
    refuse(RequestError::Kind::kTooLong, length_sum(len, o.max_tokens), " exceeds max_model_len ",
           limits.max_model_len);
  }
  if (len > limits.kv_cache_tokens || o.max_tokens > limits.kv_cache_tokens - len) {
    refuse(RequestError::Kind::kTooLong, length_sum(len, o.max_tokens), " exceeds the KV cache (",
           limits.kv_cache_tokens, " tokens)");
  }
}

}  // namespace loraplex::engine
