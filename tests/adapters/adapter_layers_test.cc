// The four tiny-llama fixture adapters through the adapter manager into the real LoRA layers
// (embedding, QKV, o_proj, merged gate_up, down_proj, logits), in one mixed batch, against
// base + scale * x A^T B^T computed in double directly from the safetensors files.

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <tuple>

#include "adapter_test_support.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/adapters/safetensors.h"
#include "loraplex/layers/fused_moe.h"
#include "loraplex/layers/logits_processor.h"
#include "loraplex/layers/lora_linear.h"
#include "loraplex/layers/vocab_embedding.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using D = test::TinyLlamaDims;

constexpr int kMaxLoras = 4;
constexpr int kMaxRank = 16;
constexpr int kTokens = 29;
constexpr int kSeqs = 9;
const char* const kAdapters[] = {"sql", "pirate", "rslora", "vocab"};
// lora_alpha / r (sqrt(r) for rslora), from the fixture manifest.
const std::map<std::string, double> kScale = {
    {"sql", 2.0}, {"pirate", 2.0}, {"rslora", 4.0}, {"vocab", 1.0}};

// tiny-llama as real LoRA layers on the CPU in float32, base weights from the fixture.
struct TinyLlamaLayers {
  TinyLlamaLayers()
      : model(SafetensorsFile::open(test::kTinyLlama + "/model/model.safetensors")),
        embed(D::kVocab, D::kHidden, DType::kF32, config(), nullptr, Device::cpu(), kTokens),
        head(D::kHidden, D::kVocab, DType::kF32, config(), nullptr, Device::cpu(), kSeqs) {
    embed.load_base(model.tensor("model.embed_tokens.weight"));
    head.load_base(model.tensor("lm_head.weight"));
    add("model.embed_tokens", LoraLayerHandle::of(embed, "embed_tokens", 1), 0, D::kVocab,
        D::kHidden, TargetKind::kEmbedding, model.tensor("model.embed_tokens.weight"));
    const int64_t q = D::kHeads * D::kHeadDim;
    const int64_t kv = D::kKvHeads * D::kHeadDim;
    for (int l = 0; l < D::kLayers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      qkv.push_back(
          linear(LinearSpec::qkv(D::kHidden, D::kHeadDim, D::kHeads, D::kKvHeads, DType::kF32),
                 {p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"},
                 {q, kv, kv}, D::kHidden));
      o.push_back(linear(LinearSpec::row(q, D::kHidden, DType::kF32), {p + "self_attn.o_proj"},
                         {D::kHidden}, q));
      gate_up.push_back(linear(
          LinearSpec::merged_column(D::kHidden, {D::kIntermediate, D::kIntermediate}, DType::kF32),
          {p + "mlp.gate_proj", p + "mlp.up_proj"}, {D::kIntermediate, D::kIntermediate},
          D::kHidden));
      down.push_back(linear(LinearSpec::row(D::kIntermediate, D::kHidden, DType::kF32),
                            {p + "mlp.down_proj"}, {D::kHidden}, D::kIntermediate));
    }
    add("lm_head", LoraLayerHandle::of(head, "lm_head", 1), 0, D::kHidden, D::kVocab,
        TargetKind::kLmHead, model.tensor("lm_head.weight"));
  }

  static LoraConfig config() { return LoraConfig{kMaxLoras, kMaxRank, DType::kF32, false}; }

  void add(const std::string& module, LoraLayerHandle layer, int slice, int64_t in, int64_t out,
           TargetKind kind, Tensor base_weight = Tensor()) {
    LoraTarget t;
    t.module = module;
    t.layer = std::move(layer);
    t.slice = slice;
    t.in_features = in;
    t.out_features = out;
    t.kind = kind;
    t.base_weight = std::move(base_weight);
    registry.add(std::move(t));
  }

  struct Linear {
    std::unique_ptr<LoraLinear> layer;
    std::vector<std::string> modules;  // one per output slice
  };

  Linear linear(LinearSpec spec, std::vector<std::string> modules, std::vector<int64_t> outs,
                int64_t in) {
    Linear out;
    out.layer = std::make_unique<LoraLinear>(spec, config(), nullptr, Device::cpu(), kTokens);
    std::vector<Tensor> weights;
    for (const std::string& m : modules) weights.push_back(model.tensor(m + ".weight"));
    out.layer->load_base(weights);
    LoraLayerHandle h = LoraLayerHandle::of(*out.layer, spec.kind, out.layer->num_lora_slices());
    for (size_t s = 0; s < modules.size(); ++s)
      add(modules[s], h, static_cast<int>(s), in, outs[s], TargetKind::kLinear);
    out.modules = std::move(modules);
    return out;
  }

  SafetensorsFile model;
  VocabEmbeddingWithLora embed;
  LogitsProcessorWithLora head;
  std::vector<Linear> qkv, o, gate_up, down;
  LoraTargetRegistry registry;
};

// Adapter weights straight from the files.
struct FixtureWeights {
  FixtureWeights() {
    for (const char* n : kAdapters)
      files.emplace(n, SafetensorsFile::open(test::kTinyLlamaAdapters + "/" + n +
                                             "/adapter_model.safetensors"));
  }
  // {A, B} of `module` in adapter `name`, or undefined tensors when it does not target it.
  std::pair<Tensor, Tensor> pair(const std::string& name, const std::string& module,
                                 bool embedding = false) const {
    const SafetensorsFile& f = files.at(name);
    const std::string p = "base_model.model." + module;
    const std::string a = p + (embedding ? ".lora_embedding_A" : ".lora_A.weight");
    const std::string b = p + (embedding ? ".lora_embedding_B" : ".lora_B.weight");
    if (!f.has(a)) return {};
    return {f.tensor(a), f.tensor(b)};
  }
  std::map<std::string, SafetensorsFile> files;
};

class AdapterLayers : public ::testing::Test {
 protected:
  void SetUp() override {
    AdapterManagerConfig c;
    c.max_loras = kMaxLoras;
    c.max_cpu_loras = kMaxLoras;
    c.max_lora_rank = kMaxRank;
    c.lora_dtype = DType::kF32;
    manager = std::make_unique<AdapterManager>(model.registry, c);
    for (const char* n : kAdapters) manager->load(n, test::kTinyLlamaAdapters + "/" + n);
    for (const char* n : kAdapters) {
      leases.push_back(manager->acquire(n));
      slot_adapter[leases.back().slot()] = n;
    }
    // Every slot and the base model, mixed.
    std::mt19937_64 rng(99);
    for (int t = 0; t < kTokens; ++t)
      token_slots.push_back(static_cast<int32_t>(rng() % (kMaxLoras + 1)) - 1);
    token_slots[0] = -1;
    for (int s = 0; s < kMaxLoras; ++s) token_slots[static_cast<size_t>(s + 1)] = s;
    for (int i = 0; i < kSeqs; ++i)
      seq_slots.push_back(static_cast<int32_t>(i % (kMaxLoras + 1)) - 1);
    punica.update_metadata(token_slots, seq_slots, Stream());
  }

