// config.json parsing: the spellings of transformers 4.x and 5.x, derived fields, and refusal
// (naming the field) of anything that would change the math.

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"
#include "loraplex/model/config.h"

namespace loraplex::model {
namespace {

using nlohmann::json;

json llama() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1000, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": [2, 7],
    "dtype": "bfloat16", "attention_bias": false, "max_position_embeddings": 4096})");
}

std::string error_of(const json& j) {
  try {
    ModelConfig::from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, ParsesLlamaWithDerivedHeadDim) {
  const ModelConfig c = ModelConfig::from_json(llama(), "config.json");
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.q_size(), 256);
  EXPECT_EQ(c.kv_size(), 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{2, 7}));
  EXPECT_EQ(c.checkpoint_dtype, DType::kBF16);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.is_moe());
}

TEST(ModelConfig, HeadDimGivenNullOrAbsent) {
  json j = llama();
  j["head_dim"] = 32;
  EXPECT_EQ(ModelConfig::from_json(j, "c").head_dim, 32);
  j["head_dim"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(j, "c").head_dim, 64);
  j.erase("head_dim");
  j.erase("num_key_value_heads");
  const ModelConfig c = ModelConfig::from_json(j, "c");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_kv_heads, 4);
}

TEST(ModelConfig, RopeThetaAtTopLevelAsTransformers4Writes) {
  json j = llama();
  j.erase("rope_parameters");
  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = nullptr;
  EXPECT_DOUBLE_EQ(ModelConfig::from_json(j, "c").rope_theta, 500000.0);
}

TEST(ModelConfig, AcceptsFieldsThatDoNotChangeTheMath) {
  json j = llama();
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["use_sliding_window"] = false;
  j["sliding_window"] = 4096;  // ignored while use_sliding_window is false
  j["max_window_layers"] = 28;
  j["layer_types"] = {"full_attention", "full_attention"};
  j["tie_word_embeddings"] = true;
  const ModelConfig c = ModelConfig::from_json(j, "c");
  EXPECT_EQ(c.arch, Architecture::kQwen2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  json m = llama();
  m["architectures"] = {"MistralForCausalLM"};
  m["sliding_window"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(m, "c").arch, Architecture::kMistral);
}

TEST(ModelConfig, Mixtral) {
  json j = llama();
  j["architectures"] = {"MixtralForCausalLM"};
  j["num_local_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["router_jitter_noise"] = 0.0;
  j["output_router_logits"] = false;
  const ModelConfig c = ModelConfig::from_json(j, "c");
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  j["num_experts_per_tok"] = 9;
  EXPECT_NE(error_of(j).find("num_experts_per_tok 9"), std::string::npos) << error_of(j);
}

// config.json as the Hugging Face Hub's Qwen3-8B and Qwen3-30B-A3B write it (transformers 4.x),
// with smaller sizes.
json qwen3() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
    "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1000, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "rope_theta": 1000000, "rope_scaling": null,
    "attention_bias": false, "attention_dropout": 0.0, "use_sliding_window": false,
    "sliding_window": null, "max_window_layers": 36, "tie_word_embeddings": false,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960})");
}

json qwen3_moe() {
  json j = qwen3();
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = "qwen3_moe";
  j["num_experts"] = 16;
  j["num_experts_per_tok"] = 4;
  j["moe_intermediate_size"] = 96;
  j["norm_topk_prob"] = true;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = json::array();
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.001;
  return j;
}

TEST(ModelConfig, Qwen3HasQkNormAndAnExplicitHeadDim) {
  const ModelConfig c = ModelConfig::from_json(qwen3(), "c");
  EXPECT_EQ(c.arch, Architecture::kQwen3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 128);  // not hidden_size / heads (32)
  EXPECT_EQ(c.q_size(), 1024);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.is_moe());
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  // Qwen3Config's head_dim defaults to 128 whatever the hidden size.
  json j = qwen3();
  j.erase("head_dim");
  EXPECT_EQ(ModelConfig::from_json(j, "c").head_dim, 128);
  j["model_type"] = "qwen3";
  j.erase("architectures");
  EXPECT_EQ(ModelConfig::from_json(j, "c").arch, Architecture::kQwen3);
  // attention_bias puts a bias on q, k, v and o, as in Llama.
  j["attention_bias"] = true;
  const ModelConfig b = ModelConfig::from_json(j, "c");
  EXPECT_TRUE(b.qkv_bias);
  EXPECT_TRUE(b.o_bias);
  // transformers 5 writes layer_types; all full attention changes nothing.
  j["layer_types"] =
      json::array({"full_attention", "full_attention", "full_attention", "full_attention"});
  EXPECT_EQ(error_of(j), "");
  EXPECT_FALSE(ModelConfig::from_json(llama(), "c").qk_norm);
}

TEST(ModelConfig, Qwen3Moe) {
  const ModelConfig c = ModelConfig::from_json(qwen3_moe(), "c");
  EXPECT_EQ(c.arch, Architecture::kQwen3Moe);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.intermediate_size, 96);  // the experts' width, not the dense 688
  EXPECT_TRUE(c.moe_renormalize);
  // norm_topk_prob defaults to false (Qwen3MoeConfig), unlike Mixtral's fixed renormalisation.
  json j = qwen3_moe();
  j.erase("norm_topk_prob");
  EXPECT_FALSE(ModelConfig::from_json(j, "c").moe_renormalize);
  j["norm_topk_prob"] = false;
  EXPECT_FALSE(ModelConfig::from_json(j, "c").moe_renormalize);
  // transformers 5 saves num_experts as num_local_experts; no dense intermediate_size needed.
  j = qwen3_moe();
  j.erase("num_experts");
  j.erase("intermediate_size");
  j["num_local_experts"] = 12;
  EXPECT_EQ(ModelConfig::from_json(j, "c").num_experts, 12);
  // mlp_only_layers beyond the last layer make no layer dense.
  j["mlp_only_layers"] = json::array({4, 7});
  EXPECT_EQ(error_of(j), "");
  j = qwen3_moe();
  j["model_type"] = "qwen3_moe";
  j.erase("architectures");
  EXPECT_EQ(ModelConfig::from_json(j, "c").arch, Architecture::kQwen3Moe);
}

