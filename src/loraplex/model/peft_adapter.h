#pragma once
// A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) read against
// the modules a Decoder exposes: every tensor is matched to a target, checked for shape and rank
// and scaled (lora_alpha / r, or / sqrt(r) with use_rslora; rank_pattern and alpha_pattern per
// module) at load, so a broken adapter fails before any generation, naming the adapter, the
// file and the problem. Installing it into a slot cannot fail afterwards.

#include <map>
#include <string>
#include <vector>

#include "loraplex/core/tensor.h"
#include "loraplex/model/decoder.h"

namespace loraplex::model {

class PeftAdapter {
 public:
  /// Loads and validates `dir` for `targets` with ranks up to `max_rank` (0 = any rank).
  static PeftAdapter load(const std::string& name, const std::string& dir,
                          const std::map<std::string, LoraTarget>& targets, int max_rank);

  /// The largest rank adapter_config.json declares (r and every rank_pattern value), read
  /// without the weights; throws naming the adapter and the file.
  static int config_max_rank(const std::string& name, const std::string& dir);

  const std::string& name() const { return name_; }
  /// The largest rank of any module (after rank_pattern).
  int max_rank() const { return max_rank_; }
  /// Programs `slot` of every module of `decoder` (modules the adapter does not target are
  /// reset, so the slot holds exactly this adapter).
  void install(Decoder& decoder, int slot) const;

 private:
  struct Module {
    LoraTarget target;
    Tensor a;  // float32 [r, in] (3-D experts: [r * E, in]; embedding: [r, vocab])
    Tensor b;  // float32 [out, r], scale folded in
  };
  std::string name_;
  int max_rank_ = 0;
  std::map<std::string, Module> modules_;
};

}  // namespace loraplex::model