  // A and B of (adapter, module) as double, cached; empty when the adapter does not target it.
  struct PairValues {
    std::vector<double> a;  // [r, in]
    std::vector<double> b;  // [out, r]
    int64_t rank = 0;
  };
  const PairValues& pair_values(const std::string& name, const std::string& module) const {
    auto key = std::make_pair(name, module);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    PairValues v;
    auto [a, b] = weights.pair(name, module);
    if (a.defined()) {
      v.a = a.to_double_vector();
      v.b = b.to_double_vector();
      v.rank = a.size(0);
    }
    return cache.emplace(key, std::move(v)).first->second;
  }

  // base + each token's adapter (scale * x A^T B^T), in double, for one linear layer.
  std::vector<double> reference(const TinyLlamaLayers::Linear& lin, const Tensor& x,
                                const std::vector<int32_t>& slots) const {
    std::vector<int64_t> widths;
    int64_t width = 0;
    for (const std::string& m : lin.modules) {
      widths.push_back(model.model.info(m + ".weight").shape[0]);
      width += widths.back();
    }
    const std::vector<double> xv = x.to_double_vector();
    const int64_t in = x.size(1);
    std::vector<double> y(static_cast<size_t>(x.size(0) * width), 0.0);
    int64_t col = 0;
    for (size_t s = 0; s < lin.modules.size(); ++s) {
      const std::vector<double> wv =
          model.model.tensor(lin.modules[s] + ".weight").to_double_vector();
      for (int64_t t = 0; t < x.size(0); ++t) {
        const double* xt = &xv[static_cast<size_t>(t * in)];
        const int32_t slot = slots[static_cast<size_t>(t)];
        const PairValues* lora =
            slot >= 0 ? &pair_values(slot_adapter.at(slot), lin.modules[s]) : nullptr;
        std::vector<double> xa;
        if (lora != nullptr && lora->rank > 0) {
          xa.assign(static_cast<size_t>(lora->rank), 0.0);
          for (int64_t r = 0; r < lora->rank; ++r)
            for (int64_t k = 0; k < in; ++k) xa[r] += xt[k] * lora->a[r * in + k];
        }
        for (int64_t j = 0; j < widths[s]; ++j) {
          double acc = 0;
          for (int64_t k = 0; k < in; ++k) acc += xt[k] * wv[j * in + k];
          if (!xa.empty()) {
            double l = 0;
            for (int64_t r = 0; r < lora->rank; ++r) l += xa[r] * lora->b[j * lora->rank + r];
            acc += kScale.at(slot_adapter.at(slot)) * l;
          }
          y[static_cast<size_t>(t * width + col + j)] = acc;
        }
      }
      col += widths[s];
    }
    return y;
  }

