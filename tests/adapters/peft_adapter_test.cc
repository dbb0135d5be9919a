#include "loraplex/adapters/peft_adapter.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "adapter_test_support.h"
#include "loraplex/adapters/safetensors.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using test::kTinyLlamaAdapters;
using test::TempDir;
using test::TinyLlamaTargets;

const std::string kAttn = "base_model.model.model.layers.0.self_attn.";

AdapterLoadOptions options(int max_rank = 16, DType dtype = DType::kF32) {
  AdapterLoadOptions o;
  o.max_lora_rank = max_rank;
  o.dtype = dtype;
  return o;
}

std::string module_of(const std::string& tensor) {
  std::string m = tensor.substr(std::string("base_model.model.").size());
  for (const char* s : {".lora_A.weight", ".lora_embedding_A"}) {
    const std::string suffix = s;
    if (m.size() > suffix.size() && m.compare(m.size() - suffix.size(), suffix.size(), suffix) == 0)
      return m.substr(0, m.size() - suffix.size());
  }
  return "";
}

// The fixture adapters: for every LoRA pair in the file, the packed slice holds A as stored and
// B times the scale from the manifest (alpha / r, or alpha / sqrt(r) for rslora).
TEST(PeftAdapter, FixtureAdaptersPackExactly) {
  const std::map<std::string, std::pair<double, int>> expected = {{"sql", {16.0 / 8, 8}},
                                                                  {"pirate", {32.0 / 16, 16}},
                                                                  {"rslora", {8.0 / 2, 4}},
                                                                  {"vocab", {8.0 / 8, 8}}};
  const std::map<std::string, size_t> pairs = {
      {"sql", 12}, {"pirate", 21}, {"rslora", 9}, {"vocab", 5}};
  for (const auto& [name, want] : expected) {
    SCOPED_TRACE(name);
    TinyLlamaTargets t;
    const std::string dir = kTinyLlamaAdapters + "/" + name;
    PackedAdapter p = load_peft_adapter(name, dir, t.registry, options());
    EXPECT_EQ(p.name, name);
    EXPECT_EQ(p.scale, want.first);
    EXPECT_EQ(p.max_rank, want.second);
    EXPECT_EQ(p.modules.size(), pairs.at(name));
    ASSERT_EQ(p.layers.size(), t.registry.layers().size());

    auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
    size_t checked = 0;
    std::set<std::pair<size_t, int>> targeted;
    for (const std::string& tensor : file.names()) {
      const std::string module = module_of(tensor);
      if (module.empty()) continue;
      const bool embedding = tensor.find("lora_embedding_A") != std::string::npos;
      const std::string b_name = embedding ? "base_model.model." + module + ".lora_embedding_B"
                                           : "base_model.model." + module + ".lora_B.weight";
      const LoraTarget* target = t.registry.find_module(module);
      ASSERT_NE(target, nullptr) << module;
      const size_t layer = t.registry.layer_index(*target);
      targeted.insert({layer, target->slice});
      ASSERT_FALSE(p.layers[layer].empty()) << module;
      const LoraSliceWeights& s = p.layers[layer][static_cast<size_t>(target->slice)];
      ASSERT_TRUE(s.a.defined() && s.b.defined()) << module;
      EXPECT_EQ(s.a.dtype(), DType::kF32);
      EXPECT_EQ(s.a.to_double_vector(), file.tensor(tensor).to_double_vector()) << module;
      std::vector<double> b = file.tensor(b_name).to_double_vector();
      for (double& v : b) v *= want.first;
      test::expect_close(s.b, b, 1e-7, 0.0, module);
      ++checked;
    }
    EXPECT_EQ(checked, pairs.at(name));
    // Everything else is untouched: layers without a target are empty, slices undefined.
    for (size_t l = 0; l < p.layers.size(); ++l) {
      for (size_t s = 0; s < p.layers[l].size(); ++s) {
        const bool want_defined = targeted.count({l, static_cast<int>(s)}) != 0;
        EXPECT_EQ(p.layers[l][s].a.defined(), want_defined) << l << "/" << s;
        EXPECT_EQ(p.layers[l][s].b.defined(), want_defined) << l << "/" << s;
      }
    }
    size_t bytes = 0;
    for (const auto& layer : p.layers)
      for (const auto& s : layer)
        if (s.a.defined()) bytes += s.a.nbytes() + s.b.nbytes();
    EXPECT_EQ(p.bytes, bytes);
  }
}

