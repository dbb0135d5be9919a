// `loraplex generate`: runs a JSON Lines file of (prompt, adapter) requests against a Hugging
// Face checkpoint and PEFT adapters, all requests continuously batched together, and writes one
// JSON line per request in input order.

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cli_args.h"
#include "command.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/generate_run.h"

namespace loraplex::cli {
namespace {

const char* kHelp =
    "usage: loraplex generate --model DIR --requests FILE.jsonl [options]\n"
    "\n"
    "Generates text for every request of FILE.jsonl (one JSON object a line: \"prompt\",\n"
    "\"adapter\" (a --lora name, or null for the base model), optional \"max_tokens\"). All\n"
    "requests share one continuously batched run: different adapters, prefills and decodes\n"
    "go through the same forward passes.\n"
    "\n"
    "options:\n"
    "  --model DIR            checkpoint directory (config.json, model.safetensors or its\n"
    "                         index, tokenizer.json)\n"
    "  --lora NAME=DIR        a PEFT LoRA adapter (repeatable); all are loaded and checked\n"
    "                         before generation starts\n"
    "  --requests FILE        the requests, JSON Lines\n"
    "  --output FILE          where to write the results (default: standard output); one line\n"
    "                         per request in input order: prompt, adapter, prompt_token_ids,\n"
    "                         output_token_ids, output_text\n"
    "  --max-tokens N         tokens to generate per request unless it says (default 16)\n"
    "  --temperature T        0 = greedy (default); otherwise sample\n"
    "  --top-k K              sample from the K most likely tokens (default 0 = all)\n"
    "  --top-p P              nucleus sampling threshold (default 1 = off)\n"
    "  --seed S               random seed for sampling (default 0)\n"
    "  --ignore-eos           keep generating past the end-of-sequence token\n"
    "  --device cpu|cuda      default: cuda when a GPU is present, else cpu\n"
    "  --dtype D              float32 (default), bfloat16 or float16\n"
    "  --max-loras N          distinct adapters in one batch (default: the number of --lora)\n"
    "  --max-lora-rank R      largest adapter rank (default: the largest among the adapters)\n"
    "  --max-num-seqs N       sequences in one batch (default: all requests)\n"
    "  --tensor-parallel-size N, -tp N\n"
    "                         shard the model over N GPUs from --device on (on the CPU over\n"
    "                         N threads); default 1\n"
    "  --fully-sharded-loras  shard the adapters like the layers they modify (LoRA-A by rank\n"
    "                         in column layers, LoRA-B by rows in row layers)\n"
    "  --stats                print load/generation times and batch sizes to standard error\n";

int run(const std::vector<std::string>& args) {
  engine::GenerateConfig cfg;
  cfg.device = cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  std::string output;
  bool stats = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kHelp, stdout);
      return 0;
    }
    if (flag == "--ignore-eos") {
      cfg.ignore_eos = true;
      continue;
    }
    if (flag == "--stats") {
      stats = true;
      continue;
    }
    if (flag == "--fully-sharded-loras") {
      cfg.fully_sharded_loras = true;
      continue;
    }
    LORAPLEX_CHECK(i + 1 < args.size(), flag, " expects a value (see --help)");
    const std::string& value = args[++i];
    if (flag == "--model") {
      cfg.model_dir = value;
    } else if (flag == "--lora") {
      const size_t eq = value.find('=');
      LORAPLEX_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < value.size(),
                     "--lora expects NAME=DIR, got '", value, "'");
      cfg.loras.emplace_back(value.substr(0, eq), value.substr(eq + 1));
    } else if (flag == "--requests") {
      cfg.requests_path = value;
    } else if (flag == "--output") {
      output = value;
    } else if (flag == "--max-tokens") {
      cfg.max_tokens = parse_int(flag, value, 1);
    } else if (flag == "--temperature") {
      cfg.temperature = parse_float(flag, value);
      LORAPLEX_CHECK(cfg.temperature >= 0.0f, "--temperature must be >= 0, got ", value);
    } else if (flag == "--top-k") {
      cfg.top_k = static_cast<int>(parse_int(flag, value, 0));
    } else if (flag == "--top-p") {
      cfg.top_p = parse_float(flag, value);
      LORAPLEX_CHECK(cfg.top_p > 0.0f && cfg.top_p <= 1.0f, "--top-p must be in (0, 1], got ",
                     value);
    } else if (flag == "--seed") {
      cfg.seed = static_cast<uint64_t>(parse_int(flag, value, 0));
    } else if (flag == "--device") {
      cfg.device = Device::parse(value);
      LORAPLEX_CHECK(cfg.device.is_cpu() || cuda_device_count() > cfg.device.index, "--device ",
                     value, ": no such CUDA device (", cuda_device_count(), " present",
                     built_with_cuda() ? "" : "; this build has no CUDA backend", ")");
    } else if (flag == "--dtype") {
      cfg.dtype = dtype_from_name(value);
    } else if (flag == "--max-loras") {
      cfg.max_loras = static_cast<int>(parse_int(flag, value, 1));
    } else if (flag == "--max-lora-rank") {
      cfg.max_lora_rank = static_cast<int>(parse_int(flag, value, 1));
    } else if (flag == "--max-num-seqs") {
      cfg.max_num_seqs = parse_int(flag, value, 1);
    } else if (flag == "--tensor-parallel-size" || flag == "-tp") {
      cfg.tensor_parallel_size = static_cast<int>(parse_int(flag, value, 1));
    } else {
      LORAPLEX_FAIL("unknown option '", flag, "' (see --help)");
    }
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
