#include "loraplex/server/unsupported_fields.h"

#include <functional>
#include <string>
#include <vector>

#include "loraplex/server/api_error.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;

struct Unsupported {
  const char* name;
  std::function<bool(const json&)> neutral;  // the value that changes nothing
  const char* why;
};

bool is_false(const json& v) { return v.is_boolean() && !v.get<bool>(); }
bool is_true(const json& v) { return v.is_boolean() && v.get<bool>(); }
bool is_empty(const json& v) {
  return (v.is_array() || v.is_object() || v.is_string()) && v.empty();
}
bool never(const json&) { return false; }
std::function<bool(const json&)> equals(double x) {
  return [x](const json& v) { return v.is_number() && v.get<double>() == x; };
}
bool text_only(const json& v) { return v.is_array() && v.size() == 1 && v[0] == "text"; }

constexpr const char* kStructured =
    "structural tags are not implemented (response_format json_object and json_schema, and the "
    "guided_* and structured_outputs json, regex, choice and grammar are)";
constexpr const char* kLogitsProcessing =
    "custom logits processors are not supported (penalties, logit_bias, allowed_token_ids and "
    "bad_words are)";

const std::vector<Unsupported>& table() {
  static const std::vector<Unsupported> t = {
      {"use_beam_search", is_false, "beam search is not implemented"},
      {"length_penalty", equals(1.0), "it applies to beam search, which is not implemented"},
      {"logits_processors", is_empty, kLogitsProcessing},
      {"structural_tag", never, kStructured},
      {"prompt_logprobs", never,
       "prompt log-probabilities are not computed: the model computes logits only for the "
       "positions it samples from"},
      {"return_tokens_as_token_ids", is_false, "it is not implemented"},
      {"priority", equals(0.0), "priority scheduling is not implemented"},
      {"cache_salt", never, "per-request prefix-cache isolation is not implemented"},
      {"kv_transfer_params", never, "disaggregated prefill is not implemented"},
      {"vllm_xargs", is_empty, "extra engine arguments are not implemented"},
      {"prompt_embeds", never, "prompts as embeddings are not accepted (send text or token ids)"},
      {"mm_processor_kwargs", is_empty, "multimodal inputs are not supported"},
      {"reasoning_effort", never, "it is not implemented"},
      {"include_reasoning", is_true, "reasoning parsing is not implemented"},
      {"functions", never, "the deprecated function-calling fields are not supported"},
      {"function_call", never, "the deprecated function-calling fields are not supported"},
      {"audio", never, "audio output is not supported"},
      {"modalities", text_only, "only text output is supported"},
      {"prediction", never, "predicted outputs are not implemented"},
  };
  return t;
}

}  // namespace

void refuse_unsupported_fields(const json& body) {
  for (const Unsupported& u : table()) {
    const auto it = body.find(u.name);
    if (it == body.end() || it->is_null() || u.neutral(*it)) continue;
    std::string message = "'";
    message.append(u.name).append("' is not supported: ").append(u.why);
    throw_api(400, message, u.name);
  }
}

}  // namespace loraplex::server
