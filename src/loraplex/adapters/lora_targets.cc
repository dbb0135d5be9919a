#include "loraplex/adapters/lora_targets.h"

#include <functional>

namespace loraplex {

LoraLayerHandle::LoraLayerHandle(std::string name, int num_slices, SetFn set_lora,
                                 ResetFn reset_lora) {
  LORAPLEX_CHECK(num_slices > 0, "LoRA layer '", name, "' must have at least one slice, got ",
                 num_slices);
  LORAPLEX_CHECK(set_lora && reset_lora, "LoRA layer '", name,
                 "' needs both set_lora and reset_lora");
  auto impl = std::make_shared<Impl>();
  impl->name = std::move(name);
  impl->num_slices = num_slices;
  impl->set = std::move(set_lora);
  impl->reset = std::move(reset_lora);
  impl_ = std::move(impl);
}

const std::string& LoraLayerHandle::name() const {
  LORAPLEX_CHECK(defined(), "name() of an undefined LoRA layer handle");
  return impl_->name;
}

int LoraLayerHandle::num_slices() const {
  LORAPLEX_CHECK(defined(), "num_slices() of an undefined LoRA layer handle");
  return impl_->num_slices;
}

void LoraLayerHandle::set_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                               const Stream& stream) const {
  LORAPLEX_CHECK(defined(), "set_lora on an undefined LoRA layer handle");
  LORAPLEX_CHECK(static_cast<int>(slices.size()) == impl_->num_slices, "LoRA layer '", impl_->name,
                 "' takes ", impl_->num_slices, " slices, got ", slices.size());
  impl_->set(slot, slices, stream);
}

void LoraLayerHandle::reset_lora(int slot, const Stream& stream) const {
  LORAPLEX_CHECK(defined(), "reset_lora on an undefined LoRA layer handle");
  impl_->reset(slot, stream);
}

LoraLayerHandle LoraLayerHandle::of_moe(FusedMoeWithLora& layer, std::string name,
                                        GateUpLayout layout) {
  const int experts = layer.spec().num_experts;
  const int64_t intermediate = layer.spec().intermediate;
  FusedMoeWithLora* l = &layer;
  SetFn set = [l, experts, intermediate, layout](
                  int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream) {
    MoeLoraWeights w;
    auto per_expert = [&](int first, std::vector<LoraSliceWeights>& out) {
      for (int e = 0; e < experts; ++e) {
        if (slices[static_cast<size_t>(first + e)].a.defined()) {
          out.assign(slices.begin() + first, slices.begin() + first + experts);
          return;
        }
      }
    };
    per_expert(MoeSlices::w1(0), w.w1);
    per_expert(MoeSlices::w3(experts, 0), w.w3);
    per_expert(MoeSlices::w2(experts, 0), w.w2);
    auto unstack = [&](const LoraSliceWeights& s) {
      std::vector<LoraSliceWeights> out(static_cast<size_t>(experts));
      for (int e = 0; e < experts; ++e)
        out[static_cast<size_t>(e)] = {s.a.select(0, e), s.b.select(0, e)};
      return out;
    };
    const LoraSliceWeights& gate_up = slices[static_cast<size_t>(MoeSlices::gate_up_3d(experts))];
    if (gate_up.a.defined()) {
      LORAPLEX_CHECK(w.w1.empty() && w.w3.empty(), "MoE layer: an adapter has both per-expert ",
                     "w1/w3 and 3-D gate_up weights");
      split_gate_up_lora(unstack(gate_up), intermediate, layout, w.w1, w.w3);
    }
    const LoraSliceWeights& down = slices[static_cast<size_t>(MoeSlices::down_3d(experts))];
    if (down.a.defined()) {
      LORAPLEX_CHECK(w.w2.empty(), "MoE layer: an adapter has both per-expert w2 and 3-D down ",
                     "weights");
      w.w2 = unstack(down);
    }
    l->set_lora(slot, w, stream);
  };
  ResetFn reset = [l](int slot, const Stream& stream) { l->reset_lora(slot, stream); };
  return LoraLayerHandle(std::move(name), MoeSlices::count(experts), std::move(set),
                         std::move(reset));
}

