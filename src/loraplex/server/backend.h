#pragma once
// What the HTTP server needs from the engine, as an interface: engine::Engine satisfies it
// through EngineBackend (engine_backend.h), and the server's tests through a fake. The server
// owns no request state beyond the stream it reads; aborting the stream ends the request.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/engine/engine.h"

namespace loraplex::server {

/// A submitted request's output stream (engine::RequestHandle's reading side).
class GenerationStream {
 public:
  virtual ~GenerationStream() = default;
  /// What arrived since the last call, waiting up to `timeout`; finished == true at the end.
  virtual engine::RequestOutput next(std::chrono::milliseconds timeout) = 0;
  /// Ends the request (finish reason abort); safe to call at any time, more than once.
  virtual void abort() = 0;
  /// The prompt as the backend runs it (text prompts tokenized).
  virtual std::vector<int32_t> prompt_ids() const = 0;
};

class ServingBackend {
 public:
  virtual ~ServingBackend() = default;
  /// Starts a request; throws engine::RequestError (invalid, too long, unknown adapter,
  /// overloaded). Thread-safe.
  virtual std::unique_ptr<GenerationStream> submit(engine::Request request) = 0;
  /// Loads a PEFT adapter while serving; throws loraplex::Error naming the problem, and then
  /// nothing changes.
  virtual AdapterInfo load_adapter(const std::string& name, const std::string& dir) = 0;
  /// Forgets an adapter (requests in flight finish first); false when it was not loaded.
  virtual bool unload_adapter(const std::string& name) = 0;
  /// Waits until an adapter being unloaded has no request left, so that its name can be
  /// loaded again; true at once when it is not being unloaded, false after `timeout`.
  virtual bool wait_until_unloaded(const std::string& name, std::chrono::milliseconds timeout) = 0;
  virtual bool has_adapter(const std::string& name) const = 0;
  virtual std::vector<AdapterInfo> list_adapters() const = 0;
  virtual engine::EngineMetrics metrics() const = 0;
  /// The longest prompt + generation a request may have.
  virtual int64_t max_model_len() const = 0;
  /// Token ids of `text` (chat prompts are tokenized here, without BOS by default).
  virtual std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const = 0;
  /// The text of one token, for logprobs.
  virtual std::string token_text(int32_t id) const = 0;
};

}  // namespace loraplex::server
