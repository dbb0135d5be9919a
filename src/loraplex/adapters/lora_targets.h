#pragma once
// The adapter <-> model contract: the model registers every module an adapter may target and
// the LoRA layer (and slice of it) that serves the module; the adapter loader matches PEFT
// weight names against these targets and the manager writes adapters into the layers' slots.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"

namespace loraplex {

/// One LoRA slice of one adapter as handed to a layer (the layers' LoraSliceWeights):
/// a = LoRA-A [rank, in], b = LoRA-B [out, rank] with the scale folded in, both on the CPU.
/// Undefined tensors mean the adapter does not target the slice (rank 0, exactly no effect).
struct LoraSlice {
  Tensor a;
  Tensor b;
};

/// What the adapter manager needs from one LoRA layer: write an adapter into a slot, clear a
/// slot. Copies share the layer; handles compare equal when they refer to the same layer.
class LoraLayerHandle {
 public:
  using SetFn =
      std::function<void(int slot, const std::vector<LoraSlice>& slices, const Stream& stream)>;
  using ResetFn = std::function<void(int slot, const Stream& stream)>;

  LoraLayerHandle() = default;
  /// `name` is used in messages; `num_slices` is the length of the slices vector set_lora takes.
  LoraLayerHandle(std::string name, int num_slices, SetFn set_lora, ResetFn reset_lora);

  /// Wraps a layer with set_lora(slot, std::vector<SliceWeights>) and reset_lora(slot), where
  /// SliceWeights has members a and b (the layers' LoraSliceWeights). When the layer also has
  /// stream-taking overloads (set_lora(slot, slices, stream), reset_lora(slot, stream)) those
  /// are used, so uploads run on the adapter manager's copy stream. The layer must outlive the
  /// handle.
  template <typename SliceWeights, typename Layer>
  static LoraLayerHandle of(Layer& layer, std::string name, int num_slices);

  bool defined() const { return impl_ != nullptr; }
  const std::string& name() const;
  int num_slices() const;
  void set_lora(int slot, const std::vector<LoraSlice>& slices, const Stream& stream) const;
  void reset_lora(int slot, const Stream& stream) const;
  bool operator==(const LoraLayerHandle& other) const { return impl_ == other.impl_; }

 private:
  struct Impl {
    std::string name;
    int num_slices = 0;
    SetFn set;
    ResetFn reset;
  };
  std::shared_ptr<const Impl> impl_;
};

enum class TargetKind {
  kLinear,     // nn.Linear projections (q/k/v/o, gate/up/down, per-expert w1/w2/w3, ...)
  kEmbedding,  // the token embedding (PEFT lora_embedding_A [r, vocab] / lora_embedding_B)
  kLmHead,     // the output head: a linear layer that "all-linear" leaves out
  kExperts3d,  // one 3-D expert parameter [num_experts, ., .] targeted by target_parameters
};

const char* target_kind_name(TargetKind kind);

/// One module (or 3-D parameter) an adapter may target.
struct LoraTarget {
  /// PEFT module path without "base_model.model.": "model.layers.0.self_attn.q_proj",
  /// "model.embed_tokens", "lm_head", "model.layers.3.mlp.experts" (kExperts3d).
  std::string module;
  LoraLayerHandle layer;
  /// Index of this target in the slices vector of layer.set_lora (q/k/v -> 0/1/2).
  int slice = 0;
  /// The forward dimensions: the module maps in_features -> out_features. kEmbedding: in =
  /// vocabulary size, out = embedding width. kExperts3d: per expert.
  int64_t in_features = 0;
  int64_t out_features = 0;
  TargetKind kind = TargetKind::kLinear;

  /// kEmbedding / kLmHead: the base weight [vocab, hidden] (any device, any float dtype) that
  /// PEFT's saved copies (<module>.base_layer.weight) are checked against. Undefined: adapters
  /// carrying such copies are refused.
  Tensor base_weight;

  /// kExperts3d: the parameter name ("gate_up_proj", "down_proj"), the number of experts, and
  /// the parameter's layout: [E, in, out] used as x @ W[e] (false), or [E, out, in] used as
  /// x @ W[e]^T (true). Register the parameters of one module in the module's parameter order:
  /// PEFT nests one wrapper per targeted parameter in that order, which decides which saved
  /// pair ("experts.base_layer.lora_A" or "experts.lora_A") belongs to which parameter.
  std::string parameter;
  int64_t num_experts = 0;
  bool parameter_out_in = false;
};

/// Every target of one model. Built once by the model before adapters load; read-only after.
class LoraTargetRegistry {
 public:
  /// Throws loraplex::Error on a duplicate (module, parameter), an undefined layer handle, a
  /// slice outside [0, layer.num_slices()), a slice used twice, or non-positive sizes.
  void add(LoraTarget target);

  const std::vector<LoraTarget>& targets() const { return targets_; }
  /// The distinct layers, in registration order.
  const std::vector<LoraLayerHandle>& layers() const { return layers_; }
  /// Index of `target.layer` in layers().
  size_t layer_index(const LoraTarget& target) const;
  /// The module target (kLinear, kEmbedding, kLmHead) named `module`, or nullptr.
  const LoraTarget* find_module(const std::string& module) const;
  /// The kExperts3d targets of `module`, in registration order (empty when none).
  std::vector<const LoraTarget*> parameters_of(const std::string& module) const;

 private:
  std::vector<LoraTarget> targets_;
  std::vector<LoraLayerHandle> layers_;
  std::vector<size_t> target_layer_;  // layer index of each target
  std::map<std::string, size_t> modules_;
  std::map<std::string, std::vector<size_t>> parameters_;
  std::map<std::pair<size_t, int>, size_t> used_slices_;  // (layer, slice) -> target
};

namespace detail {

template <typename Layer, typename Slices>
concept HasStreamSetLora = requires(Layer& layer, const Slices& slices, const Stream& stream) {
  layer.set_lora(0, slices, stream);
  layer.reset_lora(0, stream);
};

}  // namespace detail

template <typename SliceWeights, typename Layer>
LoraLayerHandle LoraLayerHandle::of(Layer& layer, std::string name, int num_slices) {
  using Slices = std::vector<SliceWeights>;
  Layer* l = &layer;
  SetFn set = [l](int slot, const std::vector<LoraSlice>& slices, const Stream& stream) {
    Slices converted(slices.size());
    for (size_t i = 0; i < slices.size(); ++i) {
      converted[i].a = slices[i].a;
      converted[i].b = slices[i].b;
    }
    if constexpr (detail::HasStreamSetLora<Layer, Slices>) {
      l->set_lora(slot, converted, stream);
    } else {
      (void)stream;
      l->set_lora(slot, converted);
    }
  };
  ResetFn reset = [l](int slot, const Stream& stream) {
    if constexpr (detail::HasStreamSetLora<Layer, Slices>) {
      l->reset_lora(slot, stream);
    } else {
      (void)stream;
      l->reset_lora(slot);
    }
  };
  return LoraLayerHandle(std::move(name), num_slices, std::move(set), std::move(reset));
}

}  // namespace loraplex
