#pragma once
// The OpenAI/vLLM endpoints as plain functions of request bodies, independent of the HTTP
// library: model-name resolution (the base model, a loaded adapter, or an adapter found in
// --lora-dir and loaded on first use), chat-template rendering, submission to the backend,
// whole responses and server-sent-event streams, /v1/models, vLLM's LoRA load/unload,
// /metrics and /version. Errors are ApiExceptions carrying the status and OpenAI's JSON shape.

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loraplex/server/api_error.h"
#include "loraplex/server/backend.h"
#include "loraplex/server/openai_request.h"
#include "loraplex/server/openai_response.h"
#include "loraplex/template/chat_template.h"

namespace loraplex::server {

struct ServiceConfig {
  std::string served_model_name;  // the base model's id in requests and /v1/models
  std::string model_root;         // the base model's directory ("root" in /v1/models)
  std::string lora_dir;           // adapters not loaded are looked up here; empty: off
  /// vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (--enable-lora-loading): without it
  /// /v1/load_lora_adapter and /v1/unload_lora_adapter answer 404, as vLLM's are absent.
  bool runtime_lora_updating = false;
  /// The directories /v1/load_lora_adapter may load from (each one and what lies below it):
  /// --lora-dir and --allowed-lora-paths. They must exist.
  std::vector<std::string> lora_roots;
  /// Where the service reports what failed on the server's side (a request the engine ended
  /// with an error); null: nowhere.
  std::function<void(const std::string&)> log;
  std::shared_ptr<const jinja::ChatTemplate> chat_template;  // null: chat is refused
  std::string version;
  /// How often a waiting handler checks for a closed connection or a shutdown.
  std::chrono::milliseconds poll_interval{50};
  /// How long a load of an adapter name that is being unloaded waits for the old adapter's
  /// requests to finish (then 409).
  std::chrono::milliseconds unload_wait{60000};
};

struct HttpReply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};

/// Where a streamed response goes (the HTTP connection).
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  /// Sends `data`; false when the client is gone.
  virtual bool write(const std::string& data) = 0;
  /// False once the client has closed the connection.
  virtual bool connected() = 0;
};

class OpenAIService {
 public:
  /// Throws loraplex::Error naming a lora_roots entry that is not a directory.
  OpenAIService(ServingBackend& backend, ServiceConfig config);

  /// A parsed, submitted generation request, ready to be answered whole or streamed.
  struct Submitted {
    GenerationRequest request;
    ResponseHeader header;
    std::vector<std::unique_ptr<GenerationStream>> streams;  // one per choice (n)
    /// Ends every choice's request.
    void abort();
  };
  /// Parses `body` (completion or chat), resolves the model, renders the chat template and
  /// submits. Throws ApiException: 400 bad request or prompt too long, 404 unknown model,
  /// 503 overloaded.
  Submitted submit(GenerationRequest::Kind kind, std::string_view body);
  /// Waits for the end and returns the whole response (500 when the engine failed it).
  HttpReply complete(Submitted& submitted);
  /// Streams server-sent events to `sink` until [DONE]; aborts the request when the client
  /// disconnects or the service shuts down.
  void stream(Submitted& submitted, ChunkSink& sink);

  HttpReply list_models() const;
  HttpReply load_adapter(std::string_view body);
  HttpReply unload_adapter(std::string_view body);
  HttpReply metrics() const;
  HttpReply version() const;

  /// Makes every waiting handler abort its request and return.
  void shutdown() { stopping_ = true; }
  bool stopping() const { return stopping_; }

 private:
  std::string resolve_adapter(const std::string& model);
  std::unique_ptr<GenerationStream> submit_resolved(engine::Request request);
  void wait_until_unloaded(const std::string& name, const std::string& param);
  std::vector<TokenLogprob> logprobs_of(const engine::RequestOutput& out) const;
  Finish finish_of(const engine::RequestOutput& out, const GenerationRequest& request) const;

  void log_failure(const Submitted& submitted, const std::string& error) const;

  ServingBackend& backend_;
  ServiceConfig config_;
  std::vector<std::filesystem::path> lora_roots_;  // config_.lora_roots, canonical
  std::mutex resolve_mutex_;                       // one --lora-dir load at a time
  std::atomic<bool> stopping_{false};
};

/// The ApiError an engine refusal maps to (400 invalid or too long, 404 unknown adapter, 503
/// overloaded).
ApiError api_error_of(const engine::RequestError& e);

}  // namespace loraplex::server
