#include "loraplex/server/engine_backend.h"

namespace loraplex::server {
namespace {

class HandleStream : public GenerationStream {
 public:
  explicit HandleStream(engine::RequestHandle handle) : handle_(std::move(handle)) {}
  ~HandleStream() override {
    // A stream dropped before its end (a handler that threw) must not leave the request
    // generating for nobody.
    handle_.abort();
  }
  engine::RequestOutput next(std::chrono::milliseconds timeout) override {
    return handle_.next(timeout);
  }
  void abort() override { handle_.abort(); }
  std::vector<int32_t> prompt_ids() const override { return handle_.prompt_ids(); }

 private:
  engine::RequestHandle handle_;
};

}  // namespace

std::unique_ptr<GenerationStream> EngineBackend::submit(engine::Request request) {
  return std::make_unique<HandleStream>(engine_.submit(std::move(request)));
}

AdapterInfo EngineBackend::load_adapter(const std::string& name, const std::string& dir) {
  return engine_.load_adapter(name, dir);
}

bool EngineBackend::unload_adapter(const std::string& name) { return engine_.unload_adapter(name); }

bool EngineBackend::wait_until_unloaded(const std::string& name,
                                        std::chrono::milliseconds timeout) {
  return engine_.wait_until_unloaded(name, timeout);
}

bool EngineBackend::has_adapter(const std::string& name) const { return engine_.has_adapter(name); }

std::vector<AdapterInfo> EngineBackend::list_adapters() const { return engine_.list_adapters(); }

engine::EngineMetrics EngineBackend::metrics() const { return engine_.metrics(); }

int64_t EngineBackend::max_model_len() const {
  const int64_t configured = engine_.options().max_model_len;
  return configured > 0 ? configured : engine_.model_config().max_position_embeddings;
}

std::vector<int32_t> EngineBackend::encode(const std::string& text, bool add_special_tokens) const {
  return engine_.tokenizer().encode(text, add_special_tokens);
}

std::string EngineBackend::token_text(int32_t id) const {
  // Without a tokenizer (serve --shape) a token is written as vLLM's return_tokens_as_token_ids
  // writes it.
  if (!engine_.has_tokenizer()) return "token_id:" + std::to_string(id);
  return engine_.tokenizer().decode({id}, false);
}

}  // namespace loraplex::server