  void check_linear(const TinyLlamaLayers::Linear& lin, int64_t in, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const Tensor x = test::random_tensor({kTokens, in}, DType::kF32, rng);
    auto lock = manager->lock_layers();
    const Tensor y = lin.layer->forward(x, punica, Stream());
    test::expect_close(y, reference(lin, x, token_slots), 2e-5, 1e-5, lin.modules[0]);
  }

  TinyLlamaLayers model;
  FixtureWeights weights;
  std::unique_ptr<AdapterManager> manager;
  std::vector<AdapterManager::Lease> leases;
  std::map<int, std::string> slot_adapter;
  std::vector<int32_t> token_slots;
  std::vector<int32_t> seq_slots;
  mutable std::map<std::pair<std::string, std::string>, PairValues> cache;
  PunicaWrapper punica{kMaxLoras, kTokens, kSeqs, Device::cpu()};
};

TEST_F(AdapterLayers, LinearLayersMatchPeftMath) {
  for (int l = 0; l < D::kLayers; ++l) {
    SCOPED_TRACE(l);
    check_linear(model.qkv[static_cast<size_t>(l)], D::kHidden, 10 + l);
    check_linear(model.o[static_cast<size_t>(l)], D::kHeads * D::kHeadDim, 20 + l);
    check_linear(model.gate_up[static_cast<size_t>(l)], D::kHidden, 30 + l);
    check_linear(model.down[static_cast<size_t>(l)], D::kIntermediate, 40 + l);
  }
}

TEST_F(AdapterLayers, EmbeddingMatchesPeftMath) {
  std::mt19937_64 rng(5);
  std::vector<int32_t> ids(kTokens);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % D::kVocab);
  const Tensor ids_t = Tensor::from_vector(ids, {kTokens});
  auto lock = manager->lock_layers();
  const Tensor y = model.embed.forward(ids_t, punica, Stream());
  const Tensor table = model.model.tensor("model.embed_tokens.weight");
  std::vector<double> want(static_cast<size_t>(kTokens * D::kHidden));
  for (int t = 0; t < kTokens; ++t) {
    const int32_t slot = token_slots[static_cast<size_t>(t)];
    Tensor a, b;
    if (slot >= 0) std::tie(a, b) = weights.pair(slot_adapter.at(slot), "model.embed_tokens", true);
    for (int64_t h = 0; h < D::kHidden; ++h) {
      double v = table.item({ids[static_cast<size_t>(t)], h});
      if (a.defined()) {
        double acc = 0;  // PEFT: embedding(id, A^T) @ B^T * scale
        for (int64_t r = 0; r < a.size(0); ++r)
          acc += a.item({r, ids[static_cast<size_t>(t)]}) * b.item({h, r});
        v += kScale.at(slot_adapter.at(slot)) * acc;
      }
      want[static_cast<size_t>(t * D::kHidden + h)] = v;
    }
  }
  test::expect_close(y, want, 1e-5, 1e-6, "embed_tokens");
  // Only the vocab adapter targets the embedding: its tokens must differ from the base.
  const int vocab_slot = leases[3].slot();
  bool changed = false;
  for (int t = 0; t < kTokens; ++t)
    if (token_slots[static_cast<size_t>(t)] == vocab_slot)
      changed |= y.item({t, 0}) != table.item({ids[static_cast<size_t>(t)], 0});
  EXPECT_TRUE(changed);
}