TEST(PeftAdapter, SqlLeavesMlpAndEmbeddingLayersEmpty) {
  TinyLlamaTargets t;
  PackedAdapter p = load_peft_adapter("sql", kTinyLlamaAdapters + "/sql", t.registry, options());
  for (size_t l = 0; l < t.registry.layers().size(); ++l) {
    const std::string& layer = t.registry.layers()[l].name();
    const bool attention =
        layer.find("qkv") != std::string::npos || layer.find("o_proj") != std::string::npos;
    EXPECT_EQ(p.layers[l].empty(), !attention) << layer;
  }
}

TEST(PeftAdapter, PacksIntoBf16WithOneRounding) {
  TinyLlamaTargets t;
  PackedAdapter p = load_peft_adapter("pirate", kTinyLlamaAdapters + "/pirate", t.registry,
                                      options(16, DType::kBF16));
  auto file = SafetensorsFile::open(kTinyLlamaAdapters + "/pirate/adapter_model.safetensors");
  const LoraTarget* up = t.registry.find_module("model.layers.1.mlp.up_proj");
  const LoraSliceWeights& s = p.layers[t.registry.layer_index(*up)][1];
  EXPECT_EQ(s.b.dtype(), DType::kBF16);
  const std::vector<double> b =
      file.tensor("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight").to_double_vector();
  const std::vector<double> got = s.b.to_double_vector();
  ASSERT_EQ(got.size(), b.size());
  for (size_t i = 0; i < b.size(); ++i)
    ASSERT_EQ(got[i], BFloat16::from_float(static_cast<float>(b[i] * 2.0)).to_float()) << i;
}

TEST(PeftAdapter, EmbeddingBaseCopiesMustEqualTheBaseModel) {
  {
    TinyLlamaTargets t;
    EXPECT_NO_THROW(
        load_peft_adapter("vocab", kTinyLlamaAdapters + "/vocab", t.registry, options()));
  }
  {
    TinyLlamaTargets t(/*with_base_weights=*/false);
    try {
      load_peft_adapter("vocab", kTinyLlamaAdapters + "/vocab", t.registry, options());
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("base_layer.weight"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("did not register"), std::string::npos) << e.what();
    }
  }
  {
    // A base model whose lm_head differs in one element from the adapter's copy.
    TinyLlamaTargets t;
    LoraTargetRegistry changed;
    for (LoraTarget target : t.registry.targets()) {
      if (target.kind == TargetKind::kLmHead) {
        target.base_weight = target.base_weight.clone();
        target.base_weight.narrow(0, 700, 1).narrow(1, 5, 1).fill_(0.25);
      }
      changed.add(target);
    }
    try {
      load_peft_adapter("vocab", kTinyLlamaAdapters + "/vocab", changed, options());
      ADD_FAILURE();
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("adapter 'vocab'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'base_model.model.lm_head.base_layer.weight' differs"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("[700, 5]"), std::string::npos) << msg;
    }
  }
}

// ------------------------------------------------------------------ crafted broken adapters

class BrokenAdapter : public ::testing::Test {
 protected:
  // A valid rank-4 adapter on layer 0's q_proj and v_proj.
  std::vector<std::pair<std::string, Tensor>> good_tensors() {
    return {{kAttn + "q_proj.lora_A.weight", rnd({4, 128})},
            {kAttn + "q_proj.lora_B.weight", rnd({128, 4})},
            {kAttn + "v_proj.lora_A.weight", rnd({4, 128})},
            {kAttn + "v_proj.lora_B.weight", rnd({64, 4})}};
  }
  static std::string config(const std::string& extra = "") {
    return R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
               "target_modules": ["q_proj", "v_proj"])" +
           (extra.empty() ? std::string() : ", " + extra) + "}";
  }
  Tensor rnd(const Shape& shape, DType dtype = DType::kF32) {
    return test::random_tensor(shape, dtype, rng_, 0.5f);
  }
  static void replace(std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& name,
                      Tensor value) {
    for (auto& [n, t] : tensors)
      if (n == name) t = value;
  }
  // Writes the adapter and expects load to refuse it with a message that names the adapter,
  // `file` and every one of `parts`.
  void expect_refused(const std::string& config_json,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::vector<std::string>& parts, int max_rank = 16,
                      const std::string& file = "adapter_model.safetensors") {
    const std::string dir = tmp_.sub("bad" + std::to_string(counter_++));
    test::write_adapter(dir, config_json, tensors);
    expect_dir_refused(dir, parts, max_rank, file);
  }
  void expect_dir_refused(const std::string& dir, const std::vector<std::string>& parts,
                          int max_rank = 16,
                          const std::string& file = "adapter_model.safetensors") {
    try {
      load_peft_adapter("bad", dir, targets_.registry, options(max_rank));
      ADD_FAILURE() << "accepted; expected " << parts.front();
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("adapter 'bad'", 0), 0u) << msg;
      EXPECT_NE(msg.find(dir + "/" + file), std::string::npos) << msg;
      for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
    }
  }

  std::mt19937_64 rng_{1234};
  TempDir tmp_;
  TinyLlamaTargets targets_;
  int counter_ = 0;
};

