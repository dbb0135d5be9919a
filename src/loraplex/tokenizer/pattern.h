#pragma once
// The `pattern` of Split, Replace and similar components: {"String": literal} or {"Regex": re}.

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loraplex/tokenizer/json_node.h"
#include "loraplex/tokenizer/onig_regex.h"

namespace loraplex::tok {

class Pattern {
 public:
  /// A literal pattern (as HF compiles String patterns: escaped, so matched verbatim).
  explicit Pattern(std::string literal);
  /// Parses {"String": "..."} or {"Regex": "..."}.
  static Pattern from_json(const JsonNode& node);

  /// Non-overlapping matches [start, end) left to right.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  /// `text` with every match replaced by `content`.
  std::string replace_all(std::string_view text, std::string_view content) const;

 private:
  Pattern() = default;

  std::string literal_;
  std::shared_ptr<const OnigRegex> regex_;  // set for Regex patterns
};

}  // namespace loraplex::tok
