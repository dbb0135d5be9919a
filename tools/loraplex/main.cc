// Entry point of the `loraplex` command: dispatches to a subcommand and turns library errors
// into a message and a non-zero exit status (never a crash or an uncaught exception).

#include <cstdio>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "command.h"
#include "loraplex/core/error.h"

namespace loraplex::cli {
// Each subcommand lives in its own cmd_*.cc file.
extern const Command kGenerateCommand;
extern const Command kSelftestCommand;
extern const Command kBenchCommand;
}  // namespace loraplex::cli

namespace {

using loraplex::cli::Command;

const Command* const kCommands[] = {&loraplex::cli::kGenerateCommand,
                                    &loraplex::cli::kSelftestCommand,
                                    &loraplex::cli::kBenchCommand};

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: loraplex <command> [options]\n\ncommands:\n");
  for (const Command* c : kCommands) std::fprintf(out, "  %-10s %s\n", c->name, c->summary);
  std::fprintf(out, "\n`loraplex <command> --help` describes a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_usage(stdout);
    return 0;
  }
  const std::vector<std::string> args(argv + 2, argv + argc);
  for (const Command* c : kCommands) {
    if (name != c->name) continue;
    try {
      return c->run(args);
    } catch (const loraplex::Error& e) {
      std::fprintf(stderr, "loraplex %s: error: %s\n", c->name, e.what());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loraplex %s: unexpected error: %s\n", c->name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "loraplex: unknown command '%s'\n\n", name.c_str());
  print_usage(stderr);
  return 2;
}
