#pragma once
// Option values of the `loraplex` subcommands, parsed strictly: the whole text must be a
// number in range, else loraplex::Error names the flag, the text and what was expected.

#include <cstdint>
#include <string>

namespace loraplex::cli {

int64_t parse_int(const std::string& flag, const std::string& value, int64_t lo);
float parse_float(const std::string& flag, const std::string& value);

}  // namespace loraplex::cli
