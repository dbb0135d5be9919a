#include "loraplex/server/openai_request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "loraplex/server/api_error.h"
#include "loraplex/server/structured_output_fields.h"
#include "loraplex/server/unsupported_fields.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;

const char* type_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "integer";
    case json::value_t::number_float:
      return "number";
    case json::value_t::string:
      return "string";
    case json::value_t::array:
      return "array";
    case json::value_t::object:
      return "object";
    default:
      return "binary";
  }
}

[[noreturn]] void bad_type(const std::string& field, const char* expected, const json& v) {
  throw_api(400, "'" + field + "' must be " + expected + ", got " + type_of(v), field);
}

// The field's value, or nullptr when absent or null (OpenAI treats null as "not given").
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad_type(name, "a boolean", *v);
  return v->get<bool>();
}

std::optional<int64_t> get_int(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw_api(400, std::string("'") + name + "' is out of range", name);
    }
    return v->get<int64_t>();
  }
  // 3.0 is accepted as 3, as pydantic does.
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      return static_cast<int64_t>(d);
    }
  }
  bad_type(name, "an integer", *v);
}

std::optional<double> get_number(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad_type(name, "a number", *v);
  const double d = v->get<double>();
  if (!std::isfinite(d)) throw_api(400, std::string("'") + name + "' must be finite", name);
  return d;
}

std::optional<std::string> get_string(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) bad_type(name, "a string", *v);
  return v->get<std::string>();
}

void refuse_unless(bool ok, const std::string& param, const std::string& what) {
  if (!ok) throw_api(400, what, param);
}

std::vector<int32_t> token_ids(const json& list, const char* param) {
  std::vector<int32_t> ids;
  for (const json& id : list) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      throw_api(400, std::string("'") + param + "' token ids must be integers >= 0", param);
    }
    ids.push_back(id.get<int32_t>());
  }
  return ids;
}

// The steps of parse_common, in the order the fields are checked.

// temperature, top_p, top_k, seed, min_tokens.
void parse_sampling(const json& body, engine::RequestOptions& o) {
  if (auto t = get_number(body, "temperature")) {
    refuse_unless(*t >= 0.0, "temperature",
                  "'temperature' must be >= 0, got " + std::to_string(*t));
    o.temperature = static_cast<float>(*t);
  }
  if (auto p = get_number(body, "top_p")) {
    refuse_unless(*p > 0.0 && *p <= 1.0, "top_p",
                  "'top_p' must be in (0, 1], got " + std::to_string(*p));
    o.top_p = static_cast<float>(*p);
  }
  if (auto k = get_int(body, "top_k")) {
    refuse_unless(*k >= -1 && *k <= std::numeric_limits<int>::max(), "top_k",
                  "'top_k' must be -1 or 0 (off) or a positive integer, got " + std::to_string(*k));
    o.top_k = *k <= 0 ? 0 : static_cast<int>(*k);
  }
  if (auto s = get_int(body, "seed")) o.seed = static_cast<uint64_t>(*s);
  if (auto m = get_int(body, "min_tokens")) {
    refuse_unless(*m >= 0, "min_tokens", "'min_tokens' must be >= 0, got " + std::to_string(*m));
    o.min_tokens = *m;
  }
}

// What the output keeps: EOS, stop strings, special tokens; the prompt's truncation.
void parse_output_options(const json& body, GenerationRequest& r) {
  engine::RequestOptions& o = r.options;
  if (auto e = get_bool(body, "ignore_eos")) o.ignore_eos = *e;
  if (auto i = get_bool(body, "include_stop_str_in_output")) o.include_stop_str_in_output = *i;
  if (auto k = get_bool(body, "skip_special_tokens")) o.skip_special_tokens = *k;
  // Read by slow tokenizers only; with tokenizer.json vLLM ignores it too.
  (void)get_bool(body, "spaces_between_special_tokens");
  if (auto t = get_int(body, "truncate_prompt_tokens")) {
    refuse_unless(
        *t == -1 || *t >= 1, "truncate_prompt_tokens",
        "'truncate_prompt_tokens' must be -1 (max_model_len) or >= 1, got " + std::to_string(*t));
    r.truncate_prompt_tokens = *t;
  }
}

