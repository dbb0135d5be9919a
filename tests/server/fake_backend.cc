#include "fake_backend.h"

#include <filesystem>
#include <thread>
#include <utility>

#include "loraplex/core/error.h"

namespace loraplex::server::testing {
namespace {

class FakeStream : public GenerationStream {
 public:
  FakeStream(FakeBackend& backend, engine::Request request, std::vector<int32_t> prompt)
      : backend_(backend), request_(std::move(request)), prompt_(std::move(prompt)) {
    tokens_ = FakeBackend::expected_tokens(prompt_, request_.adapter, request_.options.max_tokens);
  }
  ~FakeStream() override { end(false); }

  engine::RequestOutput next(std::chrono::milliseconds timeout) override {
    engine::RequestOutput out;
    out.prompt_tokens = static_cast<int64_t>(prompt_.size());
    if (done_) {
      out.finished = true;
      out.finish_reason = reason_;
      out.completion_tokens = static_cast<int64_t>(produced_);
      return out;
    }
    if (aborted_) {
      end(true);
      out.finished = true;
      out.finish_reason = reason_;
      out.completion_tokens = static_cast<int64_t>(produced_);
      return out;
    }
    std::this_thread::sleep_for(std::min(timeout, backend_.token_delay));
    const int32_t id = tokens_[produced_++];
    out.token_ids = {id};
    out.text = backend_.token_text(id);
    if (request_.options.logprobs) out.logprobs = {-0.25f * static_cast<float>(produced_)};
    if (request_.options.top_logprobs > 0) {
      // The sampled id first, then the ids after it, each less probable.
      auto& top = out.top_logprobs.emplace_back();
      for (int t = 0; t < request_.options.top_logprobs; ++t) {
        top.emplace_back(id + t, -0.25f * static_cast<float>(produced_) - static_cast<float>(t));
      }
    }
    out.completion_tokens = static_cast<int64_t>(produced_);
    if (produced_ == tokens_.size()) {
      reason_ = engine::FinishReason::kLength;
      end(false);
      out.finished = true;
      out.finish_reason = reason_;
    }
    return out;
  }
  void abort() override { aborted_ = true; }
  std::vector<int32_t> prompt_ids() const override { return prompt_; }

 private:
  void end(bool by_abort) {
    if (done_) return;
    done_ = true;
    if (by_abort || reason_ == engine::FinishReason::kNone) {
      reason_ = engine::FinishReason::kAbort;
      ++backend_.aborted;
    }
    --backend_.active;
  }

  FakeBackend& backend_;
  engine::Request request_;
  std::vector<int32_t> prompt_;
  std::vector<int32_t> tokens_;
  size_t produced_ = 0;
  std::atomic<bool> aborted_{false};
  bool done_ = false;
  engine::FinishReason reason_ = engine::FinishReason::kNone;
};

}  // namespace

FakeBackend::FakeBackend() = default;

std::vector<int32_t> FakeBackend::expected_tokens(const std::vector<int32_t>& prompt,
                                                  const std::string& adapter, int64_t count) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t id : prompt) h = (h ^ static_cast<uint64_t>(id)) * 1099511628211ull;
  for (char c : adapter) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  std::vector<int32_t> out;
  for (int64_t k = 0; k < count; ++k) {
    h = (h ^ static_cast<uint64_t>(k)) * 1099511628211ull;
    out.push_back(static_cast<int32_t>(2 + (h >> 33) % 997));
  }
  return out;
}

std::string FakeBackend::expected_text(const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t id : tokens) {
    s += 't';
    s += std::to_string(id);
    s += ' ';
  }
  return s;
}

std::unique_ptr<GenerationStream> FakeBackend::submit(engine::Request request) {
  using K = engine::RequestError::Kind;
  std::vector<int32_t> prompt =
      request.prompt_ids.empty() ? encode(request.prompt, true) : request.prompt_ids;
  if (prompt.empty()) throw engine::RequestError(K::kInvalid, "empty prompt");
  if (!unload_before_submit.empty() && request.adapter == unload_before_submit) {
    unload_adapter(std::exchange(unload_before_submit, std::string()));
  }
  if (!request.adapter.empty() && !has_adapter(request.adapter)) {
    throw engine::RequestError(K::kUnknownAdapter,
                               "adapter '" + request.adapter + "' is not loaded");
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + request.options.max_tokens;
  if (total > max_model_len_) {
    throw engine::RequestError(
        K::kTooLong, "prompt (" + std::to_string(prompt.size()) + " tokens) + max_tokens (" +
                         std::to_string(request.options.max_tokens) + ") exceeds max_model_len " +
                         std::to_string(max_model_len_));
  }
  if (max_active > 0 && active >= max_active) {
    throw engine::RequestError(K::kOverloaded, "too many requests waiting");
  }
  ++active;
  ++submitted;
  if (request.options.seed) {
    std::lock_guard<std::mutex> lock(mutex_);
    seeds_.push_back(*request.options.seed);
  }
  return std::make_unique<FakeStream>(*this, std::move(request), std::move(prompt));
}

AdapterInfo FakeBackend::load_adapter(const std::string& name, const std::string& dir) {
  LORAPLEX_CHECK(std::filesystem::exists(std::filesystem::path(dir) / "adapter_config.json"),
                 "adapter '", name, "': ", dir, " has no adapter_config.json");
  std::lock_guard<std::mutex> lock(mutex_);
  ++loads;
  adapters_[name] = dir;
  AdapterInfo info;
  info.name = name;
  info.dir = dir;
  return info;
}

std::vector<uint64_t> FakeBackend::seeds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seeds_;
}

bool FakeBackend::unload_adapter(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  return adapters_.erase(name) > 0;
}

bool FakeBackend::has_adapter(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return adapters_.count(name) > 0;
}

std::vector<AdapterInfo> FakeBackend::list_adapters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<AdapterInfo> out;
  for (const auto& [name, dir] : adapters_) {
    AdapterInfo info;
    info.name = name;
    info.dir = dir;
    out.push_back(info);
  }
  return out;
}

engine::EngineMetrics FakeBackend::metrics() const {
  engine::EngineMetrics m;
  m.num_running = active;
  m.max_loras = 4;
  m.generation_tokens_total = submitted * 3;
  m.finished_total["abort"] = aborted;
  return m;
}

std::vector<int32_t> FakeBackend::encode(const std::string& text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  if (add_special_tokens) ids.push_back(1);
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string FakeBackend::token_text(int32_t id) const { return expected_text({id}); }

}  // namespace loraplex::server::testing
