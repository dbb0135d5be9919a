#pragma once
// A compiled Oniguruma regex: the engine (and default syntax) Hugging Face tokenizers uses, so
// Unicode classes, look-ahead and (?i:...) behave as in tokenizer.json files.

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loraplex::tok {

class OnigRegex {
 public:
  /// Compiles `pattern` (UTF-8); throws loraplex::Error starting with `context` on failure.
  OnigRegex(const std::string& pattern, const std::string& context);
  ~OnigRegex();
  OnigRegex(const OnigRegex&) = delete;
  OnigRegex& operator=(const OnigRegex&) = delete;

  /// Non-overlapping matches [start, end) left to right, as the Rust onig crate's find_iter.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

  /// Whether the regex matches at the start of `text` (anchored there).
  bool matches_at_start(std::string_view text) const;

 private:
  void* regex_;  // regex_t*, kept opaque so oniguruma.h stays out of the headers.
};

}  // namespace loraplex::tok
