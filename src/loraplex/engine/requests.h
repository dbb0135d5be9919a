#pragma once
// The request file of `loraplex generate`: JSON Lines, one object per line with `prompt` (a
// string), `adapter` (an adapter name, or null / absent for the base model) and an optional
// `max_tokens`. Every error names the file, the line and the reason.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loraplex::engine {

struct RequestSpec {
  std::string prompt;
  std::optional<std::string> adapter;  // nullopt = base model
  std::optional<int64_t> max_tokens;   // nullopt = the command's --max-tokens
  int line = 0;                        // 1-based line in the file, for messages
};

/// Parses JSON Lines text; `source` names it in messages. Blank lines are skipped.
std::vector<RequestSpec> parse_requests(const std::string& text, const std::string& source);
/// Reads and parses a request file; a missing or unreadable file is an error naming it.
std::vector<RequestSpec> read_requests(const std::string& path);

}  // namespace loraplex::engine