TEST(ModelConfig, Qwen3FamiliesRefuseWhatChangesTheMathNamingTheField) {
  struct Case {
    bool moe;
    const char* key;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {false, "use_sliding_window", true, "use_sliding_window"},
      {true, "use_sliding_window", true, "use_sliding_window"},
      {false, "layer_types",
       json::array({"full_attention", "full_attention", "full_attention", "sliding_attention"}),
       "layer_types[3]"},
      {false, "rope_scaling", json::parse(R"({"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768})"),
       "rope_scaling.rope_type 'yarn'"},
      {true, "rope_scaling", json::parse(R"({"type": "dynamic", "factor": 2.0})"),
       "rope_scaling.type 'dynamic'"},
      {false, "hidden_act", "gelu", "hidden_act"},
      {true, "hidden_act", "relu", "hidden_act"},
      {true, "decoder_sparse_step", 2, "decoder_sparse_step 2"},
      {true, "mlp_only_layers", json::array({1}), "mlp_only_layers makes layer 1"},
      {true, "mlp_only_layers", "0", "mlp_only_layers"},
      {true, "num_experts", 0, "num_experts"},
      {true, "num_experts_per_tok", 17, "num_experts_per_tok 17 exceeds num_experts 16"},
      {true, "norm_topk_prob", "yes", "norm_topk_prob"},
      {true, "num_local_experts", 8, "num_experts 16 and num_local_experts 8 disagree"},
      {true, "moe_intermediate_size", nullptr, "'moe_intermediate_size'"},
      {true, "quantization_config", json::parse(R"({"quant_method": "fp8"})"),
       "FP8 mixture-of-experts models are not supported"},
  };
  for (const Case& c : cases) {
    json j = c.moe ? qwen3_moe() : qwen3();
    j[c.key] = c.value;
    const std::string err = error_of(j);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.key << ": " << err;
    EXPECT_NE(err.find("config.json"), std::string::npos) << err;
  }
}

TEST(ModelConfig, RefusesWhatChangesTheMathNamingTheField) {
  struct Case {
    const char* key;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {"architectures", json::array({"GPT2LMHeadModel"}), "architecture 'GPT2LMHeadModel'"},
      {"hidden_act", "gelu", "hidden_act"},
      {"use_sliding_window", true, "use_sliding_window"},
      {"layer_types", json::array({"full_attention", "sliding_attention"}), "layer_types[1]"},
      {"rope_parameters", json::parse(R"({"rope_type": "yarn", "rope_theta": 1e4})"),
       "rope_parameters.rope_type 'yarn'"},
      {"partial_rotary_factor", 0.5, "partial_rotary_factor"},
      {"quantization_config", json::parse(R"({"quant_method": "gptq"})"), "quantization_config"},
      {"num_attention_heads", 3, "num_key_value_heads"},
      {"vocab_size", -5, "vocab_size"},
  };
  for (const Case& c : cases) {
    json j = llama();
    j[c.key] = c.value;
    const std::string err = error_of(j);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.key << ": " << err;
    EXPECT_NE(err.find("config.json"), std::string::npos) << err;
  }
  json m = llama();
  m["architectures"] = {"MistralForCausalLM"};
  m["sliding_window"] = 4096;
  EXPECT_NE(error_of(m).find("sliding_window is 4096"), std::string::npos) << error_of(m);
  json missing = llama();
  missing.erase("hidden_size");
  EXPECT_NE(error_of(missing).find("'hidden_size'"), std::string::npos);
}

TEST(ModelConfig, RopeInvFreqMatchesTransformers) {
  json j = llama();
  j["head_dim"] = 64;
  // transformers 5.17 LlamaRotaryEmbedding(inv_freq) for theta 1e4, d 64 (every 8th value).
  const float want_default[] = {1.0f, 0.1f, 0.01f, 0.001f};
  const std::vector<float> inv = rope_inv_freq(ModelConfig::from_json(j, "c"));
  ASSERT_EQ(inv.size(), 32u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(inv[8 * i], want_default[i], 1e-7 * want_default[i]);
  EXPECT_NEAR(inv[31], 0.0001333521504420787f, 2e-7 * 0.0001333521504420787f);

  j["rope_parameters"] = json::parse(R"({"rope_type": "llama3", "rope_theta": 500000.0,
      "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})");
  // transformers' _compute_llama3_parameters for the same head_dim: unchanged high
  // frequencies, smoothed medium ones (indices 15-17), divided-by-8 low ones.
  const std::vector<std::pair<int, double>> want = {{0, 1.0},
                                                    {1, 0.663601279258728},
                                                    {14, 0.0032114461064338684},
                                                    {15, 0.0013718936825171113},
                                                    {16, 0.0005248460220173001},
                                                    {17, 0.0001785077911335975},
                                                    {18, 7.784655463183299e-05},
                                                    {31, 3.76732259610435e-07}};
  const std::vector<float> scaled = rope_inv_freq(ModelConfig::from_json(j, "c"));
  for (const auto& [i, v] : want) EXPECT_NEAR(scaled[i], v, 3e-7 * v) << i;
}

}  // namespace
}  // namespace loraplex::model
