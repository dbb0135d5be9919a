#include "loraplex/server/serve_options.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>

#include <CLI/CLI.hpp>

#include "loraplex/core/error.h"
#include "loraplex/server/adapter_policy.h"

namespace loraplex::server {
namespace {

// As vLLM reads its boolean environment variables: "1" or "true", any case.
bool env_true(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s == "1" || s == "true";
}

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

std::chrono::milliseconds milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000.0)));
}

}  // namespace

std::optional<ServeOptions> parse_serve_options(const std::vector<std::string>& args,
                                                std::string* help) {
  ServeOptions o;
  CLI::App app{
      "Serves a model and its LoRA adapters over HTTP with the OpenAI API (completions, chat),\n"
      "vLLM's adapter endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter) and vLLM's\n"
      "Prometheus metrics (/metrics).",
      "loraplex serve"};
  std::vector<std::string> loras;
  CLI::Option* model = app.add_option("--model", o.model_dir,
                                      "checkpoint directory (config.json, weights, tokenizer)")
                           ->check(CLI::ExistingDirectory);
  CLI::Option* shape =
      app.add_option("--shape", o.shape,
                     "instead of --model, random weights of a named shape (as bench e2e --shape "
                     "names them: llama3-8b, mixtral-8x7b, ...), to measure the server at a real "
                     "model's size; no tokenizer: prompts are token ids, no text comes back")
          ->excludes(model);
  app.add_option("--layers", o.shape_layers, "--shape: keep this many decoder layers (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->needs(shape);
  app.add_option("--lora", loras, "NAME=DIR: a PEFT adapter loaded at start-up (repeatable)");
  app.add_option("--lora-dir", o.lora_dir,
                 "a request naming an adapter that is not loaded loads DIR/NAME on first use")
      ->check(CLI::ExistingDirectory);
  app.add_flag("--enable-lora-loading", o.enable_lora_loading,
               "answer /v1/load_lora_adapter and /v1/unload_lora_adapter (also when "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING is true or 1); loads only from under --lora-dir "
               "and --allowed-lora-paths");
  app.add_option("--allowed-lora-paths", o.allowed_lora_paths,
                 "DIR...: more directories /v1/load_lora_adapter may load adapters from")
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
  // --http-threads is the flag's old name: a connection holds a thread while it is open.
  app.add_option("--max-connections,--http-threads", o.http.max_connections,
                 "connections open at once (streams, requests and idle keep-alive ones, a thread "
                 "each); one more gets a 503")
      ->check(CLI::Range(size_t{1}, size_t{1} << 20))
      ->capture_default_str();
  double idle_s = seconds(o.http.idle_timeout);
  double header_s = seconds(o.http.header_timeout);
  double body_s = seconds(o.http.body_timeout);
  double write_s = seconds(o.http.write_timeout);
  app.add_option("--http-idle-timeout", idle_s,
                 "seconds a connection may wait without a request before it is closed")
      ->check(CLI::Range(0.001, 86400.0))
      ->capture_default_str();
  app.add_option("--http-header-timeout", header_s,
                 "seconds a request's line and headers may take from its first byte")
      ->check(CLI::Range(0.001, 86400.0))
      ->capture_default_str();
  app.add_option("--http-body-timeout", body_s, "seconds a request's body may take")
      ->check(CLI::Range(0.001, 86400.0))
      ->capture_default_str();
  app.add_option("--http-write-timeout", write_s,
                 "seconds a response may wait for a client that stops reading (its request is "
                 "then aborted)")
      ->check(CLI::Range(0.001, 86400.0))
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
  CLI::Option* max_loras =
      app.add_option("--max-loras", e.max_loras,
                     "distinct adapters in one step (GPU slots; default: one per --lora adapter, "
                     "at least 4, at most " +
                         std::to_string(kMaxDefaultLoras) + ")")
          ->check(CLI::PositiveNumber);
  CLI::Option* max_lora_rank =
      app.add_option("--max-lora-rank", e.max_lora_rank,
                     "largest adapter rank (default: the largest --lora adapter's, at least 16)")
          ->check(CLI::PositiveNumber);
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
  app.add_flag("--allow-long-max-model-len", o.allow_long_max_model_len,
               "accept a --max-model-len above the model's max_position_embeddings (also when "
               "VLLM_ALLOW_LONG_MAX_MODEL_LEN is true or 1); positions beyond it were never "
               "trained");
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", e.enable_prefix_caching,
               "reuse the KV blocks of shared prompt prefixes")
      ->capture_default_str();
  app.add_flag("--async-scheduling,!--no-async-scheduling", e.async_scheduling,
               "plan and launch each step while the one before runs on the device (the same "
               "tokens; --no-async-scheduling collects every step before planning the next)")
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
    if (const std::string problem = adapter_name_problem(name); !problem.empty()) {
      throw Error("--lora " + spec + ": " + problem);
    }
    for (const auto& [n, d] : o.loras) {
      if (n == name) throw Error("--lora: adapter name '" + name + "' is given twice");
    }
    o.loras.emplace_back(std::move(name), spec.substr(eq + 1));
  }
  if (o.model_dir.empty() && o.shape.empty()) {
    throw Error("--model DIR or --shape NAME is required (see loraplex serve --help)");
  }
  if (o.served_model_name.empty()) o.served_model_name = o.shape.empty() ? o.model_dir : o.shape;
  for (const auto& [n, d] : o.loras) {
    if (n == o.served_model_name) {
      throw Error("--lora: adapter name '" + n + "' is the served model's name");
    }
  }
  o.http.idle_timeout = milliseconds(idle_s);
  o.http.header_timeout = milliseconds(header_s);
  o.http.body_timeout = milliseconds(body_s);
  o.http.write_timeout = milliseconds(write_s);
  o.max_loras_given = max_loras->count() > 0;
  o.max_lora_rank_given = max_lora_rank->count() > 0;
  o.allow_long_max_model_len =
      o.allow_long_max_model_len || env_true("VLLM_ALLOW_LONG_MAX_MODEL_LEN");
  o.enable_lora_loading = o.enable_lora_loading || env_true("VLLM_ALLOW_RUNTIME_LORA_UPDATING");
  if (o.enable_lora_loading && o.lora_dir.empty() && o.allowed_lora_paths.empty()) {
    throw Error(
        "--enable-lora-loading needs --lora-dir or --allowed-lora-paths: the directories "
        "/v1/load_lora_adapter may load adapters from");
  }
  if (o.max_loras_given && e.max_cpu_loras != 0 && e.max_cpu_loras < e.max_loras) {
    throw Error("--max-cpu-loras (" + std::to_string(e.max_cpu_loras) +
                ") must be 0 or at least --max-loras (" + std::to_string(e.max_loras) + ")");
  }
  if (!o.max_loras_given && e.max_cpu_loras != 0 && e.max_cpu_loras < e.max_loras) {
    e.max_loras = e.max_cpu_loras;  // the default yields to an explicit --max-cpu-loras
  }
  return o;
}

