#include "loraplex/template/text_util.h"

#include <algorithm>
#include <cctype>

namespace loraplex::jinja {
namespace {

// Decodes the code point at s[i] (length in *len); invalid bytes decode as themselves.
uint32_t decode_at(std::string_view s, size_t i, size_t* len) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    *len = 1;
    return b;
  }
  uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < n; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if ((c & 0xC0) != 0x80) {
      *len = 1;
      return b;
    }
    cp = (cp << 6) | (c & 0x3F);
  }
  *len = n;
  return cp;
}

std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = 0;
    out.push_back(decode_at(s, i, &n));
    i += n;
  }
  return out;
}

}  // namespace

std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> out;
  for (size_t i = 0; i < s.size();) {
    out.push_back(i);
    size_t n = 0;
    decode_at(s, i, &n);
    i += n;
  }
  out.push_back(s.size());
  return out;
}

size_t code_point_count(std::string_view s) { return code_point_offsets(s).size() - 1; }

bool is_python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string python_strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                         bool right) {
  const std::vector<size_t> off = code_point_offsets(s);
  const std::vector<uint32_t> strip_set = chars ? code_points(*chars) : std::vector<uint32_t>{};
  auto strips = [&](size_t k) {
    size_t n = 0;
    const uint32_t cp = decode_at(s, off[k], &n);
    if (!chars) return is_python_space(cp);
    return std::find(strip_set.begin(), strip_set.end(), cp) != strip_set.end();
  };
  size_t begin = 0, end = off.size() - 1;
  if (left)
    while (begin < end && strips(begin)) ++begin;
  if (right)
    while (end > begin && strips(end - 1)) --end;
  return std::string(s.substr(off[begin], off[end] - off[begin]));
}

std::vector<std::string> python_split(std::string_view s, const std::optional<std::string>& sep,
                                      int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      const size_t at = s.find(*sep, pos);
      if (at == std::string_view::npos) break;
      out.emplace_back(s.substr(pos, at - pos));
      pos = at + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  const std::vector<size_t> off = code_point_offsets(s);
  auto space = [&](size_t k) {
    size_t n = 0;
    return is_python_space(decode_at(s, off[k], &n));
  };
  const size_t count = off.size() - 1;
  size_t k = 0;
  while (k < count) {
    while (k < count && space(k)) ++k;
    if (k == count) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      // The rest, with trailing whitespace stripped, is the last piece.
      size_t end = count;
      while (end > k && space(end - 1)) --end;
      out.emplace_back(s.substr(off[k], off[end] - off[k]));
      return out;
    }
    const size_t start = k;
    while (k < count && !space(k)) ++k;
    out.emplace_back(s.substr(off[start], off[k] - off[start]));
  }
  return out;
}

std::string ascii_upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string ascii_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string ascii_title(std::string_view s) {
  std::string out(s);
  bool in_word = false;
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalpha(u)) {
      c = static_cast<char>(in_word ? std::tolower(u) : std::toupper(u));
      in_word = true;
    } else {
      in_word = u >= 0x80 && in_word;
    }
  }
  return out;
}

}  // namespace loraplex::jinja
