#pragma once
// The response bodies of the OpenAI API as vLLM writes them: completions and chat
// completions, whole or as server-sent-event chunks (the usage chunk with empty choices when
// stream_options.include_usage, and the closing `data: [DONE]`).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace loraplex::server {

/// What every response object of one request repeats.
struct ResponseHeader {
  std::string id;       // cmpl-... or chatcmpl-...
  int64_t created = 0;  // Unix seconds
  std::string model;    // as the request named it
};

/// A fresh id: `prefix` + 32 hex digits.
std::string new_request_id(const std::string& prefix);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
};

/// One sampled token and its log-probability, and the most probable tokens of its step when
/// top logprobs were asked for (text and log-probability, most probable first).
struct TokenLogprob {
  std::string token;  // its text
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;
};

/// The end of a choice: finish_reason ("stop", "length", "abort"; empty: null) and vLLM's
/// stop_reason (the stop string, the stop token id, or null for EOS).
struct Finish {
  std::string finish_reason;
  nlohmann::ordered_json stop_reason;  // null, a string or an integer
};

nlohmann::ordered_json usage_json(const Usage& usage);

/// Completion logprobs: tokens, token_logprobs, top_logprobs (the step's top tokens and the
/// sampled one, as vLLM writes them), text_offset counted from `text_offset` (bytes of text
/// before these tokens).
nlohmann::ordered_json completion_logprobs(const std::vector<TokenLogprob>& tokens,
                                           int64_t text_offset);
/// Chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
/// "logprob", "bytes"}, ...]}]}.
nlohmann::ordered_json chat_logprobs(const std::vector<TokenLogprob>& tokens);

// vLLM's return_token_ids: `prompt_token_ids` (whole responses and a stream's first chunk)
// and `token_ids` (the generated ids, or a chunk's new ones) are written where vLLM writes
// them when they are not null (the default: left out).

/// One choice of a whole response (n > 1 gives several, index = their order).
struct Choice {
  std::string text;
  Finish finish;
  nlohmann::ordered_json logprobs;   // null: not asked for
  nlohmann::ordered_json token_ids;  // null: not asked for
};

std::string completion_body(const ResponseHeader& h, const std::vector<Choice>& choices,
                            const Usage& usage,
                            const nlohmann::ordered_json& prompt_token_ids = {});
std::string chat_body(const ResponseHeader& h, const std::vector<Choice>& choices,
                      const Usage& usage, const nlohmann::ordered_json& prompt_token_ids = {});

/// One streamed completion chunk of choice `index`; `finish` null fields while it goes on.
std::string completion_chunk(const ResponseHeader& h, int index, const std::string& text,
                             const Finish& finish, const nlohmann::ordered_json& logprobs,
                             const nlohmann::ordered_json& prompt_token_ids = {},
                             const nlohmann::ordered_json& token_ids = {});
/// One streamed chat chunk of choice `index`; `delta` is {"role": "assistant", "content": ""}
/// first, then {"content": "..."}.
std::string chat_chunk(const ResponseHeader& h, int index, const nlohmann::ordered_json& delta,
                       const Finish& finish, const nlohmann::ordered_json& logprobs,
                       const nlohmann::ordered_json& prompt_token_ids = {},
                       const nlohmann::ordered_json& token_ids = {});
/// The closing usage chunk (choices: []), of object `object`.
std::string usage_chunk(const ResponseHeader& h, const std::string& object, const Usage& usage);

/// "data: <json>\n\n".
std::string sse_event(const std::string& json);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

/// JSON text that never throws on invalid UTF-8 (replaced by U+FFFD).
std::string dump_json(const nlohmann::ordered_json& j);

}  // namespace loraplex::server
