#pragma once
// The `loraplex` program is a set of subcommands, each in its own file (cmd_*.cc), listed
// once in main.cc. A command gets its arguments after the subcommand name and returns the
// process exit status.

#include <string>
#include <vector>

namespace loraplex::cli {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

}  // namespace loraplex::cli
