#include "loraplex/engine/generate_run.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include "loraplex/adapters/peft_config.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/model_files.h"
#include "loraplex/model/load_model.h"
#include "loraplex/tokenizer/prompt_encoding.h"

namespace loraplex::engine {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The largest rank adapter_config.json declares (r and every rank_pattern value), so the
// layers can be sized before any adapter weights are read.
int config_max_rank(const std::string& name, const std::string& dir) {
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), "adapter '", name, "': ", dir, ": not a directory");
  try {
    return PeftLoraConfig::from_file(adapter_config_path(dir)).max_rank();
  } catch (const Error& e) {
    LORAPLEX_FAIL("adapter '", name, "': ", e.what());
  }
}

// Sizes the engine so that every request of the largest possible batch fits at once: the
// prompts of the max_num_seqs longest requests in one step, and their whole sequences in the
// KV cache. Nothing then waits for blocks or is preempted, as in a one-shot offline run.
void size_for(const std::vector<std::vector<int32_t>>& prompts,
              const std::vector<int64_t>& max_tokens, EngineOptions& o) {
  std::vector<int64_t> blocks;
  std::vector<int64_t> lens;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(prompts[i].size());
    blocks.push_back((len + max_tokens[i] + o.kv_block_size - 1) / o.kv_block_size);
    lens.push_back(len);
  }
  std::sort(blocks.rbegin(), blocks.rend());
  std::sort(lens.rbegin(), lens.rend());
  const size_t k = std::min(prompts.size(), static_cast<size_t>(o.max_num_seqs));
  o.num_kv_blocks = 0;
  o.max_num_batched_tokens = 0;
  for (size_t i = 0; i < k; ++i) {
    o.num_kv_blocks += blocks[i];
    o.max_num_batched_tokens += lens[i];
  }
  o.num_kv_blocks = std::max<int64_t>(o.num_kv_blocks, 1);
  o.max_num_batched_tokens = std::max<int64_t>(o.max_num_batched_tokens, o.max_num_seqs);
}

// The steps of run_generate.

// The requests' prompts as token ids and their max_tokens; the report gets a line per request.
struct EncodedRequests {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> max_tokens;
};

EncodedRequests encode_requests(const GenerateConfig& cfg, const Tokenizer& tokenizer,
                                GenerateReport& report) {
  EncodedRequests e;
  for (const RequestSpec& r : cfg.requests) {
    std::vector<int32_t> ids;
    try {
      ids = ::loraplex::tokenizer::encode_prompt(
          [&](std::string_view text, bool special) { return tokenizer.encode(text, special); },
          r.prompt, {});
    } catch (const Error& err) {
      LORAPLEX_FAIL(cfg.requests_path, ":", r.line, ": ", err.what());
    }
    e.max_tokens.push_back(r.max_tokens.value_or(cfg.max_tokens));
    report.outputs.push_back({r.prompt, r.adapter, ids, {}, {}});
    e.prompts.push_back(std::move(ids));
  }
  return e;
}

// The engine sized for the whole run (size_for), the adapters' ranks deciding
// --max-lora-rank's default.
EngineOptions generate_engine_options(const GenerateConfig& cfg, const EncodedRequests& e,
                                      const std::vector<int>& config_ranks) {
  // The adapter configs were read first (a broken one fails before the model loads); their
  // ranks fix --max-lora-rank's default, and the weights are checked against the model's
  // modules right after it is built, all before any generation.
  EngineOptions opts;
  opts.max_loras = cfg.max_loras.value_or(std::max<int>(1, static_cast<int>(cfg.loras.size())));
  LORAPLEX_CHECK(opts.max_loras >= 1, "--max-loras ", opts.max_loras, ", expected >= 1");
  opts.max_cpu_loras = std::max<int>(opts.max_loras, static_cast<int>(cfg.loras.size()));
  opts.max_num_seqs =
      cfg.max_num_seqs.value_or(std::max<int64_t>(1, static_cast<int64_t>(e.prompts.size())));
  LORAPLEX_CHECK(opts.max_num_seqs >= 1, "--max-num-seqs ", opts.max_num_seqs, ", expected >= 1");
  int max_rank = cfg.max_lora_rank.value_or(0);
  LORAPLEX_CHECK(!cfg.max_lora_rank || max_rank >= 1, "--max-lora-rank ", max_rank,
                 ", expected >= 1");
  if (!cfg.max_lora_rank) {
    max_rank = 1;
    for (int r : config_ranks) max_rank = std::max(max_rank, r);
  }
  opts.max_lora_rank = max_rank;
  opts.kv_block_size = cfg.kv_block_size;
  opts.seed = cfg.seed;
  size_for(e.prompts, e.max_tokens, opts);
  // Every request is there from the start and only the whole run's time counts: evicting an
  // adapter for another's first token would only recompute its sequences.
  opts.lora_evict_after_s = -1.0;

  opts.tensor_parallel_size = cfg.tensor_parallel_size;
  opts.fully_sharded_loras = cfg.fully_sharded_loras;
  opts.lora_decode = cfg.lora_decode;
  opts.async_scheduling = cfg.async_scheduling;
  opts.lora_dtype = cfg.lora_dtype;
  return opts;
}