const char* target_kind_name(TargetKind kind) {
  switch (kind) {
    case TargetKind::kLinear:
      return "linear";
    case TargetKind::kEmbedding:
      return "embedding";
    case TargetKind::kLmHead:
      return "lm_head";
    case TargetKind::kExperts3d:
      return "3-D experts";
  }
  return "?";
}

void LoraTargetRegistry::add(LoraTarget target) {
  const std::string what = target.kind == TargetKind::kExperts3d
                               ? target.module + "." + target.parameter
                               : target.module;
  LORAPLEX_CHECK(!target.module.empty(), "LoRA target needs a module name");
  LORAPLEX_CHECK(target.layer.defined(), "LoRA target '", what, "' has no layer");
  LORAPLEX_CHECK(target.slice >= 0 && target.slice < target.layer.num_slices(), "LoRA target '",
                 what, "': slice ", target.slice, " is outside [0, ", target.layer.num_slices(),
                 ") of layer '", target.layer.name(), "'");
  LORAPLEX_CHECK(target.in_features > 0 && target.out_features > 0, "LoRA target '", what,
                 "' needs positive in_features and out_features, got ", target.in_features, " and ",
                 target.out_features);
  if (target.kind == TargetKind::kExperts3d) {
    LORAPLEX_CHECK(!target.parameter.empty() && target.num_experts > 0, "LoRA target '", what,
                   "' (3-D experts) needs a parameter name and num_experts > 0");
    LORAPLEX_CHECK(modules_.count(target.module) == 0, "LoRA target '", what,
                   "': module is already registered as a module target");
    for (size_t i : parameters_[target.module])
      LORAPLEX_CHECK(targets_[i].parameter != target.parameter, "LoRA target '", what,
                     "' is registered twice");
  } else {
    LORAPLEX_CHECK(target.parameter.empty(), "LoRA target '", what,
                   "': only 3-D expert targets name a parameter");
    LORAPLEX_CHECK(modules_.count(target.module) == 0 && parameters_.count(target.module) == 0,
                   "LoRA target '", what, "' is registered twice");
  }

  size_t layer = layers_.size();
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i] == target.layer) layer = i;
  auto used = used_slices_.find({layer, target.slice});
  LORAPLEX_CHECK(used == used_slices_.end(), "LoRA target '", what, "': slice ", target.slice,
                 " of layer '", target.layer.name(), "' is already served by '",
                 used == used_slices_.end() ? "" : targets_[used->second].module, "'");
  if (layer == layers_.size()) layers_.push_back(target.layer);

  const size_t index = targets_.size();
  used_slices_[{layer, target.slice}] = index;
  target_layer_.push_back(layer);
  if (target.kind == TargetKind::kExperts3d) {
    parameters_[target.module].push_back(index);
  } else {
    modules_[target.module] = index;
  }
  targets_.push_back(std::move(target));
}

size_t LoraTargetRegistry::layer_index(const LoraTarget& target) const {
  const std::less<const LoraTarget*> before;
  const LoraTarget* begin = targets_.data();
  LORAPLEX_CHECK(!before(&target, begin) && before(&target, begin + targets_.size()),
                 "layer_index: target '", target.module, "' is not in this registry");
  return target_layer_[static_cast<size_t>(&target - begin)];
}

const LoraTarget* LoraTargetRegistry::find_module(const std::string& module) const {
  auto it = modules_.find(module);
  return it == modules_.end() ? nullptr : &targets_[it->second];
}

std::vector<const LoraTarget*> LoraTargetRegistry::parameters_of(const std::string& module) const {
  std::vector<const LoraTarget*> out;
  auto it = parameters_.find(module);
  if (it != parameters_.end())
    for (size_t i : it->second) out.push_back(&targets_[i]);
  return out;
}

}  // namespace loraplex
