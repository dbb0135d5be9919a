// The first step of each base-model request of the tiny-llama-fp8 fixtures, run by the Decoder
// with log-probabilities: on the CPU (float32) the token and its log-probability are those of
// transformers on the dequantized weights; on CUDA (bfloat16 activations, W8A8 through
// cuBLASLt; skipped without a GPU) the token wherever the reference's margin is clear, and the
// log-probability within 0.15: each GEMM's input rounded to e4m3 (2^-4 relative) and bfloat16
// (2^-8) over three layers moves a logit by a few hundredths here.

#include <gtest/gtest.h>

#include <cmath>

#include "fixture_support.h"
#include "loraplex/model/decoder.h"
#include "support/gpu_check.h"

namespace loraplex::test {
namespace {

struct FirstSteps {
  std::vector<ExpectedLine> lines;  // the base-model requests
  model::StepResult result;
};

FirstSteps first_steps(const std::string& format, Device device, DType dtype) {
  FirstSteps f;
  for (const ExpectedLine& e : read_expected("tiny-llama-fp8/" + format)) {
    if (!e.adapter) f.lines.push_back(e);
  }
  model::DecoderOptions o;
  o.dtype = dtype;
  o.device = device;
  o.max_num_tokens = 256;
  o.max_num_seqs = 8;
  o.kv_blocks = 64;
  o.kv_block_size = 16;
  auto d = model::Decoder::load(fixture_dir("tiny-llama-fp8/" + format) + "/model", o);
  model::StepBatch batch;
  batch.want_logprobs = true;
  int32_t block = 0;
  for (const ExpectedLine& e : f.lines) {
    model::SequenceStep q;
    q.tokens = e.prompt_token_ids;
    for (size_t b = 0; b * 16 < q.tokens.size(); ++b) q.blocks.push_back(block++);
    q.sample = true;
    batch.seqs.push_back(q);
  }
  f.result = d->execute(batch);
  return f;
}

class Fp8FirstStep : public ::testing::TestWithParam<const char*> {};

TEST_P(Fp8FirstStep, CpuGivesTransformersTokenAndLogprob) {
  const FirstSteps f = first_steps(GetParam(), Device::cpu(), DType::kF32);
  ASSERT_EQ(f.lines.size(), 6u);
  for (size_t i = 0; i < f.lines.size(); ++i) {
    EXPECT_EQ(f.result.token_ids[i], f.lines[i].output_token_ids[0]) << f.lines[i].prompt;
    EXPECT_NEAR(f.result.logprobs[i], f.lines[i].first_step_logprob, 1e-4) << f.lines[i].prompt;
  }
}

// Disabled while LoraLinear refuses FP8 weights on CUDA: cuBLASLt's W8A8 gave the wrong tokens
// with per-row scales on an H200 (docs/model.md, FP8).
TEST_P(Fp8FirstStep, DISABLED_CudaW8A8WithinTheFormatsErrorOfTransformers) {
  LORAPLEX_REQUIRE_GPU();
  const FirstSteps f = first_steps(GetParam(), Device::cuda(0), DType::kBF16);
  int compared = 0;
  for (size_t i = 0; i < f.lines.size(); ++i) {
    EXPECT_NEAR(f.result.logprobs[i], f.lines[i].first_step_logprob, 0.15) << f.lines[i].prompt;
    if (f.lines[i].first_step_margin <= 0.05) continue;
    ++compared;
    EXPECT_EQ(f.result.token_ids[i], f.lines[i].output_token_ids[0]) << f.lines[i].prompt;
  }
  EXPECT_GE(compared, 3);
}

TEST_P(Fp8FirstStep, CudaRefusesFp8WeightsNamingTheCpu) {
  LORAPLEX_REQUIRE_GPU();
  try {
    first_steps(GetParam(), Device::cuda(0), DType::kBF16);
    ADD_FAILURE() << "an FP8 checkpoint was loaded on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--device cpu"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8FirstStep, ::testing::Values("dynamic", "static", "block"));

}  // namespace
}  // namespace loraplex::test
