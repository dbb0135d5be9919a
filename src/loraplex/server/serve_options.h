#pragma once
// The command line of `loraplex serve` (CLI11): the model, the adapters to load at start-up,
// the --lora-dir resolver, the HTTP options and the engine's options (engine.h), with vLLM's
// flag names where vLLM has the same option.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/engine/engine.h"
#include "loraplex/server/http_server.h"

namespace loraplex::server {

struct ServeOptions {
  std::string model_dir;
  /// Instead of model_dir: random weights of a named shape (model::model_shape) with this many
  /// layers (0 = all), for measuring the server at a real model's size without a checkpoint.
  /// Such a model has no tokenizer: prompts are token ids, no text comes back.
  std::string shape;
  int64_t shape_layers = 0;
  std::vector<std::pair<std::string, std::string>> loras;  // --lora NAME=DIR, in order
  std::string lora_dir;
  /// vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
  /// answer only with --enable-lora-loading (or that variable set to true or 1), and loads only
  /// from under --lora-dir and these directories.
  bool enable_lora_loading = false;
  std::vector<std::string> allowed_lora_paths;
  std::string served_model_name;  // empty: the --model argument, as vLLM names it
  std::string chat_template;      // a template file; empty: tokenizer_config.json's
  std::string device = "auto";    // auto, cpu, cuda, cuda:N
  std::string dtype = "auto";     // auto (bfloat16 on a GPU, float32 on the CPU) or a name
  HttpOptions http;
  engine::EngineOptions engine;
  // Whether the command line set these; left unset, the start-up adapters decide them
  // (settle_serve_options).
  bool max_loras_given = false;
  bool max_lora_rank_given = false;
  /// vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: --max-model-len may exceed the model's
  /// max_position_embeddings.
  bool allow_long_max_model_len = false;
};

/// The largest number of GPU slots settle_serve_options gives start-up adapters by default
/// (each slot holds max_lora_rank for every adapted layer).
inline constexpr int kMaxDefaultLoras = 32;

/// What needs the model's config and the --lora adapters' ranks (read before the weights):
/// refuses --max-model-len beyond max_position_embeddings unless allow_long_max_model_len, and
/// an adapter whose rank exceeds an explicit --max-lora-rank; without --max-lora-rank the rank
/// is the largest of the adapters' (at least the default 16), and without --max-loras there is
/// a slot for every adapter (at least the default 4, at most kMaxDefaultLoras and
/// --max-cpu-loras). `ranks` are the --lora adapters' ranks in order. Returns a line for the
/// start-up log for each value it chose; throws loraplex::Error naming the flag otherwise.
std::vector<std::string> settle_serve_options(ServeOptions& options,
                                              const model::ModelConfig& config,
                                              const std::vector<int>& ranks);

/// Parses the arguments after `serve`. Returns nullopt for --help after writing the help text
/// to `*help` (when not null); throws loraplex::Error with the problem and the flag otherwise.
std::optional<ServeOptions> parse_serve_options(const std::vector<std::string>& args,
                                                std::string* help);

}  // namespace loraplex::server
