#pragma once
// Where a decoder's base weights come from: a checkpoint (memory-mapped safetensors, read
// through the fast upload path) or random values of a real model's shapes made on the model's
// device (benchmarks at real sizes without 16 GB files).

#include <cstdint>
#include <memory>
#include <string>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
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
  /// Names the source in messages.
  virtual const std::string& origin() const = 0;
};

class CheckpointWeights : public WeightSource {
 public:
  explicit CheckpointWeights(const std::string& dir) : ckpt_(Checkpoint::open(dir)) {}
  bool has(const std::string& name) const override { return ckpt_.has(name); }
  Tensor get(const std::string& name, const Shape& shape) const override;
  const std::string& origin() const override { return ckpt_.dir(); }
  const Checkpoint& checkpoint() const { return ckpt_; }

 private:
  Checkpoint ckpt_;
};

/// Every tensor a checkpoint of `config` holds (MoE experts with the transformers 4.x names),
/// uniform in [-0.04, 0.04] from a hash of (seed, name, index), on `device` in `dtype`; RMSNorm
/// weights are 1. Made on `stream` as they are asked for (the
/// caller copies each before asking for the next on the same stream, so memory is reused).
class RandomWeights : public WeightSource {
 public:
  RandomWeights(const ModelConfig& config, DType dtype, Device device, uint64_t seed,
                Stream stream);
  bool has(const std::string& name) const override;
  Tensor get(const std::string& name, const Shape& shape) const override;
  const std::string& origin() const override { return origin_; }

 private:
  ModelConfig config_;
  DType dtype_;
  Device device_;
  uint64_t seed_;
  Stream stream_;
  std::string origin_;
};

}  // namespace loraplex::model
