#pragma once
// The vLLM request fields that loraplex does not implement. Each one is accepted only when
// absent, null or at the value that changes nothing (use_beam_search false, length_penalty 1,
// an empty list, ...); any other value is a 400 naming the field and saying why, so a client
// never gets a result computed differently from what it asked. Fields vLLM does not know are
// ignored, as vLLM ignores them.

#include <nlohmann/json.hpp>

namespace loraplex::server {

/// Throws ApiException (400, param = the field) for the first unsupported field with a
/// non-neutral value.
void refuse_unsupported_fields(const nlohmann::ordered_json& body);

}  // namespace loraplex::server