// stop and stop_token_ids.
void parse_stops(const json& body, engine::RequestOptions& o) {
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      o.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string()) bad_type("stop", "a string or a list of strings", *stop);
        o.stop.push_back(s.get<std::string>());
      }
    } else {
      bad_type("stop", "a string or a list of strings", *stop);
    }
    for (const std::string& s : o.stop)
      refuse_unless(!s.empty(), "stop", "'stop' strings must not be empty");
  }
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad_type("stop_token_ids", "a list of integers", *ids);
    for (const json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        throw_api(400, "'stop_token_ids' must be a list of token ids (integers >= 0)",
                  "stop_token_ids");
      }
      o.stop_token_ids.push_back(id.get<int32_t>());
    }
  }
}

// n, best_of, stream, return_token_ids, stream_options.
void parse_choices_and_stream(const json& body, GenerationRequest& r) {
  if (auto n = get_int(body, "n")) {
    refuse_unless(
        *n >= 1 && *n <= kMaxChoices, "n",
        "'n' must be in 1 .. " + std::to_string(kMaxChoices) + ", got " + std::to_string(*n));
    r.n = *n;
  }
  if (auto b = get_int(body, "best_of")) {
    // best_of > n would sample more and return the best: beam-search-like ranking, not done.
    refuse_unless(*b == r.n, "best_of",
                  "'best_of' must equal 'n' (" + std::to_string(r.n) +
                      "): returning the best of more samples is not implemented");
  }
  if (auto s = get_bool(body, "stream")) r.stream = *s;
  if (auto t = get_bool(body, "return_token_ids")) r.return_token_ids = *t;
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_type("stream_options", "an object", *so);
    refuse_unless(r.stream, "stream_options",
                  "'stream_options' can only be given when 'stream' is true");
    if (auto u = get_bool(*so, "include_usage")) r.include_usage = *u;
    if (auto c = get_bool(*so, "continuous_usage_stats")) {
      refuse_unless(!*c, "stream_options", "continuous_usage_stats is not supported");
    }
  }
}

// Penalties, min_p, logit_bias, allowed_token_ids, bad_words.
void parse_logits_processing(const json& body, engine::RequestOptions& o) {
  // vLLM's logits processing: ranges are the engine's to check (it names the limit).
  if (auto p = get_number(body, "presence_penalty")) o.presence_penalty = static_cast<float>(*p);
  if (auto p = get_number(body, "frequency_penalty")) o.frequency_penalty = static_cast<float>(*p);
  if (auto p = get_number(body, "repetition_penalty")) {
    o.repetition_penalty = static_cast<float>(*p);
  }
  if (auto p = get_number(body, "min_p")) o.min_p = static_cast<float>(*p);
  if (const json* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) bad_type("logit_bias", "an object of token ids to biases", *lb);
    for (const auto& [key, value] : lb->items()) {
      int64_t id = -1;
      try {
        size_t used = 0;
        id = std::stoll(key, &used);
        if (used != key.size()) id = -1;
      } catch (const std::exception&) {
        id = -1;
      }
      refuse_unless(id >= 0 && id <= std::numeric_limits<int32_t>::max(), "logit_bias",
                    "'logit_bias' keys must be token ids, got '" + key + "'");
      if (!value.is_number() || !std::isfinite(value.get<double>())) {
        bad_type("logit_bias", "an object of token ids to numbers", value);
      }
      // OpenAI's and vLLM's range: values beyond it are clamped, not refused.
      o.logit_bias[static_cast<int32_t>(id)] =
          static_cast<float>(std::clamp(value.get<double>(), -100.0, 100.0));
    }
  }
  if (const json* a = field(body, "allowed_token_ids")) {
    if (!a->is_array()) bad_type("allowed_token_ids", "a list of token ids", *a);
    refuse_unless(!a->empty(), "allowed_token_ids", "'allowed_token_ids' must not be empty");
    o.allowed_token_ids = token_ids(*a, "allowed_token_ids");
  }
  if (const json* b = field(body, "bad_words")) {
    if (!b->is_array()) bad_type("bad_words", "a list of strings", *b);
    for (const json& w : *b) {
      if (!w.is_string()) bad_type("bad_words", "a list of strings", *b);
      o.bad_words.push_back(w.get<std::string>());
    }
  }
}

// The sampling fields shared by both endpoints (OpenAI's and vLLM's extra ones).
void parse_common(const json& body, GenerationRequest& r) {
  refuse_unsupported_fields(body);
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad_type("model", "a string", *m);
    r.model = m->get<std::string>();
  }
  engine::RequestOptions& o = r.options;
  parse_sampling(body, o);
  parse_output_options(body, r);
  parse_stops(body, o);
  parse_choices_and_stream(body, r);
  parse_logits_processing(body, o);
  o.structured = structured_output_of(body);
  if (auto e = get_bool(body, "echo")) refuse_unless(!*e, "echo", "'echo' is not supported");
  if (const json* u = field(body, "user")) {
    if (!u->is_string()) bad_type("user", "a string", *u);
  }
}

