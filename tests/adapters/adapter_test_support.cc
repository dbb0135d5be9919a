#include "adapter_test_support.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "loraplex/adapters/safetensors.h"

namespace loraplex::test {

namespace fs = std::filesystem;

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "loraplex_adapters_XXXXXX").string();
  LORAPLEX_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp failed for ", tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void write_adapter(const std::string& dir, const std::string& config_json,
                   const std::vector<std::pair<std::string, Tensor>>& tensors) {
  fs::create_directories(dir);
  std::ofstream(dir + "/adapter_config.json") << config_json;
  write_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

RecordingLayer::RecordingLayer(std::string name, int num_slices) {
  handle_ = LoraLayerHandle(
      std::move(name), num_slices,
      [this](int slot, const std::vector<LoraSlice>& slices, const Stream&) {
        std::lock_guard<std::mutex> lock(mutex_);
        slots_[slot] = slices;
        ++set_calls_;
      },
      [this](int slot, const Stream&) {
        std::lock_guard<std::mutex> lock(mutex_);
        slots_.erase(slot);
        ++reset_calls_;
      });
}

std::vector<LoraSlice> RecordingLayer::slot(int slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find(slot);
  return it == slots_.end() ? std::vector<LoraSlice>{} : it->second;
}

int RecordingLayer::set_calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return set_calls_;
}

int RecordingLayer::reset_calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reset_calls_;
}

TinyLlamaTargets::TinyLlamaTargets(bool with_base_weights) {
  using D = TinyLlamaDims;
  auto add_layer = [&](const std::string& name, int slices) -> LoraLayerHandle {
    layers.push_back(std::make_unique<RecordingLayer>(name, slices));
    return layers.back()->handle();
  };
  Tensor embed_weight;
  Tensor head_weight;
  if (with_base_weights) {
    auto model = SafetensorsFile::open(kTinyLlama + "/model/model.safetensors");
    embed_weight = model.tensor("model.embed_tokens.weight");
    head_weight = model.tensor("lm_head.weight");
  }
  LoraTarget embed;
  embed.module = "model.embed_tokens";
  embed.layer = add_layer("embed_tokens", 1);
  embed.in_features = D::kVocab;
  embed.out_features = D::kHidden;
  embed.kind = TargetKind::kEmbedding;
  embed.base_weight = embed_weight;
  registry.add(embed);

  const int64_t q = D::kHeads * D::kHeadDim;
  const int64_t kv = D::kKvHeads * D::kHeadDim;
  for (int l = 0; l < D::kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LoraLayerHandle qkv = add_layer(p + "qkv_proj", 3);
    LoraLayerHandle o = add_layer(p + "o_proj", 1);
    LoraLayerHandle gate_up = add_layer(p + "gate_up_proj", 2);
    LoraLayerHandle down = add_layer(p + "down_proj", 1);
    auto linear = [&](const std::string& name, LoraLayerHandle h, int slice, int64_t in,
                      int64_t out) {
      LoraTarget t;
      t.module = p + name;
      t.layer = h;
      t.slice = slice;
      t.in_features = in;
      t.out_features = out;
      registry.add(t);
    };
    linear("self_attn.q_proj", qkv, 0, D::kHidden, q);
    linear("self_attn.k_proj", qkv, 1, D::kHidden, kv);
    linear("self_attn.v_proj", qkv, 2, D::kHidden, kv);
    linear("self_attn.o_proj", o, 0, q, D::kHidden);
    linear("mlp.gate_proj", gate_up, 0, D::kHidden, D::kIntermediate);
    linear("mlp.up_proj", gate_up, 1, D::kHidden, D::kIntermediate);
    linear("mlp.down_proj", down, 0, D::kIntermediate, D::kHidden);
  }

  LoraTarget head;
  head.module = "lm_head";
  head.layer = add_layer("lm_head", 1);
  head.in_features = D::kHidden;
  head.out_features = D::kVocab;
  head.kind = TargetKind::kLmHead;
  head.base_weight = head_weight;
  registry.add(head);
}

RecordingLayer& TinyLlamaTargets::layer_of(const std::string& module) {
  const LoraTarget* t = registry.find_module(module);
  LORAPLEX_CHECK(t != nullptr, "no target ", module);
  return *layers[registry.layer_index(*t)];
}

}  // namespace loraplex::test
