#pragma once
// What `loraplex generate` does, as a library call shared by the command and its tests: load
// the checkpoint, tokenizer and adapters, check the requests, submit them all at once to an
// Engine (engine.h) sized for them, and return one result per request in input order.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/core/device.h"
#include "loraplex/core/dtype.h"
#include "loraplex/engine/requests.h"
#include "loraplex/model/executor.h"

namespace loraplex::engine {

/// What the run's steps held.
struct EngineStats {
  int64_t steps = 0;
  int64_t max_batch = 0;        // most sequences in one step
  int64_t max_step_tokens = 0;  // most tokens in one step
  int64_t max_step_adapters = 0;
  int64_t preemptions = 0;
};

struct GenerateConfig {
  std::string model_dir;
  std::vector<std::pair<std::string, std::string>> loras;  // (name, directory), in order
  std::string requests_path;                               // names the requests in messages
  std::vector<RequestSpec> requests;
  int64_t max_tokens = 16;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  Device device = Device::cpu();
  DType dtype = DType::kF32;
  std::optional<int> max_loras;         // default: number of adapters (at least 1)
  std::optional<int> max_lora_rank;     // default: the largest adapter rank
  std::optional<int64_t> max_num_seqs;  // default: all requests
  int64_t kv_block_size = 16;
  int tensor_parallel_size = 1;  // ranks (GPUs from `device` on, or CPU threads)
  bool fully_sharded_loras = false;
  model::LoraDecode lora_decode = model::LoraDecode::kAuto;
  bool async_scheduling = true;     // EngineOptions::async_scheduling
  std::optional<DType> lora_dtype;  // the projections' LoRA storage; nullopt: `dtype`
};

struct GenerateOutput {
  std::string prompt;
  std::optional<std::string> adapter;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> output_token_ids;
  std::string output_text;
};

struct GenerateReport {
  std::vector<GenerateOutput> outputs;
  EngineStats stats;
  double load_seconds = 0.0;
  double generate_seconds = 0.0;
};

/// Runs everything; throws loraplex::Error naming the file, line or adapter at fault. Adapters
/// are all loaded and checked before any generation.
GenerateReport run_generate(const GenerateConfig& config);

/// One JSON object per line: prompt, adapter, prompt_token_ids, output_token_ids, output_text.
std::string outputs_to_jsonl(const std::vector<GenerateOutput>& outputs);

}  // namespace loraplex::engine
