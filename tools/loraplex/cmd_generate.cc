// `loraplex generate`: runs a JSON Lines file of (prompt, adapter) requests against a Hugging
// Face checkpoint and PEFT adapters, all requests continuously batched together, and writes one
// JSON line per request in input order.

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cli_parse.h"
#include "command.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/generate_run.h"

namespace loraplex::cli {
namespace {

const char* kHelp =
    "usage: loraplex generate --model DIR --requests FILE.jsonl [options]\n"
    "\n"
    "Generates text for every request of FILE.jsonl (one JSON object a line: \"prompt\",\n"
    "\"adapter\" (a --lora name, or null for the base model), optional \"max_tokens\"). All\n"
    "requests share one continuously batched run: different adapters, prefills and decodes\n"
    "go through the same forward passes.";

int run(const std::vector<std::string>& args) {
  engine::GenerateConfig cfg;
  cfg.device = cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  std::string output;
  bool stats = false;
  CLI::App app{kHelp, "loraplex generate"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model", cfg.model_dir,
                 "checkpoint directory (config.json, model.safetensors or its index, "
                 "tokenizer.json)")
      ->type_name("DIR");
  std::vector<std::string> loras;
  app.add_option("--lora", loras,
                 "a PEFT LoRA adapter (repeatable); all are loaded and checked before generation "
                 "starts")
      ->type_name("NAME=DIR")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--requests", cfg.requests_path, "the requests, JSON Lines")->type_name("FILE");
  app.add_option("--output", output,
                 "where to write the results (default: standard output); one line per request "
                 "in input order: prompt, adapter, prompt_token_ids, output_token_ids, "
                 "output_text")
      ->type_name("FILE");
  add_int(app, "--max-tokens", cfg.max_tokens, 1,
          "tokens to generate per request unless it says (default 16)");
  app.add_option_function<std::string>(
         "--temperature",
         [&](const std::string& value) {
           cfg.temperature = parse_float("--temperature", value);
           LORAPLEX_CHECK(cfg.temperature >= 0.0f, "--temperature must be >= 0, got ", value);
         },
         "0 = greedy (default); otherwise sample")
      ->type_name("FLOAT");
  add_int(app, "--top-k", cfg.top_k, 0, "sample from the K most likely tokens (default 0 = all)");
  app.add_option_function<std::string>(
         "--top-p",
         [&](const std::string& value) {
           cfg.top_p = parse_float("--top-p", value);
           LORAPLEX_CHECK(cfg.top_p > 0.0f && cfg.top_p <= 1.0f, "--top-p must be in (0, 1], got ",
                          value);
         },
         "nucleus sampling threshold (default 1 = off)")
      ->type_name("FLOAT");
  app.add_option_function<std::string>(
         "--min-p",
         [&](const std::string& value) {
           cfg.min_p = parse_float("--min-p", value);
           LORAPLEX_CHECK(cfg.min_p >= 0.0f && cfg.min_p <= 1.0f, "--min-p must be in [0, 1], got ",
                          value);
         },
         "drop tokens less likely than this times the most likely one (default 0 = off)")
      ->type_name("FLOAT");
  add_int(app, "--seed", cfg.seed, 0, "random seed for sampling (default 0)");
  app.add_flag("--ignore-eos", cfg.ignore_eos, "keep generating past the end-of-sequence token");
  app.add_option_function<std::string>(
         "--device",
         [&](const std::string& value) {
           cfg.device = Device::parse(value);
           LORAPLEX_CHECK(cfg.device.is_cpu() || cuda_device_count() > cfg.device.index,
                          "--device ", value, ": no such CUDA device (", cuda_device_count(),
                          " present", built_with_cuda() ? "" : "; this build has no CUDA backend",
                          ")");
         },
         "cpu or cuda[:N] (default: cuda when a GPU is present, else cpu)")
      ->type_name("DEVICE");
  app.add_option_function<std::string>(
         "--dtype", [&](const std::string& value) { cfg.dtype = dtype_from_name(value); },
         "float32 (default), bfloat16 or float16")
      ->type_name("DTYPE");
  add_int(app, "--max-loras", cfg.max_loras, 1,
          "distinct adapters in one batch (default: the number of --lora)");
  add_int(app, "--max-lora-rank", cfg.max_lora_rank, 1,
          "largest adapter rank (default: the largest among the adapters)");
  add_int(app, "--max-num-seqs", cfg.max_num_seqs, 1,
          "sequences in one batch (default: all requests)");
  add_int(app, "--tensor-parallel-size", cfg.tensor_parallel_size, 1,
          "shard the model over N GPUs from --device on (on the CPU over N threads); -tp N; "
          "default 1");
  app.add_flag("--fully-sharded-loras", cfg.fully_sharded_loras,
               "shard the adapters like the layers they modify (LoRA-A by rank in column layers, "
               "LoRA-B by rows in row layers)");
  bool no_async = false;
  app.add_flag("--no-async-scheduling", no_async,
               "collect every step before planning the next (the same tokens; for comparison)");
  app.add_option_function<std::string>(
         "--lora-dtype",
         [&](const std::string& value) { cfg.lora_dtype = engine::parse_lora_dtype(value); },
         "how the projections' adapters are stored: auto (the model dtype, default) or fp8 "
         "(float8_e4m3 with a scale per row: half the adapter memory)")
      ->type_name("DTYPE");
  app.add_flag("--stats", stats, "print load/generation times and batch sizes to standard error");
  if (!parse_cli(app, args)) return 0;
  cfg.async_scheduling = !no_async;
  for (const std::string& value : loras) {
    const size_t eq = value.find('=');
    LORAPLEX_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < value.size(),
                   "--lora expects NAME=DIR, got '", value, "'");
    cfg.loras.emplace_back(value.substr(0, eq), value.substr(eq + 1));
  }
  LORAPLEX_CHECK(!cfg.model_dir.empty(), "--model DIR is required (see --help)");
  LORAPLEX_CHECK(!cfg.requests_path.empty(), "--requests FILE is required (see --help)");
  cfg.requests = engine::read_requests(cfg.requests_path);
  const engine::GenerateReport report = engine::run_generate(cfg);
  const std::string text = engine::outputs_to_jsonl(report.outputs);
  if (output.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else {
    std::ofstream out(output, std::ios::binary);
    LORAPLEX_CHECK(out.good(), output, ": cannot open for writing");
    out << text;
    LORAPLEX_CHECK(out.good(), output, ": write failed");
  }
  if (stats) {
    std::fprintf(stderr,
                 "loraplex generate: %zu requests on %s (%s): load %.2f s, generate %.2f s, "
                 "%lld steps, up to %lld sequences / %lld tokens / %lld adapters per step\n",
                 report.outputs.size(), cfg.device.str().c_str(),
                 std::string(dtype_name(cfg.dtype)).c_str(), report.load_seconds,
                 report.generate_seconds, static_cast<long long>(report.stats.steps),
                 static_cast<long long>(report.stats.max_batch),
                 static_cast<long long>(report.stats.max_step_tokens),
                 static_cast<long long>(report.stats.max_step_adapters));
  }
  return 0;
}

}  // namespace

extern const Command kGenerateCommand = {
    "generate", "run prompts with many LoRA adapters in one batch (JSON Lines in and out)", run};

}  // namespace loraplex::cli
