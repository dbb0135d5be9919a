#include "loraplex/tokenizer/utf8.h"

namespace loraplex::tok {
namespace {

bool is_cont(unsigned char b) { return (b & 0xC0) == 0x80; }

// Length of the valid prefix of the sequence starting at `pos` (0 when the lead byte itself is
// invalid), and the full length the lead byte announces. Follows Unicode Table 3-7, which is
// what Rust validates against.
struct SeqCheck {
  size_t valid;
  size_t needed;
};

SeqCheck check_sequence(std::string_view s, size_t pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) return {1, 1};
  size_t needed = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    needed = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    needed = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    needed = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {0, 1};
  }
  size_t valid = 1;
  if (pos + 1 >= s.size()) return {valid, needed};
  const auto b1 = static_cast<unsigned char>(s[pos + 1]);
  if (b1 < lo || b1 > hi) return {valid, needed};
  ++valid;
  for (size_t k = 2; k < needed; ++k) {
    if (pos + k >= s.size() || !is_cont(static_cast<unsigned char>(s[pos + k]))) {
      return {valid, needed};
    }
    ++valid;
  }
  return {valid, needed};
}

}  // namespace

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const SeqCheck c = check_sequence(text, pos);
    if (c.valid != c.needed) return pos;
    pos += c.needed;
  }
  return std::nullopt;
}

size_t utf8_char_len(std::string_view text, size_t pos) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80) return 1;
  if (b0 < 0xE0) return 2;
  if (b0 < 0xF0) return 3;
  return 4;
}

char32_t utf8_decode_at(std::string_view text, size_t pos) {
  const size_t len = utf8_char_len(text, pos);
  const auto b0 = static_cast<unsigned char>(text[pos]);
  if (len == 1) return b0;
  char32_t cp = b0 & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(text[pos + k]) & 0x3F);
  }
  return cp;
}

size_t utf8_last_char_start(std::string_view text) {
  size_t pos = text.size() - 1;
  while (pos > 0 && is_cont(static_cast<unsigned char>(text[pos]))) --pos;
  return pos;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const SeqCheck c = check_sequence(bytes, pos);
    if (c.valid == c.needed) {
      out.append(bytes.substr(pos, c.needed));
      pos += c.needed;
    } else {
      // One replacement character per maximal subpart: the lead byte and the continuation
      // bytes that were still acceptable.
      out.append("\xEF\xBF\xBD");
      pos += c.valid == 0 ? 1 : c.valid;
    }
  }
  return out;
}

bool is_unicode_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

const ByteLevelMap& byte_level_map() {
  static const ByteLevelMap map = [] {
    ByteLevelMap m{};
    m.char_to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const char32_t cp = printable ? static_cast<char32_t>(b) : next++;
      m.byte_to_char[b] = cp;
      m.char_to_byte[cp] = static_cast<int16_t>(b);
      utf8_append(m.byte_to_utf8[b], cp);
    }
    return m;
  }();
  return map;
}

}  // namespace loraplex::tok
