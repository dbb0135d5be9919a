#pragma once
// Where a decoder's base weights come from: a checkpoint (memory-mapped safetensors, read
// through the fast upload path) or random values of a real model's shapes made on the model's
// device (benchmarks at real sizes without 16 GB files).

#include <cstdint>
#include <memory>
#include <string>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/layers/fp8_weight.h"
#include "loraplex/model/checkpoint.h"
#include "loraplex/model/config.h"

namespace loraplex::model {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool has(const std::string& name) const = 0;
  /// Tensor `name`, checked to have `shape` and a float dtype: a CPU view, or a tensor on the
  /// model's device in its dtype. Throws naming the source and the tensor.
  virtual Tensor get(const std::string& name, const Shape& shape) const = 0;
  /// The base weight of the projection `module` ("model.layers.0.self_attn.q_proj"):
  /// "<module>.weight" of `shape`, float, or float8_e4m3 with its scales in an FP8 model.
  virtual BaseWeight linear(const std::string& module, const Shape& shape) const = 0;
  /// Names the source in messages.
  virtual const std::string& origin() const = 0;
};

class CheckpointWeights : public WeightSource {
 public:
  /// `quant`: the checkpoint's quantization_config (ModelConfig::quant).
  CheckpointWeights(const std::string& dir, QuantConfig quant)
      : ckpt_(Checkpoint::open(dir)), quant_(std::move(quant)) {}
  bool has(const std::string& name) const override { return ckpt_.has(name); }
  Tensor get(const std::string& name, const Shape& shape) const override;
  BaseWeight linear(const std::string& module, const Shape& shape) const override;
  const std::string& origin() const override { return ckpt_.dir(); }
  const Checkpoint& checkpoint() const { return ckpt_; }

 private:
  Checkpoint ckpt_;
  QuantConfig quant_;
};

/// Every tensor a checkpoint of `config` holds (MoE experts with the transformers 4.x names),
/// uniform in [-0.04, 0.04] from a hash of (seed, name, index), on `device` in `dtype`; RMSNorm
/// weights are 1. Made on `stream` as they are asked for (the
/// caller copies each before asking for the next on the same stream, so memory is reused).
/// A quantized config (the *-fp8 shapes) gets float8_e4m3 projections with per-channel scales
/// (host float32, about 0.04 / 448, so the dequantised weights span the same range).
class RandomWeights : public WeightSource {
 public:
  RandomWeights(const ModelConfig& config, DType dtype, Device device, uint64_t seed,
                Stream stream);
  bool has(const std::string& name) const override;
  Tensor get(const std::string& name, const Shape& shape) const override;
  BaseWeight linear(const std::string& module, const Shape& shape) const override;
  const std::string& origin() const override { return origin_; }

 private:
  // `shape` of `dtype` uniform in [lo, hi] from (seed, name), on the device.
  Tensor uniform(const std::string& name, const Shape& shape, DType dtype, float lo,
                 float hi) const;

  ModelConfig config_;
  DType dtype_;
  Device device_;
  uint64_t seed_;
  Stream stream_;
  std::string origin_;
};

}  // namespace loraplex::model