std::vector<std::string> settle_serve_options(ServeOptions& o, const model::ModelConfig& config,
                                              const std::vector<int>& ranks) {
  engine::EngineOptions& e = o.engine;
  std::vector<std::string> chosen;
  const int64_t positions = config.max_position_embeddings;
  if (e.max_model_len > positions && !o.allow_long_max_model_len) {
    throw Error("--max-model-len " + std::to_string(e.max_model_len) +
                " exceeds the model's max_position_embeddings " + std::to_string(positions) +
                " (config.json): positions beyond it were never trained; give "
                "--allow-long-max-model-len (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to serve them "
                "anyway");
  }
  int largest = 0;
  for (size_t i = 0; i < ranks.size() && i < o.loras.size(); ++i) {
    const auto& [name, dir] = o.loras[i];
    if (o.max_lora_rank_given && ranks[i] > e.max_lora_rank) {
      throw Error("--lora " + name + "=" + dir + ": adapter '" + name + "' has rank " +
                  std::to_string(ranks[i]) + ", above --max-lora-rank " +
                  std::to_string(e.max_lora_rank));
    }
    largest = std::max(largest, ranks[i]);
  }
  if (!o.max_lora_rank_given && largest > e.max_lora_rank) {
    e.max_lora_rank = largest;
    chosen.push_back("max_lora_rank " + std::to_string(largest) +
                     ": the largest --lora adapter's rank (--max-lora-rank to change)");
  }
  const int count = static_cast<int>(o.loras.size());
  if (!o.max_loras_given && count > e.max_loras) {
    int slots = std::min(count, kMaxDefaultLoras);
    if (e.max_cpu_loras != 0) slots = std::min(slots, e.max_cpu_loras);
    if (slots > e.max_loras) {
      e.max_loras = slots;
      chosen.push_back("max_loras " + std::to_string(slots) +
                       (slots == count ? ": a GPU slot for each --lora adapter"
                                       : " GPU slots for the " + std::to_string(count) +
                                             " --lora adapters, which share them") +
                       " (--max-loras to change)");
    }
  }
  return chosen;
}

}  // namespace loraplex::server