TEST_F(BrokenAdapter, TheBaselineLoads) {
  const std::string dir = tmp_.sub("good");
  test::write_adapter(dir, config(), good_tensors());
  PackedAdapter p = load_peft_adapter("good", dir, targets_.registry, options());
  const LoraTarget* q = targets_.registry.find_module("model.layers.0.self_attn.q_proj");
  const auto& qkv = p.layers[targets_.registry.layer_index(*q)];
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_TRUE(qkv[0].a.defined());
  EXPECT_FALSE(qkv[1].a.defined()) << "k_proj is not targeted: rank 0";
  EXPECT_TRUE(qkv[2].a.defined());
}

TEST_F(BrokenAdapter, UnknownModule) {
  auto t = good_tensors();
  t.emplace_back("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", rnd({4, 128}));
  t.emplace_back("base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight", rnd({128, 4}));
  expect_refused(config(), t,
                 {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight",
                  "no LoRA target named 'model.layers.7.self_attn.q_proj'"});
}

TEST_F(BrokenAdapter, ModuleNotSelectedByTheConfig) {
  auto t = good_tensors();
  t.emplace_back(kAttn + "k_proj.lora_A.weight", rnd({4, 128}));
  t.emplace_back(kAttn + "k_proj.lora_B.weight", rnd({64, 4}));
  expect_refused(config(), t, {kAttn + "k_proj.lora_A.weight", "target_modules"});
  expect_refused(config(R"("exclude_modules": ["v_proj"])"), good_tensors(),
                 {kAttn + "v_proj.lora_A.weight", "exclude_modules"});
  expect_refused(config(R"("layers_to_transform": [1])"), good_tensors(),
                 {kAttn + "q_proj.lora_A.weight", "layers_to_transform"});
}

TEST_F(BrokenAdapter, ShapesThatDoNotMatchTheBaseLayer) {
  auto t = good_tensors();
  replace(t, kAttn + "q_proj.lora_A.weight", rnd({4, 127}));
  expect_refused(config(), t, {kAttn + "q_proj.lora_A.weight", "[4, 127]", "needs [4, 128]"});
  t = good_tensors();
  replace(t, kAttn + "v_proj.lora_B.weight", rnd({128, 4}));
  expect_refused(config(), t, {kAttn + "v_proj.lora_B.weight", "[128, 4]", "needs [64, 4]"});
  t = good_tensors();
  replace(t, kAttn + "v_proj.lora_B.weight", rnd({64, 3}));
  expect_refused(config(), t, {kAttn + "v_proj.lora_B.weight", "needs [64, 4]"});
  t = good_tensors();
  replace(t, kAttn + "q_proj.lora_A.weight", rnd({4, 128, 1}));
  expect_refused(config(), t, {kAttn + "q_proj.lora_A.weight", "2-D"});
}

TEST_F(BrokenAdapter, RankDisagreesWithConfig) {
  auto t = good_tensors();
  replace(t, kAttn + "q_proj.lora_A.weight", rnd({2, 128}));
  replace(t, kAttn + "q_proj.lora_B.weight", rnd({128, 2}));
  expect_refused(config(), t, {kAttn + "q_proj.lora_A.weight", "rank 4", "'r'"});
  // The same tensors are right once rank_pattern says q_proj has rank 2.
  const std::string dir = tmp_.sub("pattern");
  test::write_adapter(dir, config(R"("rank_pattern": {"q_proj": 2})"), t);
  EXPECT_NO_THROW(load_peft_adapter("ok", dir, targets_.registry, options()));
}

