#include "loraplex/tokenizer/pre_tokenizers.h"

#include <algorithm>
#include <utility>

#include "loraplex/tokenizer/pattern.h"
#include "loraplex/tokenizer/utf8.h"

namespace loraplex::tok {
namespace {

constexpr const char* kSupported = "ByteLevel, Split, Digits, Metaspace, Sequence";

// GPT-2's pattern, which ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

SplitBehavior parse_behavior(const JsonNode& node) {
  const std::string b = node.as_string();
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  node.fail("\"", b,
            "\" is not a split behavior; expected Removed, Isolated, MergedWithPrevious, "
            "MergedWithNext or Contiguous");
}

struct Span {
  size_t start;
  size_t end;
  bool is_match;  // for kRemoved after the fold: whether to drop the span
};

// HF's Pattern::find_matches: spans covering `length` bytes, each flagged as match or not.
std::vector<Span> cover(size_t length, const std::vector<std::pair<size_t, size_t>>& matches,
                        bool invert) {
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [start, end] : matches) {
    if (prev != start) spans.push_back({prev, start, invert});
    spans.push_back({start, end, !invert});
    prev = end;
  }
  if (prev != length) spans.push_back({prev, length, invert});
  return spans;
}

// HF's NormalizedString::split: folds the spans according to `behavior` into the ranges kept.
std::vector<std::pair<size_t, size_t>> split_ranges(const std::vector<Span>& spans,
                                                    SplitBehavior behavior) {
  std::vector<std::pair<size_t, size_t>> out;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Span& s : spans) {
        if (!s.is_match) out.emplace_back(s.start, s.end);
      }
      break;
    case SplitBehavior::kIsolated:
      for (const Span& s : spans) out.emplace_back(s.start, s.end);
      break;
    case SplitBehavior::kContiguous:
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.start, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.start, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty()) {
          out.back().first = it->start;
        } else {
          out.emplace_back(it->start, it->end);
        }
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  return out;
}

// Replaces every text piece by the non-empty sub-ranges `ranges_of(piece)` returns.
template <typename F>
void split_pieces(std::vector<Piece>& pieces, F&& ranges_of) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.added_id >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    for (const auto& [start, end] : ranges_of(piece)) {
      if (end <= start) continue;
      out.push_back(
          Piece{piece.text.substr(start, end - start), -1, piece.at_origin && start == 0});
    }
  }
  pieces = std::move(out);
}

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const Piece& p) {
      return split_ranges(cover(p.text.size(), pattern_.find_all(p.text), invert_), behavior_);
    });
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class DigitsPreTokenizer final : public PreTokenizer {
 public:
  DigitsPreTokenizer(const JsonNode& node, bool individual)
      // Rust's char::is_numeric is the general category N.
      : numeric_(R"(\p{N})", node.origin() + ": " + node.path()), individual_(individual) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    const SplitBehavior behavior =
        individual_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
    split_pieces(pieces, [&](const Piece& p) {
      return split_ranges(cover(p.text.size(), numeric_.find_all(p.text), false), behavior);
    });
  }

 private:
  OnigRegex numeric_;
  bool individual_;
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(const JsonNode& node, bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) {
      regex_ = std::make_unique<OnigRegex>(kGpt2Pattern, node.origin() + ": " + node.path());
    }
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    if (add_prefix_space_) {
      for (Piece& p : pieces) {
        if (p.added_id < 0 && !p.text.empty() && p.text[0] != ' ')
          p.text.insert(p.text.begin(), ' ');
      }
    }
    if (regex_) {
      split_pieces(pieces, [&](const Piece& p) {
        return split_ranges(cover(p.text.size(), regex_->find_all(p.text), false),
                            SplitBehavior::kIsolated);
      });
    }
    const ByteLevelMap& map = byte_level_map();
    for (Piece& p : pieces) {
      if (p.added_id >= 0) continue;
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (const char c : p.text) mapped += map.byte_to_utf8[static_cast<unsigned char>(c)];
      p.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<OnigRegex> regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split), space_(" ") {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    const Pattern replacement_pattern(replacement_);
    for (Piece& p : pieces) {
      if (p.added_id >= 0) continue;
      p.text = space_.replace_all(p.text, replacement_);
      const bool starts = p.text.starts_with(replacement_);
      if (!starts && (scheme_ == PrependScheme::kAlways ||
                      (scheme_ == PrependScheme::kFirst && p.at_origin))) {
        p.text.insert(0, replacement_);
      }
    }
    if (split_) {
      split_pieces(pieces, [&](const Piece& p) {
        return split_ranges(cover(p.text.size(), replacement_pattern.find_all(p.text), false),
                            SplitBehavior::kMergedWithNext);
      });
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
  Pattern space_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& part : parts_) part->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

PrependScheme parse_prepend_scheme(const JsonNode& node) {
  if (!node.has("prepend_scheme")) {
    // Files written before prepend_scheme existed carry add_prefix_space instead.
    return node.bool_or("add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
  }
  const JsonNode scheme = node.at("prepend_scheme");
  const std::string s = scheme.as_string();
  if (s == "always") return PrependScheme::kAlways;
  if (s == "first") return PrependScheme::kFirst;
  if (s == "never") return PrependScheme::kNever;
  scheme.fail("\"", s, "\" is not a prepend scheme; expected always, first or never");
}

std::string single_char(const JsonNode& node) {
  const std::string s = node.as_string();
  if (s.empty() || find_invalid_utf8(s) || utf8_char_len(s, 0) != s.size()) {
    node.fail("must be a single character, got \"", s, "\"");
  }
  return s;
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  const std::string type = node.type();
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(node, node.bool_or("add_prefix_space", true),
                                                   node.bool_or("use_regex", true));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(Pattern::from_json(node.at("pattern")),
                                               parse_behavior(node.at("behavior")),
                                               node.bool_or("invert", false));
  }
  if (type == "Digits") {
    return std::make_unique<DigitsPreTokenizer>(node, node.bool_or("individual_digits", false));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspacePreTokenizer>(single_char(node.at("replacement")),
                                                   parse_prepend_scheme(node),
                                                   node.bool_or("split", true));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (const JsonNode& child : node.at("pretokenizers").elements()) {
      auto part = make_pre_tokenizer(child);
      if (part) parts.push_back(std::move(part));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  node.unsupported_type(kSupported);
}

}  // namespace loraplex::tok
