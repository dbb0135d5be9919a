#include "loraplex/adapters/peft_config.h"

#include <gtest/gtest.h>

#include <cmath>

#include "loraplex/core/error.h"

namespace loraplex {
namespace {

const std::string kFixtures = std::string(LORAPLEX_TEST_DATA_DIR) + "/tiny-llama/adapters";

PeftLoraConfig parse(const std::string& json) { return PeftLoraConfig::from_json(json, "cfg"); }

// A minimal valid config with `extra` fields appended.
std::string config_with(const std::string& extra) {
  return R"({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"])" +
         (extra.empty() ? std::string() : ", " + extra) + "}";
}

void expect_refused(const std::string& json, const std::vector<std::string>& parts) {
  try {
    parse(json);
    ADD_FAILURE() << "accepted: " << json;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cfg"), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
  }
}

TEST(PeftConfig, ReadsFixtureConfigs) {
  auto sql = PeftLoraConfig::from_file(kFixtures + "/sql/adapter_config.json");
  EXPECT_EQ(sql.r, 8);
  EXPECT_EQ(sql.lora_alpha, 16);
  EXPECT_FALSE(sql.use_rslora);
  EXPECT_EQ(sql.default_scale(), 2.0);
  EXPECT_EQ(sql.target_mode, PeftLoraConfig::TargetMode::kList);
  EXPECT_EQ(sql.target_modules.size(), 4u);

  auto rs = PeftLoraConfig::from_file(kFixtures + "/rslora/adapter_config.json");
  EXPECT_TRUE(rs.use_rslora);
  EXPECT_EQ(rs.default_scale(), 8.0 / std::sqrt(4.0));
  EXPECT_TRUE(rs.targets_module("model.layers.2.mlp.down_proj", true));
  EXPECT_FALSE(rs.targets_module("model.layers.2.self_attn.q_proj", true));

  auto pirate = PeftLoraConfig::from_file(kFixtures + "/pirate/adapter_config.json");
  EXPECT_EQ(pirate.target_modules.size(), 7u);
  EXPECT_EQ(pirate.default_scale(), 2.0);
  auto vocab = PeftLoraConfig::from_file(kFixtures + "/vocab/adapter_config.json");
  EXPECT_TRUE(vocab.targets_module("model.embed_tokens", false));
  EXPECT_TRUE(vocab.targets_module("lm_head", false));
  EXPECT_EQ(vocab.default_scale(), 1.0);
}

TEST(PeftConfig, ListTargetsMatchWholeNameOrDottedSuffix) {
  auto c = parse(R"({"r": 4, "lora_alpha": 4,
                     "target_modules": ["q_proj", "mlp.down_proj", "model.layers.1.self_attn.o_proj"]})");
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_TRUE(c.targets_module("q_proj", true));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.xq_proj", true));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.q_proj.inner", true));
  EXPECT_TRUE(c.targets_module("model.layers.3.mlp.down_proj", true));
  EXPECT_FALSE(c.targets_module("model.layers.3.xmlp.down_proj", true));
  EXPECT_TRUE(c.targets_module("model.layers.1.self_attn.o_proj", true));
  EXPECT_FALSE(c.targets_module("model.layers.2.self_attn.o_proj", true));
}

