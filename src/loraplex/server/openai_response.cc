#include "loraplex/server/openai_response.h"

#include <random>

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;

json header_json(const ResponseHeader& h, const char* object) {
  json j;
  j["id"] = h.id;
  j["object"] = object;
  j["created"] = h.created;
  j["model"] = h.model;
  return j;
}

json finish_reason_json(const Finish& f) {
  return f.finish_reason.empty() ? json() : json(f.finish_reason);
}

}  // namespace

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string new_request_id(const std::string& prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* kHex = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 2; ++i) {
    uint64_t bits = rng();
    for (int k = 0; k < 16; ++k, bits >>= 4) id += kHex[bits & 0xF];
  }
  return id;
}

json usage_json(const Usage& u) {
  json j;
  j["prompt_tokens"] = u.prompt_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["prompt_tokens_details"] = {{"cached_tokens", u.cached_tokens}};
  return j;
}

json completion_logprobs(const std::vector<TokenLogprob>& tokens, int64_t text_offset) {
  json j;
  j["text_offset"] = json::array();
  j["token_logprobs"] = json::array();
  j["tokens"] = json::array();
  j["top_logprobs"] = json::array();
  int64_t offset = text_offset;
  for (const TokenLogprob& t : tokens) {
    j["text_offset"].push_back(offset);
    j["token_logprobs"].push_back(t.logprob);
    j["tokens"].push_back(t.token);
    json top = json::object();
    for (const auto& [text, lp] : t.top) {
      if (!top.contains(text)) top[text] = lp;
    }
    if (!top.contains(t.token)) top[t.token] = t.logprob;
    j["top_logprobs"].push_back(std::move(top));
    offset += static_cast<int64_t>(t.token.size());
  }
  return j;
}

json chat_logprobs(const std::vector<TokenLogprob>& tokens) {
  const auto bytes_of = [](const std::string& text) {
    json bytes = json::array();
    for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
    return bytes;
  };
  json content = json::array();
  for (const TokenLogprob& t : tokens) {
    json top = json::array();
    for (const auto& [text, lp] : t.top) {
      top.push_back(json{{"token", text}, {"logprob", lp}, {"bytes", bytes_of(text)}});
    }
    content.push_back(json{{"token", t.token},
                           {"logprob", t.logprob},
                           {"bytes", bytes_of(t.token)},
                           {"top_logprobs", top}});
  }
  return json{{"content", content}};
}

std::string completion_body(const ResponseHeader& h, const std::vector<Choice>& choices,
                            const Usage& usage, const json& prompt_token_ids) {
  json j = header_json(h, "text_completion");
  j["choices"] = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    json choice;
    choice["index"] = i;
    choice["text"] = c.text;
    choice["logprobs"] = c.logprobs;
    choice["finish_reason"] = finish_reason_json(c.finish);
    choice["stop_reason"] = c.finish.stop_reason;
    if (!c.token_ids.is_null()) choice["token_ids"] = c.token_ids;
    if (!prompt_token_ids.is_null()) choice["prompt_token_ids"] = prompt_token_ids;
    j["choices"].push_back(std::move(choice));
  }
  j["usage"] = usage_json(usage);
  return dump_json(j);
}

std::string chat_body(const ResponseHeader& h, const std::vector<Choice>& choices,
                      const Usage& usage, const json& prompt_token_ids) {
  json j = header_json(h, "chat.completion");
  j["choices"] = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    json message;
    message["role"] = "assistant";
    message["content"] = c.text;
    message["tool_calls"] = json::array();
    json choice;
    choice["index"] = i;
    choice["message"] = message;
    choice["logprobs"] = c.logprobs;
    choice["finish_reason"] = finish_reason_json(c.finish);
    choice["stop_reason"] = c.finish.stop_reason;
    if (!c.token_ids.is_null()) choice["token_ids"] = c.token_ids;
    j["choices"].push_back(std::move(choice));
  }
  j["usage"] = usage_json(usage);
  if (!prompt_token_ids.is_null()) j["prompt_token_ids"] = prompt_token_ids;
  return dump_json(j);
}

std::string completion_chunk(const ResponseHeader& h, int index, const std::string& text,
                             const Finish& f, const json& logprobs, const json& prompt_token_ids,
                             const json& token_ids) {
  json j = header_json(h, "text_completion");
  json choice;
  choice["index"] = index;
  choice["text"] = text;
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = finish_reason_json(f);
  choice["stop_reason"] = f.stop_reason;
  if (!prompt_token_ids.is_null()) choice["prompt_token_ids"] = prompt_token_ids;
  if (!token_ids.is_null()) choice["token_ids"] = token_ids;
  j["choices"] = json::array({choice});
  return dump_json(j);
}

std::string chat_chunk(const ResponseHeader& h, int index, const json& delta, const Finish& f,
                       const json& logprobs, const json& prompt_token_ids, const json& token_ids) {
  json j = header_json(h, "chat.completion.chunk");
  json choice;
  choice["index"] = index;
  choice["delta"] = delta;
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = finish_reason_json(f);
  if (!f.finish_reason.empty()) choice["stop_reason"] = f.stop_reason;
  if (!token_ids.is_null()) choice["token_ids"] = token_ids;
  j["choices"] = json::array({choice});
  if (!prompt_token_ids.is_null()) j["prompt_token_ids"] = prompt_token_ids;
  return dump_json(j);
}

std::string usage_chunk(const ResponseHeader& h, const std::string& object, const Usage& usage) {
  json j = header_json(h, object.c_str());
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return dump_json(j);
}

std::string sse_event(const std::string& json_text) { return "data: " + json_text + "\n\n"; }

}  // namespace loraplex::server
