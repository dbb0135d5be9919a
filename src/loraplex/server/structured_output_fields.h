#pragma once
// The request fields that ask for structured output, as vLLM's OpenAI server reads them:
// response_format (json_object, json_schema), the guided_* fields (guided_json, guided_regex,
// guided_choice, guided_grammar, guided_whitespace_pattern) and their successor
// structured_outputs {json, json_object, regex, choice, grammar, disable_any_whitespace}. One
// kind per request; anything else about them (a structural tag, a whitespace pattern, two kinds
// at once, a wrong type) is a 400 naming the field.

#include <nlohmann/json.hpp>

#include "loraplex/engine/engine.h"

namespace loraplex::server {

/// The request's structured output (kind kNone when it asks for none). Throws ApiException.
engine::StructuredOutput structured_output_of(const nlohmann::ordered_json& body);

}  // namespace loraplex::server
