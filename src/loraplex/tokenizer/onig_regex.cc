#include "loraplex/tokenizer/onig_regex.h"

#include <oniguruma.h>

#include <mutex>
#include <optional>

#include "loraplex/core/error.h"
#include "loraplex/tokenizer/utf8.h"

namespace loraplex::tok {
namespace {

// Oniguruma requires that regex objects are not created or freed by several threads at once
// (doc/API, "thread safe"); searching a compiled regex concurrently is fine.
std::mutex& onig_lifecycle_mutex() {
  static std::mutex mutex;
  return mutex;
}

void init_oniguruma() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
}

const OnigUChar* uchars(std::string_view s) { return reinterpret_cast<const OnigUChar*>(s.data()); }

// Frees the region however a search ends.
struct Region {
  OnigRegion* r = onig_region_new();
  ~Region() { onig_region_free(r, 1); }
};

}  // namespace

OnigRegex::OnigRegex(const std::string& pattern, const std::string& context) : regex_(nullptr) {
  init_oniguruma();
  regex_t* reg = nullptr;
  OnigErrorInfo info;
  std::unique_lock lock(onig_lifecycle_mutex());
  const int rc = onig_new(&reg, uchars(pattern), uchars(pattern) + pattern.size(), ONIG_OPTION_NONE,
                          ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &info);
  lock.unlock();
  if (rc != ONIG_NORMAL) {
    OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(message, rc, &info);
    LORAPLEX_FAIL(context, " regex /", pattern,
                  "/ does not compile: ", reinterpret_cast<const char*>(message));
  }
  regex_ = reg;
}

OnigRegex::~OnigRegex() {
  std::lock_guard lock(onig_lifecycle_mutex());
  onig_free(static_cast<regex_t*>(regex_));
}

std::vector<std::pair<size_t, size_t>> OnigRegex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  auto* reg = static_cast<regex_t*>(regex_);
  Region region;
  const OnigUChar* begin = uchars(text);
  const OnigUChar* end = begin + text.size();
  // The Rust onig crate's FindMatches: an empty match right where the previous match ended is
  // skipped by stepping one character ahead.
  size_t last_end = 0;
  std::optional<size_t> last_match_end;
  while (last_end <= text.size()) {
    onig_region_clear(region.r);
    const int found =
        onig_search(reg, begin, end, begin + last_end, end, region.r, ONIG_OPTION_NONE);
    if (found == ONIG_MISMATCH) break;
    LORAPLEX_CHECK(found >= 0, "oniguruma search failed with code ", found);
    const auto start = static_cast<size_t>(region.r->beg[0]);
    const auto stop = static_cast<size_t>(region.r->end[0]);
    if (start == stop && last_match_end == stop) {
      last_end += last_end < text.size() ? utf8_char_len(text, last_end) : 1;
      continue;
    }
    last_end = stop;
    last_match_end = stop;
    matches.emplace_back(start, stop);
  }
  return matches;
}

bool OnigRegex::matches_at_start(std::string_view text) const {
  const OnigUChar* begin = uchars(text);
  const int len = onig_match(static_cast<regex_t*>(regex_), begin, begin + text.size(), begin,
                             nullptr, ONIG_OPTION_NONE);
  return len >= 0;
}

}  // namespace loraplex::tok
