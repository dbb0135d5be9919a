// lora_shrink / lora_expand (SGMV, with batch metadata) and the BGMV forms on the CPU against
// double references, over the shared case table; plus argument checks.

#include <gtest/gtest.h>

#include "kernels_cpu/op_cases.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/punica/batch_meta.h"

namespace loraplex::test {
namespace {

const Device kCpu = Device::cpu();

std::string param_name(const ::testing::TestParamInfo<LinearCase>& info) {
  return case_name(info.param);
}

// The dtypes the shrink output may have: float32, or the input dtype.
std::vector<DType> shrink_out_dtypes(const LinearCase& c) {
  if (c.dtype == DType::kF32) return {DType::kF32};
  return {DType::kF32, c.dtype};
}

class LoraShrink : public ::testing::TestWithParam<LinearCase> {};
class BgmvShrink : public ::testing::TestWithParam<LinearCase> {};
class LoraExpand : public ::testing::TestWithParam<LinearCase> {};
class BgmvExpand : public ::testing::TestWithParam<LinearCase> {};
class BgmvExpandSlice : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LoraShrink, MatchesDoubleReference) {
  const LinearProblem p = make_linear_problem(GetParam());
  for (DType out : shrink_out_dtypes(p.c)) {
    const Tensor before = shrink_output_before(p, out);
    const Tensor got = run_shrink(p, OpForm::kSgmv, before, kCpu);
    EXPECT_TRUE(
        matches_reference(got, before, reference_shrink(p, before), shrink_tolerance(p, out)))
        << "output dtype " << out;
  }
}

TEST_P(BgmvShrink, MatchesDoubleReferenceAndSgmvBitwise) {
  const LinearProblem p = make_linear_problem(GetParam());
  for (DType out : shrink_out_dtypes(p.c)) {
    const Tensor before = shrink_output_before(p, out);
    const Tensor got = run_shrink(p, OpForm::kBgmv, before, kCpu);
    EXPECT_TRUE(
        matches_reference(got, before, reference_shrink(p, before), shrink_tolerance(p, out)))
        << "output dtype " << out;
    EXPECT_TRUE(bit_identical(got, run_shrink(p, OpForm::kSgmv, before, kCpu)));
  }
}

TEST_P(LoraExpand, MatchesDoubleReference) {
  const LinearProblem p = make_linear_problem(GetParam());
  for (DType mid_dtype : shrink_out_dtypes(p.c)) {
    const Tensor mid = p.mid.to(mid_dtype);
    for (bool add : {true, false}) {
      const Tensor got = run_expand(p, OpForm::kSgmv, mid, add, kCpu);
      EXPECT_TRUE(matches_reference(got, p.y0,
                                    reference_expand(p, mid, add, 0, p.num_slices(), p.c.offset),
                                    expand_tolerance(p, mid_dtype)))
          << "intermediate " << mid_dtype << (add ? ", add_inputs" : ", overwrite");
    }
  }
}

TEST_P(BgmvExpand, MatchesDoubleReferenceAndSgmvBitwise) {
  const LinearProblem p = make_linear_problem(GetParam());
  for (DType mid_dtype : shrink_out_dtypes(p.c)) {
    const Tensor mid = p.mid.to(mid_dtype);
    for (bool add : {true, false}) {
      const Tensor got = run_expand(p, OpForm::kBgmv, mid, add, kCpu);
      EXPECT_TRUE(matches_reference(got, p.y0,
                                    reference_expand(p, mid, add, 0, p.num_slices(), p.c.offset),
                                    expand_tolerance(p, mid_dtype)))
          << "intermediate " << mid_dtype << (add ? ", add_inputs" : ", overwrite");
      EXPECT_TRUE(bit_identical(got, run_expand(p, OpForm::kSgmv, mid, add, kCpu)));
    }
  }
}

TEST_P(BgmvExpandSlice, EachSliceAtItsOffset) {
  const LinearProblem p = make_linear_problem(GetParam());
  int64_t offset = p.c.offset;
  for (int s = 0; s < p.num_slices(); ++s) {
    for (bool add : {true, false}) {
      const Tensor got = run_expand_slice(p, s, offset, add, kCpu);
      EXPECT_TRUE(matches_reference(got, p.y0, reference_expand(p, p.mid, add, s, 1, offset),
                                    expand_tolerance(p, DType::kF32)))
          << "slice " << s << " at column " << offset << (add ? ", add_inputs" : ", overwrite");
    }
    offset += p.c.widths[s];
  }
}

INSTANTIATE_TEST_SUITE_P(, LoraShrink, ::testing::ValuesIn(linear_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(, BgmvShrink, ::testing::ValuesIn(linear_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(, LoraExpand, ::testing::ValuesIn(linear_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(, BgmvExpand, ::testing::ValuesIn(linear_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(, BgmvExpandSlice, ::testing::ValuesIn(linear_cases()), param_name);

// A small valid shrink/expand setup on the CPU whose fields the error tests break one at a time.
struct SmallCall {
  static constexpr int kTokens = 3;
  static constexpr int kLoras = 4;
  static constexpr int kRank = 8;
  static constexpr int kHidden = 32;
  static constexpr int kWidth = 16;
  std::mt19937_64 rng{7};
  std::vector<int32_t> slots = {0, -1, 3};
  std::vector<int32_t> ranks = {8, 4, 0, 2};
  Tensor x = random_tensor({kTokens, kHidden}, DType::kBF16, rng);
  Tensor a = random_tensor({kLoras, kRank, kHidden}, DType::kBF16, rng);
  Tensor b = random_tensor({kLoras, kWidth, kRank}, DType::kBF16, rng);
  Tensor mid = random_tensor({1, kTokens, kRank}, DType::kF32, rng);
  Tensor y = random_tensor({kTokens, kWidth}, DType::kBF16, rng);
  LoraBatchMeta meta{kLoras, 8, Device::cpu()};

  SmallCall() { meta.prepare(slots, Stream()); }

  kernels::ShrinkArgs shrink() {
    kernels::ShrinkArgs s;
    s.dtype = DType::kBF16;
    s.num_tokens = kTokens;
    s.hidden = kHidden;
    s.x = x.data_ptr();
    s.x_row_stride = kHidden;
    s.lora_a[0] = a.data_ptr();
    s.max_loras = kLoras;
    s.max_rank = kRank;
    s.ranks = ranks.data();
    s.out = mid.data_ptr();
    return s;
  }
  kernels::ExpandArgs expand() {
    kernels::ExpandArgs e;
    e.dtype = DType::kBF16;
    e.num_tokens = kTokens;
    e.in = mid.data_ptr();
    e.lora_b[0] = b.data_ptr();
    e.slice_width[0] = kWidth;
    e.max_loras = kLoras;
    e.max_rank = kRank;
    e.ranks = ranks.data();
    e.y = y.data_ptr();
    e.y_row_stride = kWidth;
    return e;
  }
};

// The status is an invalid-argument error whose message contains every part of `parts`.
::testing::AssertionResult rejected(const Status& status,
                                    std::initializer_list<const char*> parts) {
  if (status.ok()) return ::testing::AssertionFailure() << "accepted";
  if (status.code() != StatusCode::kInvalidArgument) {
    return ::testing::AssertionFailure()
           << "code " << static_cast<int>(status.code()) << ": " << status.message();
  }
  for (const char* part : parts) {
    if (status.message().find(part) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "message '" << status.message() << "' lacks '" << part << "'";
    }
  }
  return ::testing::AssertionSuccess() << status.message();
}

TEST_F(LoraShrink, RejectsBadArgumentsNamingTheValue) {
  SmallCall c;
  ASSERT_TRUE(kernels::cpu::lora_shrink(c.shrink(), c.meta.view()).ok());
  kernels::ShrinkArgs s = c.shrink();
  s.out_dtype = DType::kF16;
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()),
                       {"output dtype float16", "expected float32 or bfloat16"}));
  s = c.shrink();
  s.dtype = DType::kF8E4M3;
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()), {"float8_e4m3"}));
  s = c.shrink();
  s.x_row_stride = 31;
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()),
                       {"row stride 31", "smaller than hidden 32"}));
  std::vector<int32_t> big = {8, 9, 0, 2};
  s = c.shrink();
  s.ranks = big.data();
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()),
                       {"slot 1 has rank 9", "expected 0..8"}));
  s = c.shrink();
  s.num_tokens = 2;
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()),
                       {"metadata built for 3 tokens", "the call has 2"}));
  s = c.shrink();
  s.lora_a[0] = nullptr;
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()), {"LoRA-A of slice 0"}));
  s = c.shrink();
  s.num_slices = 9;
  EXPECT_TRUE(rejected(kernels::cpu::lora_shrink(s, c.meta.view()), {"num_slices 9"}));
}