TEST(PeftConfig, StringTargetIsAFullMatchRegex) {
  auto c = parse(R"({"r": 4, "lora_alpha": 4, "target_modules": ".*\\.(q|v)_proj"})");
  EXPECT_EQ(c.target_mode, PeftLoraConfig::TargetMode::kRegex);
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_TRUE(c.targets_module("model.layers.9.self_attn.v_proj", true));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.k_proj", true));
  // Not a search: the whole name must match.
  auto bare = parse(R"({"r": 4, "lora_alpha": 4, "target_modules": "q_proj"})");
  EXPECT_FALSE(bare.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_TRUE(bare.targets_module("q_proj", true));
  // Alternation must still find the longer whole-name match.
  auto alt = parse(R"({"r": 4, "lora_alpha": 4, "target_modules": "a|ab"})");
  EXPECT_TRUE(alt.targets_module("ab", true));
}

TEST(PeftConfig, AllLinearSelectsLinearLayersButNotTheHead) {
  auto c = parse(R"({"r": 4, "lora_alpha": 4, "target_modules": "ALL-LINEAR"})");
  EXPECT_EQ(c.target_mode, PeftLoraConfig::TargetMode::kAllLinear);
  EXPECT_TRUE(c.targets_module("model.layers.0.mlp.up_proj", true));
  EXPECT_FALSE(c.targets_module("lm_head", false));
  EXPECT_FALSE(c.targets_module("model.embed_tokens", false));
}

TEST(PeftConfig, ExcludeModules) {
  auto list = parse(config_with(R"("exclude_modules": ["model.layers.1.self_attn.q_proj"])"));
  EXPECT_TRUE(list.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_FALSE(list.targets_module("model.layers.1.self_attn.q_proj", true));
  auto suffix = parse(config_with(R"("exclude_modules": ["1.self_attn.v_proj"])"));
  EXPECT_FALSE(suffix.targets_module("model.layers.1.self_attn.v_proj", true));
  EXPECT_TRUE(suffix.targets_module("model.layers.11.self_attn.v_proj", true));
  auto re = parse(config_with(R"("exclude_modules": ".*layers\\.[02]\\..*")"));
  EXPECT_FALSE(re.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_TRUE(re.targets_module("model.layers.1.self_attn.q_proj", true));
  EXPECT_FALSE(re.targets_module("model.layers.2.self_attn.v_proj", true));
}

TEST(PeftConfig, LayersToTransformAndLayersPattern) {
  auto c = parse(config_with(R"("layers_to_transform": [0, 2])"));
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj", true));
  EXPECT_TRUE(c.targets_module("model.layers.2.self_attn.v_proj", true));
  EXPECT_TRUE(c.targets_module("q_proj", true)) << "an exact name bypasses the layer filter";
  EXPECT_FALSE(c.targets_module("self_attn.q_proj", true)) << "a suffix match needs an index";
  auto single = parse(config_with(R"("layers_to_transform": 1, "layers_pattern": "layers")"));
  EXPECT_TRUE(single.targets_module("model.layers.1.self_attn.q_proj", true));
  EXPECT_FALSE(single.targets_module("model.layers.0.self_attn.q_proj", true));
  EXPECT_FALSE(single.targets_module("model.h.1.self_attn.q_proj", true));
  auto pats =
      parse(config_with(R"("layers_to_transform": [3], "layers_pattern": ["blocks", "h"])"));
  EXPECT_TRUE(pats.targets_module("transformer.h.3.attn.q_proj", true));
  EXPECT_FALSE(pats.targets_module("transformer.layers.3.attn.q_proj", true));
  // An exact module name in the list is taken without the layer filter, as in PEFT.
  auto exact = parse(R"({"r": 4, "lora_alpha": 4, "layers_to_transform": [0],
                        "target_modules": ["model.layers.5.self_attn.q_proj"]})");
  EXPECT_TRUE(exact.targets_module("model.layers.5.self_attn.q_proj", true));
  // A regular expression target ignores layers_to_transform, as in PEFT.
  auto re = parse(R"({"r": 4, "lora_alpha": 4, "layers_to_transform": [0],
                      "target_modules": ".*q_proj"})");
  EXPECT_TRUE(re.targets_module("model.layers.5.self_attn.q_proj", true));
}

TEST(PeftConfig, LayerIndexFollowsPeftRegex) {
  EXPECT_EQ(layer_index_of("model.layers.12.self_attn.q_proj", {}), 12);
  EXPECT_EQ(layer_index_of("model.decoder.layers.3.fc1", {}), 3);
  // Greedy: the last "<name>.<digits>." wins.
  EXPECT_EQ(layer_index_of("model.layers.1.block.4.proj", {}), 4);
  EXPECT_EQ(layer_index_of("lm_head", {}), std::nullopt);
  EXPECT_EQ(layer_index_of("layers.3.q_proj", {}), std::nullopt) << "needs a leading '.'";
  auto c = parse(config_with(R"("layers_to_transform": [1], "layers_pattern": "layers")"));
  EXPECT_EQ(layer_index_of("model.layers.1.block.4.proj", c.layers_pattern), 1);
}

TEST(PeftConfig, RankAndAlphaPatternsFirstMatchInFileOrder) {
  auto c = parse(R"({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                     "rank_pattern": {"layers.0.self_attn.q_proj": 4, "q_proj": 32},
                     "alpha_pattern": {"v_proj": 64}})");
  EXPECT_EQ(c.rank_for("model.layers.0.self_attn.q_proj"), 4);
  EXPECT_EQ(c.rank_for("model.layers.1.self_attn.q_proj"), 32);
  EXPECT_EQ(c.rank_for("model.layers.1.self_attn.v_proj"), 8);
  // The key must start the name or follow a '.'.
  EXPECT_EQ(c.rank_for("model.xlayers.0.self_attn.q_proj"), 32);
  EXPECT_EQ(c.alpha_for("model.layers.1.self_attn.v_proj"), 64);
  EXPECT_EQ(c.alpha_for("model.layers.1.self_attn.q_proj"), 16);
  EXPECT_EQ(c.scale_for("model.layers.0.self_attn.q_proj"), 16.0 / 4);
  EXPECT_EQ(c.scale_for("model.layers.1.self_attn.v_proj"), 64.0 / 8);
  EXPECT_EQ(c.max_rank(), 32);

  auto reversed = parse(R"({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                            "rank_pattern": {"q_proj": 32, "layers.0.self_attn.q_proj": 4}})");
  EXPECT_EQ(reversed.rank_for("model.layers.0.self_attn.q_proj"), 32);

  auto rs = parse(R"({"r": 16, "lora_alpha": 8, "use_rslora": true, "target_modules": ["o"],
                      "rank_pattern": {"model\\.layers\\.[0-9]+\\.o": 4}})");
  EXPECT_EQ(rs.scale_for("model.layers.7.o"), 8.0 / 2.0);
  EXPECT_EQ(rs.scale_for("o"), 8.0 / 4.0);
}

