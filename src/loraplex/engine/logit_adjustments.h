#pragma once
// vLLM's logits processing beyond temperature, top-k and top-p, as each step's adjustments of a
// sequence's logits (model::LogitAdjustment): logit_bias, allowed_token_ids, bad_words and the
// presence, frequency and repetition penalties. Built once per request (bad words tokenized as
// vLLM tokenizes them) and turned into a sparse list per step from the tokens so far.

#include <cstdint>
#include <string>
#include <vector>

#include "loraplex/engine/engine.h"
#include "loraplex/model/step_batch.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::engine {

class LogitsProcessing {
 public:
  LogitsProcessing() = default;
  /// From the request's options; `tokenizer` (may be null when there are no bad words) gives
  /// the bad words' token sequences.
  LogitsProcessing(const RequestOptions& options, const std::vector<int32_t>& prompt,
                   const Tokenizer* tokenizer);

  /// False when the request asked for none of it (its steps need no adjustment).
  bool active() const { return active_; }
  /// Whether a step's adjustments depend on the tokens generated so far (penalties, bad words):
  /// then the next step is planned only once the last token is known on the host.
  bool reads_output() const {
    return presence_ != 0.0f || frequency_ != 0.0f || repetition_ != 1.0f || !bad_words_.empty();
  }

  /// This step's adjustments for a sequence whose generated tokens are `output`: each id at
  /// most once, sorted by id; `only_listed` when unlisted ids must become -inf.
  void step(const std::vector<int32_t>& output, std::vector<model::LogitAdjustment>& adjust,
            bool& only_listed) const;

  /// vLLM's tokenization of bad words: each word with its leading spaces stripped, and again
  /// after one space when that gives another first token and as many tokens.
  static std::vector<std::vector<int32_t>> bad_word_ids(const std::vector<std::string>& words,
                                                        const Tokenizer& tokenizer);

 private:
  bool active_ = false;
  float presence_ = 0.0f;
  float frequency_ = 0.0f;
  float repetition_ = 1.0f;
  std::vector<std::pair<int32_t, float>> bias_;  // sorted by id
  std::vector<int32_t> allowed_;                 // sorted; empty: every id
  std::vector<std::vector<int32_t>> bad_words_;
  std::vector<int32_t> prompt_ids_;  // sorted, unique (the repetition penalty counts them)
};

}  // namespace loraplex::engine
