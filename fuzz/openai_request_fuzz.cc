// libFuzzer target for the request path of the HTTP server: bytes as a /v1/completions or
// /v1/chat/completions body -> parsing and validation -> model resolution, chat-template
// rendering and tokenization -> the engine request -> the response body. Any input must end in a
// response or an ApiException (an OpenAI error of status 400/404/503); anything else escaping,
// or a crash, is a finding.

#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loraplex/server/openai_service.h"
#include "loraplex/template/chat_template.h"

namespace {

using loraplex::server::ApiException;
using loraplex::server::GenerationRequest;

// A backend that accepts every request and finishes it at once with one token.
class EchoBackend : public loraplex::server::ServingBackend {
 public:
  class Done : public loraplex::server::GenerationStream {
   public:
    explicit Done(loraplex::engine::Request r) : r_(std::move(r)) {}
    loraplex::engine::RequestOutput next(std::chrono::milliseconds) override {
      loraplex::engine::RequestOutput out;
      out.token_ids = {7};
      out.text = "x";
      if (r_.options.logprobs) out.logprobs = {-1.0f};
      out.finished = true;
      out.finish_reason = loraplex::engine::FinishReason::kLength;
      out.prompt_tokens = static_cast<int64_t>(r_.prompt_ids.size() + r_.prompt.size());
      out.completion_tokens = 1;
      return out;
    }
    void abort() override {}
    std::vector<int32_t> prompt_ids() const override { return r_.prompt_ids; }

   private:
    loraplex::engine::Request r_;
  };
  std::unique_ptr<loraplex::server::GenerationStream> submit(
      loraplex::engine::Request request) override {
    // The parser's promises to the engine.
    if (request.options.max_tokens < 1 || request.options.min_tokens < 0 ||
        request.options.temperature < 0.0f || request.options.top_p <= 0.0f ||
        request.options.top_p > 1.0f || request.options.top_k < 0 ||
        (request.prompt.empty() && request.prompt_ids.empty())) {
      std::abort();
    }
    return std::make_unique<Done>(std::move(request));
  }
  loraplex::AdapterInfo load_adapter(const std::string&, const std::string&) override { return {}; }
  bool unload_adapter(const std::string&) override { return false; }
  bool wait_until_unloaded(const std::string&, std::chrono::milliseconds) override { return true; }
  bool has_adapter(const std::string& name) const override { return name == "sql"; }
  std::vector<loraplex::AdapterInfo> list_adapters() const override { return {}; }
  loraplex::engine::EngineMetrics metrics() const override { return {}; }
  int64_t max_model_len() const override { return 256; }
  std::vector<int32_t> encode(const std::string& text, bool) const override {
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string token_text(int32_t) const override { return "x"; }
};

loraplex::server::OpenAIService& service() {
  static EchoBackend backend;
  static loraplex::server::OpenAIService s(backend, [] {
    loraplex::server::ServiceConfig c;
    c.served_model_name = "base";
    c.chat_template = std::make_shared<loraplex::jinja::ChatTemplate>(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}[S]{{ m.content | trim }}"
        "{% elif m.role == 'user' %}[U]{{ m.content }}{% else %}[A]{{ m.content }}{% endif %}"
        "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{% if add_generation_prompt %}[A]{% endif %}",
        nlohmann::ordered_json{{"bos_token", "<s>"}}, "fuzz template");
    return c;
  }());
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  for (GenerationRequest::Kind kind :
       {GenerationRequest::Kind::kCompletion, GenerationRequest::Kind::kChat}) {
    try {
      auto submitted = service().submit(kind, body);
      const auto reply = service().complete(submitted);
      (void)nlohmann::json::parse(reply.body);  // every response is valid JSON
    } catch (const ApiException& e) {
      const int status = e.error().status;
      if (status != 400 && status != 404 && status != 503) std::abort();
      (void)nlohmann::json::parse(loraplex::server::error_body(e.error()));
    }
  }
  return 0;
}
