// Checkpoint layouts that must give exactly the fixture's tokens: sharded weights with an
// index, float32 instead of bfloat16 storage (the same values), the Mistral architecture name for
// Llama math, Mixtral and Qwen3-MoE with transformers-5 fused expert names, Qwen3-MoE without
// top-k renormalisation; and errors that name the file and the tensor.

#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "fixture_support.h"
#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/error.h"
#include "loraplex/model/checkpoint.h"

namespace loraplex::test {
namespace {

namespace fs = std::filesystem;

class CheckpointVariants : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() /
           ("loraplex_ckpt_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }

  // A writable copy of <fixture>/model.
  std::string copy_model(const std::string& fixture) {
    const fs::path dst = tmp_ / fixture;
    fs::copy(fixture_dir(fixture) + "/model", dst, fs::copy_options::recursive);
    for (const auto& e : fs::directory_iterator(dst)) {
      fs::permissions(e.path(), fs::perms::owner_read | fs::perms::owner_write);
    }
    return dst.string();
  }

  static std::vector<std::pair<std::string, Tensor>> read_all(const std::string& path) {
    const SafetensorsFile f = SafetensorsFile::open(path);
    std::vector<std::pair<std::string, Tensor>> out;
    for (const std::string& n : f.names()) out.emplace_back(n, f.tensor(n).clone());
    return out;
  }

  static void edit_config(const std::string& dir,
                          const std::function<void(nlohmann::json&)>& edit) {
    const std::string path = dir + "/config.json";
    nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
    edit(j);
    std::ofstream(path) << j.dump(2);
  }

  // Runs the fixture's requests (a subset, to keep it quick) against `model_dir`.
  void expect_fixture_tokens(const std::string& fixture, const std::string& model_dir,
                             size_t stride = 1) {
    const auto expected = read_expected(fixture);
    std::vector<size_t> order;
    for (size_t i = 0; i < expected.size(); i += stride) order.push_back(i);
    engine::GenerateConfig cfg = fixture_config(fixture, expected, order);
    cfg.model_dir = model_dir;
    const engine::GenerateReport report = engine::run_generate(cfg);
    for (size_t i = 0; i < order.size(); ++i) {
      EXPECT_EQ(report.outputs[i].output_token_ids, expected[order[i]].output_token_ids)
          << "request " << order[i];
    }
  }

  // Rewrites the 2-layer, hidden-64 MoE checkpoint in `dir` from the per-expert 4.x names
  // (<moe>.experts.N.<gate|up|down>.weight, router <moe>.gate.weight) to the 3-D parameters
  // transformers 5 holds in memory: mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up),
  // mlp.experts.down_proj [E, H, I] and the router at mlp.gate.weight.
  static void fuse_experts(const std::string& dir, const std::string& moe,
                           const std::array<std::string, 3>& names, int64_t experts,
                           int64_t inter) {
    const int64_t hidden = 64;
    const auto tensors = read_all(dir + "/model.safetensors");
    std::map<std::string, Tensor> left(tensors.begin(), tensors.end());
    std::vector<std::pair<std::string, Tensor>> out;
    auto take = [&](const std::string& name) {
      const Tensor t = left.at(name);
      left.erase(name);
      return t;
    };
    for (int l = 0; l < 2; ++l) {
      const std::string old_p = "model.layers." + std::to_string(l) + "." + moe + ".";
      const std::string new_p = "model.layers." + std::to_string(l) + ".mlp.";
      Tensor gate_up = Tensor::empty({experts, 2 * inter, hidden}, DType::kBF16);
      Tensor down = Tensor::empty({experts, hidden, inter}, DType::kBF16);
      for (int64_t e = 0; e < experts; ++e) {
        const std::string ep = old_p + "experts." + std::to_string(e) + ".";
        gate_up.select(0, e).narrow(0, 0, inter).copy_from(take(ep + names[0] + ".weight"));
        gate_up.select(0, e).narrow(0, inter, inter).copy_from(take(ep + names[1] + ".weight"));
        down.select(0, e).copy_from(take(ep + names[2] + ".weight"));
      }
      out.emplace_back(new_p + "experts.gate_up_proj", gate_up);
      out.emplace_back(new_p + "experts.down_proj", down);
      out.emplace_back(new_p + "gate.weight", take(old_p + "gate.weight"));
    }
    out.insert(out.end(), left.begin(), left.end());
    write_safetensors(dir + "/model.safetensors", out);
  }

  fs::path tmp_;
};

TEST_F(CheckpointVariants, ShardedWithIndexGivesTheSameTokens) {
  const std::string dir = copy_model("tiny-llama");
  auto tensors = read_all(dir + "/model.safetensors");
  fs::remove(dir + "/model.safetensors");
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  std::vector<std::pair<std::string, Tensor>> shard[3];
  for (size_t i = 0; i < tensors.size(); ++i) {
    shard[i % 3].push_back(tensors[i]);
    index["weight_map"][tensors[i].first] =
        "model-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors";
  }
  for (int s = 0; s < 3; ++s) {
    write_safetensors(dir + "/model-0000" + std::to_string(s + 1) + "-of-00003.safetensors",
                      shard[s], {{"format", "pt"}});
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
  expect_fixture_tokens("tiny-llama", dir, 3);

  // A shard the index names but the directory lacks is reported by name.
  fs::remove(dir + "/model-00002-of-00003.safetensors");
  try {
    model::Checkpoint::open(dir);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model-00002-of-00003.safetensors"), std::string::npos)
        << e.what();
  }
}

TEST_F(CheckpointVariants, Float32StorageOfTheSameValues) {
  const std::string dir = copy_model("tiny-llama");
  auto tensors = read_all(dir + "/model.safetensors");
  for (auto& [name, t] : tensors) t = t.to(DType::kF32);
  write_safetensors(dir + "/model.safetensors", tensors);
  edit_config(dir, [](nlohmann::json& j) { j["dtype"] = "float32"; });
  expect_fixture_tokens("tiny-llama", dir, 4);
}

TEST_F(CheckpointVariants, MistralArchitectureRunsLlamaMath) {
  const std::string dir = copy_model("tiny-llama");
  edit_config(dir, [](nlohmann::json& j) {
    j["architectures"] = {"MistralForCausalLM"};
    j["model_type"] = "mistral";
    j["sliding_window"] = nullptr;
    j.erase("attention_bias");
    j.erase("mlp_bias");
  });
  expect_fixture_tokens("tiny-llama", dir, 3);
  edit_config(dir, [](nlohmann::json& j) { j["sliding_window"] = 4096; });
  try {
    expect_fixture_tokens("tiny-llama", dir, 30);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sliding_window"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointVariants, MixtralWithTransformers5FusedExpertNames) {
  const std::string dir = copy_model("tiny-mixtral");
  fuse_experts(dir, "block_sparse_moe", {"w1", "w3", "w2"}, 4, 96);
  expect_fixture_tokens("tiny-mixtral", dir, 2);
}

TEST_F(CheckpointVariants, Qwen3MoeWithTransformers5FusedExpertNames) {
  const std::string dir = copy_model("tiny-qwen3-moe");
  fuse_experts(dir, "mlp", {"gate_proj", "up_proj", "down_proj"}, 8, 32);
  expect_fixture_tokens("tiny-qwen3-moe", dir, 3);
}

TEST_F(CheckpointVariants, Qwen3MoeWithNormTopkProbFalse) {
  // The same checkpoint with the router's top-k probabilities used as they are, against what
  // transformers + PEFT generate with that config (the tokens differ from the renormalised ones).
  const std::string dir = copy_model("tiny-qwen3-moe");
  edit_config(dir, [](nlohmann::json& j) { j["norm_topk_prob"] = false; });
  const auto expected = read_expected("tiny-qwen3-moe", "expected_norm_topk_prob_false.jsonl");
  const auto renormalised = read_expected("tiny-qwen3-moe");
  std::vector<size_t> order(expected.size());
  std::iota(order.begin(), order.end(), 0);
  engine::GenerateConfig cfg = fixture_config("tiny-qwen3-moe", expected, order);
  cfg.model_dir = dir;
  const engine::GenerateReport report = engine::run_generate(cfg);
  size_t differ = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(report.outputs[i].output_token_ids, expected[i].output_token_ids) << "request " << i;
    for (const ExpectedLine& r : renormalised) {
      if (r.prompt == expected[i].prompt && r.adapter == expected[i].adapter) {
        differ += r.output_token_ids != expected[i].output_token_ids;
      }
    }
  }
  EXPECT_GE(differ, 3u);
}

TEST_F(CheckpointVariants, MissingTensorIsNamed) {
  const std::pair<const char*, const char*> cases[] = {
      {"tiny-qwen2", "model.layers.1.self_attn.k_proj.bias"},
      {"tiny-qwen3", "model.layers.1.self_attn.k_norm.weight"}};
  for (const auto& [fixture, missing] : cases) {
    const std::string dir = copy_model(fixture);
    auto tensors = read_all(dir + "/model.safetensors");
    std::erase_if(tensors, [&](const auto& p) { return p.first == missing; });
    write_safetensors(dir + "/model.safetensors", tensors);
    try {
      expect_fixture_tokens(fixture, dir, 30);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      std::string quoted = "'";
      quoted += missing;
      quoted += "'";
      EXPECT_NE(std::string(e.what()).find(quoted), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace loraplex::test
