#include "loraplex/engine/generate_run.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/adapters/peft_adapter.h"
#include "loraplex/adapters/peft_config.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::engine {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// EOS ids from config.json, plus generation_config.json's when present (Llama 3 lists several).
std::vector<int32_t> eos_ids(const std::string& dir, const model::ModelConfig& config) {
  std::vector<int32_t> ids = config.eos_token_ids;
  const std::filesystem::path gen = std::filesystem::path(dir) / "generation_config.json";
  std::ifstream in(gen);
  if (!in.good()) return ids;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    LORAPLEX_FAIL(gen.string(), ": not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("eos_token_id")) return ids;
  const nlohmann::json& e = j.at("eos_token_id");
  if (e.is_number_integer()) ids.push_back(e.get<int32_t>());
  if (e.is_array()) {
    for (const auto& v : e)
      if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
  }
  return ids;
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

}  // namespace

GenerateReport run_generate(const GenerateConfig& cfg) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  LORAPLEX_CHECK(fs::is_directory(cfg.model_dir), cfg.model_dir,
                 ": model directory does not exist");
  LORAPLEX_CHECK(cfg.max_tokens >= 1, "--max-tokens ", cfg.max_tokens, ", expected >= 1");
  const model::ModelConfig config =
      model::ModelConfig::from_file((fs::path(cfg.model_dir) / "config.json").string());
  const std::string tok_path = (fs::path(cfg.model_dir) / "tokenizer.json").string();
  LORAPLEX_CHECK(fs::exists(tok_path), tok_path,
                 ": missing (the model directory needs its "
                 "tokenizer.json)");
  const Tokenizer tokenizer = Tokenizer::from_file(tok_path);

  // Adapter names must be unique; their configs are read first so a broken one fails early.
  std::map<std::string, int> adapter_index;
  for (size_t i = 0; i < cfg.loras.size(); ++i) {
    LORAPLEX_CHECK(adapter_index.emplace(cfg.loras[i].first, static_cast<int>(i)).second,
                   "--lora: adapter name '", cfg.loras[i].first, "' is given twice");
  }
  std::vector<EngineRequest> requests;
  GenerateReport report;
  std::vector<int> config_ranks;
  for (const auto& [name, dir] : cfg.loras) config_ranks.push_back(config_max_rank(name, dir));
  for (const RequestSpec& r : cfg.requests) {
    EngineRequest e;
    try {
      e.prompt_ids = tokenizer.encode(r.prompt, true);
    } catch (const Error& err) {
      LORAPLEX_FAIL(cfg.requests_path, ":", r.line, ": cannot tokenize the prompt: ", err.what());
    }
    LORAPLEX_CHECK(!e.prompt_ids.empty(), cfg.requests_path, ":", r.line,
                   ": the prompt encodes to no tokens");
    e.max_tokens = r.max_tokens.value_or(cfg.max_tokens);
    requests.push_back(std::move(e));
    report.outputs.push_back({r.prompt, r.adapter, requests.back().prompt_ids, {}, {}});
  }

  // Adapter configs were checked above (a broken one fails before the model loads); their
  // ranks fix --max-lora-rank's default, and the weights are checked against the model's
  // modules right after it is built, all before any generation.
  const int max_loras =
      cfg.max_loras.value_or(std::max<int>(1, static_cast<int>(cfg.loras.size())));
  LORAPLEX_CHECK(max_loras >= 1, "--max-loras ", max_loras, ", expected >= 1");
  EngineOptions opts;
  opts.max_num_seqs =
      cfg.max_num_seqs.value_or(std::max<int64_t>(1, static_cast<int64_t>(requests.size())));
  LORAPLEX_CHECK(opts.max_num_seqs >= 1, "--max-num-seqs ", opts.max_num_seqs, ", expected >= 1");
  opts.sampling = {cfg.temperature, cfg.top_k, cfg.top_p};
  opts.seed = cfg.seed;
  opts.ignore_eos = cfg.ignore_eos;
  opts.eos_token_ids = eos_ids(cfg.model_dir, config);

  model::DecoderOptions dopts;
  dopts.dtype = cfg.dtype;
  dopts.device = cfg.device;
  dopts.max_loras = max_loras;
  dopts.kv_block_size = cfg.kv_block_size;
  const EngineSizing sizing = size_engine(requests, opts, cfg.kv_block_size);
  dopts.kv_blocks = sizing.kv_blocks;
  dopts.max_num_tokens = sizing.max_num_tokens;
  dopts.max_num_seqs = opts.max_num_seqs;
  int max_rank = cfg.max_lora_rank.value_or(0);
  LORAPLEX_CHECK(!cfg.max_lora_rank || max_rank >= 1, "--max-lora-rank ", max_rank,
                 ", expected >= 1");
  if (!cfg.max_lora_rank) {
    max_rank = 1;
    for (int r : config_ranks) max_rank = std::max(max_rank, r);
  }
  dopts.max_lora_rank = max_rank;
  std::unique_ptr<model::Decoder> decoder = model::Decoder::load(cfg.model_dir, dopts);
  AdapterManagerConfig mcfg;
  mcfg.max_loras = max_loras;
  mcfg.max_cpu_loras = std::max<int>(max_loras, static_cast<int>(cfg.loras.size()));
  mcfg.max_lora_rank = max_rank;
  mcfg.lora_dtype = cfg.dtype;
  mcfg.device = cfg.device;
  AdapterManager adapters(decoder->targets(), mcfg);
  for (const auto& [name, dir] : cfg.loras) adapters.load(name, dir);
  // Request adapter names are resolved once every adapter has loaded cleanly.
  for (size_t i = 0; i < cfg.requests.size(); ++i) {
    const RequestSpec& r = cfg.requests[i];
    if (!r.adapter) continue;
    const auto it = adapter_index.find(*r.adapter);
    LORAPLEX_CHECK(it != adapter_index.end(), cfg.requests_path, ":", r.line, ": unknown adapter '",
                   *r.adapter, "' (load it with --lora ", *r.adapter, "=DIR)");
    requests[i].adapter = it->first;
  }
  report.load_seconds = seconds_since(t0);

  const auto t1 = std::chrono::steady_clock::now();
  std::vector<std::vector<int32_t>> outs =
      generate(*decoder, adapters, requests, opts, &report.stats);
  report.generate_seconds = seconds_since(t1);
  for (size_t i = 0; i < outs.size(); ++i) {
    report.outputs[i].output_token_ids = outs[i];
    report.outputs[i].output_text = tokenizer.decode(outs[i], true);
  }
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
