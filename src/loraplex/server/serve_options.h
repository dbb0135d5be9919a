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
  std::vector<std::pair<std::string, std::string>> loras;  // --lora NAME=DIR, in order
  std::string lora_dir;
  std::string served_model_name;  // empty: the --model argument, as vLLM names it
  std::string chat_template;      // a template file; empty: tokenizer_config.json's
  std::string device = "auto";    // auto, cpu, cuda, cuda:N
  std::string dtype = "auto";     // auto (bfloat16 on a GPU, float32 on the CPU) or a name
  HttpOptions http;
  engine::EngineOptions engine;
};

/// Parses the arguments after `serve`. Returns nullopt for --help after writing the help text
/// to `*help` (when not null); throws loraplex::Error with the problem and the flag otherwise.
std::optional<ServeOptions> parse_serve_options(const std::vector<std::string>& args,
                                                std::string* help);

}  // namespace loraplex::server
