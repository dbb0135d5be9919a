#include "loraplex/model/config.h"

#include <cmath>
#include <fstream>
#include <numbers>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::model {
namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  const std::string& source;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  int64_t integer(const char* key) const {
    LORAPLEX_CHECK(has(key), source, ": missing required field '", key, "'");
    const json& v = j.at(key);
    LORAPLEX_CHECK(v.is_number_integer(), source, ": field '", key, "' is ", v.dump(),
                   ", expected an integer");
    return v.get<int64_t>();
  }
  int64_t integer_or(const char* key, int64_t fallback) const {
    return has(key) ? integer(key) : fallback;
  }
  int64_t positive(const char* key) const {
    const int64_t v = integer(key);
    LORAPLEX_CHECK(v >= 1, source, ": field '", key, "' is ", v, ", expected a positive integer");
    return v;
  }
  double number(const json& obj, const char* key, const char* where) const {
    LORAPLEX_CHECK(obj.contains(key) && obj.at(key).is_number(), source, ": field '", where, key,
                   "' is ", obj.contains(key) ? obj.at(key).dump() : std::string("missing"),
                   ", expected a number");
    return obj.at(key).get<double>();
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = j.at(key);
    LORAPLEX_CHECK(v.is_boolean(), source, ": field '", key, "' is ", v.dump(),
                   ", expected true or false");
    return v.get<bool>();
  }
};

Architecture parse_architecture(const Reader& r) {
  std::string name;
  if (r.has("architectures")) {
    const json& a = r.j.at("architectures");
    LORAPLEX_CHECK(a.is_array() && a.size() == 1 && a.at(0).is_string(), r.source,
                   ": field 'architectures' is ", a.dump(), ", expected one architecture name");
    name = a.at(0).get<std::string>();
  } else {
    LORAPLEX_CHECK(r.has("model_type") && r.j.at("model_type").is_string(), r.source,
                   ": neither 'architectures' nor 'model_type' names the architecture");
    const std::string type = r.j.at("model_type").get<std::string>();
    if (type == "llama") name = "LlamaForCausalLM";
    if (type == "mistral") name = "MistralForCausalLM";
    if (type == "qwen2") name = "Qwen2ForCausalLM";
    if (type == "qwen3") name = "Qwen3ForCausalLM";
    if (type == "mixtral") name = "MixtralForCausalLM";
    if (type == "qwen3_moe") name = "Qwen3MoeForCausalLM";
    LORAPLEX_CHECK(!name.empty(), r.source, ": model_type '", type,
                   "' is not supported (expected llama, mistral, qwen2, qwen3, mixtral or "
                   "qwen3_moe)");
  }
  for (Architecture arch :
       {Architecture::kLlama, Architecture::kMistral, Architecture::kQwen2, Architecture::kQwen3,
        Architecture::kMixtral, Architecture::kQwen3Moe}) {
    if (name == architecture_name(arch)) return arch;
  }
  LORAPLEX_FAIL(r.source, ": architecture '", name,
                "' is not supported (expected LlamaForCausalLM, MistralForCausalLM, "
                "Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or Qwen3MoeForCausalLM)");
}

// transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4.x writes rope_theta at
// the top level and an optional rope_scaling {rope_type or type, ...}.
void parse_rope(const Reader& r, ModelConfig& c) {
  const json* params = nullptr;
  std::string where;
  if (r.has("rope_parameters")) {
    params = &r.j.at("rope_parameters");
    where = "rope_parameters.";
  } else if (r.has("rope_scaling")) {
    params = &r.j.at("rope_scaling");
    where = "rope_scaling.";
  }
  if (params != nullptr) {
    LORAPLEX_CHECK(params->is_object(), r.source, ": field '", where.substr(0, where.size() - 1),
                   "' is ", params->dump(), ", expected an object");
  }
  if (params != nullptr && params->contains("rope_theta")) {
    c.rope_theta = r.number(*params, "rope_theta", where.c_str());
  } else if (r.has("rope_theta")) {
    c.rope_theta = r.number(r.j, "rope_theta", "");
  }
  LORAPLEX_CHECK(c.rope_theta > 0.0, r.source, ": rope_theta is ", c.rope_theta,
                 ", expected a positive number");
  if (r.has("partial_rotary_factor")) {
    const double f = r.number(r.j, "partial_rotary_factor", "");
    LORAPLEX_CHECK(f == 1.0, r.source, ": partial_rotary_factor ", f,
                   " is not supported (expected 1.0: RoPE over the whole head)");
  }
  if (params == nullptr) return;
  std::string type = "default";
  const char* type_key = params->contains("rope_type") ? "rope_type" : "type";
  if (params->contains(type_key) && !params->at(type_key).is_null()) {
    LORAPLEX_CHECK(params->at(type_key).is_string(), r.source, ": field '", where, type_key,
                   "' is ", params->at(type_key).dump(), ", expected a string");
    type = params->at(type_key).get<std::string>();
  }
  if (type == "default") return;
  LORAPLEX_CHECK(type == "llama3", r.source, ": ", where, type_key, " '", type,
                 "' is not supported (expected 'default' or 'llama3')");
  RopeScaling& s = c.rope_scaling;
  s.kind = RopeScaling::Kind::kLlama3;
  s.factor = r.number(*params, "factor", where.c_str());
  s.low_freq_factor = r.number(*params, "low_freq_factor", where.c_str());
  s.high_freq_factor = r.number(*params, "high_freq_factor", where.c_str());
  s.original_max_position_embeddings =
      r.number(*params, "original_max_position_embeddings", where.c_str());
  LORAPLEX_CHECK(
      s.factor > 0.0 && s.low_freq_factor > 0.0 && s.high_freq_factor > s.low_freq_factor &&
          s.original_max_position_embeddings > 0.0,
      r.source, ": ", where,
      "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
      "factor ",
      s.factor, ", low_freq_factor ", s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor);
}

// Sliding-window attention changes which keys a query sees; loraplex implements full causal
// attention only, so a checkpoint that switches it on is refused rather than run differently.
void check_no_sliding_window(const Reader& r, Architecture arch) {
  if (r.has("use_sliding_window")) {
    LORAPLEX_CHECK(!r.boolean_or("use_sliding_window", false), r.source,
                   ": use_sliding_window is true: sliding-window attention is not supported "
                   "(expected false)");
  } else if (arch == Architecture::kMistral || arch == Architecture::kMixtral) {
    // Mistral and Mixtral switch the window on by giving its size.
    LORAPLEX_CHECK(!r.has("sliding_window"), r.source, ": sliding_window is ",
                   r.j.at("sliding_window").dump(),
                   ": sliding-window attention is not supported (expected null)");
  }
  if (r.has("layer_types")) {
    const json& types = r.j.at("layer_types");
    LORAPLEX_CHECK(types.is_array(), r.source, ": field 'layer_types' is ", types.dump(),
                   ", expected a list");
    for (size_t i = 0; i < types.size(); ++i) {
      LORAPLEX_CHECK(types[i] == "full_attention", r.source, ": layer_types[", i, "] is ",
                     types[i].dump(), ": only \"full_attention\" layers are supported");
    }
  }
}

