#include "cli_parse.h"

#include <algorithm>
#include <cstdio>

#include "loraplex/core/error.h"

namespace loraplex::cli {

bool parse_cli(CLI::App& app, const std::vector<std::string>& args) {
  // CLI11 takes a vector of arguments in reverse order, and no short names of two letters:
  // vLLM's -tp is spelled out here.
  std::vector<std::string> reversed;
  for (auto it = args.rbegin(); it != args.rend(); ++it) {
    if (*it == "-tp" || it->starts_with("-tp=")) {
      reversed.push_back("--tensor-parallel-size" + it->substr(3));
    } else {
      reversed.push_back(*it);
    }
  }
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return false;
  } catch (const CLI::ExtrasError&) {
    const std::vector<std::string> extra = app.remaining();
    LORAPLEX_FAIL("unknown option '", extra.empty() ? std::string() : extra.front(),
                  "' (see --help)");
  } catch (const CLI::ParseError& e) {
    LORAPLEX_FAIL(e.what(), " (see --help)");
  }
  return true;
}

}  // namespace loraplex::cli
