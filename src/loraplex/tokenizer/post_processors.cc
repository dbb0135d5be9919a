#include "loraplex/tokenizer/post_processors.h"

#include <unordered_map>
#include <utility>

namespace loraplex::tok {
namespace {

constexpr const char* kSupported = "TemplateProcessing, ByteLevel, Sequence";

class ByteLevelPostProcessor final : public PostProcessor {
 public:
  // Only offsets change under ByteLevel post-processing; ids pass through.
  void process(std::vector<int32_t>&, bool) const override {}
};

class TemplatePostProcessor final : public PostProcessor {
 public:
  explicit TemplatePostProcessor(const JsonNode& node) {
    std::unordered_map<std::string, std::vector<int32_t>> special_ids;
    const JsonNode specials = node.at("special_tokens");
    if (!specials.value().is_object()) specials.fail("must be an object");
    for (const auto& [name, unused] : specials.value().items()) {
      const JsonNode entry = specials.at(name);
      std::vector<int32_t> ids;
      for (const JsonNode& id : entry.at("ids").elements()) {
        const int64_t v = id.as_int();
        if (v < 0 || v > INT32_MAX) id.fail("must be a token id, got ", v);
        ids.push_back(static_cast<int32_t>(v));
      }
      special_ids.emplace(name, std::move(ids));
    }
    for (const JsonNode& piece : node.at("single").elements()) {
      if (piece.has("SpecialToken")) {
        const JsonNode id = piece.at("SpecialToken").at("id");
        const auto it = special_ids.find(id.as_string());
        if (it == special_ids.end()) {
          id.fail("\"", id.as_string(), "\" is not listed in special_tokens");
        }
        items_.push_back({false, it->second});
      } else if (piece.has("Sequence")) {
        const JsonNode id = piece.at("Sequence").at("id");
        if (id.as_string() != "A") {
          id.fail("must be \"A\" in the single-sequence template, got \"", id.as_string(), "\"");
        }
        items_.push_back({true, {}});
      } else {
        piece.fail("must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
      }
    }
  }

  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    std::vector<int32_t> out;
    for (const Item& item : items_) {
      if (item.is_sequence) {
        out.insert(out.end(), ids.begin(), ids.end());
      } else {
        out.insert(out.end(), item.ids.begin(), item.ids.end());
      }
    }
    ids = std::move(out);
  }

 private:
  struct Item {
    bool is_sequence;
    std::vector<int32_t> ids;
  };
  std::vector<Item> items_;
};

class SequencePostProcessor final : public PostProcessor {
 public:
  explicit SequencePostProcessor(std::vector<std::unique_ptr<PostProcessor>> parts)
      : parts_(std::move(parts)) {}
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    for (const auto& part : parts_) part->process(ids, add_special_tokens);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

}  // namespace

std::unique_ptr<PostProcessor> make_post_processor(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  const std::string type = node.type();
  if (type == "ByteLevel") return std::make_unique<ByteLevelPostProcessor>();
  if (type == "TemplateProcessing") return std::make_unique<TemplatePostProcessor>(node);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> parts;
    for (const JsonNode& child : node.at("processors").elements()) {
      auto part = make_post_processor(child);
      if (part) parts.push_back(std::move(part));
    }
    return std::make_unique<SequencePostProcessor>(std::move(parts));
  }
  node.unsupported_type(kSupported);
}

}  // namespace loraplex::tok