TEST_F(AdapterLayers, LogitsMatchPeftMath) {
  std::mt19937_64 rng(6);
  const Tensor x = test::random_tensor({kSeqs, D::kHidden}, DType::kF32, rng);
  auto lock = manager->lock_layers();
  const Tensor y = model.head.forward(x, punica, Stream());
  TinyLlamaLayers::Linear head_view;
  head_view.modules = {"lm_head"};
  test::expect_close(y, reference(head_view, x, seq_slots), 2e-5, 1e-5, "lm_head");
}

TEST_F(AdapterLayers, EvictionRewritesSlotsCompletely) {
  // One slot, every adapter in turn: each activation must leave no trace of the one before
  // (pirate targets every linear layer, rslora only the MLP, sql only attention, vocab the
  // embedding, lm_head and q_proj).
  leases.clear();
  AdapterManagerConfig c = manager->config();
  c.max_loras = 1;
  c.max_cpu_loras = 1;
  manager.reset();
  manager = std::make_unique<AdapterManager>(model.registry, c);
  for (const char* n : kAdapters) manager->load(n, test::kTinyLlamaAdapters + "/" + n);
  std::mt19937_64 rng(7);
  const Tensor x = test::random_tensor({kTokens, D::kHidden}, DType::kF32, rng);
  for (const char* n : {"pirate", "rslora", "sql", "vocab", "pirate", "sql", "rslora"}) {
    SCOPED_TRACE(n);
    auto lease = manager->acquire(n);
    ASSERT_EQ(lease.slot(), 0);
    slot_adapter[0] = n;
    std::vector<int32_t> slots(kTokens, 0);
    slots[3] = -1;
    punica.update_metadata(slots, std::vector<int32_t>(kSeqs, 0), Stream());
    auto lock = manager->lock_layers();
    for (int l = 0; l < D::kLayers; ++l) {
      const auto& qkv = model.qkv[static_cast<size_t>(l)];
      test::expect_close(qkv.layer->forward(x, punica, Stream()), reference(qkv, x, slots), 2e-5,
                         1e-5, std::string(n) + " qkv");
      const auto& gu = model.gate_up[static_cast<size_t>(l)];
      test::expect_close(gu.layer->forward(x, punica, Stream()), reference(gu, x, slots), 2e-5,
                         1e-5, std::string(n) + " gate_up");
    }
  }
}

