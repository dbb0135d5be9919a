#pragma once
// Incremental detokenization of a generated sequence, as vLLM does it: each new token is decoded
// together with a few tokens before it (so that decoders which strip a leading space, or merge
// bytes across tokens, see their context), and text is released only once it no longer ends in
// an incomplete UTF-8 character (decode's U+FFFD). Stop strings may span tokens; a match cuts
// the text before the stop string (after it with include_stop). While streaming, the last
// (longest stop string - 1) bytes are held back, so released text never has to be taken back
// (nothing is, with include_stop: what a match cuts then comes after it).

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::engine {

/// vLLM's SamplingParams fields that shape the text.
struct DetokenizeOptions {
  bool include_stop = false;        // include_stop_str_in_output
  bool skip_special_tokens = true;  // special tokens have no text
};

class IncrementalDetokenizer {
 public:
  /// `tokenizer` must outlive this. The last few ids of `prompt` are the context the first
  /// generated tokens are decoded in.
  IncrementalDetokenizer(const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                         std::vector<std::string> stop, DetokenizeOptions options = {});

  /// Appends a generated token. With `check_stop` (min_tokens reached), looks for the stop
  /// strings in the text that this token completed; on a match the text is cut before it (after
  /// it with include_stop), the matched stop string is returned and no further token may be
  /// added.
  std::optional<std::string> add(int32_t id, bool check_stop);
  /// The text not taken yet. Unless `finished`, keeps back what could still turn out to be the
  /// start of a stop string; when finished, also releases a trailing incomplete character.
  std::string take(bool finished);
  /// All the output text so far (after any stop cut).
  const std::string& text() const { return text_; }
  bool stopped() const { return stopped_; }

 private:
  void flush();

  std::string decode(size_t from) const;

  const Tokenizer& tokenizer_;
  std::vector<std::string> stop_;
  DetokenizeOptions options_;
  size_t hold_ = 0;           // bytes kept back while streaming
  std::vector<int32_t> ids_;  // context ids, then generated ids
  size_t prefix_offset_ = 0;  // ids_[prefix_offset_, read_offset_) decode to prefix_text_
  size_t read_offset_ = 0;    // ids before this one are in text_
  std::string prefix_text_;
  std::string text_;
  size_t taken_ = 0;  // bytes of text_ handed out
  bool stopped_ = false;
};

}  // namespace loraplex::engine
