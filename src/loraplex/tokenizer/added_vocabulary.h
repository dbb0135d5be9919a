#pragma once
// tokenizer.json "added_tokens": ids assigned as Hugging Face does on load, and the splitting of
// the input on them (leftmost-longest, with single_word / lstrip / rstrip) before the model runs.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "loraplex/tokenizer/bpe_model.h"
#include "loraplex/tokenizer/json_node.h"
#include "loraplex/tokenizer/normalizers.h"
#include "loraplex/tokenizer/onig_regex.h"
#include "loraplex/tokenizer/pre_tokenizers.h"

namespace loraplex::tok {

struct AddedToken {
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;

  bool operator==(const AddedToken&) const = default;
};

class AddedVocabulary {
 public:
  /// Reads the "added_tokens" array; `normalizer` (may be null) is applied to the contents of
  /// normalized tokens, which are matched against normalized text.
  AddedVocabulary(const JsonNode& node, const BpeModel& model, const Normalizer* normalizer);

  /// Splits the text pieces on tokens matched in the raw (non-normalized) input.
  void split_raw(std::vector<Piece>& pieces) const { split(pieces, raw_trie_); }
  /// Splits the text pieces (already normalized) on normalized tokens.
  void split_normalized(std::vector<Piece>& pieces) const { split(pieces, normalized_trie_); }

  std::optional<int32_t> token_to_id(std::string_view content) const;
  /// The string decoding starts from for added token `id` (its content, or for a normalized
  /// token its normalized content), or nullptr when `id` is no added token.
  const std::string* id_to_token(int32_t id) const;
  /// Whether `token` is the content of a special token. Decoding tests the string id_to_token
  /// returned, as HF does: a normalized special token whose normalized form differs is kept.
  bool is_special(std::string_view token) const { return special_set_.contains(token); }
  /// Largest added id, -1 when there are none.
  int32_t max_id() const { return max_id_; }

 private:
  // A byte trie over token contents for leftmost-longest matching.
  struct Trie {
    struct Node {
      std::unordered_map<unsigned char, int32_t> children;
      int32_t id = -1;  // token id when a content ends here
    };
    std::vector<Node> nodes{Node{}};
    void insert(std::string_view content, int32_t id);
    /// Length of the longest content starting at text[pos] and its id; length 0 when none.
    std::pair<size_t, int32_t> longest_at(std::string_view text, size_t pos) const;
  };

  struct Match {
    int32_t id;
    size_t start;
    size_t end;
  };
  std::vector<Match> find_matches(std::string_view text, const Trie& trie) const;
  void split(std::vector<Piece>& pieces, const Trie& trie) const;
  bool is_word_char_at(std::string_view text, size_t pos) const;

  const BpeModel& model_;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id_;
  std::unordered_map<int32_t, AddedToken> id_to_token_;
  std::unordered_map<int32_t, std::string> decode_form_;
  std::unordered_set<std::string, StringHash, std::equal_to<>> special_set_;
  Trie raw_trie_;
  Trie normalized_trie_;
  int32_t max_id_ = -1;
  // Rust regex's Unicode \w, which HF's single_word check uses.
  std::unique_ptr<OnigRegex> word_char_;
};

}  // namespace loraplex::tok
