// End-to-end generation against the PEFT references of testdata/: the whole mixed batch (base
// model and every adapter, prefills and decodes together) must give, token for token, what
// PEFT gives one request at a time. Runs the same library call as `loraplex generate`.

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "fixture_support.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "support/gpu_check.h"

namespace loraplex::test {
namespace {

std::vector<size_t> identity_order(size_t n) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  return order;
}

// Runs `cfg` and checks every output against expected[order[i]].
engine::GenerateReport expect_matches(const engine::GenerateConfig& cfg,
                                      const std::vector<ExpectedLine>& expected,
                                      const std::vector<size_t>& order, bool check_text = true) {
  const engine::GenerateReport report = engine::run_generate(cfg);
  EXPECT_EQ(report.outputs.size(), order.size());
  for (size_t i = 0; i < report.outputs.size() && i < order.size(); ++i) {
    const ExpectedLine& e = expected[order[i]];
    const engine::GenerateOutput& got = report.outputs[i];
    const std::string what = "request " + std::to_string(order[i]) + " (" + e.prompt + ", " +
                             e.adapter.value_or("base") + ")";
    EXPECT_EQ(got.prompt, e.prompt) << what;
    EXPECT_EQ(got.adapter, e.adapter) << what;
    EXPECT_EQ(got.prompt_token_ids, e.prompt_token_ids) << what;
    EXPECT_EQ(got.output_token_ids, e.output_token_ids) << what;
    if (check_text) {
      EXPECT_EQ(got.output_text, e.output_text) << what;
    }
  }
  return report;
}

class GenerateTinyLlama : public ::testing::Test {
 protected:
  void SetUp() override { expected_ = read_expected("tiny-llama"); }
  std::vector<ExpectedLine> expected_;
};

TEST_F(GenerateTinyLlama, OneMixedBatchMatchesPeft) {
  ASSERT_EQ(expected_.size(), 30u);
  const auto order = identity_order(expected_.size());
  const engine::GenerateReport report =
      expect_matches(fixture_config("tiny-llama", expected_, order), expected_, order);
  // All 30 requests really shared steps: the first step prefilled all of them, with the base
  // model and all four adapters together.
  EXPECT_EQ(report.stats.max_batch, 30);
  EXPECT_EQ(report.stats.max_step_adapters, 4);
  EXPECT_EQ(report.stats.steps, 12);
}

class GenerateTinyLlamaMaxNumSeqs : public GenerateTinyLlama,
                                    public ::testing::WithParamInterface<int> {};

TEST_P(GenerateTinyLlamaMaxNumSeqs, MatchesPeft) {
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.max_num_seqs = GetParam();
  const engine::GenerateReport report = expect_matches(cfg, expected_, order);
  EXPECT_LE(report.stats.max_batch, GetParam());
}

INSTANTIATE_TEST_SUITE_P(GenerateTinyLlama, GenerateTinyLlamaMaxNumSeqs,
                         ::testing::Values(1, 7, 30));

TEST_F(GenerateTinyLlama, ShuffledOrderMatchesPeft) {
  auto order = identity_order(expected_.size());
  std::mt19937_64 rng(2024);
  std::shuffle(order.begin(), order.end(), rng);
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.max_num_seqs = 11;
  expect_matches(cfg, expected_, order);
}

TEST_F(GenerateTinyLlama, FewerLoraSlotsThanAdaptersWaitAndMatch) {
  // Two slots for four adapters: requests wait for a slot, slots are reprogrammed in between.
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.max_loras = 2;
  const engine::GenerateReport report = expect_matches(cfg, expected_, order);
  EXPECT_LE(report.stats.max_step_adapters, 2);
  EXPECT_GT(report.stats.steps, 12);
}

// On the CPU decode steps with LoRA take the fused path by default (the shrink in the base
// GEMM, the expand in the op after it); the LoRA kernels after each GEMM give the same tokens.
TEST_F(GenerateTinyLlama, LoraKernelsPathMatchesPeft) {
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.lora_decode = model::LoraDecode::kKernels;
  expect_matches(cfg, expected_, order);
}

TEST_F(GenerateTinyLlama, StopsAtEosUnlessIgnored) {
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.ignore_eos = false;
  const engine::GenerateReport report = engine::run_generate(cfg);
  int stopped = 0;
  for (size_t i = 0; i < expected_.size(); ++i) {
    std::vector<int32_t> want = expected_[i].output_token_ids;
    const auto eos = std::find(want.begin(), want.end(), 1);  // the fixture's EOS id
    if (eos != want.end()) {
      want.erase(eos + 1, want.end());
      ++stopped;
    }
    EXPECT_EQ(report.outputs[i].output_token_ids, want) << "request " << i;
  }
  EXPECT_GT(stopped, 0) << "the fixture has sequences that run past EOS";
}

TEST_F(GenerateTinyLlama, PerRequestMaxTokens) {
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  for (size_t i = 0; i < cfg.requests.size(); ++i) cfg.requests[i].max_tokens = 1 + i % 12;
  cfg.max_num_seqs = 9;
  const engine::GenerateReport report = engine::run_generate(cfg);
  for (size_t i = 0; i < expected_.size(); ++i) {
    const std::vector<int32_t>& full = expected_[i].output_token_ids;
    const std::vector<int32_t> want(full.begin(), full.begin() + static_cast<long>(1 + i % 12));
    EXPECT_EQ(report.outputs[i].output_token_ids, want) << "request " << i;
  }
}

TEST_F(GenerateTinyLlama, Bfloat16FirstTokenWhereTheMarginIsClear) {
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.dtype = DType::kBF16;
  const engine::GenerateReport report = engine::run_generate(cfg);
  int compared = 0;
  for (size_t i = 0; i < expected_.size(); ++i) {
    if (expected_[i].first_step_margin <= 0.05) continue;
    ++compared;
    EXPECT_EQ(report.outputs[i].output_token_ids.at(0), expected_[i].output_token_ids.at(0))
        << "request " << i << " (first-step margin " << expected_[i].first_step_margin << ")";
  }
  EXPECT_GT(compared, 10);
}

TEST_F(GenerateTinyLlama, UnknownAdapterNamesFileAndLine) {
  auto order = identity_order(3);
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.requests[1].adapter = "nosuch";
  cfg.requests_path = "reqs.jsonl";
  cfg.requests[1].line = 7;
  try {
    engine::run_generate(cfg);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reqs.jsonl:7"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nosuch"), std::string::npos) << e.what();
  }
}

