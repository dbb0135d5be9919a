#include "loraplex/model/peft_adapter.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/error.h"

namespace loraplex::model {
namespace {

using nlohmann::json;

constexpr const char* kPrefix = "base_model.model.";

// PEFT's get_pattern_key: a pattern matches a module path when the path ends with it at a
// component boundary (the pattern itself may be a regular expression).
const json* match_pattern(const json& patterns, const std::string& module) {
  if (!patterns.is_object()) return nullptr;
  for (const auto& item : patterns.items()) {
    if (item.key() == module) return &item.value();
  }
  for (const auto& item : patterns.items()) {
    try {
      if (std::regex_match(module, std::regex("(^|.*\\.)(" + item.key() + ")$")))
        return &item.value();
    } catch (const std::regex_error&) {
      // A pattern that is not a valid regular expression can only match literally (above).
    }
  }
  return nullptr;
}

Tensor scaled(const Tensor& b, double scale) {
  Tensor out = b.to(DType::kF32).contiguous().clone();
  float* p = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) p[i] = static_cast<float>(p[i] * scale);
  return out;
}

json read_config(const std::string& who, const std::string& dir) {
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), who, ": ", dir, ": not a directory");
  const std::string config_path = (fs::path(dir) / "adapter_config.json").string();
  std::ifstream in(config_path);
  LORAPLEX_CHECK(in.good(), who, ": ", config_path, ": cannot open");
  json cfg;
  try {
    cfg = json::parse(in);
  } catch (const json::exception& e) {
    LORAPLEX_FAIL(who, ": ", config_path, ": not valid JSON: ", e.what());
  }
  LORAPLEX_CHECK(cfg.is_object(), who, ": ", config_path, ": expected a JSON object");
  LORAPLEX_CHECK(
      cfg.contains("r") && cfg.at("r").is_number_integer() && cfg.at("r").get<int64_t>() >= 1, who,
      ": ", config_path, ": r is ", cfg.contains("r") ? cfg.at("r").dump() : "missing",
      ", expected a positive integer");
  if (cfg.contains("rank_pattern") && cfg.at("rank_pattern").is_object()) {
    for (const auto& item : cfg.at("rank_pattern").items()) {
      LORAPLEX_CHECK(item.value().is_number_integer() && item.value().get<int64_t>() >= 1, who,
                     ": ", config_path, ": rank_pattern['", item.key(), "'] is ",
                     item.value().dump(), ", expected a positive integer");
    }
  }
  if (cfg.contains("alpha_pattern") && cfg.at("alpha_pattern").is_object()) {
    for (const auto& item : cfg.at("alpha_pattern").items()) {
      LORAPLEX_CHECK(item.value().is_number(), who, ": ", config_path, ": alpha_pattern['",
                     item.key(), "'] is ", item.value().dump(), ", expected a number");
    }
  }
  return cfg;
}

}  // namespace

int PeftAdapter::config_max_rank(const std::string& name, const std::string& dir) {
  const json cfg = read_config("adapter '" + name + "'", dir);
  int64_t r = cfg.at("r").get<int64_t>();
  if (cfg.contains("rank_pattern") && cfg.at("rank_pattern").is_object()) {
    for (const auto& item : cfg.at("rank_pattern").items())
      r = std::max(r, item.value().get<int64_t>());
  }
  return static_cast<int>(r);
}

