#pragma once
// A ServingBackend that generates deterministic tokens without a model, so that the HTTP
// layer can be tested on its own: token k of a request is a function of its prompt ids, its
// adapter and k; each token takes `token_delay` to "generate". It counts live and aborted
// requests, so that tests can check that a disconnect ends its request.

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "loraplex/server/backend.h"

namespace loraplex::server::testing {

class FakeBackend : public ServingBackend {
 public:
  FakeBackend();

  std::unique_ptr<GenerationStream> submit(engine::Request request) override;
  AdapterInfo load_adapter(const std::string& name, const std::string& dir) override;
  bool unload_adapter(const std::string& name) override;
  /// The fake forgets an adapter at once; `still_unloading` plays one whose requests in flight
  /// outlast any wait.
  bool wait_until_unloaded(const std::string&, std::chrono::milliseconds) override {
    return !still_unloading;
  }
  bool has_adapter(const std::string& name) const override;
  std::vector<AdapterInfo> list_adapters() const override;
  engine::EngineMetrics metrics() const override;
  int64_t max_model_len() const override { return max_model_len_; }
  /// Bytes as ids (plus BOS = 1 when asked).
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const override;
  std::string token_text(int32_t id) const override;

  /// The seeds of the requests submitted with one, in order.
  std::vector<uint64_t> seeds() const;

  /// What the fake generates for `prompt_ids` on `adapter`: the reference for tests.
  static std::vector<int32_t> expected_tokens(const std::vector<int32_t>& prompt_ids,
                                              const std::string& adapter, int64_t count);
  static std::string expected_text(const std::vector<int32_t>& tokens);

  std::chrono::milliseconds token_delay{1};
  int64_t max_model_len_ = 4096;
  int64_t max_active = 0;  // > 0: submit refuses (overloaded) beyond this many live requests
  std::atomic<int64_t> active{0};
  std::atomic<int64_t> aborted{0};
  std::atomic<int64_t> submitted{0};
  std::atomic<int64_t> loads{0};
  std::atomic<bool> still_unloading{false};
  /// Plays an unload that lands between the service resolving a request's adapter and the
  /// engine taking it: the next submit for this adapter forgets it first (once).
  std::string unload_before_submit;

 private:
  mutable std::mutex mutex_;
  std::map<std::string, std::string> adapters_;  // name -> dir
  std::vector<uint64_t> seeds_;
};

}  // namespace loraplex::server::testing