TEST_F(BrokenAdapter, RankOverMaxLoraRank) {
  expect_refused(config(), good_tensors(), {"lora_A.weight", "rank 4 exceeds max_lora_rank 2"},
                 /*max_rank=*/2);
}

TEST_F(BrokenAdapter, UnsupportedDtypes) {
  auto t = good_tensors();
  replace(t, kAttn + "q_proj.lora_A.weight",
          Tensor::from_vector(std::vector<int32_t>(4 * 128, 1), {4, 128}));
  expect_refused(config(), t, {kAttn + "q_proj.lora_A.weight", "dtype I32"});
  t = good_tensors();
  replace(t, kAttn + "v_proj.lora_B.weight", rnd({64, 4}, DType::kF8E4M3));
  expect_refused(config(), t, {kAttn + "v_proj.lora_B.weight", "dtype F8_E4M3"});
}

TEST_F(BrokenAdapter, NanOrInfInWeights) {
  auto t = good_tensors();
  Tensor a = rnd({4, 128});
  a.narrow(0, 2, 1).narrow(1, 77, 1).fill_(std::numeric_limits<double>::quiet_NaN());
  replace(t, kAttn + "q_proj.lora_A.weight", a);
  expect_refused(config(), t, {kAttn + "q_proj.lora_A.weight", "nan", "[2, 77]", "finite"});
  t = good_tensors();
  Tensor b = rnd({64, 4}, DType::kBF16);
  b.narrow(0, 63, 1).narrow(1, 3, 1).fill_(-std::numeric_limits<double>::infinity());
  replace(t, kAttn + "v_proj.lora_B.weight", b);
  expect_refused(config(), t, {kAttn + "v_proj.lora_B.weight", "inf", "[63, 3]"});
  // Past the first 4096 elements (the check scans blocks of them), in float16.
  t = good_tensors();
  Tensor big = rnd({40, 128}, DType::kF16);
  big.narrow(0, 39, 1).narrow(1, 100, 1).fill_(std::numeric_limits<double>::quiet_NaN());
  replace(t, kAttn + "q_proj.lora_A.weight", big);
  replace(t, kAttn + "q_proj.lora_B.weight", rnd({128, 40}, DType::kF16));
  expect_refused(config(R"("rank_pattern": {"q_proj": 40})"), t,
                 {kAttn + "q_proj.lora_A.weight", "nan", "[39, 100]"}, 64);
}

TEST_F(BrokenAdapter, OverflowOnceScaled) {
  auto t = good_tensors();
  Tensor b = rnd({64, 4});
  b.narrow(0, 1, 1).narrow(1, 0, 1).fill_(3.0e38);
  replace(t, kAttn + "v_proj.lora_B.weight", b);
  expect_refused(config(), t, {kAttn + "v_proj.lora_B.weight", "overflows"});
}

TEST_F(BrokenAdapter, MissingHalfOfAPair) {
  auto t = good_tensors();
  t.erase(t.begin() + 1);  // q_proj lora_B
  expect_refused(config(), t, {kAttn + "q_proj.lora_A.weight", "no matching lora_B"});
  t = good_tensors();
  t.erase(t.begin() + 2);  // v_proj lora_A
  expect_refused(config(), t, {kAttn + "v_proj.lora_B.weight", "no matching lora_A"});
}

TEST_F(BrokenAdapter, TensorsPeftDoesNotWriteForServedAdapters) {
  auto t = good_tensors();
  t.emplace_back(kAttn + "q_proj.lora_B.bias", rnd({128}));
  expect_refused(config(), t, {kAttn + "q_proj.lora_B.bias", "lora_bias"});
  t = good_tensors();
  t.emplace_back(kAttn + "q_proj.lora_magnitude_vector", rnd({128}));
  expect_refused(config(), t, {"lora_magnitude_vector", "DoRA"});
  t = good_tensors();
  t.emplace_back("base_model.model.model.norm.weight", rnd({128}));
  expect_refused(config(), t, {"base_model.model.model.norm.weight", "not a LoRA weight"});
  t = good_tensors();
  t.emplace_back(kAttn + "q_proj.base_layer.weight", rnd({128, 128}));
  expect_refused(config(), t, {kAttn + "q_proj.base_layer.weight", "not served"});
  expect_refused(config(), {}, {"holds no LoRA weights"});
}

