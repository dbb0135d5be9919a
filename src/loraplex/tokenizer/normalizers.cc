#include "loraplex/tokenizer/normalizers.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>

#include <vector>

#include "loraplex/tokenizer/pattern.h"

namespace loraplex::tok {
namespace {

constexpr const char* kSupported = "Prepend, Replace, NFC, NFKC, Sequence";

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string& text) const override { text = pattern_.replace_all(text, content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

// Unicode normalization forms through ICU, which implements them fully (composition
// exclusions, Hangul, canonical ordering).
class UnicodeNormalizer final : public Normalizer {
 public:
  UnicodeNormalizer(const JsonNode& node, bool compatibility) {
    UErrorCode status = U_ZERO_ERROR;
    normalizer_ = compatibility ? icu::Normalizer2::getNFKCInstance(status)
                                : icu::Normalizer2::getNFCInstance(status);
    if (U_FAILURE(status)) node.fail("could not be set up with ICU: ", u_errorName(status));
  }
  void normalize(std::string& text) const override {
    std::string out;
    icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(text.size()));
    UErrorCode status = U_ZERO_ERROR;
    normalizer_->normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())),
                               sink, nullptr, status);
    LORAPLEX_CHECK(U_SUCCESS(status), "Unicode normalization failed: ", u_errorName(status));
    text = std::move(out);
  }

 private:
  const icu::Normalizer2* normalizer_ = nullptr;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void normalize(std::string& text) const override {
    for (const auto& part : parts_) part->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  const std::string type = node.type();
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(node.at("prepend").as_string());
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(Pattern::from_json(node.at("pattern")),
                                               node.at("content").as_string());
  }
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(node, false);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(node, true);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const JsonNode& child : node.at("normalizers").elements()) {
      auto part = make_normalizer(child);
      if (part) parts.push_back(std::move(part));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  node.unsupported_type(kSupported);
}

}  // namespace loraplex::tok