TEST_F(GenerateTinyLlama, MaxLoraRankBelowAnAdapterRankNamesIt) {
  auto order = identity_order(5);
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.max_lora_rank = 8;  // pirate has rank 16
  try {
    engine::run_generate(cfg);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("adapter 'pirate'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("adapter_model.safetensors"), std::string::npos)
        << e.what();
  }
}

TEST_F(GenerateTinyLlama, SamplingIsSeededPerRequestAndBatchIndependent) {
  const auto order = identity_order(expected_.size());
  engine::GenerateConfig cfg = fixture_config("tiny-llama", expected_, order);
  cfg.temperature = 0.9f;
  cfg.top_k = 40;
  cfg.top_p = 0.95f;
  cfg.seed = 7;
  const auto batched = engine::run_generate(cfg);
  cfg.max_num_seqs = 4;
  const auto small = engine::run_generate(cfg);
  cfg.seed = 8;
  const auto other_seed = engine::run_generate(cfg);
  int differs_from_greedy = 0;
  int differs_by_seed = 0;
  for (size_t i = 0; i < expected_.size(); ++i) {
    EXPECT_EQ(batched.outputs[i].output_token_ids, small.outputs[i].output_token_ids) << i;
    differs_from_greedy += batched.outputs[i].output_token_ids != expected_[i].output_token_ids;
    differs_by_seed +=
        batched.outputs[i].output_token_ids != other_seed.outputs[i].output_token_ids;
  }
  EXPECT_GT(differs_from_greedy, 0);
  EXPECT_GT(differs_by_seed, 0);
}

TEST(GenerateTinyQwen2, OneMixedBatchMatchesPeft) {
  const auto expected = read_expected("tiny-qwen2");
  const auto order = identity_order(expected.size());
  const auto report =
      expect_matches(fixture_config("tiny-qwen2", expected, order), expected, order);
  EXPECT_EQ(report.stats.max_step_adapters, 3);
}

TEST(GenerateTinyQwen2, LoraKernelsPathMatchesPeft) {
  const auto expected = read_expected("tiny-qwen2");
  const auto order = identity_order(expected.size());
  engine::GenerateConfig cfg = fixture_config("tiny-qwen2", expected, order);
  cfg.lora_decode = model::LoraDecode::kKernels;
  expect_matches(cfg, expected, order);
}

// The fixture's requests in a shuffled order, one sequence per step.
void expect_one_sequence_at_a_time_matches(const std::string& fixture, uint64_t seed) {
  const auto expected = read_expected(fixture);
  auto order = identity_order(expected.size());
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  engine::GenerateConfig cfg = fixture_config(fixture, expected, order);
  cfg.max_num_seqs = 1;
  expect_matches(cfg, expected, order);
}

TEST(GenerateTinyQwen2, OneSequenceAtATimeMatchesPeft) {
  expect_one_sequence_at_a_time_matches("tiny-qwen2", 5);
}

TEST(GenerateTinyMixtral, OneMixedBatchMatchesPeft) {
  // Includes the 3-D expert adapter and the same adapter in per-expert 2-D form.
  const auto expected = read_expected("tiny-mixtral");
  const auto order = identity_order(expected.size());
  expect_matches(fixture_config("tiny-mixtral", expected, order), expected, order);
}

// The fixture's expert adapter as PEFT's 3-D parameters ("experts") and converted to per-expert
// 2-D modules ("experts2d") through one LoRA slot that the two forms take in turn.
void expect_2d_and_3d_expert_adapters_agree(const std::string& fixture) {
  const auto expected = read_expected(fixture);
  std::vector<size_t> order;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i].adapter == "experts" || expected[i].adapter == "experts2d") order.push_back(i);
  }
  ASSERT_GE(order.size(), 4u);
  engine::GenerateConfig cfg = fixture_config(fixture, expected, order);
  cfg.max_loras = 1;  // one slot: the two forms replace each other in it
  cfg.max_num_seqs = 3;
  const auto report = engine::run_generate(cfg);
  for (size_t i = 0; i < order.size(); ++i) {
    for (size_t j = 0; j < order.size(); ++j) {
      if (expected[order[i]].prompt == expected[order[j]].prompt) {
        EXPECT_EQ(report.outputs[i].output_token_ids, report.outputs[j].output_token_ids);
      }
    }
    EXPECT_EQ(report.outputs[i].output_token_ids, expected[order[i]].output_token_ids);
  }
}