TEST_F(BrokenAdapter, EmbeddingNeedsEmbeddingWeights) {
  const std::string cfg = R"({"r": 4, "lora_alpha": 4, "target_modules": ["embed_tokens"]})";
  expect_refused(cfg,
                 {{"base_model.model.model.embed_tokens.lora_A.weight", rnd({4, 1024})},
                  {"base_model.model.model.embed_tokens.lora_B.weight", rnd({128, 4})}},
                 {"embed_tokens.lora_A.weight", "lora_embedding_A"});
  expect_refused(cfg,
                 {{"base_model.model.model.embed_tokens.lora_embedding_A", rnd({4, 1000})},
                  {"base_model.model.model.embed_tokens.lora_embedding_B", rnd({128, 4})}},
                 {"lora_embedding_A", "needs [4, 1024]"});
}

TEST_F(BrokenAdapter, FilesAndConfigErrorsNameAdapterAndFile) {
  // No config.
  const std::string no_config = tmp_.sub("no_config");
  test::write_adapter(no_config, "{}", good_tensors());
  std::filesystem::remove(no_config + "/adapter_config.json");
  expect_dir_refused(no_config, {"file not found"}, 16, "adapter_config.json");
  // A refused config field.
  expect_refused(config(R"("use_dora": true)"), good_tensors(), {"'use_dora'"}, 16,
                 "adapter_config.json");
  // Pickled weights only.
  const std::string bin = tmp_.sub("bin");
  test::write_adapter(bin, config(), good_tensors());
  std::filesystem::rename(bin + "/adapter_model.safetensors", bin + "/adapter_model.bin");
  expect_dir_refused(bin, {"adapter_model.bin", "safetensors"});
  // A truncated safetensors file.
  const std::string cut = tmp_.sub("cut");
  test::write_adapter(cut, config(), good_tensors());
  std::filesystem::resize_file(cut + "/adapter_model.safetensors", 200);
  expect_dir_refused(cut, {"safetensors file"});
  // Not a directory.
  try {
    load_peft_adapter("bad", tmp_.sub("nowhere"), targets_.registry, options());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos);
  }
}

TEST_F(BrokenAdapter, PerModuleRankAndAlpha) {
  auto t = good_tensors();
  replace(t, kAttn + "q_proj.lora_A.weight", rnd({2, 128}));
  replace(t, kAttn + "q_proj.lora_B.weight", rnd({128, 2}));
  const std::string dir = tmp_.sub("patterns");
  test::write_adapter(
      dir, config(R"("rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 32})"), t);
  PackedAdapter p = load_peft_adapter("p", dir, targets_.registry, options());
  EXPECT_EQ(p.max_rank, 4);
  ASSERT_EQ(p.modules.size(), 2u);
  for (const AdapterModule& m : p.modules) {
    if (m.key == "model.layers.0.self_attn.q_proj") {
      EXPECT_EQ(m.rank, 2);
      EXPECT_EQ(m.scale, 8.0 / 2);
    } else {
      EXPECT_EQ(m.key, "model.layers.0.self_attn.v_proj");
      EXPECT_EQ(m.rank, 4);
      EXPECT_EQ(m.scale, 32.0 / 4);
    }
  }
  const LoraTarget* v = targets_.registry.find_module("model.layers.0.self_attn.v_proj");
  std::vector<double> b = t[3].second.to_double_vector();
  for (double& x : b) x *= 8.0;
  test::expect_close(p.layers[targets_.registry.layer_index(*v)][2].b, b, 1e-7, 0, "v_proj B");
}

// --------------------------------------------------------------------------- 3-D experts

// A module "model.layers.0.mlp.experts" with two 3-D parameters, registered in parameter
// order: gate_up_proj [E, in=8, out=12] used as x @ W[e], down_proj [E, out=8, in=6] used as
// x @ W[e]^T.
struct ExpertTargets {
  static constexpr int64_t kE = 3;
  ExpertTargets() : gate_up("gate_up", 1), down("down", 1) {
    LoraTarget g;
    g.module = "model.layers.0.mlp.experts";
    g.layer = gate_up.handle();
    g.in_features = 8;
    g.out_features = 12;
    g.kind = TargetKind::kExperts3d;
    g.parameter = "gate_up_proj";
    g.num_experts = kE;
    registry.add(g);
    LoraTarget d = g;
    d.layer = down.handle();
    d.in_features = 6;
    d.out_features = 8;
    d.parameter = "down_proj";
    d.parameter_out_in = true;
    registry.add(d);
  }
  test::RecordingLayer gate_up;
  test::RecordingLayer down;
  LoraTargetRegistry registry;
};