// Qwen3-MoE: every layer routed over num_experts experts. transformers makes layer l a dense MLP
// (of intermediate_size) when l is in mlp_only_layers or (l + 1) is not a multiple of
// decoder_sparse_step; loraplex runs one kind of MLP in every layer, so such a config is refused.
void parse_qwen3_moe(const Reader& r, ModelConfig& c) {
  // Hub checkpoints say num_experts; transformers 5 saves it as num_local_experts (its alias).
  const bool local = r.has("num_local_experts");
  c.num_experts = r.positive(local ? "num_local_experts" : "num_experts");
  if (local && r.has("num_experts")) {
    LORAPLEX_CHECK(r.positive("num_experts") == c.num_experts, r.source, ": num_experts ",
                   r.integer("num_experts"), " and num_local_experts ", c.num_experts, " disagree");
  }
  c.num_experts_per_tok = r.positive("num_experts_per_tok");
  LORAPLEX_CHECK(c.num_experts_per_tok <= c.num_experts, r.source, ": num_experts_per_tok ",
                 c.num_experts_per_tok, " exceeds num_experts ", c.num_experts);
  c.intermediate_size = r.positive("moe_intermediate_size");
  c.moe_renormalize = r.boolean_or("norm_topk_prob", false);
  const int64_t step = r.has("decoder_sparse_step") ? r.positive("decoder_sparse_step") : 1;
  LORAPLEX_CHECK(step == 1, r.source, ": decoder_sparse_step ", step,
                 " makes layer 0 a dense MLP layer: models that mix dense and MoE layers are not "
                 "supported (expected 1)");
  if (!r.has("mlp_only_layers")) return;
  const json& only = r.j.at("mlp_only_layers");
  LORAPLEX_CHECK(only.is_array(), r.source, ": field 'mlp_only_layers' is ", only.dump(),
                 ", expected a list of layer indices");
  for (const json& l : only) {
    LORAPLEX_CHECK(l.is_number_integer(), r.source, ": field 'mlp_only_layers' holds ", l.dump(),
                   ", expected layer indices");
    const int64_t layer = l.get<int64_t>();
    LORAPLEX_CHECK(layer < 0 || layer >= c.num_layers, r.source, ": mlp_only_layers makes layer ",
                   layer,
                   " a dense MLP layer: models that mix dense and MoE layers are not "
                   "supported (expected [])");
  }
}

std::vector<int32_t> parse_token_ids(const Reader& r, const char* key) {
  std::vector<int32_t> ids;
  if (!r.has(key)) return ids;
  const json& v = r.j.at(key);
  if (v.is_number_integer()) {
    ids.push_back(v.get<int32_t>());
  } else {
    LORAPLEX_CHECK(v.is_array(), r.source, ": field '", key, "' is ", v.dump(),
                   ", expected a token id or a list of them");
    for (const json& e : v) {
      LORAPLEX_CHECK(e.is_number_integer(), r.source, ": field '", key, "' holds ", e.dump(),
                     ", expected token ids");
      ids.push_back(e.get<int32_t>());
    }
  }
  return ids;
}

}  // namespace

