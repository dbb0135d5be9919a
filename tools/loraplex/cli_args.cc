#include "cli_args.h"

#include <cstdlib>
#include <ctime>
#include <exception>

#include "loraplex/core/error.h"

namespace loraplex::cli {

int64_t parse_int(const std::string& flag, const std::string& value, int64_t lo) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LORAPLEX_CHECK(used == value.size() && !value.empty() && v >= lo, flag,
                 " expects an integer >= ", lo, ", got '", value, "'");
  return v;
}

float parse_float(const std::string& flag, const std::string& value) {
  size_t used = 0;
  float v = 0.0f;
  try {
    v = std::stof(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LORAPLEX_CHECK(used == value.size() && !value.empty(), flag, " expects a number, got '", value,
                 "'");
  return v;
}

std::string iso_date() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

std::string env_commit() {
  const char* commit = std::getenv("LORAPLEX_COMMIT");
  return commit != nullptr ? commit : "unknown";
}

}  // namespace loraplex::cli
