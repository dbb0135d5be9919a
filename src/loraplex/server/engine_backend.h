#pragma once
// ServingBackend over the online engine (engine/engine.h): what `loraplex serve` runs on.

#include "loraplex/engine/engine.h"
#include "loraplex/server/backend.h"

namespace loraplex::server {

class EngineBackend : public ServingBackend {
 public:
  /// `engine` must outlive this backend.
  explicit EngineBackend(engine::Engine& engine) : engine_(engine) {}

  std::unique_ptr<GenerationStream> submit(engine::Request request) override;
  AdapterInfo load_adapter(const std::string& name, const std::string& dir) override;
  bool unload_adapter(const std::string& name) override;
  bool wait_until_unloaded(const std::string& name, std::chrono::milliseconds timeout) override;
  bool has_adapter(const std::string& name) const override;
  std::vector<AdapterInfo> list_adapters() const override;
  engine::EngineMetrics metrics() const override;
  int64_t max_model_len() const override;
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const override;
  std::string token_text(int32_t id) const override;

 private:
  engine::Engine& engine_;
};

}  // namespace loraplex::server
