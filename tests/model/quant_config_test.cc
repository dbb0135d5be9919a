// quantization_config parsing: the FP8 formats as their tools write them, and refusal (naming
// the field and value) of every other method and of values that would change the math.

#include "loraplex/model/quant_config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"
#include "loraplex/model/config.h"

namespace loraplex::model {
namespace {

using nlohmann::json;

// llm-compressor's FP8-dynamic recipe as it saves it (Meta-Llama-3.1-8B-Instruct-FP8-dynamic).
json fp8_dynamic() {
  return json::parse(R"({
    "config_groups": {"group_0": {
      "input_activations": {"actorder": null, "block_structure": null, "dynamic": true,
        "group_size": null, "num_bits": 8, "observer": null, "observer_kwargs": {},
        "strategy": "token", "symmetric": true, "type": "float"},
      "output_activations": null, "targets": ["Linear"],
      "weights": {"actorder": null, "block_structure": null, "dynamic": false,
        "group_size": null, "num_bits": 8, "observer": "minmax", "observer_kwargs": {},
        "strategy": "channel", "symmetric": true, "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": null, "ignore": ["lm_head"],
    "kv_cache_scheme": null, "quant_method": "compressed-tensors",
    "quantization_status": "compressed", "sparsity_config": {}})");
}

std::string error_of(const json& q) {
  try {
    parse_quantization_config(q, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(QuantConfig, CompressedTensorsFp8Dynamic) {
  const QuantConfig c = parse_quantization_config(fp8_dynamic(), "config.json");
  EXPECT_EQ(c.method, QuantConfig::Method::kCompressedTensors);
  EXPECT_EQ(c.weight_scale, Fp8WeightScale::kPerChannel);
  EXPECT_EQ(c.activations, Fp8Activations::kDynamicPerToken);
  EXPECT_EQ(c.weight_scale_names, std::vector<std::string>{"weight_scale"});
  EXPECT_EQ(c.describe(),
            "compressed-tensors float8, per-channel weight scales, dynamic per-token activation "
            "scales");
}

TEST(QuantConfig, CompressedTensorsFp8StaticAndWeightOnlyAndBlocks) {
  json q = fp8_dynamic();
  auto& g = q["config_groups"]["group_0"];
  g["weights"]["strategy"] = "tensor";
  g["input_activations"]["strategy"] = "tensor";
  g["input_activations"]["dynamic"] = false;
  QuantConfig c = parse_quantization_config(q, "c");
  EXPECT_EQ(c.weight_scale, Fp8WeightScale::kPerTensor);
  EXPECT_EQ(c.activations, Fp8Activations::kStatic);
  EXPECT_EQ(c.input_scale_names, std::vector<std::string>{"input_scale"});

  g["input_activations"] = nullptr;  // weight-only (W8A16): per token on CUDA
  c = parse_quantization_config(q, "c");
  EXPECT_EQ(c.activations, Fp8Activations::kDynamicPerToken);

  g["weights"]["strategy"] = "block";
  g["weights"]["block_structure"] = {128, 128};
  g["input_activations"] = fp8_dynamic()["config_groups"]["group_0"]["input_activations"];
  g["input_activations"]["strategy"] = "group";
  g["input_activations"]["group_size"] = 128;
  c = parse_quantization_config(q, "c");
  EXPECT_EQ(c.weight_scale, Fp8WeightScale::kBlock);
  EXPECT_EQ(c.block_n, 128);
  EXPECT_EQ(c.block_k, 128);
}

TEST(QuantConfig, TransformersFineGrainedFp8AndPerTensorFp8) {
  QuantConfig c = parse_quantization_config(
      json::parse(R"({"quant_method": "fp8", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 64], "modules_to_not_convert": null})"),
      "c");
  EXPECT_EQ(c.method, QuantConfig::Method::kFp8);
  EXPECT_EQ(c.weight_scale, Fp8WeightScale::kBlock);
  EXPECT_EQ(c.block_n, 128);
  EXPECT_EQ(c.block_k, 64);
  EXPECT_EQ(c.weight_scale_names, std::vector<std::string>{"weight_scale_inv"});
  // Without weight_block_size: one scale per tensor, under either name its writers use.
  c = parse_quantization_config(
      json::parse(R"({"quant_method": "fp8", "activation_scheme": "static"})"), "c");
  EXPECT_EQ(c.weight_scale, Fp8WeightScale::kPerTensor);
  EXPECT_EQ(c.activations, Fp8Activations::kStatic);
  EXPECT_EQ(c.weight_scale_names, (std::vector<std::string>{"weight_scale_inv", "weight_scale"}));
  EXPECT_EQ(c.input_scale_names, (std::vector<std::string>{"activation_scale", "input_scale"}));
}

TEST(QuantConfig, RefusesOtherMethodsAndMathChangingFieldsNamingThem) {
  struct Case {
    json q;
    const char* expect;
  };
  auto ct = [](const std::function<void(json&)>& edit) {
    json q = fp8_dynamic();
    edit(q);
    return q;
  };
  const Case cases[] = {
      {json::parse(R"({"quant_method": "gptq", "bits": 4})"), "quant_method \"gptq\""},
      {json::parse(R"({"quant_method": "awq"})"), "quant_method \"awq\""},
      {json::parse(R"({"quant_method": "bitsandbytes", "load_in_4bit": true})"),
       "quant_method \"bitsandbytes\""},
      {json::parse(R"({"bits": 4})"), "quant_method is null"},
      {"fp8", "quantization_config is \"fp8\""},
      {ct([](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 4; }),
       "weights.num_bits is 4"},
      {ct([](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "int"; }),
       "weights.type is \"int\""},
      {ct([](json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "group"; }),
       "weights.strategy \"group\""},
      {ct([](json& q) { q["config_groups"]["group_0"]["weights"]["symmetric"] = false; }),
       "weights.symmetric is false"},
      {ct([](json& q) { q["config_groups"]["group_0"]["weights"]["dynamic"] = true; }),
       "weights.dynamic is true"},
      {ct([](json& q) { q["config_groups"]["group_0"]["targets"] = {"re:.*q_proj"}; }),
       "targets is [\"re:.*q_proj\"]"},
      {ct([](json& q) { q["config_groups"]["group_1"] = q["config_groups"]["group_0"]; }),
       "config_groups has 2 groups"},
      {ct([](json& q) {
         q["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}};
       }),
       "kv_cache_scheme"},
      {ct([](json& q) { q["format"] = "pack-quantized"; }), "format \"pack-quantized\""},
      {ct([](json& q) {
         q["sparsity_config"] = {{"format", "sparse-24-bitmask"}};
       }),
       "sparsity_config"},
      {ct([](json& q) {
         auto& a = q["config_groups"]["group_0"]["input_activations"];
         a["dynamic"] = false;
       }),
       "static \"token\" scales are not supported"},
      {ct([](json& q) {
         q["config_groups"]["group_0"]["output_activations"] =
             q["config_groups"]["group_0"]["weights"];
       }),
       "output_activations"},
      {json::parse(R"({"quant_method": "fp8", "weight_block_size": [128, 128],
                       "activation_scheme": "static"})"),
       "activation_scheme \"static\" with weight_block_size"},
      {json::parse(R"({"quant_method": "fp8", "weight_block_size": [128, 128],
                       "scale_fmt": "ue8m0"})"),
       "scale_fmt \"ue8m0\""},
      {json::parse(R"({"quant_method": "fp8", "weight_block_size": [128]})"),
       "weight_block_size is [128]"},
      {json::parse(R"({"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]})"),
       "modules_to_convert"},
      {json::parse(R"({"quant_method": "fp8", "activation_scheme": "per_token"})"),
       "activation_scheme \"per_token\""},
  };
  for (const Case& c : cases) {
    const std::string err = error_of(c.q);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.q.dump() << ": " << err;
    EXPECT_NE(err.find("config.json"), std::string::npos) << err;
  }
}

TEST(QuantConfig, ModelConfigCarriesItAndRefusesFp8MoeModels) {
  json j = json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000})");
  j["quantization_config"] = fp8_dynamic();
  const ModelConfig c = ModelConfig::from_json(j, "config.json");
  EXPECT_TRUE(c.quant.quantized());
  EXPECT_EQ(c.quant.weight_scale, Fp8WeightScale::kPerChannel);
  j["architectures"] = {"MixtralForCausalLM"};
  j["num_local_experts"] = 4;
  j["num_experts_per_tok"] = 2;
  try {
    ModelConfig::from_json(j, "config.json");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FP8 mixture-of-experts models are not supported"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace loraplex::model
