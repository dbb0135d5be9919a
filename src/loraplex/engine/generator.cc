#include "loraplex/engine/generator.h"

#include <algorithm>
#include <deque>
#include <set>

#include "loraplex/core/error.h"
#include "loraplex/model/sampler.h"

namespace loraplex::engine {
namespace {

struct Sequence {
  size_t index = 0;  // request index
  AdapterManager::Lease lease;
  int slot = -1;
  std::vector<int32_t> blocks;
  std::vector<int32_t> output;
  bool prefilled = false;
  std::mt19937_64 rng;
};

}  // namespace

EngineSizing size_engine(const std::vector<EngineRequest>& requests, const EngineOptions& options,
                         int64_t block_size) {
  std::vector<int64_t> blocks, prompts;
  for (const EngineRequest& r : requests) {
    const int64_t len = static_cast<int64_t>(r.prompt_ids.size());
    blocks.push_back((len + r.max_tokens + block_size - 1) / block_size);
    prompts.push_back(len);
  }
  std::sort(blocks.rbegin(), blocks.rend());
  std::sort(prompts.rbegin(), prompts.rend());
  EngineSizing s;
  const size_t k = std::min(requests.size(), static_cast<size_t>(options.max_num_seqs));
  for (size_t i = 0; i < k; ++i) {
    s.kv_blocks += blocks[i];
    s.max_num_tokens += prompts[i];
  }
  s.kv_blocks = std::max<int64_t>(s.kv_blocks, 1);
  s.max_num_tokens = std::max<int64_t>(s.max_num_tokens, static_cast<int64_t>(k));
  return s;
}

std::vector<std::vector<int32_t>> generate(model::Decoder& decoder, AdapterManager& adapters,
                                           const std::vector<EngineRequest>& requests,
                                           const EngineOptions& options, EngineStats* stats) {
  LORAPLEX_CHECK(options.max_num_seqs >= 1, "max_num_seqs ", options.max_num_seqs, " must be >= 1");
  model::KvCache& kv = decoder.kv_cache();
  for (size_t i = 0; i < requests.size(); ++i) {
    const EngineRequest& r = requests[i];
    LORAPLEX_CHECK(!r.prompt_ids.empty(), "request ", i, ": the prompt has no tokens");
    LORAPLEX_CHECK(r.max_tokens >= 1, "request ", i, ": max_tokens ", r.max_tokens,
                   ", expected >= 1");
    LORAPLEX_CHECK(r.adapter.empty() || adapters.contains(r.adapter), "request ", i, ": adapter '",
                   r.adapter, "' is not loaded");
    const int64_t need = kv.blocks_for(static_cast<int64_t>(r.prompt_ids.size()) + r.max_tokens);
    LORAPLEX_CHECK(need <= kv.num_blocks(), "request ", i, " needs ", need,
                   " KV-cache blocks, the cache has ", kv.num_blocks());
  }
  const std::set<int32_t> eos(options.eos_token_ids.begin(), options.eos_token_ids.end());
  std::vector<std::vector<int32_t>> results(requests.size());
  std::deque<size_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(i);
  std::vector<Sequence> running;

  while (!waiting.empty() || !running.empty()) {
    // Admission, strictly in input order.
    while (!waiting.empty() && static_cast<int64_t>(running.size()) < options.max_num_seqs) {
      const EngineRequest& r = requests[waiting.front()];
      const int64_t need = kv.blocks_for(static_cast<int64_t>(r.prompt_ids.size()) + r.max_tokens);
      if (need > kv.num_free_blocks()) break;
      Sequence s;
      if (!r.adapter.empty()) {
        try {
          s.lease = adapters.acquire(r.adapter);
        } catch (const AdapterCapacityError&) {
          break;  // every slot serves a running adapter: wait for one to finish
        }
        s.slot = s.lease.slot();
      }
      s.index = waiting.front();
      waiting.pop_front();
      s.blocks = kv.allocate(need);
      s.rng = model::make_sequence_rng(options.seed, s.index);
      running.push_back(std::move(s));
    }
    LORAPLEX_CHECK(!running.empty(), "no request can be admitted (internal error)");

    model::StepBatch step;
    std::set<int> step_adapters;
    int64_t step_tokens = 0;
    for (Sequence& s : running) {
      const EngineRequest& r = requests[s.index];
      model::SequenceStep q;
      const int32_t plen = static_cast<int32_t>(r.prompt_ids.size());
      if (!s.prefilled) {
        q.tokens = r.prompt_ids;
        q.start_position = 0;
      } else {
        q.tokens = {s.output.back()};
        q.start_position = plen + static_cast<int32_t>(s.output.size()) - 1;
      }
      q.blocks = s.blocks;
      q.lora_slot = s.slot;
      q.sample = true;
      q.sampling = options.sampling;
      q.uniform = model::next_uniform(s.rng);
      step_tokens += static_cast<int64_t>(q.tokens.size());
      step.seqs.push_back(std::move(q));
      if (s.slot >= 0) step_adapters.insert(s.slot);
    }
    if (stats != nullptr) {
      ++stats->steps;
      stats->max_batch = std::max(stats->max_batch, static_cast<int64_t>(running.size()));
      stats->max_step_tokens = std::max(stats->max_step_tokens, step_tokens);
      stats->max_step_adapters =
          std::max(stats->max_step_adapters, static_cast<int64_t>(step_adapters.size()));
    }

    for (const Sequence& s : running) {
      if (s.lease.valid()) s.lease.wait_ready(decoder.stream());
    }
    const auto layers_lock = adapters.lock_layers();
    const std::vector<int32_t> next = decoder.execute(step).token_ids;

    std::vector<Sequence> still;
    for (size_t q = 0; q < running.size(); ++q) {
      Sequence& s = running[q];
      s.prefilled = true;
      s.output.push_back(next[q]);
      const bool done = static_cast<int64_t>(s.output.size()) >= requests[s.index].max_tokens ||
                        (!options.ignore_eos && eos.count(next[q]) != 0);
      if (done) {
        kv.release(s.blocks);
        s.lease.release();
        results[s.index] = std::move(s.output);
      } else {
        still.push_back(std::move(s));
      }
    }
    running = std::move(still);
  }
  return results;
}

}  // namespace loraplex::engine