TEST(GenerateTinyMixtral, ExpertAdapterIn2dAnd3dFormGiveTheSameTokens) {
  expect_2d_and_3d_expert_adapters_agree("tiny-mixtral");
}

// All of the fixture's `requests` in one batch, whose steps hold the base model and `adapters`.
void expect_one_batch_matches(const std::string& fixture, size_t requests, int64_t adapters) {
  const auto expected = read_expected(fixture);
  ASSERT_EQ(expected.size(), requests);
  const auto order = identity_order(expected.size());
  const auto report = expect_matches(fixture_config(fixture, expected, order), expected, order);
  EXPECT_EQ(report.stats.max_batch, static_cast<int64_t>(requests));
  EXPECT_EQ(report.stats.max_step_adapters, adapters);
}

TEST(GenerateTinyQwen3, OneMixedBatchMatchesPeft) {
  // The base model, an attention adapter and an all-linear one (q/k LoRA before q_norm/k_norm).
  expect_one_batch_matches("tiny-qwen3", 18, 2);
}

TEST(GenerateTinyQwen3, OneSequenceAtATimeMatchesPeft) {
  expect_one_sequence_at_a_time_matches("tiny-qwen3", 7);
}

TEST(GenerateTinyQwen3Moe, OneMixedBatchMatchesPeft) {
  // The base model and adapters on attention, on the experts (3-D and 2-D) and on both.
  expect_one_batch_matches("tiny-qwen3-moe", 25, 4);
}

TEST(GenerateTinyQwen3Moe, ExpertAdapterIn2dAnd3dFormGiveTheSameTokens) {
  expect_2d_and_3d_expert_adapters_agree("tiny-qwen3-moe");
}

// The CUDA path reproduces the float32 references token for token, and in bfloat16 the first
// token wherever the reference's first-step margin is clear. Skipped without a GPU.
class GenerateCuda : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { LORAPLEX_REQUIRE_GPU(); }
};

TEST_P(GenerateCuda, Float32MatchesPeft) {
  const auto expected = read_expected(GetParam());
  const auto order = identity_order(expected.size());
  engine::GenerateConfig cfg = fixture_config(GetParam(), expected, order);
  cfg.device = Device::cuda(0);
  expect_matches(cfg, expected, order);
  cfg.max_num_seqs = 5;
  expect_matches(cfg, expected, order);
}

// The default (kAuto) takes the overlap path for these decode steps and the fused one for the
// prefills of up to 512 tokens; each path alone gives the same tokens.
TEST_P(GenerateCuda, Float32EveryLoraDecodePathMatchesPeft) {
  const auto expected = read_expected(GetParam());
  const auto order = identity_order(expected.size());
  engine::GenerateConfig cfg = fixture_config(GetParam(), expected, order);
  cfg.device = Device::cuda(0);
  for (model::LoraDecode path :
       {model::LoraDecode::kFused, model::LoraDecode::kKernels, model::LoraDecode::kOverlap}) {
    cfg.lora_decode = path;
    expect_matches(cfg, expected, order);
  }
}

TEST_P(GenerateCuda, Bfloat16FirstTokenWhereTheMarginIsClear) {
  const auto expected = read_expected(GetParam());
  const auto order = identity_order(expected.size());
  engine::GenerateConfig cfg = fixture_config(GetParam(), expected, order);
  cfg.device = Device::cuda(0);
  cfg.dtype = DType::kBF16;
  const auto report = engine::run_generate(cfg);
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i].first_step_margin <= 0.05) continue;
    EXPECT_EQ(report.outputs[i].output_token_ids.at(0), expected[i].output_token_ids.at(0))
        << "request " << i << " (first-step margin " << expected[i].first_step_margin << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GenerateCuda,
                         ::testing::Values("tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3",
                                           "tiny-qwen3-moe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace loraplex::test
