#pragma once
// Command-line parsing of a subcommand's arguments with CLI11: errors become loraplex::Error
// naming the option and the problem (main prints them); --help prints the options.

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace loraplex::cli {

/// Parses `args` (the words after the subcommand's name) into `app`'s options; -tp N is
/// --tensor-parallel-size N. Returns false when --help was asked for (and printed); throws
/// loraplex::Error on a bad command line.
bool parse_cli(CLI::App& app, const std::vector<std::string>& args);

}  // namespace loraplex::cli
