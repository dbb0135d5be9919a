// Entry point of the `loraplex` command: dispatches to a subcommand and turns library errors
// into a message and a non-zero exit status (never a crash or an uncaught exception).

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "loraplex/core/error.h"

namespace loraplex::cli {
// Each subcommand lives in its own cmd_*.cc file.
extern const Command kGenerateCommand;
extern const Command kSelftestCommand;
extern const Command kBenchCommand;
extern const Command kBenchAdapterLoadCommand;
extern const Command kBenchE2eCommand;
extern const Command kBenchSamplingCommand;
extern const Command kBenchServeCommand;
extern const Command kServeCommand;
}  // namespace loraplex::cli

namespace {

using loraplex::cli::Command;

// A name may have several words ("bench adapter-load"): the longest name that the arguments
// start with wins.
const Command* const kCommands[] = {
    &loraplex::cli::kGenerateCommand,   &loraplex::cli::kSelftestCommand,
    &loraplex::cli::kBenchCommand,      &loraplex::cli::kBenchAdapterLoadCommand,
    &loraplex::cli::kBenchE2eCommand,   &loraplex::cli::kBenchSamplingCommand,
    &loraplex::cli::kBenchServeCommand, &loraplex::cli::kServeCommand};

std::vector<std::string> words_of(const std::string& name) {
  std::vector<std::string> out;
  std::istringstream in(name);
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: loraplex <command> [options]\n\ncommands:\n");
  for (const Command* c : kCommands) std::fprintf(out, "  %-20s %s\n", c->name, c->summary);
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
  const std::vector<std::string> all(argv + 1, argv + argc);
  const Command* command = nullptr;
  size_t used = 0;
  for (const Command* c : kCommands) {
    const std::vector<std::string> words = words_of(c->name);
    if (words.size() <= used || words.size() > all.size()) continue;
    if (std::equal(words.begin(), words.end(), all.begin())) {
      command = c;
      used = words.size();
    }
  }
  if (command != nullptr) {
    const std::vector<std::string> args(all.begin() + static_cast<std::ptrdiff_t>(used), all.end());
    try {
      return command->run(args);
    } catch (const loraplex::Error& e) {
      std::fprintf(stderr, "loraplex %s: error: %s\n", command->name, e.what());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loraplex %s: unexpected error: %s\n", command->name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "loraplex: unknown command '%s'\n\n", name.c_str());
  print_usage(stderr);
  return 2;
}
