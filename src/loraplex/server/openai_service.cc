#include "loraplex/server/openai_service.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <string_view>

#include "loraplex/server/adapter_policy.h"
#include "loraplex/server/prometheus.h"
#include "loraplex/template/errors.h"
#include "loraplex/tokenizer/prompt_encoding.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

double unix_now_precise() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

json model_card(const std::string& id, const std::string& root, const json& parent,
                const json& max_model_len) {
  json card;
  card["id"] = id;
  card["object"] = "model";
  card["created"] = unix_now();
  card["owned_by"] = "loraplex";
  card["root"] = root;
  card["parent"] = parent;
  card["max_model_len"] = max_model_len;
  card["permission"] = json::array({json{{"id", new_request_id("modelperm-")},
                                         {"object", "model_permission"},
                                         {"created", unix_now()},
                                         {"allow_create_engine", false},
                                         {"allow_sampling", true},
                                         {"allow_logprobs", true},
                                         {"allow_search_indices", false},
                                         {"allow_view", true},
                                         {"allow_fine_tuning", false},
                                         {"organization", "*"},
                                         {"group", nullptr},
                                         {"is_blocking", false}}});
  return card;
}

// An adapter name usable as one path component under --lora-dir.
bool safe_component(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

// A text prompt's ids as the request asks (special tokens, vLLM's truncate_prompt_tokens: the
// last k ids after the special tokens the encoding starts with, which a tokenizer truncating on
// the left keeps); throws Error.
std::vector<int32_t> encode(const ServingBackend& backend, const std::string& text,
                            const GenerationRequest& r) {
  tokenizer::PromptEncoding how;
  how.add_special_tokens = r.add_special_tokens;
  how.truncate_to = r.truncate_prompt_tokens;
  how.max_model_len = backend.max_model_len();
  return tokenizer::encode_prompt(
      [&](std::string_view t, bool special) { return backend.encode(std::string(t), special); },
      text, how);
}

HttpReply text_reply(int status, std::string body) {
  return HttpReply{status, "text/plain; charset=utf-8", std::move(body)};
}

// vLLM registers the adapter endpoints only when runtime updating is allowed: a client sees a
// 404, here with the reason.
[[noreturn]] void refuse_runtime_updating() {
  throw ApiException(ApiError{404,
                              "runtime adapter loading and unloading is off: start the server with "
                              "--enable-lora-loading (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                              "NotFoundError", ""});
}

std::string string_field(const json& j, const char* name) {
  const auto it = j.find(name);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

ApiError api_error_of(const engine::RequestError& e) {
  switch (e.kind()) {
    case engine::RequestError::Kind::kUnknownAdapter:
      return ApiError{404, e.what(), "", "model"};
    case engine::RequestError::Kind::kOverloaded:
      return ApiError{503, e.what(), "", ""};
    case engine::RequestError::Kind::kTooLong:
      return ApiError{400, e.what(), "", "prompt"};
    case engine::RequestError::Kind::kInvalid:
    default:
      return ApiError{400, e.what(), "", ""};
  }
}

OpenAIService::OpenAIService(ServingBackend& backend, ServiceConfig config)
    : backend_(backend),
      config_(std::move(config)),
      lora_roots_(canonical_roots(config_.lora_roots)) {}

void OpenAIService::log_failure(const Submitted& s, const std::string& error) const {
  if (config_.log)
    config_.log("request " + s.header.id + " (model " + s.header.model + ") failed: " + error);
}

void OpenAIService::wait_until_unloaded(const std::string& name, const std::string& param) {
  // An unloaded adapter keeps its name until its last request in flight has finished (they
  // finish first, on its weights); only then can the name be loaded again.
  if (!backend_.wait_until_unloaded(name, config_.unload_wait)) {
    throw ApiException(ApiError{409,
                                "adapter '" + name +
                                    "' is being unloaded and its requests in flight have not "
                                    "finished yet; load it again once they have",
                                "", param});
  }
}

std::string OpenAIService::resolve_adapter(const std::string& model) {
  if (model.empty() || model == config_.served_model_name) return "";
  if (backend_.has_adapter(model)) return model;
  // A name outside the adapter name set can never have been loaded, nor be loaded here.
  if (!config_.lora_dir.empty() && safe_component(model) && adapter_name_problem(model).empty()) {
    const std::filesystem::path dir = std::filesystem::path(config_.lora_dir) / model;
    std::error_code ec;
    if (std::filesystem::is_directory(dir, ec)) {
      wait_until_unloaded(model, "model");
      // Concurrent first requests for one adapter load it once.
      std::lock_guard<std::mutex> lock(resolve_mutex_);
      if (backend_.has_adapter(model)) return model;
      try {
        backend_.load_adapter(model, dir.string());
      } catch (const Error& e) {
        throw_api(400, "adapter '" + model + "' (" + dir.string() + ") failed to load: " + e.what(),
                  "model");
      }
      return model;
    }
  }
  throw ApiException(ApiError{404, "The model `" + model + "` does not exist.", "", "model"});
}

std::unique_ptr<GenerationStream> OpenAIService::submit_resolved(engine::Request request) {
  try {
    return backend_.submit(request);
  } catch (const engine::RequestError& e) {
    // The adapter was resolved, then unloaded before the engine took the request: with
    // --lora-dir the name still resolves, so the request loads it again instead of failing.
    if (e.kind() != engine::RequestError::Kind::kUnknownAdapter || request.adapter.empty() ||
        config_.lora_dir.empty()) {
      throw;
    }
    resolve_adapter(request.adapter);
    return backend_.submit(std::move(request));
  }
}

OpenAIService::Submitted OpenAIService::submit(GenerationRequest::Kind kind,
                                               std::string_view body) {
  Submitted s;
  s.request = kind == GenerationRequest::Kind::kChat ? parse_chat_request(body)
                                                     : parse_completion_request(body);
  GenerationRequest& r = s.request;
  engine::Request req;
  req.adapter = resolve_adapter(r.model);
  req.options = r.options;
  if (kind == GenerationRequest::Kind::kChat) {
    if (!config_.chat_template) {
      throw_api(400,
                "this model has no chat template: start the server with --chat-template FILE, or "
                "use /v1/completions");
    }
    std::string prompt;
    try {
      prompt = config_.chat_template->render(r.messages, r.chat);
    } catch (const jinja::TemplateRenderError& e) {
      throw_api(400, std::string("the chat template failed: ") + e.what(), "messages");
    } catch (const Error& e) {
      throw_api(400, e.what(), "messages");
    }
    try {
      req.prompt_ids = encode(backend_, prompt, r);
    } catch (const Error& e) {
      throw_api(400, e.what(), "messages");
    }
    if (!r.max_tokens_given) {
      // vLLM's default for chat: whatever context the prompt leaves.
      const int64_t room = backend_.max_model_len() - static_cast<int64_t>(req.prompt_ids.size());
      if (room < 1) {
        throw_api(400,
                  "This model's maximum context length is " +
                      std::to_string(backend_.max_model_len()) +
                      " tokens. However, your messages "
                      "resulted in " +
                      std::to_string(req.prompt_ids.size()) + " tokens.",
                  "messages");
      }
      req.options.max_tokens = room;
    }
  } else if (!r.prompt_ids.empty()) {
    req.prompt_ids = r.prompt_ids;
    if (r.truncate_prompt_tokens) {
      tokenizer::truncate_prompt_left(req.prompt_ids, 0, *r.truncate_prompt_tokens,
                                      backend_.max_model_len());
    }
  } else if (r.add_special_tokens && !r.truncate_prompt_tokens) {
    req.prompt = r.prompt;  // the engine encodes it (tokenizer::encode_prompt, the same rules)
  } else {
    try {
      req.prompt_ids = encode(backend_, r.prompt, r);
    } catch (const Error& e) {
      throw_api(400, e.what(), "prompt");
    }
  }
  s.header.id = new_request_id(kind == GenerationRequest::Kind::kChat ? "chatcmpl-" : "cmpl-");
  s.header.created = unix_now();
  s.header.model = r.model.empty() ? config_.served_model_name : r.model;
  // n > 1: n requests of the same prompt (the prefix cache shares its blocks once one has
  // computed them); with a seed, choice i samples from seed + i, as vLLM's parallel sampling.
  try {
    for (int64_t i = 0; i < r.n; ++i) {
      engine::Request one = req;
      if (one.options.seed && i > 0) *one.options.seed += static_cast<uint64_t>(i);
      s.streams.push_back(submit_resolved(std::move(one)));
    }
  } catch (const engine::RequestError& e) {
    s.abort();
    throw ApiException(api_error_of(e));
  }
  return s;
}

std::vector<TokenLogprob> OpenAIService::logprobs_of(const engine::RequestOutput& out) const {
  std::vector<TokenLogprob> lps;
  for (size_t i = 0; i < out.token_ids.size() && i < out.logprobs.size(); ++i) {
    TokenLogprob t{backend_.token_text(out.token_ids[i]), out.logprobs[i], {}};
    if (i < out.top_logprobs.size()) {
      for (const auto& [id, lp] : out.top_logprobs[i])
        t.top.emplace_back(backend_.token_text(id), lp);
    }
    lps.push_back(std::move(t));
  }
  return lps;
}

Finish OpenAIService::finish_of(const engine::RequestOutput& out,
                                const GenerationRequest& request) const {
  Finish f;
  switch (out.finish_reason) {
    case engine::FinishReason::kStop:
      f.finish_reason = "stop";
      break;
    case engine::FinishReason::kLength:
      f.finish_reason = "length";
      break;
    case engine::FinishReason::kAbort:
      f.finish_reason = "abort";
      break;
    default:
      break;
  }
  if (!out.stop_reason.empty()) {
    // A stop token id is reported as a number (as vLLM does), a stop string as text.
    bool is_id = false;
    for (int32_t id : request.options.stop_token_ids)
      is_id = is_id || out.stop_reason == std::to_string(id);
    f.stop_reason = is_id ? json(std::stoll(out.stop_reason)) : json(out.stop_reason);
  }
  return f;
}

void OpenAIService::Submitted::abort() {
  for (const auto& st : streams) st->abort();
}

HttpReply OpenAIService::complete(Submitted& s) {
  const bool chat = s.request.kind == GenerationRequest::Kind::kChat;
  std::vector<Choice> choices;
  Usage usage;
  // The choices run together in the engine; each is read to its end in turn.
  for (size_t i = 0; i < s.streams.size(); ++i) {
    GenerationStream& st = *s.streams[i];
    Choice c;
    std::vector<TokenLogprob> lps;
    std::vector<int32_t> ids;
    engine::RequestOutput out;
    do {
      if (stopping_) s.abort();
      out = st.next(config_.poll_interval);
      c.text += out.text;
      ids.insert(ids.end(), out.token_ids.begin(), out.token_ids.end());
      if (s.request.logprobs) {
        std::vector<TokenLogprob> more = logprobs_of(out);
        lps.insert(lps.end(), more.begin(), more.end());
      }
    } while (!out.finished);
    if (out.finish_reason == engine::FinishReason::kError) {
      log_failure(s, out.error);
      s.abort();
      throw_api(500, "generation failed: " + out.error);
    }
    c.finish = finish_of(out, s.request);
    if (s.request.logprobs) c.logprobs = chat ? chat_logprobs(lps) : completion_logprobs(lps, 0);
    if (s.request.return_token_ids) c.token_ids = ids;
    // The prompt counts once, as in vLLM; every choice's tokens count.
    if (i == 0) usage = Usage{out.prompt_tokens, 0, out.cached_tokens};
    usage.completion_tokens += out.completion_tokens;
    choices.push_back(std::move(c));
  }
  json prompt_ids;
  if (s.request.return_token_ids) prompt_ids = s.streams.front()->prompt_ids();
  return HttpReply{200, "application/json",
                   chat ? chat_body(s.header, choices, usage, prompt_ids)
                        : completion_body(s.header, choices, usage, prompt_ids)};
}

void OpenAIService::stream(Submitted& s, ChunkSink& sink) {
  const bool chat = s.request.kind == GenerationRequest::Kind::kChat;
  const size_t n = s.streams.size();
  auto send = [&](const std::string& event) {
    if (sink.write(event)) return true;
    s.abort();
    return false;
  };
  // vLLM's return_token_ids: the prompt's ids go with the first chunk only (of each choice,
  // for completions).
  json prompt_ids;
  if (s.request.return_token_ids) prompt_ids = s.streams.front()->prompt_ids();
  std::vector<json> first_prompt_ids(n, chat ? json() : prompt_ids);
  if (chat) {
    for (size_t i = 0; i < n; ++i) {
      if (!send(sse_event(chat_chunk(s.header, static_cast<int>(i),
                                     json{{"role", "assistant"}, {"content", ""}}, Finish{}, json(),
                                     i == 0 ? prompt_ids : json())))) {
        return;
      }
    }
  }
  std::vector<int64_t> text_offset(n, 0);
  std::vector<bool> finished(n, false);
  size_t left = n;
  Usage usage;
  // One choice waits for its tokens as long as it likes; several take turns, briefly each.
  const auto wait = n == 1 ? config_.poll_interval : std::chrono::milliseconds(2);
  while (left > 0) {
    for (size_t i = 0; i < n; ++i) {
      if (finished[i]) continue;
      if (stopping_ || !sink.connected()) {
        // A client that left (or a shutdown) ends its requests: nothing keeps generating.
        s.abort();
        return;
      }
      engine::RequestOutput out = s.streams[i]->next(wait);
      if (out.finished && out.finish_reason == engine::FinishReason::kError) {
        log_failure(s, out.error);
        s.abort();
        send(sse_event(error_body(ApiError{500, "generation failed: " + out.error, "", ""})));
        send(kSseDone);
        return;
      }
      if (!out.finished && out.text.empty() && out.token_ids.empty()) continue;
      const Finish finish = out.finished ? finish_of(out, s.request) : Finish{};
      json logprobs;
      if (s.request.logprobs) {
        const std::vector<TokenLogprob> lps = logprobs_of(out);
        logprobs = chat ? chat_logprobs(lps) : completion_logprobs(lps, text_offset[i]);
      }
      text_offset[i] += static_cast<int64_t>(out.text.size());
      json token_ids;
      if (s.request.return_token_ids) token_ids = out.token_ids;
      std::string chunk;
      const int index = static_cast<int>(i);
      if (chat) {
        json delta = json::object();
        if (!out.text.empty() || !out.finished) delta["content"] = out.text;
        chunk = chat_chunk(s.header, index, delta, finish, logprobs, json(), token_ids);
      } else {
        chunk = completion_chunk(s.header, index, out.text, finish, logprobs, first_prompt_ids[i],
                                 token_ids);
        first_prompt_ids[i] = json();
      }
      if (!send(sse_event(chunk))) return;
      if (out.finished) {
        finished[i] = true;
        --left;
        if (i == 0) {
          usage.prompt_tokens = out.prompt_tokens;
          usage.cached_tokens = out.cached_tokens;
        }
        usage.completion_tokens += out.completion_tokens;
      }
    }
  }
  if (s.request.include_usage) {
    if (!send(sse_event(
            usage_chunk(s.header, chat ? "chat.completion.chunk" : "text_completion", usage)))) {
      return;
    }
  }
  send(kSseDone);
}

HttpReply OpenAIService::list_models() const {
  json data = json::array();
  data.push_back(model_card(config_.served_model_name, config_.model_root, json(),
                            json(backend_.max_model_len())));
  for (const AdapterInfo& a : backend_.list_adapters()) {
    data.push_back(model_card(a.name, a.dir, json(config_.served_model_name), json()));
  }
  return HttpReply{200, "application/json", dump_json(json{{"object", "list"}, {"data", data}})};
}

HttpReply OpenAIService::load_adapter(std::string_view body) {
  if (!config_.runtime_lora_updating) refuse_runtime_updating();
  const json j = parse_json_object(body);
  const std::string name = string_field(j, "lora_name");
  const std::string path = string_field(j, "lora_path");
  if (name.empty() || path.empty()) {
    throw ApiException(ApiError{400, "Both 'lora_name' and 'lora_path' must be provided.",
                                "InvalidUserInput", ""});
  }
  if (const std::string problem = adapter_name_problem(name); !problem.empty()) {
    throw ApiException(ApiError{400, problem, "InvalidUserInput", "lora_name"});
  }
  if (name == config_.served_model_name) {
    throw ApiException(
        ApiError{400, "'" + name + "' is the base model's name", "InvalidUserInput", "lora_name"});
  }
  // Checked before anything looks at the path, and answered alike whether it exists or not.
  if (!inside_roots(path, lora_roots_)) {
    throw ApiException(ApiError{400,
                                "lora_path '" + path +
                                    "' is not under a directory adapters may be loaded from "
                                    "(--lora-dir, --allowed-lora-paths)",
                                "InvalidUserInput", "lora_path"});
  }
  if (backend_.has_adapter(name)) {
    throw ApiException(ApiError{400, "The lora adapter '" + name + "' has already been loaded.",
                                "InvalidUserInput", "lora_name"});
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) {
    throw ApiException(
        ApiError{404, "No adapter found for '" + name + "' at " + path, "", "lora_path"});
  }
  wait_until_unloaded(name, "lora_name");
  try {
    std::lock_guard<std::mutex> lock(resolve_mutex_);
    backend_.load_adapter(name, path);
  } catch (const Error& e) {
    // The loaded adapters keep serving: a failed load changes nothing.
    throw_api(400, "adapter '" + name + "' failed to load: " + e.what(), "lora_path");
  }
  return text_reply(200, "Success: LoRA adapter '" + name + "' added successfully.");
}

HttpReply OpenAIService::unload_adapter(std::string_view body) {
  if (!config_.runtime_lora_updating) refuse_runtime_updating();
  const json j = parse_json_object(body);
  const std::string name = string_field(j, "lora_name");
  if (name.empty()) {
    throw ApiException(
        ApiError{400, "'lora_name' must be provided.", "InvalidUserInput", "lora_name"});
  }
  if (!backend_.unload_adapter(name)) {
    throw ApiException(ApiError{404, "The lora adapter '" + name + "' cannot be found.",
                                "NotFoundError", "lora_name"});
  }
  return text_reply(200, "Success: LoRA adapter '" + name + "' removed successfully.");
}

HttpReply OpenAIService::metrics() const {
  return HttpReply{
      200, "text/plain; version=0.0.4; charset=utf-8",
      format_prometheus(backend_.metrics(), config_.served_model_name, unix_now_precise())};
}

HttpReply OpenAIService::version() const {
  return HttpReply{200, "application/json", dump_json(json{{"version", config_.version}})};
}

}  // namespace loraplex::server
