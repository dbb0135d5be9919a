#pragma once
// Parses and validates the bodies of POST /v1/completions and /v1/chat/completions into what
// the engine takes (engine::Request) plus what the response needs (stream flags, logprobs).
// Every wrong type or value is an ApiException (400) naming the field; fields loraplex does
// not implement with a non-default value (penalties, logit_bias, top logprobs, beam search,
// structured output, ...; unsupported_fields.h) are refused rather than ignored, so a client
// never gets a result it did not ask for. Unknown fields are ignored, as vLLM ignores them.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loraplex/engine/engine.h"
#include "loraplex/template/chat_template.h"

namespace loraplex::server {

/// The most choices (n) one request may ask for.
inline constexpr int64_t kMaxChoices = 128;
/// The most top logprobs per token (vLLM's default max_logprobs).
inline constexpr int64_t kMaxTopLogprobs = 20;

struct GenerationRequest {
  enum class Kind { kCompletion, kChat };
  Kind kind = Kind::kCompletion;
  std::string model;  // the "model" field as the client wrote it; empty when absent

  engine::RequestOptions options;
  bool max_tokens_given = false;  // false: the server picks the default (16, or the context)
  int64_t n = 1;                  // choices, each its own engine request

  // Completions: the prompt as text or token ids (one of them).
  std::string prompt;
  std::vector<int32_t> prompt_ids;

  /// vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (-1: max_model_len).
  std::optional<int64_t> truncate_prompt_tokens;

  // Chat: the messages with text content flattened (vLLM's "string" content format).
  nlohmann::ordered_json messages;
  jinja::ChatRenderOptions chat;
  // Chat's default: the template writes BOS itself; completions' default is true.
  bool add_special_tokens = false;

  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
  bool logprobs = false;          // per-token log-probabilities of the sampled tokens
  bool return_token_ids = false;  // vLLM's: the prompt's and the output's token ids too
};

/// POST /v1/completions. Throws ApiException (400) naming the field.
GenerationRequest parse_completion_request(std::string_view body);
/// POST /v1/chat/completions. Throws ApiException (400) naming the field.
GenerationRequest parse_chat_request(std::string_view body);

/// Parses a JSON object body; malformed JSON or a non-object is an ApiException (400).
nlohmann::ordered_json parse_json_object(std::string_view body);

}  // namespace loraplex::server
