#pragma once
// UTF-8 helpers with the exact semantics of Rust's str/char functions that Hugging Face
// tokenizers relies on (from_utf8_lossy, char::is_whitespace), plus GPT-2's byte-to-unicode map.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace loraplex::tok {

/// Byte offset of the first invalid UTF-8 sequence in `text`, or nullopt when it is valid.
std::optional<size_t> find_invalid_utf8(std::string_view text);

/// Length in bytes of the character starting at `text[pos]`; `text` must be valid UTF-8.
size_t utf8_char_len(std::string_view text, size_t pos);

/// Decodes the character starting at `text[pos]`; `text` must be valid UTF-8.
char32_t utf8_decode_at(std::string_view text, size_t pos);

/// Start offset of the last character of non-empty valid UTF-8 `text`.
size_t utf8_last_char_start(std::string_view text);

void utf8_append(std::string& out, char32_t cp);

/// Replaces every maximal ill-formed subsequence by U+FFFD, as Rust's String::from_utf8_lossy.
std::string utf8_lossy(std::string_view bytes);

/// Unicode White_Space, which is what Rust's char::is_whitespace and regex `\s` test.
bool is_unicode_whitespace(char32_t cp);

/// GPT-2's reversible byte <-> printable code point map used by ByteLevel components.
struct ByteLevelMap {
  std::array<char32_t, 256> byte_to_char;
  /// Code point -> byte, or -1; covers code points below 512 (all of byte_to_char's range).
  std::array<int16_t, 512> char_to_byte;
  /// UTF-8 encoding of byte_to_char for each byte.
  std::array<std::string, 256> byte_to_utf8;
};
const ByteLevelMap& byte_level_map();

}  // namespace loraplex::tok
