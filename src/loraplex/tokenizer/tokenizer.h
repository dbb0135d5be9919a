#pragma once
// A Hugging Face tokenizer.json reader that encodes and decodes exactly like the `tokenizers`
// library for byte-level BPE (GPT-2, Llama 3, Qwen2) and SentencePiece-style BPE with byte
// fallback (Llama 2, Mistral). Components it does not implement are refused at load time with an
// Error naming the JSON path and the type, never silently approximated.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loraplex {

/// An immutable tokenizer; encode/decode are thread-safe.
class Tokenizer {
 public:
  /// Loads a tokenizer.json file; throws loraplex::Error naming the file on any problem.
  static Tokenizer from_file(const std::string& path);
  /// Parses tokenizer.json text; `origin` names it in error messages.
  static Tokenizer from_json(const std::string& json_text, const std::string& origin = "<memory>");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// Token ids of `text` (UTF-8; invalid UTF-8 throws), with the post-processor's special tokens
  /// (BOS, ...) when `add_special_tokens`.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  /// Text of `ids` [n] in; ids outside [0, vocab_size()) throw. Bytes that do not form valid
  /// UTF-8 decode to U+FFFD as in Hugging Face.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = true) const;

  /// Number of ids including added tokens: the largest id + 1.
  int32_t vocab_size() const;
  /// The id of `token` (an added token or a model vocabulary entry).
  std::optional<int32_t> token_to_id(std::string_view token) const;
  /// Whether `id` is a special token (removed by decode with skip_special_tokens).
  bool is_special(int32_t id) const;
  /// The vocabulary as tokenizer.json writes it: entry `id` is the token string of that id
  /// (added tokens included; "" where no token has the id), before the decoder maps it to text.
  std::vector<std::string> vocabulary() const;
  /// tokenizer.json's "decoder", "normalizer" and "pre_tokenizer" as one JSON object: how the
  /// vocabulary's strings map to bytes, what a grammar library needs to read vocabulary().
  const std::string& vocabulary_encoding_json() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace loraplex
