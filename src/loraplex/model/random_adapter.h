#pragma once
// Random PEFT LoRA adapters for a model's shapes, written as real adapter directories
// (adapter_config.json + adapter_model.safetensors) so that benchmarks load them through the
// same path as trained adapters.

#include <cstdint>
#include <string>
#include <vector>

#include "loraplex/model/config.h"

namespace loraplex::model {

/// Writes a rank-`rank` adapter (lora_alpha = 2 * rank) targeting `targets` (q_proj, k_proj,
/// v_proj, o_proj; gate_proj, up_proj, down_proj of dense models and of every Qwen3-MoE expert,
/// or w1, w2, w3 of every Mixtral expert, in transformers 4.x's names) of every layer into `dir`
/// (created): bf16 weights, A uniform in +-0.04 and B in +-0.02 from `seed`, so that each
/// adapter moves its projections' outputs by a few percent. Throws naming an unknown target.
void write_random_peft_adapter(const std::string& dir, const ModelConfig& config, int rank,
                               const std::vector<std::string>& targets, uint64_t seed);

/// The seven linear projections of a Llama-style layer.
std::vector<std::string> all_linear_targets();
/// Those of `config`'s layers: attention and MLP (Qwen3-MoE: its experts' gate_proj, up_proj,
/// down_proj), or attention and Mixtral's experts' w1, w2, w3.
std::vector<std::string> all_linear_targets(const ModelConfig& config);

}  // namespace loraplex::model
