#include "loraplex/tokenizer/decoders.h"

#include <utility>

#include "loraplex/tokenizer/pattern.h"
#include "loraplex/tokenizer/utf8.h"

namespace loraplex::tok {
namespace {

constexpr const char* kSupported =
    "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence";

constexpr const char* kReplacementChar = "\xEF\xBF\xBD";

// Maps each token's characters back to bytes and decodes all of them as one lossy UTF-8 string.
class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    const ByteLevelMap& map = byte_level_map();
    std::string bytes;
    std::string token_bytes;
    for (const std::string& token : tokens) {
      token_bytes.clear();
      bool mapped = true;
      for (size_t pos = 0; pos < token.size(); pos += utf8_char_len(token, pos)) {
        const char32_t cp = utf8_decode_at(token, pos);
        if (cp >= map.char_to_byte.size() || map.char_to_byte[cp] < 0) {
          mapped = false;
          break;
        }
        token_bytes.push_back(static_cast<char>(map.char_to_byte[cp]));
      }
      // A token with characters outside the map (an added token, say) is taken verbatim.
      bytes += mapped ? token_bytes : token;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) t = pattern_.replace_all(t, content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

// Runs of <0xXX> tokens become the UTF-8 text they spell, or one U+FFFD per byte when they
// do not spell valid UTF-8.
class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending;
    const auto flush = [&] {
      if (pending.empty()) return;
      if (!find_invalid_utf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending.size(); ++i) out.emplace_back(kReplacementChar);
      }
      pending.clear();
    };
    for (std::string& t : tokens) {
      int byte = -1;
      if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>') byte = parse_hex_byte(t);
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }

 private:
  // Rust's u8::from_str_radix(s, 16) on the two characters after "<0x": either case, and a
  // leading '+' is accepted (the one sign Rust allows for unsigned types).
  static int parse_hex_byte(const std::string& t) {
    const auto digit = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = digit(t[3]);
    const int lo = digit(t[4]);
    if (t[3] == '+' && lo >= 0) return lo;
    if (hi < 0 || lo < 0) return -1;
    return hi * 16 + lo;
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& t : tokens) joined += t;
    tokens.assign(1, std::move(joined));
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, size_t start, size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) t = strip(t);
  }

 private:
  std::string strip(const std::string& token) const {
    std::vector<size_t> starts;  // byte offset of each character, plus the end
    for (size_t pos = 0; pos < token.size(); pos += utf8_char_len(token, pos))
      starts.push_back(pos);
    const size_t n = starts.size();
    starts.push_back(token.size());
    const auto is_content = [&](size_t i) {
      return std::string_view(token).substr(starts[i], starts[i + 1] - starts[i]) == content_;
    };
    size_t start_cut = 0;
    while (start_cut < start_ && start_cut < n && is_content(start_cut)) ++start_cut;
    // The end cut never reaches into the start cut. HF 0.23 panics in that case (a token of
    // fewer than `stop` content characters); this is the bounded form of its later fix.
    size_t stop_cut = n;
    while (n - stop_cut < stop_ && stop_cut > start_cut && is_content(stop_cut - 1)) --stop_cut;
    return token.substr(starts[start_cut], starts[stop_cut] - starts[start_cut]);
  }

  std::string content_;
  size_t start_;
  size_t stop_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    const Pattern pattern(replacement_);
    for (size_t i = 0; i < tokens.size(); ++i) {
      // In the first token every replacement character is dropped, not only a leading one.
      tokens[i] = pattern.replace_all(tokens[i], i == 0 && strip_first_ ? "" : " ");
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& part : parts_) part->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

size_t non_negative(const JsonNode& node) {
  const int64_t v = node.as_int();
  if (v < 0) node.fail("must be >= 0, got ", v);
  return static_cast<size_t>(v);
}

}  // namespace

std::unique_ptr<Decoder> make_decoder(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  const std::string type = node.type();
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(Pattern::from_json(node.at("pattern")),
                                            node.at("content").as_string());
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    const JsonNode content = node.at("content");
    const std::string c = content.as_string();
    if (c.empty() || find_invalid_utf8(c) || utf8_char_len(c, 0) != c.size()) {
      content.fail("must be a single character, got \"", c, "\"");
    }
    return std::make_unique<StripDecoder>(c, non_negative(node.at("start")),
                                          non_negative(node.at("stop")));
  }
  if (type == "Metaspace") {
    const JsonNode replacement = node.at("replacement");
    const std::string r = replacement.as_string();
    if (r.empty() || find_invalid_utf8(r) || utf8_char_len(r, 0) != r.size()) {
      replacement.fail("must be a single character, got \"", r, "\"");
    }
    bool strip_first;
    if (node.has("prepend_scheme")) {
      const JsonNode scheme = node.at("prepend_scheme");
      const std::string s = scheme.as_string();
      if (s != "always" && s != "first" && s != "never") {
        scheme.fail("\"", s, "\" is not a prepend scheme; expected always, first or never");
      }
      strip_first = s != "never";
    } else {
      strip_first = node.bool_or("add_prefix_space", true);
    }
    return std::make_unique<MetaspaceDecoder>(r, strip_first);
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> parts;
    for (const JsonNode& child : node.at("decoders").elements()) {
      auto part = make_decoder(child);
      if (part) parts.push_back(std::move(part));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  node.unsupported_type(kSupported);
}

}  // namespace loraplex::tok
