#include "loraplex/tokenizer/json_node.h"

namespace loraplex::tok {
namespace {

const nlohmann::json& null_json() {
  static const nlohmann::json null_value;
  return null_value;
}

}  // namespace

std::string JsonNode::child_path(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

const char* JsonNode::kind() const { return value_->type_name(); }

bool JsonNode::has(std::string_view key) const {
  if (!value_->is_object()) return false;
  const auto it = value_->find(key);
  return it != value_->end() && !it->is_null();
}

JsonNode JsonNode::at(std::string_view key) const {
  if (!value_->is_object()) fail("must be an object, got ", kind());
  const auto it = value_->find(key);
  if (it == value_->end()) fail("has no member \"", key, "\"");
  return JsonNode(*it, child_path(key), *origin_);
}

JsonNode JsonNode::get(std::string_view key) const {
  if (!value_->is_object()) fail("must be an object, got ", kind());
  const auto it = value_->find(key);
  if (it == value_->end()) return JsonNode(null_json(), child_path(key), *origin_);
  return JsonNode(*it, child_path(key), *origin_);
}

std::vector<JsonNode> JsonNode::elements() const {
  if (!value_->is_array()) fail("must be an array, got ", kind());
  std::vector<JsonNode> out;
  out.reserve(value_->size());
  for (size_t i = 0; i < value_->size(); ++i) {
    out.emplace_back((*value_)[i], path_ + "[" + std::to_string(i) + "]", *origin_);
  }
  return out;
}

std::string JsonNode::as_string() const {
  if (!value_->is_string()) fail("must be a string, got ", kind());
  return value_->get<std::string>();
}

bool JsonNode::as_bool() const {
  if (!value_->is_boolean()) fail("must be a boolean, got ", kind());
  return value_->get<bool>();
}

int64_t JsonNode::as_int() const {
  if (!value_->is_number_integer()) fail("must be an integer, got ", kind());
  return value_->get<int64_t>();
}

std::string JsonNode::string_or(std::string_view key, const std::string& fallback) const {
  return has(key) ? at(key).as_string() : fallback;
}

bool JsonNode::bool_or(std::string_view key, bool fallback) const {
  return has(key) ? at(key).as_bool() : fallback;
}

std::string JsonNode::type() const { return at("type").as_string(); }

void JsonNode::unsupported_type(std::string_view supported) const {
  LORAPLEX_FAIL(*origin_, ": ", child_path("type"), " \"", type(),
                "\" is not supported; supported: ", supported);
}

}  // namespace loraplex::tok