// PEFT's ParamWrapper delta for a 3-D parameter [E, d1, d2] (peft/tuners/lora/layer.py):
// A [E r, d1] -> [E, r, d1]; B [d2, r E] -> [d2, r, E]; delta[e, i, o] = s sum_r B A.
std::vector<double> peft_delta(const Tensor& a, const Tensor& b, int64_t e_count, int64_t r,
                               double scale) {
  const int64_t d1 = a.size(1);
  const int64_t d2 = b.size(0);
  std::vector<double> delta(static_cast<size_t>(e_count * d1 * d2), 0.0);
  for (int64_t e = 0; e < e_count; ++e)
    for (int64_t i = 0; i < d1; ++i)
      for (int64_t o = 0; o < d2; ++o) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k)
          acc += b.item({o, k * e_count + e}) * a.item({e * r + k, i});
        delta[static_cast<size_t>((e * d1 + i) * d2 + o)] = scale * acc;
      }
  return delta;
}

// The layer-facing weights per expert, as the dense update they apply in forward
// orientation: W_lora[e] = b[e] a[e], [out, in].
std::vector<double> forward_update(const LoraSliceWeights& s) {
  const int64_t e_count = s.a.size(0), r = s.a.size(1), in = s.a.size(2), out = s.b.size(1);
  std::vector<double> w(static_cast<size_t>(e_count * out * in), 0.0);
  for (int64_t e = 0; e < e_count; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += s.b.item({e, o, k}) * s.a.item({e, k, i});
        w[static_cast<size_t>((e * out + o) * in + i)] = acc;
      }
  return w;
}

TEST_F(BrokenAdapter, Experts3dFollowPeftNestingAndLayout) {
  ExpertTargets ex;
  const int64_t E = ExpertTargets::kE, r = 2;
  const std::string m = "base_model.model.model.layers.0.mlp.experts.";
  // gate_up (first parameter) is the inner wrapper: base_layer.lora_*; param [E, 8, 12].
  Tensor ga = rnd({E * r, 8}), gb = rnd({12, E * r});
  // down (second parameter) is the outer wrapper; param [E, d1=out 8, d2=in 6].
  Tensor da = rnd({E * r, 8}), db = rnd({6, E * r});
  const std::string cfg = R"({"r": 2, "lora_alpha": 6, "target_modules": [],
      "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})";
  const std::string dir = tmp_.sub("experts");
  test::write_adapter(dir, cfg,
                      {{m + "base_layer.lora_A.weight", ga},
                       {m + "base_layer.lora_B.weight", gb},
                       {m + "lora_A.weight", da},
                       {m + "lora_B.weight", db}});
  PackedAdapter p = load_peft_adapter("moe", dir, ex.registry, options());
  ASSERT_EQ(p.layers.size(), 2u);
  const LoraSliceWeights& g = p.layers[0][0];
  const LoraSliceWeights& d = p.layers[1][0];
  EXPECT_EQ(g.a.shape(), (Shape{E, r, 8}));
  EXPECT_EQ(g.b.shape(), (Shape{E, 12, r}));
  EXPECT_EQ(d.a.shape(), (Shape{E, r, 6}));
  EXPECT_EQ(d.b.shape(), (Shape{E, 8, r}));

  // gate_up: x @ (W + delta)[e] with delta [E, in, out]: forward update [out, in] = delta^T.
  const std::vector<double> g_delta = peft_delta(ga, gb, E, r, 3.0);
  std::vector<double> g_want(g_delta.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t o = 0; o < 12; ++o)
        g_want[static_cast<size_t>((e * 12 + o) * 8 + i)] =
            g_delta[static_cast<size_t>((e * 8 + i) * 12 + o)];
  const std::vector<double> g_got = forward_update(g);
  ASSERT_LT(test::tolerance_ratio(g_got, g_want, 1e-6, 1e-7), 1.0);
  // down: x @ (W + delta)[e]^T with delta [E, out, in]: forward update = delta itself.
  const std::vector<double> d_want = peft_delta(da, db, E, r, 3.0);
  ASSERT_LT(test::tolerance_ratio(forward_update(d), d_want, 1e-6, 1e-7), 1.0);

  // With only down_proj targeted there is a single, unnested wrapper.
  const std::string dir1 = tmp_.sub("experts_down");
  test::write_adapter(dir1, R"({"r": 2, "lora_alpha": 6, "target_parameters": ["down_proj"]})",
                      {{m + "lora_A.weight", da}, {m + "lora_B.weight", db}});
  PackedAdapter p1 = load_peft_adapter("moe1", dir1, ex.registry, options());
  EXPECT_TRUE(p1.layers[0].empty());
  ASSERT_LT(test::tolerance_ratio(forward_update(p1.layers[1][0]), d_want, 1e-6, 1e-7), 1.0);

  // A nested pair when only one parameter is targeted is refused.
  const std::string dir2 = tmp_.sub("experts_bad");
  test::write_adapter(dir2, R"({"r": 2, "lora_alpha": 6, "target_parameters": ["down_proj"]})",
                      {{m + "base_layer.lora_A.weight", ga}, {m + "base_layer.lora_B.weight", gb}});
  try {
    load_peft_adapter("moe2", dir2, ex.registry, options());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested base_layer"), std::string::npos) << e.what();
  }
  // Shapes are checked per layout: gate_up's A must have in = 8 columns.
  const std::string dir3 = tmp_.sub("experts_shape");
  test::write_adapter(dir3, cfg,
                      {{m + "base_layer.lora_A.weight", rnd({E * r, 12})},
                       {m + "base_layer.lora_B.weight", rnd({8, E * r})},
                       {m + "lora_A.weight", da},
                       {m + "lora_B.weight", db}});
  try {
    load_peft_adapter("moe3", dir3, ex.registry, options());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs [6, 8]"), std::string::npos) << e.what();
  }
}