TEST(PeftConfig, TargetParameters) {
  auto c = parse(R"({"r": 4, "lora_alpha": 8, "target_modules": [],
                     "target_parameters": ["mlp.experts.gate_up_proj", "down_proj"]})");
  EXPECT_TRUE(c.targets_parameter("model.layers.0.mlp.experts", "gate_up_proj"));
  EXPECT_TRUE(c.targets_parameter("model.layers.0.mlp.experts", "down_proj"));
  EXPECT_FALSE(c.targets_parameter("model.layers.0.attn.experts", "gate_up_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.0.mlp.experts", false));
  auto only = parse(R"({"r": 4, "lora_alpha": 8, "target_parameters": ["down_proj"]})");
  EXPECT_EQ(only.target_mode, PeftLoraConfig::TargetMode::kNone);
  EXPECT_FALSE(only.targets_module("model.layers.0.mlp.down_proj", true));
}

TEST(PeftConfig, DefaultValuesOfRefusedFieldsAreAccepted) {
  auto c = parse(config_with(
      R"("bias": "none", "lora_bias": false, "modules_to_save": null, "use_dora": false,
         "fan_in_fan_out": false, "trainable_token_indices": null, "layer_replication": [],
         "alora_invocation_tokens": null, "use_qalora": false, "use_bdlora": null,
         "arrow_config": null, "init_lora_weights": "gaussian", "peft_type": "LORA",
         "unknown_future_field": {"x": 1})"));
  EXPECT_EQ(c.r, 8);
}

TEST(PeftConfig, RefusesFieldsThatChangeTheMath) {
  expect_refused(config_with(R"("bias": "all")"), {"'bias'", "all"});
  expect_refused(config_with(R"("bias": "lora_only")"), {"'bias'"});
  expect_refused(config_with(R"("lora_bias": true)"), {"'lora_bias'"});
  expect_refused(config_with(R"("modules_to_save": ["lm_head"])"), {"'modules_to_save'"});
  expect_refused(config_with(R"("use_dora": true)"), {"'use_dora'", "DoRA"});
  expect_refused(config_with(R"("fan_in_fan_out": true)"), {"'fan_in_fan_out'"});
  expect_refused(config_with(R"("trainable_token_indices": [5, 6])"),
                 {"'trainable_token_indices'"});
  expect_refused(config_with(R"("layer_replication": [[0, 2]])"), {"'layer_replication'"});
  expect_refused(config_with(R"("alora_invocation_tokens": [1, 2])"),
                 {"'alora_invocation_tokens'"});
  expect_refused(config_with(R"("use_qalora": true)"), {"'use_qalora'"});
  expect_refused(config_with(R"("use_bdlora": {"blocks": 2})"), {"'use_bdlora'"});
  expect_refused(config_with(R"("arrow_config": {"top_k": 2})"), {"'arrow_config'"});
  expect_refused(config_with(R"("init_lora_weights": "pissa_niter_4")"), {"'init_lora_weights'"});
  expect_refused(config_with(R"("init_lora_weights": "loftq")"), {"'init_lora_weights'"});
  expect_refused(config_with(R"("peft_type": "LOHA")"), {"'peft_type'"});
}

TEST(PeftConfig, RefusesMalformedFields) {
  expect_refused(R"({"lora_alpha": 16, "target_modules": ["q"]})", {"'r'"});
  expect_refused(R"({"r": 0, "lora_alpha": 16, "target_modules": ["q"]})", {"'r'"});
  expect_refused(R"({"r": "8", "lora_alpha": 16, "target_modules": ["q"]})", {"'r'"});
  expect_refused(R"({"r": 8, "target_modules": ["q"]})", {"'lora_alpha'"});
  expect_refused(R"({"r": 8, "lora_alpha": 16})", {"'target_modules'", "'target_parameters'"});
  expect_refused(R"({"r": 8, "lora_alpha": 16, "target_modules": [1]})", {"'target_modules'"});
  expect_refused(R"({"r": 8, "lora_alpha": 16, "target_modules": "(?P<x>q)_proj"})",
                 {"'target_modules'", "(?P<x>q)_proj"});
  expect_refused(config_with(R"("rank_pattern": {"q_proj": 0})"), {"'rank_pattern'", "q_proj"});
  expect_refused(config_with(R"("rank_pattern": {"q_proj[": 4})"), {"'rank_pattern'"});
  expect_refused(config_with(R"("alpha_pattern": {"q_proj": "x"})"), {"'alpha_pattern'"});
  expect_refused(config_with(R"("layers_to_transform": [-1])"), {"'layers_to_transform'"});
  expect_refused(config_with(R"("use_rslora": "yes")"), {"'use_rslora'"});
  expect_refused("[1, 2]", {"JSON object"});
  expect_refused("{\"r\": ", {"not valid JSON"});
  EXPECT_THROW(PeftLoraConfig::from_file("/nonexistent/adapter_config.json"), Error);
}

}  // namespace
}  // namespace loraplex
