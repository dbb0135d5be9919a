#include "engine_test_support.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "loraplex/engine/model_files.h"
#include "loraplex/model/load_model.h"

namespace loraplex::test {

void RecordingExecutor::launch(const model::StepBatch& batch) {
  inner_->launch(batch);
  int64_t fed = 0;
  for (const model::SequenceStep& q : batch.seqs) fed += q.feed_row >= 0 ? 1 : 0;
  std::lock_guard<std::mutex> lock(log_->mutex);
  ++log_->launches;
  if (in_flight_ > 0) ++log_->launched_while_running;
  ++in_flight_;
  log_->max_in_flight = std::max(log_->max_in_flight, in_flight_);
  log_->fed_tokens += fed;
  if (fed > 0 && inner_->last_step().graph) ++log_->graph_fed_launches;
}

model::StepResult RecordingExecutor::collect() {
  model::StepResult r = inner_->collect();
  std::lock_guard<std::mutex> lock(log_->mutex);
  ++log_->collects;
  --in_flight_;
  return r;
}

engine::EngineOptions small_engine_options() {
  engine::EngineOptions o;
  o.max_num_seqs = 32;
  o.max_num_batched_tokens = 256;
  o.max_loras = 4;
  o.max_lora_rank = 16;
  o.num_kv_blocks = 256;
  o.kv_block_size = 4;
  return o;
}

std::unique_ptr<engine::Engine> make_fixture_engine(const std::string& fixture,
                                                    const engine::EngineOptions& options,
                                                    bool with_adapters, Device device,
                                                    std::shared_ptr<StepLog> log) {
  const std::string dir = fixture_dir(fixture) + "/model";
  std::unique_ptr<model::ModelExecutor> m =
      model::load_model(dir, engine::engine_decoder_options(options, DType::kF32, device));
  const model::ModelConfig config = m->config();
  if (log != nullptr) m = std::make_unique<RecordingExecutor>(std::move(m), std::move(log));
  auto e = std::make_unique<engine::Engine>(std::move(m), engine::read_tokenizer(dir),
                                            engine::read_eos_token_ids(dir, config), options);
  if (with_adapters) {
    std::vector<std::filesystem::path> adapters;
    for (const auto& entry :
         std::filesystem::directory_iterator(fixture_dir(fixture) + "/adapters"))
      adapters.push_back(entry.path());
    std::sort(adapters.begin(), adapters.end());
    for (const auto& a : adapters) e->load_adapter(a.filename().string(), a.string());
  }
  return e;
}

engine::Request fixture_request(const ExpectedLine& e, int64_t max_tokens) {
  engine::Request r;
  r.prompt = e.prompt;
  r.adapter = e.adapter.value_or("");
  r.options.max_tokens = max_tokens;
  r.options.temperature = 0.0f;
  r.options.ignore_eos = true;
  return r;
}

std::vector<engine::RequestOutput> expect_fixture_tokens(engine::Engine& engine,
                                                         const std::vector<ExpectedLine>& expected,
                                                         const std::string& what) {
  std::vector<engine::Request> requests;
  for (const ExpectedLine& e : expected) requests.push_back(fixture_request(e));
  std::vector<engine::RequestHandle> handles = engine.submit_all(std::move(requests));
  std::vector<engine::RequestOutput> outputs;
  for (size_t i = 0; i < handles.size(); ++i) {
    outputs.push_back(handles[i].wait());
    const engine::RequestOutput& out = outputs.back();
    EXPECT_EQ(out.finish_reason, engine::FinishReason::kLength)
        << what << " request " << i << out.error;
    EXPECT_EQ(out.token_ids, expected[i].output_token_ids)
        << what << ": request " << i << " (" << expected[i].prompt << ", "
        << expected[i].adapter.value_or("base") << ")";
    EXPECT_EQ(handles[i].prompt_ids(), expected[i].prompt_token_ids) << what << " request " << i;
  }
  return outputs;
}

}  // namespace loraplex::test
