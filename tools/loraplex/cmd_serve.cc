// `loraplex serve`: the OpenAI-compatible HTTP server with per-request adapters, vLLM's adapter
// endpoints and metrics, on the online engine (server/serve_run.h does the work).

#include <cstdio>
#include <string>
#include <vector>

#include "command.h"
#include "loraplex/server/serve_options.h"
#include "loraplex/server/serve_run.h"

namespace loraplex::cli {
namespace {

int run(const std::vector<std::string>& args) {
  std::string help;
  const std::optional<server::ServeOptions> options = server::parse_serve_options(args, &help);
  if (!options) {
    std::fputs(help.c_str(), stdout);
    return 0;
  }
  return server::run_serve(*options, stderr);
}

}  // namespace

extern const Command kServeCommand = {
    "serve", "serve a model and its LoRA adapters over HTTP (OpenAI API, vLLM's LoRA endpoints)",
    run};

}  // namespace loraplex::cli
