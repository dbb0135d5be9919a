#include "cli_parse.h"

#include <algorithm>
#include <cstdio>

#include "loraplex/core/error.h"

namespace loraplex::cli {

bool parse_cli(CLI::App& app, const std::vector<std::string>& args) {
  // CLI11 takes a vector of arguments in reverse order.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
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