void set_max_tokens(GenerationRequest& r, std::optional<int64_t> max_tokens, const char* name) {
  if (!max_tokens) return;
  refuse_unless(*max_tokens >= 1, name,
                std::string("'") + name + "' must be >= 1, got " + std::to_string(*max_tokens));
  r.options.max_tokens = *max_tokens;
  r.max_tokens_given = true;
}

void check_min_tokens(const GenerationRequest& r) {
  if (r.max_tokens_given) {
    refuse_unless(r.options.min_tokens <= r.options.max_tokens, "min_tokens",
                  "'min_tokens' (" + std::to_string(r.options.min_tokens) +
                      ") must not exceed 'max_tokens' (" + std::to_string(r.options.max_tokens) +
                      ")");
  }
}

// vLLM's "string" content format: text parts joined with newlines.
json flatten_content(const json& content, size_t index) {
  const std::string param = "messages[" + std::to_string(index) + "].content";
  if (content.is_null()) return "";
  if (content.is_string()) return content;
  if (!content.is_array()) bad_type(param, "a string or a list of content parts", content);
  std::string text;
  bool first = true;
  for (const json& part : content) {
    if (!part.is_object()) bad_type(param, "a list of content parts (objects)", part);
    const std::string type = part.value("type", "");
    if (type != "text" && type != "input_text") {
      throw_api(400, "content part type '" + type + "' is not supported (only text)", param);
    }
    const auto t = part.find("text");
    if (t == part.end() || !t->is_string())
      bad_type(param, "a text part with a string 'text'", part);
    if (!first) text += "\n";
    first = false;
    text += t->get<std::string>();
  }
  return text;
}

// The deepest nesting of arrays and objects in `j`, walked without recursion.
size_t nesting_depth(const json& j) {
  size_t deepest = 0;
  std::vector<std::pair<const json*, size_t>> todo = {{&j, 1}};
  while (!todo.empty()) {
    const auto [node, depth] = todo.back();
    todo.pop_back();
    if (!node->is_structured()) continue;
    deepest = std::max(deepest, depth);
    for (const json& child : *node) todo.emplace_back(&child, depth + 1);
  }
  return deepest;
}

}  // namespace

