// The shared op case library (tests/kernels_cpu/op_cases.h) run on the GPU: every case the
// CPU tests run, through the same runners (the op routers and the Punica wrapper), checked
// against the same double-precision references, including the bit-for-bit check that
// elements an op must not write are untouched and the NaN poisoning of weights and
// intermediates past each slot's rank. Skipped without a GPU.
//
// One tolerance differs from the CPU tests: the tensor-core expand rounds an fp32
// intermediate to the activation dtype before the MMA (as vLLM's Triton kernel does), so the
// expand and the split shrink+expand add one rounding of that dtype per term.

#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "kernels_cpu/op_cases.h"

namespace loraplex::test {
namespace {

Tolerance with_intermediate_rounding(Tolerance t, DType activation) {
  if (activation != DType::kF32) t.acc_rel += unit_roundoff(activation);
  return t;
}

std::string linear_name(const ::testing::TestParamInfo<LinearCase>& info) {
  return case_name(info.param);
}

std::vector<DType> shrink_out_dtypes(const LinearCase& c) {
  if (c.dtype == DType::kF32) return {DType::kF32};
  return {DType::kF32, c.dtype};
}

class CudaShrinkCases : public ::testing::TestWithParam<LinearCase> {};
class CudaExpandCases : public ::testing::TestWithParam<LinearCase> {};
class CudaLinearCases : public ::testing::TestWithParam<LinearCase> {};
class CudaLogitsCases : public ::testing::TestWithParam<LinearCase> {};
class CudaEmbeddingCases : public ::testing::TestWithParam<EmbeddingCase> {};
class CudaExpandFp8Cases : public ::testing::TestWithParam<Fp8Case> {};
class CudaFusedMoeCases : public ::testing::TestWithParam<MoeCase> {};

TEST_P(CudaShrinkCases, SgmvAndBgmvMatchDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const LinearProblem p = make_linear_problem(GetParam());
  for (DType out : shrink_out_dtypes(p.c)) {
    const Tensor before = shrink_output_before(p, out);
    const Reference ref = reference_shrink(p, before);
    for (OpForm form : {OpForm::kSgmv, OpForm::kBgmv}) {
      const Tensor got = run_shrink(p, form, before, gpu());
      EXPECT_TRUE(matches_reference(got, before, ref, shrink_tolerance(p, out)))
          << "output dtype " << out << (form == OpForm::kSgmv ? " sgmv" : " bgmv");
    }
  }
}

TEST_P(CudaExpandCases, SgmvBgmvAndSliceMatchDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const LinearProblem p = make_linear_problem(GetParam());
  for (DType mid_dtype : shrink_out_dtypes(p.c)) {
    const Tensor mid = p.mid.to(mid_dtype);
    const Tolerance tol = with_intermediate_rounding(expand_tolerance(p, mid_dtype), p.c.dtype);
    for (bool add : {true, false}) {
      const Reference ref = reference_expand(p, mid, add, 0, p.num_slices(), p.c.offset);
      for (OpForm form : {OpForm::kSgmv, OpForm::kBgmv}) {
        const Tensor got = run_expand(p, form, mid, add, gpu());
        EXPECT_TRUE(matches_reference(got, p.y0, ref, tol))
            << "intermediate " << mid_dtype << (add ? ", add_inputs" : ", overwrite")
            << (form == OpForm::kSgmv ? " sgmv" : " bgmv");
      }
    }
  }
  int64_t offset = p.c.offset;
  for (int s = 0; s < p.num_slices(); ++s) {
    const Tensor got = run_expand_slice(p, s, offset, true, gpu());
    EXPECT_TRUE(matches_reference(got, p.y0, reference_expand(p, p.mid, true, s, 1, offset),
                                  expand_tolerance(p, DType::kF32)))
        << "slice " << s << " at column " << offset;
    offset += p.c.widths[static_cast<size_t>(s)];
  }
}

TEST_P(CudaLinearCases, AddLoraLinearMatchesDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const LinearProblem p = make_linear_problem(GetParam());
  const Tensor got = run_lora_linear(p, gpu());
  EXPECT_TRUE(
      matches_reference(got, p.y0, reference_linear(p),
                        with_intermediate_rounding(linear_tolerance(p, DType::kF32), p.c.dtype)));
}

TEST_P(CudaLogitsCases, AddLoraLogitsMatchesDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const LinearProblem p = make_linear_problem(GetParam());
  const Tensor got = run_lora_logits(p, gpu());
  EXPECT_TRUE(
      matches_reference(got, p.y0, reference_linear(p),
                        with_intermediate_rounding(linear_tolerance(p, DType::kF32), p.c.dtype)));
}

TEST_P(CudaEmbeddingCases, MatchesDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const EmbeddingProblem p = make_embedding_problem(GetParam());
  const Tensor got = run_embedding(p, gpu());
  EXPECT_TRUE(matches_reference(got, p.y0, reference_embedding(p), embedding_tolerance(p)));
}

TEST_P(CudaExpandFp8Cases, QuantisationAndExpandMatchDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const Fp8Problem p = make_fp8_problem(GetParam());
  const Fp8Input in = fp8_expand_input(p, gpu());
  if (in.in_scale.defined()) {
    EXPECT_TRUE(check_quantized(p, in));
    // The GPU quantisation equals the CPU one bit for bit (same rounding, same scales).
    const Fp8Input cpu_in = fp8_expand_input(p, Device::cpu());
    EXPECT_TRUE(bit_identical(in.mid, cpu_in.mid));
    EXPECT_TRUE(bit_identical(in.in_scale, cpu_in.in_scale));
  }
  const Tensor got = run_expand_fp8(p, in, gpu());
  EXPECT_TRUE(matches_reference(got, p.y0, reference_expand_fp8(p, in), expand_fp8_tolerance(p)));
}

TEST_P(CudaFusedMoeCases, MatchesDoubleReference) {
  LORAPLEX_REQUIRE_GPU();
  const MoeProblem p = make_moe_problem(GetParam());
  const Tensor got = run_fused_moe(p, gpu());
  EXPECT_TRUE(matches_reference(got, p.y0, reference_fused_moe(p), fused_moe_tolerance(p)));
}

TEST(CudaMoeAlignCases, MatchesVllmDefinitionAndCpuBitwise) {
  LORAPLEX_REQUIRE_GPU();
  for (const MoeCase& c : moe_cases()) {
    const MoeProblem p = make_moe_problem(c);
    const MoeAlignment got =
        run_moe_align(c.num_tokens, c.top_k, c.num_experts, c.block_size, c.max_loras, p.slots,
                      p.topk_ids, p.adapter_enabled, gpu());
    EXPECT_TRUE(check_alignment(got)) << case_name(c);
    const MoeAlignment cpu =
        run_moe_align(c.num_tokens, c.top_k, c.num_experts, c.block_size, c.max_loras, p.slots,
                      p.topk_ids, p.adapter_enabled, Device::cpu());
    // Both are stable counting sorts, so even the order inside an expert group agrees.
    EXPECT_EQ(got.sorted_ids, cpu.sorted_ids) << case_name(c);
    EXPECT_EQ(got.expert_ids, cpu.expert_ids) << case_name(c);
    EXPECT_EQ(got.num_tokens_post_pad, cpu.num_tokens_post_pad) << case_name(c);
  }
}

INSTANTIATE_TEST_SUITE_P(, CudaShrinkCases, ::testing::ValuesIn(linear_cases()), linear_name);
INSTANTIATE_TEST_SUITE_P(, CudaExpandCases, ::testing::ValuesIn(linear_cases()), linear_name);
INSTANTIATE_TEST_SUITE_P(, CudaLinearCases, ::testing::ValuesIn(linear_cases()), linear_name);
INSTANTIATE_TEST_SUITE_P(, CudaLogitsCases, ::testing::ValuesIn(logits_cases()), linear_name);
INSTANTIATE_TEST_SUITE_P(, CudaEmbeddingCases, ::testing::ValuesIn(embedding_cases()),
                         [](const auto& info) { return case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(, CudaExpandFp8Cases, ::testing::ValuesIn(fp8_cases()),
                         [](const auto& info) { return case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(, CudaFusedMoeCases, ::testing::ValuesIn(moe_cases()),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace loraplex::test
