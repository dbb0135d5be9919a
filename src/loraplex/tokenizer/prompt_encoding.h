// How a text prompt becomes token ids: the one place the engine, the OpenAI server (completion
// and rendered chat prompts) and `loraplex generate` encode prompts, so that special tokens,
// left truncation and the errors are the same for all of them. Header-only over an encode
// function, so that the server's protocol layer (which sees a backend, not a Tokenizer) uses
// the same rules without linking the tokenizer.

#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loraplex/core/error.h"

namespace loraplex::tokenizer {

struct PromptEncoding {
  bool add_special_tokens = true;  // the post-processor's BOS and the like
  /// Keep only the last k tokens (vLLM's truncate_prompt_tokens; -1: max_model_len), the special
  /// tokens that add_special_tokens put in front kept there. nullopt: no truncation.
  std::optional<int64_t> truncate_to;
  int64_t max_model_len = 0;  // what truncate_to == -1 means
};

/// Drops tokens from position `keep` on so that at most k remain (k < 0: max_model_len), the
/// first `keep` (at most k) kept in front: left truncation after a fixed prefix.
inline void truncate_prompt_left(std::vector<int32_t>& ids, size_t keep, int64_t k,
                                 int64_t max_model_len) {
  const size_t limit = static_cast<size_t>(k < 0 ? max_model_len : k);
  if (ids.size() <= limit) return;
  keep = std::min(keep, limit);
  ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(keep),
            ids.end() - static_cast<std::ptrdiff_t>(limit - keep));
}

/// The ids of `text` by encode(text, add_special_tokens) (a Tokenizer's encode or a backend's).
/// Throws loraplex::Error saying "cannot tokenize the prompt: ..." (invalid UTF-8, ...) or "the
/// prompt encodes to no tokens"; callers add where the prompt came from.
template <typename Encode>
std::vector<int32_t> encode_prompt(const Encode& encode, std::string_view text,
                                   const PromptEncoding& how) {
  std::vector<int32_t> ids;
  size_t special = 0;  // tokens the post-processor put in front
  try {
    ids = encode(text, how.add_special_tokens);
    if (how.truncate_to && how.add_special_tokens) {
      const std::vector<int32_t> plain = encode(text, false);
      if (plain.size() < ids.size() && std::equal(plain.rbegin(), plain.rend(), ids.rbegin())) {
        special = ids.size() - plain.size();
      }
    }
  } catch (const Error& e) {
    throw Error(std::string("cannot tokenize the prompt: ") + e.what());
  }
  if (how.truncate_to) truncate_prompt_left(ids, special, *how.truncate_to, how.max_model_len);
  if (ids.empty()) throw Error("the prompt encodes to no tokens");
  return ids;
}

}  // namespace loraplex::tokenizer
