#pragma once
// Continuous batching for `loraplex generate`: requests are admitted in input order into one
// running batch of at most max_num_seqs sequences using at most max_loras distinct adapters
// (one LoRA slot each); a request that would exceed either waits for a running one to finish.
// Every step runs the prefills of newly admitted sequences and the decodes of running ones,
// whatever their adapters, in one forward pass.

#include <cstdint>
#include <vector>

#include <string>

#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/sampler.h"

namespace loraplex::engine {

struct EngineRequest {
  std::vector<int32_t> prompt_ids;  // at least one token
  std::string adapter;              // a name loaded in the adapter manager; "" = base model
  int64_t max_tokens = 16;
};

struct EngineOptions {
  int64_t max_num_seqs = 1;
  model::SamplingParams sampling;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::vector<int32_t> eos_token_ids;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t max_batch = 0;        // most sequences in one step
  int64_t max_step_tokens = 0;  // most tokens in one step
  int64_t max_step_adapters = 0;
};

/// KV-cache blocks and per-step tokens that `requests` can need at most under `options`.
struct EngineSizing {
  int64_t kv_blocks = 0;
  int64_t max_num_tokens = 0;
};
EngineSizing size_engine(const std::vector<EngineRequest>& requests, const EngineOptions& options,
                         int64_t block_size);

/// Generates every request; returns the generated ids of each, in request order. A sequence
/// holds a lease on its adapter's slot from admission to its last token; a request whose
/// adapter finds every slot pinned by other adapters waits (and so does everything after it).
std::vector<std::vector<int32_t>> generate(model::Decoder& decoder, AdapterManager& adapters,
                                           const std::vector<EngineRequest>& requests,
                                           const EngineOptions& options,
                                           EngineStats* stats = nullptr);

}  // namespace loraplex::engine