std::vector<Request> make_requests(const GenerateConfig& cfg,
                                   const std::map<std::string, int>& adapter_index,
                                   const EncodedRequests& e) {
  std::vector<Request> requests(cfg.requests.size());
  for (size_t i = 0; i < cfg.requests.size(); ++i) {
    const RequestSpec& r = cfg.requests[i];
    if (r.adapter) {
      LORAPLEX_CHECK(adapter_index.count(*r.adapter) != 0, cfg.requests_path, ":", r.line,
                     ": unknown adapter '", *r.adapter, "' (load it with --lora ", *r.adapter,
                     "=DIR)");
      requests[i].adapter = *r.adapter;
    }
    requests[i].prompt_ids = e.prompts[i];
    RequestOptions& o = requests[i].options;
    o.max_tokens = e.max_tokens[i];
    o.temperature = cfg.temperature;
    o.top_k = cfg.top_k;
    o.top_p = cfg.top_p;
    o.min_p = cfg.min_p;
    o.ignore_eos = cfg.ignore_eos;
  }
  return requests;
}

// Each request's tokens and text into the report; a request that failed fails the run.
void collect_outputs(const GenerateConfig& cfg, std::vector<RequestHandle>& handles,
                     const Tokenizer& tokenizer, GenerateReport& report) {
  for (size_t i = 0; i < handles.size(); ++i) {
    const RequestOutput out = handles[i].wait();
    LORAPLEX_CHECK(out.finish_reason != FinishReason::kError, cfg.requests_path, ":",
                   cfg.requests[i].line, ": ", out.error);
    report.outputs[i].output_token_ids = out.token_ids;
    report.outputs[i].output_text = tokenizer.decode(out.token_ids, true);
  }
}

}  // namespace

GenerateReport run_generate(const GenerateConfig& cfg) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  LORAPLEX_CHECK(fs::is_directory(cfg.model_dir), cfg.model_dir,
                 ": model directory does not exist");
  LORAPLEX_CHECK(cfg.max_tokens >= 1, "--max-tokens ", cfg.max_tokens, ", expected >= 1");
  const model::ModelConfig config =
      model::ModelConfig::from_file((fs::path(cfg.model_dir) / "config.json").string());
  const std::shared_ptr<const Tokenizer> tokenizer = read_tokenizer(cfg.model_dir);

  // Adapter names must be unique; their configs are read first so a broken one fails early.
  std::map<std::string, int> adapter_index;
  for (size_t i = 0; i < cfg.loras.size(); ++i) {
    LORAPLEX_CHECK(adapter_index.emplace(cfg.loras[i].first, static_cast<int>(i)).second,
                   "--lora: adapter name '", cfg.loras[i].first, "' is given twice");
  }
  GenerateReport report;
  std::vector<int> config_ranks;
  for (const auto& [name, dir] : cfg.loras) config_ranks.push_back(config_max_rank(name, dir));
  const EncodedRequests encoded = encode_requests(cfg, *tokenizer, report);

  EngineOptions opts = generate_engine_options(cfg, encoded, config_ranks);
  Engine engine(
      model::load_model(cfg.model_dir, engine_decoder_options(opts, cfg.dtype, cfg.device)),
      tokenizer, read_eos_token_ids(cfg.model_dir, config), opts);
  for (const auto& [name, dir] : cfg.loras) engine.load_adapter(name, dir);
  // Request adapter names are resolved once every adapter has loaded cleanly.
  std::vector<Request> requests = make_requests(cfg, adapter_index, encoded);
  report.load_seconds = seconds_since(t0);

  const auto t1 = std::chrono::steady_clock::now();
  std::vector<RequestHandle> handles;
  try {
    handles = engine.submit_all(std::move(requests));
  } catch (const RequestError& e) {
    if (e.index() < 0) throw;
    LORAPLEX_FAIL(cfg.requests_path, ":", cfg.requests[static_cast<size_t>(e.index())].line, ": ",
                  e.reason());
  }
  collect_outputs(cfg, handles, *tokenizer, report);
  report.generate_seconds = seconds_since(t1);
  const EngineMetrics m = engine.metrics();
  report.stats.steps = m.steps_total;
  report.stats.max_batch = m.max_step_seqs;
  report.stats.max_step_tokens = m.max_step_tokens;
  report.stats.max_step_adapters = m.max_step_adapters;
  report.stats.preemptions = m.preemptions_total;
  return report;
}

std::string outputs_to_jsonl(const std::vector<GenerateOutput>& outputs) {
  std::string text;
  for (const GenerateOutput& o : outputs) {
    nlohmann::ordered_json j;
    j["prompt"] = o.prompt;
    j["adapter"] = o.adapter ? nlohmann::ordered_json(*o.adapter) : nlohmann::ordered_json();
    j["prompt_token_ids"] = o.prompt_token_ids;
    j["output_token_ids"] = o.output_token_ids;
    j["output_text"] = o.output_text;
    // Invalid UTF-8 cannot reach here (decode yields U+FFFD), but never throw on output.
    text += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    text += '\n';
  }
  return text;
}

}  // namespace loraplex::engine