// PEFT >= 0.19 saves a [E, out, in] parameter's pair the standard way (A [r E, in],
// B [out, r E]; delta[e] = B_e A_e in the parameter layout); when in == out only peft_version
// tells the two layouts apart.
TEST_F(BrokenAdapter, Experts3dSavedByNewerPeft) {
  const int64_t E = 2, r = 3;
  const std::string m = "base_model.model.model.layers.0.mlp.experts.";
  for (const int64_t in : {int64_t{6}, int64_t{8}}) {
    for (const char* version : {"0.18.1", "0.21.0"}) {
      SCOPED_TRACE(std::to_string(in) + " " + version);
      test::RecordingLayer down("down", 1);
      LoraTargetRegistry registry;
      LoraTarget d;
      d.module = "model.layers.0.mlp.experts";
      d.layer = down.handle();
      d.in_features = in;
      d.out_features = 8;
      d.kind = TargetKind::kExperts3d;
      d.parameter = "down_proj";
      d.num_experts = E;
      d.parameter_out_in = true;
      registry.add(d);
      Tensor a = rnd({E * r, in}), b = rnd({8, E * r});
      const std::string dir = tmp_.sub(std::string("new_") + std::to_string(in) + version);
      test::write_adapter(dir,
                          std::string(R"({"r": 3, "lora_alpha": 3, "peft_version": ")") + version +
                              R"(", "target_parameters": ["down_proj"]})",
                          {{m + "lora_A.weight", a}, {m + "lora_B.weight", b}});
      PackedAdapter p = load_peft_adapter("moe", dir, registry, options());
      const LoraSliceWeights& s = p.layers[0][0];
      std::vector<double> want(static_cast<size_t>(E * 8 * in));
      const bool legacy = in == 8 && std::string(version) == "0.18.1";
      if (!legacy) {
        // delta[e][o][i] = sum_k B[o, k E + e] A[e r + k, i]
        for (int64_t e = 0; e < E; ++e)
          for (int64_t o = 0; o < 8; ++o)
            for (int64_t i = 0; i < in; ++i) {
              double acc = 0;
              for (int64_t k = 0; k < r; ++k)
                acc += b.item({o, k * E + e}) * a.item({e * r + k, i});
              want[static_cast<size_t>((e * 8 + o) * in + i)] = acc;
            }
      } else {
        // PEFT 0.18 read the square parameter as [E, in, out]: delta[e][o][i] is its (i, o)
        // entry, i.e. sum_k B[i, k E + e] A[e r + k, o].
        want = peft_delta(a, b, E, r, 1.0);
      }
      ASSERT_LT(test::tolerance_ratio(forward_update(s), want, 1e-6, 1e-7), 1.0);
    }
  }
}

}  // namespace
}  // namespace loraplex
