#pragma once
// Command-line parsing of a subcommand's arguments with CLI11: errors become loraplex::Error
// naming the option and the problem (main prints them); --help prints the options.

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "cli_args.h"

namespace loraplex::cli {

/// Parses `args` (the words after the subcommand's name) into `app`'s options; -tp N is
/// --tensor-parallel-size N. Returns false when --help was asked for (and printed); throws
/// loraplex::Error on a bad command line (an argument no option takes: "unknown option 'ARG'").
bool parse_cli(CLI::App& app, const std::vector<std::string>& args);

/// --name N for an integer >= lo, parsed by parse_int (cli_args.h), whose error says
/// "--name expects an integer >= lo, got 'TEXT'".
template <typename T>
CLI::Option* add_int(CLI::App& app, const std::string& name, T& target, int64_t lo,
                     const std::string& help) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, name, lo](const std::string& v) {
            target = static_cast<T>(parse_int(name, v, lo));
          },
          help)
      ->type_name("INT");
}

/// --name X for a number, parsed by parse_float ("--name expects a number, got 'TEXT'").
inline CLI::Option* add_float(CLI::App& app, const std::string& name, float& target,
                              const std::string& help) {
  return app
      .add_option_function<std::string>(
          name, [&target, name](const std::string& v) { target = parse_float(name, v); }, help)
      ->type_name("FLOAT");
}

}  // namespace loraplex::cli
