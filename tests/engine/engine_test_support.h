#pragma once
// The Engine on the PEFT fixtures of testdata/ for the engine tests: engines with the fixture's
// adapters, its requests, a check of its tokens, and a model wrapper that records how the
// engine launched and collected its steps.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../model/fixture_support.h"
#include "loraplex/core/device.h"
#include "loraplex/engine/engine.h"
#include "loraplex/model/executor.h"

namespace loraplex::test {

/// What the engine asked of its model. Written by the step loop, read by the test.
struct StepLog {
  mutable std::mutex mutex;
  int64_t launches = 0;
  int64_t collects = 0;
  int64_t max_in_flight = 0;           // most steps launched and not yet collected
  int64_t fed_tokens = 0;              // tokens taken from the step before (feed_row)
  int64_t graph_fed_launches = 0;      // CUDA-graph steps with fed tokens
  int64_t launched_while_running = 0;  // launches while another step was in flight
};

/// A model that records every launch and collect of the one it wraps in `log`.
class RecordingExecutor : public model::ModelExecutor {
 public:
  RecordingExecutor(std::unique_ptr<model::ModelExecutor> inner, std::shared_ptr<StepLog> log)
      : inner_(std::move(inner)), log_(std::move(log)) {}
  const model::ModelConfig& config() const override { return inner_->config(); }
  const model::DecoderOptions& options() const override { return inner_->options(); }
  void allocate_kv_cache(int64_t num_blocks) override { inner_->allocate_kv_cache(num_blocks); }
  int64_t kv_block_bytes() const override { return inner_->kv_block_bytes(); }
  void launch(const model::StepBatch& batch) override;
  model::StepResult collect() override;
  const model::StepStats& last_step() const override { return inner_->last_step(); }
  const LoraTargetRegistry& targets() const override { return inner_->targets(); }
  std::vector<Device> devices() const override { return inner_->devices(); }
  std::vector<Stream> streams() const override { return inner_->streams(); }

 private:
  std::unique_ptr<model::ModelExecutor> inner_;
  std::shared_ptr<StepLog> log_;
  int64_t in_flight_ = 0;
};

/// 32 sequences, 256 tokens a step, 4 slots of rank 16, 256 KV blocks of 4 tokens.
engine::EngineOptions small_engine_options();

/// An engine on testdata/<fixture> (float32) with every adapter of the fixture loaded (none
/// when `with_adapters` is false); its steps are recorded in `log` when one is given.
std::unique_ptr<engine::Engine> make_fixture_engine(const std::string& fixture,
                                                    const engine::EngineOptions& options,
                                                    bool with_adapters = true,
                                                    Device device = Device::cpu(),
                                                    std::shared_ptr<StepLog> log = nullptr);

/// The expected line's request: greedy, `max_tokens` tokens, EOS ignored.
engine::Request fixture_request(const ExpectedLine& e, int64_t max_tokens = 12);

/// Submits every expected line at once and checks each output against PEFT's tokens; returns
/// the outputs.
std::vector<engine::RequestOutput> expect_fixture_tokens(engine::Engine& engine,
                                                         const std::vector<ExpectedLine>& expected,
                                                         const std::string& what);

/// Polls the metrics until `pred` holds (the step loop publishes them after each step).
template <typename Pred>
engine::EngineMetrics wait_metrics(const engine::Engine& engine, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    engine::EngineMetrics m = engine.metrics();
    if (pred(m) || std::chrono::steady_clock::now() > deadline) return m;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace loraplex::test
