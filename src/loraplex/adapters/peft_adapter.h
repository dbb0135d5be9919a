#pragma once
// Reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors),
// validates every tensor against the model's LoRA targets and packs it into the slices the
// layers' set_lora takes, with the scale folded into B once. Nothing here touches a layer:
// this is the disk -> CPU half of loading and may run on any thread.

#include <cstddef>
#include <string>
#include <vector>

#include "loraplex/adapters/lora_targets.h"
#include "loraplex/adapters/peft_config.h"
#include "loraplex/core/dtype.h"

namespace loraplex {

struct AdapterLoadOptions {
  /// Largest rank a slot accepts; a module of higher rank is refused.
  int max_lora_rank = 16;
  /// dtype of the packed weights (normally the layers' lora_dtype, so the layers do not
  /// convert again). B is scaled in float32 and rounded to this dtype once.
  DType dtype = DType::kF32;
  /// Put the packed weights in page-locked host memory, so uploads to a GPU can be
  /// asynchronous (needs CUDA).
  bool pinned = false;
};

/// One targeted module (or 3-D parameter) of an adapter.
struct AdapterModule {
  std::string key;  // module name, or "<module>.<parameter>" for 3-D experts
  TargetKind kind = TargetKind::kLinear;
  int rank = 0;
  double scale = 0.0;
};

/// An adapter validated against one model and packed for its layers.
struct PackedAdapter {
  std::string name;
  std::string dir;
  /// The largest rank among its modules; and the config-level scale (lora_alpha / r, or
  /// lora_alpha / sqrt(r) with use_rslora). Modules may differ (rank_pattern, alpha_pattern).
  int max_rank = 0;
  double scale = 0.0;
  std::vector<AdapterModule> modules;
  /// One entry per registry layer (LoraTargetRegistry::layers() order): the slices for
  /// set_lora, or empty when the adapter targets no slice of the layer (its slot is reset).
  std::vector<std::vector<LoraSlice>> layers;
  /// Bytes of packed weights.
  size_t bytes = 0;
};

/// The files of an adapter directory.
std::string adapter_config_path(const std::string& dir);
std::string adapter_weights_path(const std::string& dir);

/// Loads adapter `name` from `dir`. Throws loraplex::Error whose message starts with
/// "adapter '<name>'", names the file (and the tensor or config field) and the problem.
PackedAdapter load_peft_adapter(const std::string& name, const std::string& dir,
                                const LoraTargetRegistry& registry,
                                const AdapterLoadOptions& options);

}  // namespace loraplex
