#include "loraplex/server/serve_options.h"

#include <algorithm>

#include <CLI/CLI.hpp>

#include "loraplex/core/error.h"

namespace loraplex::server {

std::optional<ServeOptions> parse_serve_options(const std::vector<std::string>& args,
                                                std::string* help) {
  ServeOptions o;
  CLI::App app{
      "Serves a model and its LoRA adapters over HTTP with the OpenAI API (completions, chat),\n"
      "vLLM's adapter endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter) and vLLM's\n"
      "Prometheus metrics (/metrics).",
      "loraplex serve"};
  std::vector<std::string> loras;
  app.add_option("--model", o.model_dir, "checkpoint directory (config.json, weights, tokenizer)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--lora", loras, "NAME=DIR: a PEFT adapter loaded at start-up (repeatable)");
  app.add_option("--lora-dir", o.lora_dir,
                 "a request naming an adapter that is not loaded loads DIR/NAME on first use")
      ->check(CLI::ExistingDirectory);
  app.add_option("--host", o.http.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.http.port,
                 "port to listen on (0: any free port; the address is printed when listening)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--api-key", o.http.api_key,
                 "clients must send 'Authorization: Bearer KEY' on /v1/* (also read from "
                 "LORAPLEX_API_KEY)")
      ->envname("LORAPLEX_API_KEY");
  app.add_option("--served-model-name", o.served_model_name,
                 "the base model's name in requests and /v1/models (default: --model)");
  app.add_option("--chat-template", o.chat_template,
                 "a Jinja chat template file (default: tokenizer_config.json's chat_template)")
      ->check(CLI::ExistingFile);
  app.add_option("--max-body-bytes", o.http.max_body_bytes, "largest request body accepted (413)")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 30))
      ->capture_default_str();
  app.add_option("--http-threads", o.http.threads,
                 "connections served at once (each stream holds one)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--device", o.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--dtype", o.dtype, "auto, float32, bfloat16 or float16")->capture_default_str();
  engine::EngineOptions& e = o.engine;
  app.add_option("--max-num-seqs", e.max_num_seqs, "sequences in one step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-num-batched-tokens", e.max_num_batched_tokens, "tokens in one step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-loras", e.max_loras, "distinct adapters in one step (GPU slots)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-lora-rank", e.max_lora_rank, "largest adapter rank")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-cpu-loras", e.max_cpu_loras,
                 "packed adapters kept in host memory (0: --max-loras)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--gpu-memory-utilization", e.gpu_memory_utilization,
                 "fraction of the GPU the KV cache may fill, less the rest")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  app.add_option(
         "--num-kv-blocks", e.num_kv_blocks,
         "exactly this many KV blocks (0: on a GPU what --gpu-memory-utilization leaves; on "
         "the CPU what --max-num-seqs sequences of --max-model-len need, at most 1 GiB)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--block-size", e.kv_block_size, "tokens per KV block")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-model-len", e.max_model_len,
                 "longest prompt + generation (0: the model's max_position_embeddings)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", e.enable_prefix_caching,
               "reuse the KV blocks of shared prompt prefixes")
      ->capture_default_str();
  app.add_option("--max-waiting", e.max_waiting,
                 "refuse requests (503) beyond this many waiting (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--seed", e.seed, "seed for requests that give none")->capture_default_str();
  app.add_option("--tensor-parallel-size", e.tensor_parallel_size,
                 "-tp: GPUs the model is sharded over, from --device on (CPU: threads)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--fully-sharded-loras", e.fully_sharded_loras,
               "shard the adapters like the layers they modify (LoRA-A by rank too)");
  app.add_option_function<std::string>(
         "--lora-dtype", [&](const std::string& v) { e.lora_dtype = engine::parse_lora_dtype(v); },
         "how the projections' adapters are stored: auto (the model dtype) or fp8 (float8_e4m3 "
         "with a scale per row: half the adapter memory)")
      ->default_str("auto");

  // CLI11 has no two-letter short names: vLLM's -tp is spelled out.
  std::vector<std::string> reversed;
  for (auto it = args.rbegin(); it != args.rend(); ++it) {
    const bool tp = *it == "-tp" || it->starts_with("-tp=");
    reversed.push_back(tp ? "--tensor-parallel-size" + it->substr(3) : *it);
  }
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    if (help) *help = app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& err) {
    throw Error(std::string(err.what()) + " (see loraplex serve --help)");
  }
  for (const std::string& spec : loras) {
    const size_t eq = spec.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) {
      throw Error("--lora expects NAME=DIR, got '" + spec + "'");
    }
    std::string name = spec.substr(0, eq);
    for (const auto& [n, d] : o.loras) {
      if (n == name) throw Error("--lora: adapter name '" + name + "' is given twice");
    }
    o.loras.emplace_back(std::move(name), spec.substr(eq + 1));
  }
  if (o.served_model_name.empty()) o.served_model_name = o.model_dir;
  for (const auto& [n, d] : o.loras) {
    if (n == o.served_model_name) {
      throw Error("--lora: adapter name '" + n + "' is the served model's name");
    }
  }
  if (e.max_cpu_loras != 0 && e.max_cpu_loras < e.max_loras) {
    throw Error("--max-cpu-loras (" + std::to_string(e.max_cpu_loras) +
                ") must be 0 or at least --max-loras (" + std::to_string(e.max_loras) + ")");
  }
  return o;
}

}  // namespace loraplex::server
