// `loraplex serve`: the OpenAI-compatible HTTP server with per-request adapters, vLLM's adapter
// endpoints and metrics, on the online engine (server/serve_run.h does the work). Builds without
// cpp-httplib have the command, and it says why it cannot run.

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "command.h"

#if LORAPLEX_WITH_SERVE
#include "loraplex/server/serve_options.h"
#include "loraplex/server/serve_run.h"
#endif

namespace loraplex::cli {
namespace {

int run(const std::vector<std::string>& args) {
#if LORAPLEX_WITH_SERVE
  std::string help;
  const std::optional<server::ServeOptions> options = server::parse_serve_options(args, &help);
  if (!options) {
    std::fputs(help.c_str(), stdout);
    return 0;
  }
  return server::run_serve(*options, stderr);
#else
  (void)args;
  std::fputs(
      "loraplex serve: this build has no HTTP server (cpp-httplib was not found when it was "
      "configured; install libcpp-httplib-dev and build again)\n",
      stderr);
  return 1;
#endif
}

}  // namespace

extern const Command kServeCommand = {
    "serve", "serve a model and its LoRA adapters over HTTP (OpenAI API, vLLM's LoRA endpoints)",
    run};

}  // namespace loraplex::cli