const char* architecture_name(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama:
      return "LlamaForCausalLM";
    case Architecture::kMistral:
      return "MistralForCausalLM";
    case Architecture::kQwen2:
      return "Qwen2ForCausalLM";
    case Architecture::kQwen3:
      return "Qwen3ForCausalLM";
    case Architecture::kMixtral:
      return "MixtralForCausalLM";
    case Architecture::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
  }
  return "unknown";
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& source) {
  LORAPLEX_CHECK(j.is_object(), source, ": expected a JSON object, got ", j.type_name());
  const Reader r{j, source};
  ModelConfig c;
  c.arch = parse_architecture(r);
  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  // Qwen3-MoE's intermediate_size is the width of dense layers, which loraplex refuses;
  // its experts' width is moe_intermediate_size.
  if (c.arch != Architecture::kQwen3Moe) c.intermediate_size = r.positive("intermediate_size");
  c.num_layers = r.positive("num_hidden_layers");
  c.num_heads = r.positive("num_attention_heads");
  c.num_kv_heads = r.has("num_key_value_heads") ? r.positive("num_key_value_heads") : c.num_heads;
  LORAPLEX_CHECK(c.num_heads % c.num_kv_heads == 0, source, ": num_attention_heads ", c.num_heads,
                 " is not a multiple of num_key_value_heads ", c.num_kv_heads);
  if (r.has("head_dim")) {
    c.head_dim = r.positive("head_dim");
  } else if (c.arch == Architecture::kQwen3) {
    c.head_dim = 128;  // Qwen3Config's default, not hidden_size / num_attention_heads
  } else {
    LORAPLEX_CHECK(c.hidden_size % c.num_heads == 0, source,
                   ": head_dim is not given and hidden_size ", c.hidden_size,
                   " is not a multiple of num_attention_heads ", c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
  }
  LORAPLEX_CHECK(c.head_dim % 2 == 0, source, ": head_dim ", c.head_dim,
                 " must be even for rotary embeddings");
  c.rms_norm_eps = r.has("rms_norm_eps") ? r.number(j, "rms_norm_eps", "") : 1e-6;
  c.max_position_embeddings = r.integer_or("max_position_embeddings", 0);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  if (r.has("hidden_act")) {
    LORAPLEX_CHECK(j.at("hidden_act") == "silu", source, ": hidden_act is ",
                   j.at("hidden_act").dump(), ", expected \"silu\"");
  }
  parse_rope(r, c);
  check_no_sliding_window(r, c.arch);
  const bool qwen3 = c.arch == Architecture::kQwen3 || c.arch == Architecture::kQwen3Moe;
  if (c.arch == Architecture::kQwen2) {
    c.qkv_bias = true;  // Qwen2 attention always has q/k/v bias and no o_proj bias.
  } else if (c.arch == Architecture::kLlama || qwen3) {
    c.qkv_bias = c.o_bias = r.boolean_or("attention_bias", false);
  }
  if (c.arch == Architecture::kLlama) c.mlp_bias = r.boolean_or("mlp_bias", false);
  c.qk_norm = qwen3;
  if (c.arch == Architecture::kMixtral) {
    c.num_experts = r.positive("num_local_experts");
    c.num_experts_per_tok = r.positive("num_experts_per_tok");
    LORAPLEX_CHECK(c.num_experts_per_tok <= c.num_experts, source, ": num_experts_per_tok ",
                   c.num_experts_per_tok, " exceeds num_local_experts ", c.num_experts);
  }
  if (c.arch == Architecture::kQwen3Moe) parse_qwen3_moe(r, c);
  if (r.has("quantization_config")) {
    c.quant = parse_quantization_config(j.at("quantization_config"), source);
    LORAPLEX_CHECK(!c.is_moe(), source, ": quantization_config on ", architecture_name(c.arch),
                   ": FP8 mixture-of-experts models are not supported (FP8 dense models are)");
  }
  const std::vector<int32_t> bos = parse_token_ids(r, "bos_token_id");
  c.bos_token_id = bos.empty() ? -1 : bos.front();
  c.eos_token_ids = parse_token_ids(r, "eos_token_id");
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (r.has(key) && j.at(key).is_string()) {
      c.checkpoint_dtype = dtype_from_name(j.at(key).get<std::string>());
      break;
    }
  }
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  LORAPLEX_CHECK(in.good(), path,
                 ": cannot open the model config (expected config.json in the "
                 "checkpoint directory)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    LORAPLEX_FAIL(path, ": not valid JSON: ", e.what());
  }
  return from_json(j, path);
}

std::vector<float> rope_inv_freq(const ModelConfig& c) {
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  const float base = static_cast<float>(c.rope_theta);
  for (int64_t i = 0; i < half; ++i) {
    // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all in float32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(base, exponent);
  }
  if (c.rope_scaling.kind == RopeScaling::Kind::kLlama3) {
    const RopeScaling& s = c.rope_scaling;
    const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    for (float& f : inv) {
      const float wavelen = static_cast<float>(2.0 * std::numbers::pi) / f;
      if (wavelen < high_wavelen) continue;  // high frequency: unchanged
      if (wavelen > low_wavelen) {
        f = f / static_cast<float>(s.factor);
        continue;
      }
      const float smooth =
          static_cast<float>((s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                             (s.high_freq_factor - s.low_freq_factor));
      f = (1.0f - smooth) * f / static_cast<float>(s.factor) + smooth * f;
    }
  }
  return inv;
}

}  // namespace loraplex::model
