#pragma once
// Option values of the `loraplex` subcommands, parsed strictly: the whole text must be a
// number in range, else loraplex::Error names the flag, the text and what was expected.

#include <cstdint>
#include <string>

namespace loraplex::cli {

int64_t parse_int(const std::string& flag, const std::string& value, int64_t lo);
float parse_float(const std::string& flag, const std::string& value);

/// Today's date (UTC) as YYYY-MM-DD, for the benchmarks' JSON.
std::string iso_date();
/// The source commit the benchmarks record: $LORAPLEX_COMMIT, else "unknown".
std::string env_commit();

}  // namespace loraplex::cli
