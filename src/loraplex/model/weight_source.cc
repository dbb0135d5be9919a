#include "loraplex/model/weight_source.h"

#include <functional>

#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"
#include "loraplex/model/fp8_checkpoint.h"

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

BaseWeight CheckpointWeights::linear(const std::string& module, const Shape& shape) const {
  return read_linear_weight(ckpt_, quant_, module, shape);
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

Tensor RandomWeights::uniform(const std::string& name, const Shape& shape, DType dtype, float lo,
                              float hi) const {
  Tensor t = Tensor::empty(shape, dtype, device_);
  ops::FillUniformArgs a;
  a.dtype = dtype;
  a.n = t.numel();
  a.seed = seed_ ^ std::hash<std::string>{}(name);
  a.lo = lo;
  a.hi = hi;
  a.out = t.data_ptr();
  throw_if_error(ops::run(&ops::cpu::fill_uniform, &ops::cuda::fill_uniform, a, stream_));
  return t;
}

Tensor RandomWeights::get(const std::string& name, const Shape& shape) const {
  LORAPLEX_CHECK(has(name), origin_, ": no tensor '", name, "'");
  // Every RMSNorm weight (input, post-attention, final, Qwen3's q_norm / k_norm).
  const bool norm = name.ends_with("norm.weight");
  return uniform(name, shape, dtype_, norm ? 1.0f : -0.04f, norm ? 1.0f : 0.04f);
}

BaseWeight RandomWeights::linear(const std::string& module, const Shape& shape) const {
  BaseWeight b;
  if (!config_.quant.quantized()) {
    b.weight = get(module + ".weight", shape);
    return b;
  }
  LORAPLEX_CHECK(shape.size() == 2 && has(module + ".weight"), origin_, ": no projection '", module,
                 "' of shape ", shape_str(shape));
  // Codes over the whole e4m3 range and per-channel scales around 0.04 / 448: dequantised
  // weights of the same size as the float models' random ones.
  b.weight = uniform(module + ".weight", shape, DType::kF8E4M3, -kE4M3Max, kE4M3Max);
  b.scale = Tensor::empty({shape[0], 1}, DType::kF32);
  const uint64_t h = seed_ ^ std::hash<std::string>{}(module + ".weight_scale");
  for (int64_t r = 0; r < shape[0]; ++r) {
    const double u =
        static_cast<double>((h + static_cast<uint64_t>(r) * 0x9e3779b97f4a7c15ULL) >> 11) /
        9007199254740992.0;
    b.scale.data<float>()[r] = static_cast<float>((0.5 + u) * 0.04 / kE4M3Max);
  }
  b.group_n = 1;
  b.group_k = shape[1];
  return b;
}

}  // namespace loraplex::model
