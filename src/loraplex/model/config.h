#pragma once
// The hyper-parameters of a Hugging Face decoder checkpoint (config.json), for the families that
// share loraplex's decoder: Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE. Parsing accepts
// the fields that do not change the math (transformers 4.x and 5.x spellings alike) and refuses,
// naming the field, any value that would change it (sliding-window attention switched on, an
// unknown RoPE scaling, an activation other than SiLU, Qwen3-MoE layers made dense, a
// quantization method other than FP8), so a checkpoint never runs with silently different math.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "loraplex/core/dtype.h"
#include "loraplex/model/quant_config.h"

namespace loraplex::model {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3, kMixtral, kQwen3Moe };

/// "LlamaForCausalLM", ...
const char* architecture_name(Architecture arch);

/// RoPE frequency scaling: none ("default") or Llama 3.1's piecewise scaling ("llama3").
struct RopeScaling {
  enum class Kind { kDefault, kLlama3 };
  Kind kind = Kind::kDefault;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192.0;
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // per expert for MoE models (Qwen3-MoE: moe_intermediate_size)
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 always; Llama and Qwen3 with attention_bias
  bool o_bias = false;    // Llama and Qwen3 with attention_bias
  bool mlp_bias = false;  // Llama with mlp_bias
  // Qwen3: an RMSNorm over head_dim of every q and k head (q_norm / k_norm weights), after the
  // projection and before RoPE.
  bool qk_norm = false;
  int64_t num_experts = 0;  // Mixtral: num_local_experts; Qwen3-MoE: num_experts (0 = dense)
  int64_t num_experts_per_tok = 0;
  // The top-k router probabilities renormalised to sum 1: Mixtral always, Qwen3-MoE when
  // norm_topk_prob is true.
  bool moe_renormalize = true;
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
  DType checkpoint_dtype = DType::kBF16;  // "dtype" / "torch_dtype", informational
  // quantization_config: FP8 projections (quant_config.h), or not quantized.
  QuantConfig quant;

  bool is_moe() const { return num_experts > 0; }
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }

  /// Parses config.json of a checkpoint directory; errors name `path` and the field.
  static ModelConfig from_file(const std::string& path);
  /// Parses a config object; `source` names it in error messages.
  static ModelConfig from_json(const nlohmann::json& json, const std::string& source);
};

/// The RoPE inverse frequencies [head_dim / 2], computed in float32 as transformers does
/// (inv_freq = 1 / theta^(2i / d), then the scaling rule of `scaling`).
std::vector<float> rope_inv_freq(const ModelConfig& config);

}  // namespace loraplex::model