// PEFT 3-D expert adapters (target_parameters on a transformers-5 MoE, saved by PEFT >= 0.19)
// through the manager into the fused MoE layer, against the same layer given the raw PEFT
// tensors through the layers' own conversion (peft_3d_expert_lora, split_gate_up_lora).
TEST(MoeAdapter, Peft3dExpertsThroughTheManagerMatchDirectSetLora) {
  constexpr int kE = 4, kR = 3, kT = 11;
  constexpr int64_t kH = 16, kI = 12;
  std::mt19937_64 rng(31);
  MoeSpec spec;
  spec.num_experts = kE;
  spec.top_k = 2;
  spec.hidden = kH;
  spec.intermediate = kI;
  spec.dtype = DType::kF32;
  const LoraConfig cfg{2, 8, DType::kF32, false};
  const Tensor router = test::random_tensor({kE, kH}, DType::kF32, rng);
  const Tensor gate_up = test::random_tensor({kE, 2 * kI, kH}, DType::kF32, rng, 0.3f);
  const Tensor down = test::random_tensor({kE, kH, kI}, DType::kF32, rng, 0.3f);
  FusedMoeWithLora managed(spec, cfg, nullptr, Device::cpu(), kT);
  FusedMoeWithLora direct(spec, cfg, nullptr, Device::cpu(), kT);
  managed.load_base_3d(router, gate_up, down);
  direct.load_base_3d(router, gate_up, down);

  LoraTargetRegistry registry;
  const LoraLayerHandle h =
      LoraLayerHandle::of_moe(managed, "experts", GateUpLayout::kConcatenated);
  for (const auto& [param, in, out, slice] :
       {std::tuple{"gate_up_proj", kH, 2 * kI, MoeSlices::gate_up_3d(kE)},
        std::tuple{"down_proj", kI, kH, MoeSlices::down_3d(kE)}}) {
    LoraTarget t;
    t.module = "model.layers.0.mlp.experts";
    t.layer = h;
    t.slice = slice;
    t.in_features = in;
    t.out_features = out;
    t.kind = TargetKind::kExperts3d;
    t.parameter = param;
    t.num_experts = kE;
    t.parameter_out_in = true;
    registry.add(t);
  }
  const Tensor gu_a = test::random_tensor({kR * kE, kH}, DType::kF32, rng, 0.5f);
  const Tensor gu_b = test::random_tensor({2 * kI, kR * kE}, DType::kF32, rng, 0.5f);
  const Tensor dn_a = test::random_tensor({kR * kE, kI}, DType::kF32, rng, 0.5f);
  const Tensor dn_b = test::random_tensor({kH, kR * kE}, DType::kF32, rng, 0.5f);
  test::TempDir tmp;
  const std::string m = "base_model.model.model.layers.0.mlp.experts.";
  test::write_adapter(tmp.sub("moe"),
                      R"({"r": 3, "lora_alpha": 6, "peft_version": "0.21.0",
                          "target_modules": null,
                          "target_parameters": ["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"]})",
                      {{m + "base_layer.lora_A.weight", gu_a},
                       {m + "base_layer.lora_B.weight", gu_b},
                       {m + "lora_A.weight", dn_a},
                       {m + "lora_B.weight", dn_b}});
  AdapterManagerConfig c;
  c.max_loras = 2;
  c.max_lora_rank = 8;
  c.lora_dtype = DType::kF32;
  AdapterManager manager(registry, c);
  manager.load("moe", tmp.sub("moe"));
  auto lease = manager.acquire("moe");

  auto scaled = [](const Tensor& b) {
    Tensor out = b.clone();
    float* p = out.data<float>();
    for (int64_t i = 0; i < out.numel(); ++i) p[i] *= 2.0f;  // lora_alpha / r
    return out;
  };
  MoeLoraWeights w;
  split_gate_up_lora(peft_3d_expert_lora(gu_a, scaled(gu_b), kE), kI, GateUpLayout::kConcatenated,
                     w.w1, w.w3);
  w.w2 = peft_3d_expert_lora(dn_a, scaled(dn_b), kE);
  direct.set_lora(1, w);

  const Tensor x = test::random_tensor({kT, kH}, DType::kF32, rng);
  PunicaWrapper p_managed(2, kT, 1, Device::cpu());
  PunicaWrapper p_direct(2, kT, 1, Device::cpu());
  PunicaWrapper p_base(2, kT, 1, Device::cpu());
  p_managed.update_metadata(std::vector<int32_t>(kT, lease.slot()), {}, Stream());
  p_direct.update_metadata(std::vector<int32_t>(kT, 1), {}, Stream());
  p_base.update_metadata(std::vector<int32_t>(kT, -1), {}, Stream());
  auto lock = manager.lock_layers();
  const std::vector<double> got = managed.forward(x, p_managed, Stream()).to_double_vector();
  const Tensor want = direct.forward(x, p_direct, Stream());
  test::expect_close(want, got, 1e-5, 1e-6, "moe");
  const std::vector<double> base = managed.forward(x, p_base, Stream()).to_double_vector();
  EXPECT_GT(test::tolerance_ratio(got, base, 1e-3, 1e-3), 1.0) << "the adapter has an effect";
}

}  // namespace
}  // namespace loraplex
