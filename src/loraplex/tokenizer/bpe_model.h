#pragma once
// tokenizer.json "model" of type BPE: vocabulary, ranked merges, byte fallback and unknown-token
// handling, with the merge order of Hugging Face's Word::merge_all.

#include <cstdint>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loraplex/tokenizer/json_node.h"

namespace loraplex::tok {

/// Hash for heterogeneous lookup of std::string keys by std::string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  explicit BpeModel(const JsonNode& node);
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  /// Appends the ids of `word` (one pre-tokenized piece) to `out`. Thread-safe.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  /// The token of `id`, or nullptr when the vocabulary has no such id.
  const std::string* id_to_token(int32_t id) const;
  /// Number of vocabulary entries (what HF calls the model's vocab size).
  size_t vocab_entries() const { return vocab_.size(); }
  /// Largest id in the vocabulary, -1 when empty.
  int32_t max_id() const { return max_id_; }

 private:
  std::vector<int32_t> merge_word(std::string_view word) const;

  TokenMap vocab_;
  std::unordered_map<int32_t, std::string> vocab_r_;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::optional<std::string> unk_token_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t max_id_ = -1;

  // Per-word cache as in HF: only short words, and it stops growing once full.
  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace loraplex::tok
