#include "loraplex/tokenizer/pattern.h"

namespace loraplex::tok {

Pattern::Pattern(std::string literal) : literal_(std::move(literal)) {}

Pattern Pattern::from_json(const JsonNode& node) {
  Pattern p;
  if (node.has("String")) {
    p.literal_ = node.at("String").as_string();
    if (p.literal_.empty()) node.at("String").fail("must not be empty");
  } else if (node.has("Regex")) {
    const JsonNode re = node.at("Regex");
    p.regex_ = std::make_shared<const OnigRegex>(re.as_string(), re.origin() + ": " + re.path());
  } else {
    node.fail("must be {\"String\": ...} or {\"Regex\": ...}");
  }
  return p;
}

std::vector<std::pair<size_t, size_t>> Pattern::find_all(std::string_view text) const {
  if (regex_) return regex_->find_all(text);
  std::vector<std::pair<size_t, size_t>> out;
  size_t pos = 0;
  while ((pos = text.find(literal_, pos)) != std::string_view::npos) {
    out.emplace_back(pos, pos + literal_.size());
    pos += literal_.size();
  }
  return out;
}

std::string Pattern::replace_all(std::string_view text, std::string_view content) const {
  std::string out;
  size_t prev = 0;
  for (const auto& [start, end] : find_all(text)) {
    out.append(text.substr(prev, start - prev));
    out.append(content);
    prev = end;
  }
  out.append(text.substr(prev));
  return out;
}

}  // namespace loraplex::tok
