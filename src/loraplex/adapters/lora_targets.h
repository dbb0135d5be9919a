#pragma once
// The adapter <-> model contract: the model registers every module an adapter may target and
// the LoRA layer (and slice of it) that serves the module; the adapter loader matches PEFT
// weight names against these targets and the manager writes adapters into the layers' slots.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/layers/fused_moe.h"
#include "loraplex/layers/lora_layer.h"

namespace loraplex {

/// The name this code used for LoraSliceWeights before the layers defined it.
using LoraSlice = LoraSliceWeights;

/// What the adapter manager needs from one LoRA layer: write an adapter into a slot, clear a
/// slot. Copies share the layer; handles compare equal when they refer to the same layer.
class LoraLayerHandle {
 public:
  using SetFn = std::function<void(int slot, const std::vector<LoraSliceWeights>& slices,
                                   const Stream& stream)>;
  using ResetFn = std::function<void(int slot, const Stream& stream)>;

  LoraLayerHandle() = default;
  /// `name` is used in messages; `num_slices` is the length of the slices vector set_lora takes.
  LoraLayerHandle(std::string name, int num_slices, SetFn set_lora, ResetFn reset_lora);

  /// Wraps a layer with set_lora(slot, std::vector<LoraSliceWeights>) and reset_lora(slot)
  /// (LoraLinear: num_slices = num_lora_slices(); VocabEmbeddingWithLora and
  /// LogitsProcessorWithLora: 1). When the layer also has stream-taking overloads
  /// (set_lora(slot, slices, stream), reset_lora(slot, stream)) those are used, so uploads run
  /// on the adapter manager's copy stream. The layer must outlive the handle.
  template <typename Layer>
  static LoraLayerHandle of(Layer& layer, std::string name, int num_slices) {
    return wrap(layer, std::move(name), num_slices);
  }
  /// The same, spelled as before the layers' slice type existed (of<LoraSliceWeights>(...)).
  template <typename SliceWeights, typename Layer>
  static LoraLayerHandle of(Layer& layer, std::string name, int num_slices) {
    static_assert(std::is_same_v<SliceWeights, LoraSliceWeights>,
                  "layers take std::vector<LoraSliceWeights>");
    return wrap(layer, std::move(name), num_slices);
  }
  /// Wraps the per-rank instances of one tensor-parallel layer (one per rank, all of the same
  /// kind): set_lora and reset_lora go to every rank (each takes its own shard of the full
  /// weights). Uploads use each layer's own default stream.
  template <typename Layer>
  static LoraLayerHandle of_ranks(std::vector<Layer*> ranks, std::string name, int num_slices);
  /// Wraps a fused MoE layer. Its slices (see MoeSlices) are the per-expert 2-D adapters
  /// (w1, w3, w2 of each expert) and PEFT's two 3-D expert parameters (gate_up, down); a
  /// 3-D gate_up is split into w1 / w3 by `layout` (the base gate_up_proj row order).
  static LoraLayerHandle of_moe(FusedMoeWithLora& layer, std::string name, GateUpLayout layout);

  bool defined() const { return impl_ != nullptr; }
  const std::string& name() const;
  int num_slices() const;
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream) const;
  void reset_lora(int slot, const Stream& stream) const;
  bool operator==(const LoraLayerHandle& other) const { return impl_ == other.impl_; }

 private:
  template <typename Layer>
  static LoraLayerHandle wrap(Layer& layer, std::string name, int num_slices);

  struct Impl {
    std::string name;
    int num_slices = 0;
    SetFn set;
    ResetFn reset;
  };
  std::shared_ptr<const Impl> impl_;
};

/// Slice indices of a fused MoE layer handle (LoraLayerHandle::of_moe) with E experts: the
/// per-expert 2-D adapters (transformers-4 modules "...experts.<e>.w1", ".w3", ".w2") and PEFT's
/// two 3-D expert parameters (kExperts3d targets "gate_up_proj" and "down_proj").
struct MoeSlices {
  static constexpr int w1(int e) { return e; }
  static constexpr int w3(int num_experts, int e) { return num_experts + e; }
  static constexpr int w2(int num_experts, int e) { return 2 * num_experts + e; }
  static constexpr int gate_up_3d(int num_experts) { return 3 * num_experts; }
  static constexpr int down_3d(int num_experts) { return 3 * num_experts + 1; }
  static constexpr int count(int num_experts) { return 3 * num_experts + 2; }
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
  /// the parameter's layout: [E, in, out] used as x @ W[e] (false, GPT-OSS), or [E, out, in]
  /// used as x @ W[e]^T (true, transformers-5 Mixtral / Qwen MoE). The layout decides how PEFT
  /// saved the pair: PEFT >= 0.19 (and transformers' patch) saves A [r E, in], B [out, r E]
  /// for both; PEFT 0.18 saved A [r E, out], B [in, r E] for [E, out, in] parameters. Both are
  /// read (by shape, by peft_version when square). Register the parameters of one module in
  /// the module's parameter order: PEFT nests one wrapper per targeted parameter in that
  /// order, which decides which saved pair ("experts.base_layer.lora_A" or "experts.lora_A")
  /// belongs to which parameter.
  std::string parameter;
  int64_t num_experts = 0;
  bool parameter_out_in = false;

  /// The layer copies these weights into a host staging buffer of its own before the upload
  /// (the MoE layer does, one buffer per expert stack), so the adapter loader keeps them in
  /// pageable memory: pinning host memory is a slow driver call, and pinned sources only pay
  /// off for weights that are copied to the device directly.
  bool staged_on_host = false;
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

template <typename Layer>
concept HasStreamSetLora = requires(Layer& layer, const std::vector<LoraSliceWeights>& slices,
                                    const Stream& stream) {
  layer.set_lora(0, slices, stream);
  layer.reset_lora(0, stream);
};

}  // namespace detail

template <typename Layer>
LoraLayerHandle LoraLayerHandle::wrap(Layer& layer, std::string name, int num_slices) {
  Layer* l = &layer;
  SetFn set = [l](int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream) {
    if constexpr (detail::HasStreamSetLora<Layer>) {
      l->set_lora(slot, slices, stream);
    } else {
      (void)stream;
      l->set_lora(slot, slices);
    }
  };
  ResetFn reset = [l](int slot, const Stream& stream) {
    if constexpr (detail::HasStreamSetLora<Layer>) {
      l->reset_lora(slot, stream);
    } else {
      (void)stream;
      l->reset_lora(slot);
    }
  };
  return LoraLayerHandle(std::move(name), num_slices, std::move(set), std::move(reset));
}

template <typename Layer>
LoraLayerHandle LoraLayerHandle::of_ranks(std::vector<Layer*> ranks, std::string name,
                                          int num_slices) {
  LORAPLEX_CHECK(!ranks.empty(), "LoRA layer '", name, "': no ranks");
  SetFn set = [ranks](int slot, const std::vector<LoraSliceWeights>& slices, const Stream&) {
    for (Layer* l : ranks) l->set_lora(slot, slices);
  };
  ResetFn reset = [ranks](int slot, const Stream&) {
    for (Layer* l : ranks) l->reset_lora(slot);
  };
  return LoraLayerHandle(std::move(name), num_slices, std::move(set), std::move(reset));
}

}  // namespace loraplex
