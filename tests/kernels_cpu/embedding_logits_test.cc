// Embedding LoRA and logits (lm_head) LoRA through the Punica wrapper on the CPU against
// double references; plus argument checks.

#include <gtest/gtest.h>

#include <cmath>

#include "kernels_cpu/op_cases.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::test {
namespace {

const Device kCpu = Device::cpu();

class LoraEmbedding : public ::testing::TestWithParam<EmbeddingCase> {};
class LoraLogits : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LoraEmbedding, MatchesDoubleReference) {
  const EmbeddingProblem p = make_embedding_problem(GetParam());
  const Tensor got = run_embedding(p, kCpu);
  EXPECT_TRUE(matches_reference(got, p.y0, reference_embedding(p), embedding_tolerance(p)));
}

TEST_P(LoraLogits, MatchesDoubleReference) {
  const LinearProblem p = make_linear_problem(GetParam());
  const Tensor got = run_lora_logits(p, kCpu);
  EXPECT_TRUE(matches_reference(got, p.y0, reference_linear(p), linear_tolerance(p, DType::kF32)));
}

INSTANTIATE_TEST_SUITE_P(, LoraEmbedding, ::testing::ValuesIn(embedding_cases()),
                         [](const auto& info) { return case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(, LoraLogits, ::testing::ValuesIn(logits_cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST_F(LoraEmbedding, RejectsTokenIdsOutsideTheLoraVocabulary) {
  std::mt19937_64 rng(3);
  PunicaWrapper wrapper(2, 8, 1, kCpu);
  Stream cpu;
  wrapper.update_metadata(std::vector<int32_t>{0, -1, 1}, {}, cpu);
  SlotRanks ranks(1, 2, 4, kCpu);
  ranks.set_slot(0, 4, cpu);
  ranks.set_slot(1, 2, cpu);
  const Tensor a = random_tensor({2, 10, 4}, DType::kF32, rng);
  const Tensor b = random_tensor({2, 6, 4}, DType::kF32, rng);
  Tensor y = random_tensor({3, 6}, DType::kF32, rng);
  // Token 1 is base-only: its id is never looked up and may exceed the LoRA vocabulary.
  wrapper.add_lora_embedding(y, Tensor::from_vector(std::vector<int32_t>{9, 50, 0}, {3}), a, b,
                             ranks, 1.0f, cpu);
  try {
    wrapper.add_lora_embedding(y, Tensor::from_vector(std::vector<int32_t>{9, 0, 10}, {3}), a, b,
                               ranks, 1.0f, cpu);
    FAIL() << "accepted token id 10 with a vocabulary of 10";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 2 has id 10, expected 0..9"), std::string::npos)
        << e.what();
  }
  const Tensor b_wide = random_tensor({2, 7, 4}, DType::kF32, rng);
  EXPECT_THROW(
      wrapper.add_lora_embedding(y, Tensor::from_vector(std::vector<int32_t>{0, 0, 0}, {3}), a,
                                 b_wide, ranks, 1.0f, cpu),
      Error);
  const Tensor a_bf16 = a.to(DType::kBF16);
  EXPECT_THROW(
      wrapper.add_lora_embedding(y, Tensor::from_vector(std::vector<int32_t>{0, 0, 0}, {3}), a_bf16,
                                 b, ranks, 1.0f, cpu),
      Error);
}

TEST_F(LoraLogits, UsesTheSamplerMappingNotTheTokenMapping) {
  // Tokens and sampled rows differ in count and slots: the logits LoRA follows the sampler.
  std::mt19937_64 rng(5);
  PunicaWrapper wrapper(2, 16, 4, kCpu);
  Stream cpu;
  wrapper.update_metadata(std::vector<int32_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
                          std::vector<int32_t>{-1, 1, -1}, cpu);
  SlotRanks ranks(1, 2, 4, kCpu);
  ranks.set_slot(0, 4, cpu);
  ranks.set_slot(1, 4, cpu);
  const Tensor x = random_tensor({3, 8}, DType::kF32, rng);
  const Tensor a = random_tensor({2, 4, 8}, DType::kF32, rng);
  const Tensor b = random_tensor({2, 5, 4}, DType::kF32, rng);
  Tensor y = random_tensor({3, 5}, DType::kF32, rng);
  const Tensor y0 = y.clone();
  Tensor ws = Tensor::empty({64}, DType::kF32);
  wrapper.add_lora_logits(y, x, a, b, ranks, 1.0f, ws, cpu);
  for (int64_t j = 0; j < 5; ++j) {
    EXPECT_EQ(y.item({0, j}), y0.item({0, j}));
    EXPECT_EQ(y.item({2, j}), y0.item({2, j}));
  }
  double changed = 0;
  for (int64_t j = 0; j < 5; ++j) changed += std::fabs(y.item({1, j}) - y0.item({1, j}));
  EXPECT_GT(changed, 0.0);
  // Ten token rows do not fit the sampler metadata of three rows.
  Tensor y_tokens = random_tensor({10, 5}, DType::kF32, rng);
  EXPECT_THROW(wrapper.add_lora_logits(y_tokens, random_tensor({10, 8}, DType::kF32, rng), a, b,
                                       ranks, 1.0f, ws, cpu),
               Error);
}

}  // namespace
}  // namespace loraplex::test
