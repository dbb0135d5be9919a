#include "loraplex/model/weight_source.h"

#include <functional>

#include "loraplex/core/error.h"
#include "loraplex/model/model_ops.h"

namespace loraplex::model {

Tensor CheckpointWeights::get(const std::string& name, const Shape& shape) const {
  const Tensor t = ckpt_.tensor(name);
  LORAPLEX_CHECK(t.shape() == shape, ckpt_.dir(), ": tensor '", name, "' has shape ",
                 shape_str(t.shape()), ", expected ", shape_str(shape));
  LORAPLEX_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF16 || t.dtype() == DType::kBF16,
                 ckpt_.dir(), ": tensor '", name, "' has dtype ", t.dtype(),
                 ", expected float32, float16 or bfloat16");
  return t;
}

RandomWeights::RandomWeights(const ModelConfig& config, DType dtype, Device device, uint64_t seed,
                             Stream stream)
    : config_(config),
      dtype_(dtype),
      device_(device),
      seed_(seed),
      stream_(std::move(stream)),
      origin_("random weights (seed " + std::to_string(seed) + ")") {}

bool RandomWeights::has(const std::string& name) const {
  if (name == "lm_head.weight") return !config_.tie_word_embeddings;
  // MoE experts in the transformers 4.x names (per-expert w1/w2/w3 under block_sparse_moe for
  // Mixtral, gate_proj/up_proj/down_proj under mlp.experts.N for Qwen3-MoE), never the fused
  // 5.x ones (mlp.experts.gate_up_proj / down_proj).
  if (config_.arch == Architecture::kQwen3Moe) {
    return !name.ends_with(".mlp.experts.gate_up_proj") &&
           !name.ends_with(".mlp.experts.down_proj");
  }
  return name.find(".mlp.gate.weight") == std::string::npos &&
         name.find(".mlp.experts.") == std::string::npos;
}

Tensor RandomWeights::get(const std::string& name, const Shape& shape) const {
  LORAPLEX_CHECK(has(name), origin_, ": no tensor '", name, "'");
  Tensor t = Tensor::empty(shape, dtype_, device_);
  // Every RMSNorm weight (input, post-attention, final, Qwen3's q_norm / k_norm).
  const bool norm = name.ends_with("norm.weight");
  ops::FillUniformArgs a;
  a.dtype = dtype_;
  a.n = t.numel();
  a.seed = seed_ ^ std::hash<std::string>{}(name);
  a.lo = norm ? 1.0f : -0.04f;
  a.hi = norm ? 1.0f : 0.04f;
  a.out = t.data_ptr();
  throw_if_error(ops::run(&ops::cpu::fill_uniform, &ops::cuda::fill_uniform, a, stream_));
  return t;
}

}  // namespace loraplex::model
