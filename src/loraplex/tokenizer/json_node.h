#pragma once
// A tokenizer.json value together with its path in the file, so every load error names the file
// and the field (`tok.json: pre_tokenizer.pretokenizers[1].type "X" is not supported; ...`).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::tok {

class JsonNode {
 public:
  JsonNode(const nlohmann::json& value, std::string path, const std::string& origin)
      : value_(&value), path_(std::move(path)), origin_(&origin) {}

  const nlohmann::json& value() const { return *value_; }
  const std::string& path() const { return path_; }
  const std::string& origin() const { return *origin_; }
  bool is_null() const { return value_->is_null(); }

  /// Whether `key` is present and not null.
  bool has(std::string_view key) const;
  /// The member `key`, which must be present (it may be null).
  JsonNode at(std::string_view key) const;
  /// The member `key` of an object, or a null node when absent.
  JsonNode get(std::string_view key) const;
  /// The elements of this array.
  std::vector<JsonNode> elements() const;

  std::string as_string() const;
  bool as_bool() const;
  int64_t as_int() const;
  /// The member `key` as a string / bool; `fallback` when absent or null.
  std::string string_or(std::string_view key, const std::string& fallback) const;
  bool bool_or(std::string_view key, bool fallback) const;
  /// The required string member "type".
  std::string type() const;

  /// Throws loraplex::Error "<origin>: <path> <message...>".
  template <typename... Args>
  [[noreturn]] void fail(Args&&... args) const {
    LORAPLEX_FAIL(*origin_, ": ", path_.empty() ? std::string("<root>") : path_, " ",
                  std::forward<Args>(args)...);
  }
  /// Throws the error for a component type this library does not implement.
  [[noreturn]] void unsupported_type(std::string_view supported) const;

 private:
  std::string child_path(std::string_view key) const;
  const char* kind() const;

  const nlohmann::json* value_;
  std::string path_;
  const std::string* origin_;
};

}  // namespace loraplex::tok