json parse_json_object(std::string_view body) {
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    throw_api(400, std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) {
    throw_api(400, std::string("the request body must be a JSON object, got ") + type_of(j));
  }
  // The template engine and the response writer walk values recursively; real requests nest a
  // handful of levels (tool schemas a few more).
  constexpr size_t kMaxDepth = 64;
  if (nesting_depth(j) > kMaxDepth) {
    throw_api(400, "the request body nests deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  return j;
}

GenerationRequest parse_completion_request(std::string_view body_text) {
  const json body = parse_json_object(body_text);
  GenerationRequest r;
  r.kind = GenerationRequest::Kind::kCompletion;
  r.add_special_tokens = true;
  parse_common(body, r);
  if (auto a = get_bool(body, "add_special_tokens")) r.add_special_tokens = *a;
  set_max_tokens(r, get_int(body, "max_tokens"), "max_tokens");
  check_min_tokens(r);
  const json* prompt = field(body, "prompt");
  if (!prompt) throw_api(400, "'prompt' is required", "prompt");
  if (prompt->is_string()) {
    r.prompt = prompt->get<std::string>();
  } else if (prompt->is_array()) {
    if (prompt->empty()) throw_api(400, "'prompt' must not be empty", "prompt");
    const json& first = prompt->front();
    if (first.is_number_integer()) {
      r.prompt_ids = token_ids(*prompt, "prompt");
    } else {
      // A list of prompts (strings or id lists): one is accepted, as n=1 serves one.
      if (prompt->size() != 1) {
        throw_api(400,
                  "only one prompt per request is supported, got " + std::to_string(prompt->size()),
                  "prompt");
      }
      if (first.is_string()) {
        r.prompt = first.get<std::string>();
      } else if (first.is_array()) {
        r.prompt_ids = token_ids(first, "prompt");
      } else {
        bad_type("prompt", "a string, a list of token ids, or a list of one of them", *prompt);
      }
    }
  } else {
    bad_type("prompt", "a string or a list of token ids", *prompt);
  }
  if (r.prompt.empty() && r.prompt_ids.empty()) {
    throw_api(400, "'prompt' must not be empty", "prompt");
  }
  if (const json* lp = field(body, "logprobs")) {
    if (!lp->is_number_integer()) bad_type("logprobs", "an integer", *lp);
    const int64_t k = lp->get<int64_t>();
    refuse_unless(k >= 0 && k <= kMaxTopLogprobs, "logprobs",
                  "'logprobs' must be in 0 .. " + std::to_string(kMaxTopLogprobs) + ", got " +
                      std::to_string(k));
    r.options.top_logprobs = static_cast<int>(k);
    r.logprobs = true;
  }
  if (auto s = get_string(body, "suffix")) {
    refuse_unless(s->empty(), "suffix", "'suffix' is not supported");
  }
  r.options.logprobs = r.logprobs;
  return r;
}

GenerationRequest parse_chat_request(std::string_view body_text) {
  const json body = parse_json_object(body_text);
  GenerationRequest r;
  r.kind = GenerationRequest::Kind::kChat;
  parse_common(body, r);
  // max_completion_tokens is OpenAI's newer name; it wins when both are given.
  const std::optional<int64_t> mct = get_int(body, "max_completion_tokens");
  if (mct) {
    set_max_tokens(r, mct, "max_completion_tokens");
  } else {
    set_max_tokens(r, get_int(body, "max_tokens"), "max_tokens");
  }
  check_min_tokens(r);
  const json* messages = field(body, "messages");
  if (!messages) throw_api(400, "'messages' is required", "messages");
  if (!messages->is_array()) bad_type("messages", "a list of messages", *messages);
  if (messages->empty()) throw_api(400, "'messages' must not be empty", "messages");
  r.messages = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string param = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad_type(param, "an object", m);
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      throw_api(400, "'" + param + ".role' must be a string", param + ".role");
    }
    json copy = m;
    copy["content"] = flatten_content(m.contains("content") ? m.at("content") : json(), i);
    r.messages.push_back(std::move(copy));
  }
  if (auto g = get_bool(body, "add_generation_prompt")) r.chat.add_generation_prompt = *g;
  if (auto c = get_bool(body, "continue_final_message")) r.chat.continue_final_message = *c;
  refuse_unless(!(r.chat.add_generation_prompt && r.chat.continue_final_message),
                "continue_final_message",
                "'continue_final_message' needs 'add_generation_prompt': false");
  if (r.chat.continue_final_message) {
    refuse_unless(r.messages.back().value("role", "") == "assistant", "continue_final_message",
                  "'continue_final_message' needs the last message to be the assistant's");
  }
  if (auto a = get_bool(body, "add_special_tokens")) r.add_special_tokens = *a;
  if (const json* k = field(body, "chat_template_kwargs")) {
    if (!k->is_object()) bad_type("chat_template_kwargs", "an object", *k);
    r.chat.kwargs = *k;
  }
  if (const json* t = field(body, "tools")) {
    if (!t->is_array()) bad_type("tools", "a list", *t);
    r.chat.tools = *t;
  }
  if (const json* tc = field(body, "tool_choice")) {
    refuse_unless(
        tc->is_string() && (tc->get<std::string>() == "none" || tc->get<std::string>() == "auto"),
        "tool_choice", "only tool_choice \"none\" or \"auto\" is supported");
  }
  if (const json* d = field(body, "documents")) {
    if (!d->is_array()) bad_type("documents", "a list", *d);
    r.chat.documents = *d;
  }
  if (field(body, "chat_template")) {
    throw_api(
        400,
        "a per-request 'chat_template' is not supported (start the server with --chat-template)",
        "chat_template");
  }
  if (auto lp = get_bool(body, "logprobs")) r.logprobs = *lp;
  if (auto top = get_int(body, "top_logprobs")) {
    refuse_unless(*top >= 0 && *top <= kMaxTopLogprobs, "top_logprobs",
                  "'top_logprobs' must be in 0 .. " + std::to_string(kMaxTopLogprobs) + ", got " +
                      std::to_string(*top));
    refuse_unless(*top == 0 || r.logprobs, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r.options.top_logprobs = static_cast<int>(*top);
  }
  r.options.logprobs = r.logprobs;
  return r;
}

}  // namespace loraplex::server