TEST_F(BgmvShrink, RejectsSlotsOutsideMaxLoras) {
  SmallCall c;
  std::vector<int32_t> mapping = {0, 4, -1};
  EXPECT_TRUE(rejected(kernels::cpu::bgmv_shrink(c.shrink(), mapping.data()),
                       {"token 1 has LoRA slot 4", "[0, 4)"}));
  mapping = {0, -2, -1};
  EXPECT_TRUE(rejected(kernels::cpu::bgmv_shrink(c.shrink(), mapping.data()),
                       {"token 1 has LoRA slot -2"}));
  EXPECT_TRUE(rejected(kernels::cpu::bgmv_shrink(c.shrink(), nullptr), {"mapping is null"}));
}

TEST_F(LoraExpand, RejectsBadArgumentsNamingTheValue) {
  SmallCall c;
  ASSERT_TRUE(kernels::cpu::lora_expand(c.expand(), c.meta.view()).ok());
  kernels::ExpandArgs e = c.expand();
  e.offset_start = 1;
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(e, c.meta.view()),
                       {"slices end at column 17", "row stride 16"}));
  e = c.expand();
  e.in_dtype = DType::kF16;
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(e, c.meta.view()),
                       {"intermediate dtype float16", "expected float32 or bfloat16"}));
  e = c.expand();
  e.slice_width[0] = 0;
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(e, c.meta.view()), {"slice 0 width 0"}));
  e = c.expand();
  e.max_loras = 2;
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(e, c.meta.view()),
                       {"metadata built for max_loras 4", "the weights have 2"}));
  std::vector<int32_t> negative = {8, -1, 0, 2};
  e = c.expand();
  e.ranks = negative.data();
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(e, c.meta.view()), {"slot 1 has rank -1"}));
}

TEST_F(BgmvExpand, RejectsSlotsOutsideMaxLoras) {
  SmallCall c;
  std::vector<int32_t> mapping = {0, 1, 7};
  EXPECT_TRUE(
      rejected(kernels::cpu::bgmv_expand(c.expand(), mapping.data()), {"token 2 has LoRA slot 7"}));
}

TEST_F(LoraExpand, StaleMetadataIsRejected) {
  // Metadata rebuilt for another batch of the same size lists other tokens: with a slot -1
  // token where the op expects a LoRA token the op refuses rather than touching it.
  SmallCall c;
  kernels::LoraMetaView view = c.meta.view();
  std::vector<int32_t> sorted = {1, 0, 1};  // position 2 lists token 1, which has slot -1
  view.sorted_token_indices = sorted.data();
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(c.expand(), view), {"lists token 1"}));
  sorted = {1, 0, 5};
  EXPECT_TRUE(rejected(kernels::cpu::lora_expand(c.expand(), view), {"lists token 5"}));
}

}  // namespace
}  // namespace loraplex::test
