#include "loraplex/engine/logit_adjustments.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace loraplex::engine {

LogitsProcessing::LogitsProcessing(const RequestOptions& o, const std::vector<int32_t>& prompt,
                                   const Tokenizer* tokenizer)
    : presence_(o.presence_penalty),
      frequency_(o.frequency_penalty),
      repetition_(o.repetition_penalty),
      bias_(o.logit_bias.begin(), o.logit_bias.end()),
      allowed_(o.allowed_token_ids) {
  std::sort(allowed_.begin(), allowed_.end());
  allowed_.erase(std::unique(allowed_.begin(), allowed_.end()), allowed_.end());
  if (!o.bad_words.empty() && tokenizer != nullptr) {
    bad_words_ = bad_word_ids(o.bad_words, *tokenizer);
  }
  if (repetition_ != 1.0f) {
    prompt_ids_ = prompt;
    std::sort(prompt_ids_.begin(), prompt_ids_.end());
    prompt_ids_.erase(std::unique(prompt_ids_.begin(), prompt_ids_.end()), prompt_ids_.end());
  }
  active_ = presence_ != 0.0f || frequency_ != 0.0f || repetition_ != 1.0f || !bias_.empty() ||
            !allowed_.empty() || !bad_words_.empty();
}

std::vector<std::vector<int32_t>> LogitsProcessing::bad_word_ids(
    const std::vector<std::string>& words, const Tokenizer& tokenizer) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& word : words) {
    const size_t start = word.find_first_not_of(' ');
    const std::string bare = start == std::string::npos ? std::string() : word.substr(start);
    std::vector<int32_t> plain = tokenizer.encode(bare, false);
    if (plain.empty()) continue;
    const std::vector<int32_t> spaced = tokenizer.encode(" " + bare, false);
    out.push_back(plain);
    // At the start of a text and after a space a word usually tokenizes differently.
    if (!spaced.empty() && spaced.front() != plain.front() && spaced.size() == plain.size()) {
      out.push_back(spaced);
    }
  }
  return out;
}

void LogitsProcessing::step(const std::vector<int32_t>& output,
                            std::vector<model::LogitAdjustment>& adjust, bool& only_listed) const {
  adjust.clear();
  only_listed = !allowed_.empty();
  if (!active_) return;
  std::map<int32_t, model::LogitAdjustment> by_id;
  const auto at = [&](int32_t id) -> model::LogitAdjustment& {
    model::LogitAdjustment& e = by_id[id];
    e.id = id;
    return e;
  };
  for (int32_t id : allowed_) at(id);
  for (const auto& [id, bias] : bias_) at(id).bias += bias;
  if (repetition_ != 1.0f) {
    for (int32_t id : prompt_ids_) at(id).repetition = repetition_;
    for (int32_t id : output) at(id).repetition = repetition_;
  }
  if (presence_ != 0.0f || frequency_ != 0.0f) {
    std::map<int32_t, int64_t> counts;
    for (int32_t id : output) ++counts[id];
    for (const auto& [id, n] : counts) {
      at(id).subtract = frequency_ * static_cast<float>(n) + presence_;
    }
  }
  // A bad word's last token is banned where the output ends with the rest of it.
  const float ban = -std::numeric_limits<float>::infinity();
  for (const std::vector<int32_t>& w : bad_words_) {
    const size_t prefix = w.size() - 1;
    if (prefix > output.size()) continue;
    if (std::equal(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(prefix),
                   output.end() - static_cast<std::ptrdiff_t>(prefix))) {
      at(w.back()).bias = ban;
    }
  }
  adjust.reserve(by_id.size());
  for (const auto& [id, e] : by_id) adjust.push_back(e);
}

}  // namespace loraplex::engine
