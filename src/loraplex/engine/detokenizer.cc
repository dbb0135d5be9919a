#include "loraplex/engine/detokenizer.h"

#include <algorithm>

#include "loraplex/core/error.h"

namespace loraplex::engine {
namespace {

// vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded as context.
constexpr size_t kContextTokens = 5;

bool ends_with_replacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer,
                                               std::span<const int32_t> prompt,
                                               std::vector<std::string> stop,
                                               DetokenizeOptions options)
    : tokenizer_(tokenizer), stop_(std::move(stop)), options_(options) {
  // With the stop string kept in the output, released text never needs taking back.
  if (!options_.include_stop) {
    for (const std::string& s : stop_) hold_ = std::max(hold_, s.empty() ? 0 : s.size() - 1);
  }
  const size_t context = std::min(prompt.size(), kContextTokens);
  ids_.assign(prompt.end() - static_cast<std::ptrdiff_t>(context), prompt.end());
  read_offset_ = ids_.size();
  prefix_text_ = decode(0);
}

// The text of ids_[from, end).
std::string IncrementalDetokenizer::decode(size_t from) const {
  return tokenizer_.decode(
      std::vector<int32_t>(ids_.begin() + static_cast<std::ptrdiff_t>(from), ids_.end()),
      options_.skip_special_tokens);
}

std::optional<std::string> IncrementalDetokenizer::add(int32_t id, bool check_stop) {
  LORAPLEX_CHECK(!stopped_, "detokenizer: token added after a stop string");
  // A model's vocabulary may be padded past the tokenizer's: such ids have no text.
  if (id < 0 || id >= tokenizer_.vocab_size()) return std::nullopt;
  ids_.push_back(id);
  const std::string full = decode(prefix_offset_);
  if (full.size() <= prefix_text_.size() || ends_with_replacement(full)) return std::nullopt;
  // The context's text is normally a prefix of the longer decode; where a decoder rewrote it,
  // only what differs is new.
  size_t common = 0;
  while (common < prefix_text_.size() && full[common] == prefix_text_[common]) ++common;
  while (common > 0 && common < full.size() && is_continuation(full[common])) --common;
  const size_t before = text_.size();
  text_.append(full, common, std::string::npos);
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  prefix_text_ = decode(prefix_offset_);
  if (!check_stop || stop_.empty()) return std::nullopt;

  size_t best = std::string::npos;
  const std::string* match = nullptr;
  for (const std::string& s : stop_) {
    if (s.empty()) continue;
    // Only matches that end in the new text: earlier ones were looked for before. Text already
    // handed out may hold the start of a match only when the match stays in the output.
    const size_t floor = options_.include_stop ? 0 : taken_;
    const size_t from = std::max(floor, before + 1 >= s.size() ? before + 1 - s.size() : 0);
    const size_t pos = text_.find(s, from);
    if (pos != std::string::npos && pos < best) {
      best = pos;
      match = &s;
    }
  }
  if (match == nullptr) return std::nullopt;
  text_.resize(options_.include_stop ? best + match->size() : best);
  stopped_ = true;
  return *match;
}

void IncrementalDetokenizer::flush() {
  if (stopped_ || read_offset_ == ids_.size()) return;
  const std::string full = decode(prefix_offset_);
  size_t common = 0;
  while (common < prefix_text_.size() && common < full.size() &&
         full[common] == prefix_text_[common])
    ++common;
  while (common > 0 && common < full.size() && is_continuation(full[common])) --common;
  if (full.size() > common) text_.append(full, common, std::string::npos);
  prefix_offset_ = read_offset_ = ids_.size();
  prefix_text_.clear();
}

std::string IncrementalDetokenizer::take(bool finished) {
  if (finished) flush();
  size_t end = text_.size();
  if (!finished && !stopped_) end = end > hold_ ? end - hold_ : 0;
  end = std::max(end, taken_);
  while (end > taken_ && end < text_.size() && is_continuation(text_[end])) --end;
  std::string out = text_.substr(taken_, end - taken_);
  taken_ = end;
  return out;
}

}  // namespace loraplex::engine
