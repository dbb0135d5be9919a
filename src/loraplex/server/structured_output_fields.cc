#include "loraplex/server/structured_output_fields.h"

#include <string>
#include <vector>

#include "loraplex/server/api_error.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;
using Kind = engine::StructuredOutput::Kind;

const json* present(const json& obj, const char* name) {
  const auto it = obj.find(name);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void refuse(const std::string& param, const std::string& message) {
  throw_api(400, message, param);
}

// A schema is given as an object or as its JSON text (vLLM accepts both for guided_json).
std::string schema_text(const json& v, const std::string& param) {
  if (v.is_object() || v.is_boolean()) return v.dump();
  if (v.is_string()) {
    const json parsed = json::parse(v.get<std::string>(), nullptr, false);
    if (parsed.is_discarded()) refuse(param, "'" + param + "' is not valid JSON");
    return v.get<std::string>();
  }
  refuse(param, "'" + param + "' must be a JSON schema (an object or its JSON text)");
}

std::string string_of(const json& v, const std::string& param) {
  if (!v.is_string() || v.get<std::string>().empty()) {
    refuse(param, "'" + param + "' must be a non-empty string");
  }
  return v.get<std::string>();
}

std::vector<std::string> choices_of(const json& v, const std::string& param) {
  if (!v.is_array() || v.empty()) refuse(param, "'" + param + "' must be a non-empty list");
  std::vector<std::string> out;
  for (const json& c : v) {
    if (!c.is_string()) refuse(param, "'" + param + "' must be a list of strings");
    out.push_back(c.get<std::string>());
  }
  return out;
}

// Collects the kinds asked for, so that two at once can be refused naming both.
struct Asked {
  engine::StructuredOutput out;
  std::string field;
  void set(Kind kind, const std::string& name) {
    if (out.kind != Kind::kNone) {
      refuse(name, "'" + name + "' and '" + field +
                       "' both ask for structured output; give one kind per request");
    }
    out.kind = kind;
    field = name;
  }
};

void read_response_format(const json& body, Asked& asked) {
  const json* rf = present(body, "response_format");
  if (rf == nullptr) return;
  if (!rf->is_object()) refuse("response_format", "'response_format' must be an object");
  const std::string type = rf->value("type", "text");
  if (type == "text") return;
  if (type == "json_object") {
    asked.set(Kind::kAnyJson, "response_format");
    return;
  }
  if (type == "json_schema") {
    const json* js = present(*rf, "json_schema");
    if (js == nullptr || !js->is_object()) {
      refuse("response_format", "response_format json_schema needs a 'json_schema' object");
    }
    const json* schema = present(*js, "schema");
    if (schema == nullptr) refuse("response_format", "response_format json_schema has no 'schema'");
    asked.set(Kind::kJson, "response_format");
    asked.out.spec = schema_text(*schema, "response_format");
    return;
  }
  refuse("response_format",
         "response_format type '" + type + "' is not supported (text, json_object or json_schema)");
}

void read_guided(const json& body, Asked& asked) {
  if (const json* v = present(body, "guided_json")) {
    asked.set(Kind::kJson, "guided_json");
    asked.out.spec = schema_text(*v, "guided_json");
  }
  if (const json* v = present(body, "guided_regex")) {
    asked.set(Kind::kRegex, "guided_regex");
    asked.out.spec = string_of(*v, "guided_regex");
  }
  if (const json* v = present(body, "guided_choice")) {
    asked.set(Kind::kChoice, "guided_choice");
    asked.out.choices = choices_of(*v, "guided_choice");
  }
  if (const json* v = present(body, "guided_grammar")) {
    asked.set(Kind::kGrammar, "guided_grammar");
    asked.out.spec = string_of(*v, "guided_grammar");
  }
  if (present(body, "guided_whitespace_pattern") != nullptr) {
    refuse("guided_whitespace_pattern",
           "'guided_whitespace_pattern' is not supported (structured_outputs."
           "disable_any_whitespace is)");
  }
}

void read_structured_outputs(const json& body, Asked& asked) {
  const json* so = present(body, "structured_outputs");
  if (so == nullptr) return;
  const std::string p = "structured_outputs";
  if (!so->is_object()) refuse(p, "'structured_outputs' must be an object");
  for (const auto& [key, value] : so->items()) {
    if (value.is_null()) continue;
    const std::string name = p + "." + key;
    if (key == "json") {
      asked.set(Kind::kJson, name);
      asked.out.spec = schema_text(value, name);
    } else if (key == "json_object") {
      if (!value.is_boolean()) refuse(name, "'" + name + "' must be a boolean");
      if (value.get<bool>()) asked.set(Kind::kAnyJson, name);
    } else if (key == "regex") {
      asked.set(Kind::kRegex, name);
      asked.out.spec = string_of(value, name);
    } else if (key == "choice") {
      asked.set(Kind::kChoice, name);
      asked.out.choices = choices_of(value, name);
    } else if (key == "grammar") {
      asked.set(Kind::kGrammar, name);
      asked.out.spec = string_of(value, name);
    } else if (key == "disable_any_whitespace") {
      if (!value.is_boolean()) refuse(name, "'" + name + "' must be a boolean");
    } else if (key == "disable_fallback" || key == "disable_additional_properties") {
      // Backend choices of vLLM's: there is one backend here, and it has no fallback.
      if (!value.is_boolean()) refuse(name, "'" + name + "' must be a boolean");
      if (key == "disable_additional_properties" && value.get<bool>()) {
        refuse(name, "'" + name + "' is not supported");
      }
    } else {
      refuse(name, "'" + name +
                       "' is not supported (json, json_object, regex, choice, grammar, "
                       "disable_any_whitespace)");
    }
  }
  if (const json* w = present(*so, "disable_any_whitespace")) {
    asked.out.any_whitespace = !w->get<bool>();
  }
}

}  // namespace

engine::StructuredOutput structured_output_of(const json& body) {
  Asked asked;
  read_response_format(body, asked);
  read_guided(body, asked);
  read_structured_outputs(body, asked);
  return asked.out;
}

}  // namespace loraplex::server
