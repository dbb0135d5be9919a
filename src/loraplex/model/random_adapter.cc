#include "loraplex/model/random_adapter.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"

namespace loraplex::model {

std::vector<std::string> all_linear_targets() {
  return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
}

std::vector<std::string> all_linear_targets(const ModelConfig& config) {
  if (config.arch != Architecture::kMixtral) return all_linear_targets();
  return {"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"};
}

void write_random_peft_adapter(const std::string& dir, const ModelConfig& c, int rank,
                               const std::vector<std::string>& targets, uint64_t seed) {
  LORAPLEX_CHECK(rank >= 1, "random adapter: rank ", rank, ", expected >= 1");
  const int64_t h = c.hidden_size;
  // (in, out) of each projection.
  auto dims = [&](const std::string& t) -> std::pair<int64_t, int64_t> {
    if (t == "q_proj") return {h, c.q_size()};
    if (t == "k_proj" || t == "v_proj") return {h, c.kv_size()};
    if (t == "o_proj") return {c.q_size(), h};
    if (t == "gate_proj" || t == "up_proj") return {h, c.intermediate_size};
    if (t == "down_proj") return {c.intermediate_size, h};
    if (t == "w1" || t == "w3") return {h, c.intermediate_size};
    if (t == "w2") return {c.intermediate_size, h};
    LORAPLEX_FAIL("random adapter: unknown target module '", t,
                  "' (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; w1, w2, w3 "
                  "of MoE experts)");
  };
  // Mixtral's experts are w1/w3/w2; Qwen3-MoE's are gate_proj/up_proj/down_proj, the names
  // of a dense MLP.
  const bool mixtral = c.arch == Architecture::kMixtral;
  for (const std::string& t : targets) {
    dims(t);
    const bool expert = t == "w1" || t == "w2" || t == "w3";
    const bool mlp = t == "gate_proj" || t == "up_proj" || t == "down_proj";
    LORAPLEX_CHECK(!(mixtral && mlp) && (mixtral || !expert), "random adapter: ", t,
                   mixtral ? " is an expert projection of this MoE model (w1, w2, w3)"
                           : " is a Mixtral expert projection, and this model has none");
  }
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t k = 0;
  auto random = [&](int64_t rows, int64_t cols, float scale) {
    Tensor t = Tensor::empty({rows, cols}, DType::kBF16);
    ops::FillUniformArgs a{DType::kBF16, t.numel(), seed * 1000003 + ++k,
                           -scale,       scale,     t.data_ptr()};
    throw_if_error(ops::cpu::fill_uniform(a));
    return t;
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string layer = "base_model.model.model.layers." + std::to_string(l);
    for (const std::string& t : targets) {
      const auto [in, out] = dims(t);
      const bool attn = t == "q_proj" || t == "k_proj" || t == "v_proj" || t == "o_proj";
      // Experts in transformers 4.x's names (block_sparse_moe.experts.E.wK, or
      // mlp.experts.E.gate_proj for Qwen3-MoE), one pair each.
      std::vector<std::string> modules;
      if (!attn && c.is_moe()) {
        const std::string experts = mixtral ? ".block_sparse_moe.experts." : ".mlp.experts.";
        for (int64_t e = 0; e < c.num_experts; ++e) {
          modules.push_back(layer + experts + std::to_string(e) + "." + t);
        }
      } else {
        modules.push_back(layer + (attn ? ".self_attn." : ".mlp.") + t);
      }
      for (const std::string& p : modules) {
        tensors.emplace_back(p + ".lora_A.weight", random(rank, in, 0.04f));
        tensors.emplace_back(p + ".lora_B.weight", random(out, rank, 0.02f));
      }
    }
  }
  write_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  nlohmann::json cfg = {{"peft_type", "LORA"},
                        {"r", rank},
                        {"lora_alpha", 2 * rank},
                        {"target_modules", targets},
                        {"base_model_name_or_path", "random"},
                        {"bias", "none"},
                        {"fan_in_fan_out", false},
                        {"use_rslora", false},
                        {"use_dora", false},
                        {"lora_dropout", 0.0},
                        {"task_type", "CAUSAL_LM"}};
  std::ofstream out(dir + "/adapter_config.json");
  out << cfg.dump(2) << "\n";
  LORAPLEX_CHECK(out.good(), dir, "/adapter_config.json: write failed");
}

}  // namespace loraplex::model
