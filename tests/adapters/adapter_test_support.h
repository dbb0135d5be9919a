#pragma once
// Shared pieces of the adapter tests: temporary directories, writing PEFT-style adapters, and
// a tiny-llama target registry over recording layers (layers that keep what set_lora gave them,
// so tests can check exactly what the adapter code hands to the layers).

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/adapters/lora_targets.h"
#include "loraplex/core/tensor.h"

namespace loraplex::test {

inline const std::string kTinyLlama = std::string(LORAPLEX_TEST_DATA_DIR) + "/tiny-llama";
inline const std::string kTinyLlamaAdapters = kTinyLlama + "/adapters";

/// tiny-llama's dimensions (testdata/tiny-llama/model/config.json).
struct TinyLlamaDims {
  static constexpr int kLayers = 3;
  static constexpr int64_t kHidden = 128;
  static constexpr int64_t kHeadDim = 32;
  static constexpr int64_t kHeads = 4;
  static constexpr int64_t kKvHeads = 2;
  static constexpr int64_t kIntermediate = 320;
  static constexpr int64_t kVocab = 1024;
};

/// A directory under the system temp directory, removed with everything in it.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// Writes `dir`/adapter_config.json (the text as given) and `dir`/adapter_model.safetensors.
void write_adapter(const std::string& dir, const std::string& config_json,
                   const std::vector<std::pair<std::string, Tensor>>& tensors);
/// Reads a whole text file.
std::string read_text(const std::string& path);

/// Keeps the slices of every slot as set_lora gave them (thread-safe).
class RecordingLayer {
 public:
  RecordingLayer(std::string name, int num_slices);
  LoraLayerHandle handle() const { return handle_; }
  /// What the slot holds: the slices of the last set_lora, or empty after reset_lora / never.
  std::vector<LoraSlice> slot(int slot) const;
  int set_calls() const;
  int reset_calls() const;

 private:
  mutable std::mutex mutex_;
  std::map<int, std::vector<LoraSlice>> slots_;
  int set_calls_ = 0;
  int reset_calls_ = 0;
  LoraLayerHandle handle_;
};

/// tiny-llama's LoRA targets over recording layers: per decoder layer a QKV layer (q, k, v
/// slices), o_proj, a merged gate_up layer (gate, up) and down_proj; the embedding and lm_head
/// with their base weights from the fixture model (unless `with_base_weights` is false).
struct TinyLlamaTargets {
  explicit TinyLlamaTargets(bool with_base_weights = true);
  LoraTargetRegistry registry;
  std::vector<std::unique_ptr<RecordingLayer>> layers;  // registry.layers() order
  /// The recording layer serving `module`.
  RecordingLayer& layer_of(const std::string& module);
};

}  // namespace loraplex::test