PeftAdapter PeftAdapter::load(const std::string& name, const std::string& dir,
                              const std::map<std::string, LoraTarget>& targets, int max_rank) {
  namespace fs = std::filesystem;
  const std::string who = "adapter '" + name + "'";
  const json cfg = read_config(who, dir);
  const std::string config_path = (fs::path(dir) / "adapter_config.json").string();
  const std::string weights_path = (fs::path(dir) / "adapter_model.safetensors").string();
  auto field = [&](const char* key) -> const json& {
    static const json null_value;
    return cfg.contains(key) ? cfg.at(key) : null_value;
  };
  LORAPLEX_CHECK(field("peft_type") == "LORA", who, ": ", config_path, ": peft_type is ",
                 field("peft_type").dump(), ", expected \"LORA\"");
  for (const char* flag : {"use_dora", "lora_bias", "fan_in_fan_out"}) {
    LORAPLEX_CHECK(!field(flag).is_boolean() || !field(flag).get<bool>(), who, ": ", config_path,
                   ": ", flag, " is true, which loraplex does not support");
  }
  LORAPLEX_CHECK(field("lora_alpha").is_number(), who, ": ", config_path, ": lora_alpha is ",
                 field("lora_alpha").dump(), ", expected a number");
  const int r_default = field("r").get<int>();
  const double alpha_default = field("lora_alpha").get<double>();
  const bool rslora = field("use_rslora").is_boolean() && field("use_rslora").get<bool>();
  std::vector<std::string> target_params;
  if (field("target_parameters").is_array()) {
    for (const json& p : field("target_parameters")) target_params.push_back(p.get<std::string>());
  }

  LORAPLEX_CHECK(fs::exists(weights_path), who, ": ", weights_path, ": missing");
  SafetensorsFile file = [&] {
    try {
      return SafetensorsFile::open(weights_path);
    } catch (const Error& e) {
      LORAPLEX_FAIL(who, ": ", e.what());
    }
  }();

  // Group the tensors by module: module -> {A name, B name}.
  struct Pair {
    std::string a, b;
    int nesting = 0;  // ".base_layer" wrappers around a 3-D ParamWrapper
  };
  std::map<std::string, Pair> pairs;
  for (const std::string& key : file.names()) {
    LORAPLEX_CHECK(key.rfind(kPrefix, 0) == 0, who, ": ", weights_path, ": tensor '", key,
                   "' does not start with '", kPrefix, "'");
    std::string rest = key.substr(std::string(kPrefix).size());
    std::string module;
    bool is_a = false;
    for (const auto& [suffix, a_side] : {std::pair<std::string, bool>{".lora_A.weight", true},
                                         {".lora_B.weight", false},
                                         {".lora_embedding_A", true},
                                         {".lora_embedding_B", false}}) {
      if (rest.size() > suffix.size() &&
          rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
        module = rest.substr(0, rest.size() - suffix.size());
        is_a = a_side;
      }
    }
    if (module.empty()) {
      // PEFT also saves copies of the base embedding/lm_head ("...base_layer.weight"); they
      // equal the checkpoint's weights and are not part of the LoRA.
      LORAPLEX_CHECK(rest.size() > 18 && rest.rfind(".base_layer.weight") == rest.size() - 18, who,
                     ": ", weights_path, ": tensor '", key,
                     "' is not a LoRA weight (expected *.lora_A.weight, *.lora_B.weight, "
                     "*.lora_embedding_A or *.lora_embedding_B)");
      continue;
    }
    int nesting = 0;
    for (size_t pos; (pos = module.find(".base_layer")) != std::string::npos; ++nesting) {
      module.erase(pos, 11);
    }
    const std::string id = module + "#" + std::to_string(nesting);
    Pair& p = pairs[id];
    p.nesting = nesting;
    (is_a ? p.a : p.b) = key;
  }

  PeftAdapter out;
  out.name_ = name;
  for (const auto& [id, p] : pairs) {
    const std::string module = id.substr(0, id.find('#'));
    LORAPLEX_CHECK(!p.a.empty() && !p.b.empty(), who, ": ", weights_path, ": module '", module,
                   "' has ", p.a.empty() ? "no LoRA A" : "no LoRA B");
    const auto it = targets.find(module);
    LORAPLEX_CHECK(it != targets.end(), who, ": ", weights_path, ": module '", module,
                   "' is not a LoRA target of this model");
    LoraTarget target = it->second;
    const Tensor a = file.tensor(p.a);
    const Tensor b = file.tensor(p.b);
    for (const Tensor* t : {&a, &b}) {
      LORAPLEX_CHECK(t->dim() == 2 && is_floating(t->dtype()) && !is_fp8(t->dtype()), who, ": ",
                     weights_path, ": ", t == &a ? p.a : p.b, " is ", t->describe(),
                     ", expected a 2-D float32/float16/bfloat16 tensor");
    }
    std::string pattern_name = module;
    int64_t in = target.in_features;
    int64_t out_f = target.out_features;
    int64_t experts = 1;
    if (target.kind == LoraTarget::Kind::kExperts3d) {
      // PEFT nests one ParamWrapper per target parameter, the first listed innermost: the
      // wrapper with k ".base_layer" segments adapts target_parameters[n - 1 - k].
      const int n = static_cast<int>(target_params.size());
      LORAPLEX_CHECK(p.nesting < n, who, ": ", weights_path, ": 3-D expert LoRA '", p.a,
                     "' has no matching entry in target_parameters");
      const std::string param = target_params[static_cast<size_t>(n - 1 - p.nesting)];
      const bool gate_up = param.size() >= 12 && param.rfind("gate_up_proj") == param.size() - 12;
      const bool down = param.size() >= 9 && param.rfind("down_proj") == param.size() - 9;
      LORAPLEX_CHECK(gate_up || down, who, ": ", config_path, ": target parameter '", param,
                     "' is not supported (expected experts.gate_up_proj or experts.down_proj)");
      experts = target.moe->num_experts();
      target.which = gate_up ? 0 : 1;
      in = gate_up ? target.moe->hidden() : target.moe->intermediate();
      out_f = gate_up ? 2 * target.moe->intermediate() : target.moe->hidden();
      pattern_name = module + "." + (gate_up ? "gate_up_proj" : "down_proj");
    }
    const int64_t rows = a.size(0);
    LORAPLEX_CHECK(rows >= 1 && rows % experts == 0, who, ": ", weights_path, ": ", p.a, " has ",
                   rows, " rows, expected a multiple of ", experts, " experts");
    const int64_t rank = rows / experts;
    LORAPLEX_CHECK(a.size(1) == in, who, ": ", weights_path, ": ", p.a, " is ", a.describe(),
                   ", expected [", rows, ", ", in, "] for module '", module, "'");
    LORAPLEX_CHECK(b.size(0) == out_f && b.size(1) == rows, who, ": ", weights_path, ": ", p.b,
                   " is ", b.describe(), ", expected [", out_f, ", ", rows, "] for module '",
                   module, "'");
    LORAPLEX_CHECK(max_rank <= 0 || rank <= max_rank, who, ": ", weights_path, ": module '", module,
                   "' has rank ", rank, ", above --max-lora-rank ", max_rank);
    const json* r_pat = match_pattern(field("rank_pattern"), pattern_name);
    const json* a_pat = match_pattern(field("alpha_pattern"), pattern_name);
    const int64_t r_cfg = r_pat != nullptr ? r_pat->get<int64_t>() : r_default;
    LORAPLEX_CHECK(r_cfg == rank, who, ": ", weights_path, ": module '", module, "' has rank ",
                   rank, " but adapter_config.json says ", r_cfg);
    const double alpha = a_pat != nullptr ? a_pat->get<double>() : alpha_default;
    const double scale =
        rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
    out.max_rank_ = std::max(out.max_rank_, static_cast<int>(rank));
    out.modules_[id] = Module{target, a.to(DType::kF32).contiguous(), scaled(b, scale)};
  }
  LORAPLEX_CHECK(!out.modules_.empty(), who, ": ", weights_path, ": holds no LoRA weights");
  return out;
}

void PeftAdapter::install(Decoder& decoder, int slot) const {
  decoder.reset_slot(slot);
  // Group slices by module so that q/k/v (and gate/up) go to their layer in one set_lora.
  std::map<LoraModule*, std::vector<LoraSliceWeights>> per_module;
  for (const auto& [id, m] : modules_) {
    switch (m.target.kind) {
      case LoraTarget::Kind::kLinear:
      case LoraTarget::Kind::kEmbedding:
      case LoraTarget::Kind::kLogits: {
        auto& slices = per_module[m.target.module];
        slices.resize(static_cast<size_t>(m.target.module->num_slices()));
        slices[static_cast<size_t>(m.target.slice)] = {m.a, m.b};
        break;
      }
      case LoraTarget::Kind::kExperts3d:
        m.target.moe->set_lora_3d(slot, m.target.which, m.a, m.b);
        break;
      case LoraTarget::Kind::kExpert2d:
        m.target.moe->set_lora_expert(slot, m.target.expert, m.target.which, m.a, m.b);
        break;
    }
  }
  for (const auto& [module, slices] : per_module) module->set_lora(slot, slices);
}

}  // namespace loraplex::model
