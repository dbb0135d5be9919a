#include "loraplex/punica/punica_wrapper.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "kernels_cpu/op_cases.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using Wrapper = ::loraplex::PunicaWrapper;
const Device kCpu = Device::cpu();

// The gtest suite is named after the class under test; inside it, `Wrapper` is the class.
class PunicaWrapper : public ::testing::TestWithParam<test::LinearCase> {};

TEST_P(PunicaWrapper, AddLoraLinearMatchesDoubleReference) {
  const test::LinearProblem p = test::make_linear_problem(GetParam());
  const Tensor got = test::run_lora_linear(p, kCpu);
  EXPECT_TRUE(test::matches_reference(got, p.y0, test::reference_linear(p),
                                      test::linear_tolerance(p, DType::kF32)));
}

TEST_P(PunicaWrapper, AddShrinkAndAddExpandMatchDoubleReference) {
  const test::LinearProblem p = test::make_linear_problem(GetParam());
  const test::LinearCase& c = p.c;
  Wrapper wrapper(c.max_loras, c.num_tokens, 1, kCpu);
  Stream cpu;
  wrapper.update_metadata(p.slots, {}, cpu);
  SlotRanks ranks(p.num_slices(), c.max_loras, c.max_rank, kCpu);
  for (int s = 0; s < p.num_slices(); ++s) {
    for (int k = 0; k < c.max_loras; ++k) ranks.set(s, k, p.rank(s, k), cpu);
  }
  for (DType out : {DType::kF32, c.dtype}) {
    const Tensor before = test::shrink_output_before(p, out);
    Tensor got = before.clone();
    wrapper.add_shrink(got, p.x, p.a, ranks, p.scale, cpu);
    EXPECT_TRUE(test::matches_reference(got, before, test::reference_shrink(p, before),
                                        test::shrink_tolerance(p, out)))
        << "shrink into " << out;
  }
  for (bool add : {true, false}) {
    Tensor y = p.y0.clone();
    wrapper.add_expand(y, p.mid, p.b, ranks, c.offset, add, cpu);
    EXPECT_TRUE(test::matches_reference(
        y, p.y0, test::reference_expand(p, p.mid, add, 0, p.num_slices(), c.offset),
        test::expand_tolerance(p, DType::kF32)))
        << (add ? "add_inputs" : "overwrite");
  }
}

INSTANTIATE_TEST_SUITE_P(, PunicaWrapper, ::testing::ValuesIn(test::linear_cases()),
                         [](const auto& info) { return test::case_name(info.param); });

void expect_error(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(PunicaWrapper, RejectsMismatchedShapesWithClearErrors) {
  Wrapper wrapper(4, 16, 4, kCpu);
  Stream cpu;
  std::vector<int32_t> slots = {0, 1, -1};
  wrapper.update_metadata(slots, {}, cpu);
  std::mt19937_64 rng(1);
  SlotRanks ranks(1, 4, 8, kCpu);
  std::vector<Tensor> a = {test::random_tensor({4, 8, 32}, DType::kF32, rng)};
  std::vector<Tensor> b = {test::random_tensor({4, 16, 8}, DType::kF32, rng)};
  Tensor ws = Tensor::empty({1024}, DType::kF32);
  Tensor y = test::random_tensor({3, 16}, DType::kF32, rng);
  const Tensor x = test::random_tensor({3, 32}, DType::kF32, rng);
  const Tensor x_bad = test::random_tensor({3, 31}, DType::kF32, rng);
  expect_error([&] { wrapper.add_lora_linear(y, x_bad, a, b, ranks, 1.0f, ws, cpu); },
               "input size 32, x has 31");
  const Tensor x_bf16 = test::random_tensor({3, 32}, DType::kBF16, rng);
  expect_error([&] { wrapper.add_lora_linear(y, x_bf16, a, b, ranks, 1.0f, ws, cpu); },
               "has dtype float32, expected bfloat16");
  std::vector<Tensor> a_wide = {test::random_tensor({5, 8, 32}, DType::kF32, rng)};
  expect_error([&] { wrapper.add_lora_linear(y, x, a_wide, b, ranks, 1.0f, ws, cpu); },
               "stacks 5 slots, expected max_loras 4");
  Tensor small_ws = Tensor::empty({10}, DType::kF32);
  expect_error([&] { wrapper.add_lora_linear(y, x, a, b, ranks, 1.0f, small_ws, cpu); },
               "workspace has 10 elements, needs 24");
  expect_error([&] { ranks.set(0, 0, 9, cpu); },
               "LoRA rank 9 for slot 0 is outside [0, max_lora_rank 8]");
  const Tensor x_4 = test::random_tensor({4, 32}, DType::kF32, rng);
  expect_error([&] { wrapper.add_lora_linear(y, x_4, a, b, ranks, 1.0f, ws, cpu); },
               "x has 4 rows, the batch metadata has 3 tokens");
}

TEST_F(PunicaWrapper, RejectsBadSlotsRanksAndLayouts) {
  Wrapper wrapper(4, 8, 2, kCpu);
  Stream cpu;
  expect_error(
      [&] {
        wrapper.update_metadata(std::vector<int32_t>{0, 1, 4}, {}, cpu);
      },
      "token 2 has LoRA slot 4, expected -1 (no LoRA) or a slot in [0, 4)");
  expect_error([&] { wrapper.update_metadata(std::vector<int32_t>(9, 0), {}, cpu); },
               "9 tokens exceed max_num_tokens 8");
  expect_error(
      [&] {
        wrapper.update_metadata({}, std::vector<int32_t>{0, 0, 0}, cpu);
      },
      "3 tokens exceed max_num_tokens 2");
  wrapper.update_metadata(std::vector<int32_t>{0, 3, -1}, {}, cpu);
  std::mt19937_64 rng(2);
  const std::vector<Tensor> a = {test::random_tensor({4, 8, 32}, DType::kBF16, rng)};
  const std::vector<Tensor> b = {test::random_tensor({4, 16, 8}, DType::kBF16, rng)};
  Tensor ws = Tensor::empty({1024}, DType::kF32);
  Tensor y = test::random_tensor({3, 16}, DType::kBF16, rng);
  const Tensor x = test::random_tensor({3, 32}, DType::kBF16, rng);
  // Ranks larger than the stacked weights.
  SlotRanks big(1, 4, 16, kCpu);
  big.set(0, 3, 12, cpu);
  expect_error([&] { wrapper.add_lora_linear(y, x, a, b, big, 1.0f, ws, cpu); },
               "slice 0 slot 3 has rank 12, expected 0..8 (the stacked weights' rank)");
  SlotRanks two_slices(2, 4, 8, kCpu);
  expect_error([&] { wrapper.add_lora_linear(y, x, a, b, two_slices, 1.0f, ws, cpu); },
               "ranks are [2, 4], expected [num_slices 1, max_loras 4]");
  expect_error([&] { wrapper.add_lora_linear(y, x, a, b, SlotRanks(), 1.0f, ws, cpu); },
               "ranks are empty");
  SlotRanks ranks(1, 4, 8, kCpu);
  ranks.set_slot(0, 8, cpu);
  // Non-contiguous inputs where contiguity is required.
  const Tensor x_cols = test::random_tensor({32, 3}, DType::kBF16, rng).transpose(0, 1);
  expect_error([&] { wrapper.add_lora_linear(y, x_cols, a, b, ranks, 1.0f, ws, cpu); },
               "x needs contiguous rows (last stride 1), got strides [1, 3]");
  const std::vector<Tensor> a_t = {
      test::random_tensor({4, 32, 8}, DType::kBF16, rng).transpose(1, 2)};
  expect_error([&] { wrapper.add_lora_linear(y, x, a_t, b, ranks, 1.0f, ws, cpu); },
               "LoRA-A of slice 0 must have contiguous rows and slots that do not overlap, got "
               "strides [256, 1, 8]");
  Tensor ws_bf16 = Tensor::empty({1024}, DType::kBF16);
  expect_error([&] { wrapper.add_lora_linear(y, x, a, b, ranks, 1.0f, ws_bf16, cpu); },
               "workspace must be contiguous float32");
  // Shrink output and expand intermediate of the wrong shape or dtype.
  Tensor out_bad = Tensor::empty({1, 3, 7}, DType::kF32);
  expect_error([&] { wrapper.add_shrink(out_bad, x, a, ranks, 1.0f, cpu); },
               "output must be contiguous [1, 3, 8], got float32[1, 3, 7]");
  const Tensor mid_f16 = Tensor::zeros({1, 3, 8}, DType::kF16);
  expect_error([&] { wrapper.add_expand(y, mid_f16, b, ranks, 0, true, cpu); },
               "intermediate dtype float16, expected float32 or bfloat16");
  const Tensor mid = Tensor::zeros({1, 3, 8}, DType::kF32);
  expect_error([&] { wrapper.add_expand(y, mid, b, ranks, 1, true, cpu); },
               "slices cover columns [1, 17) but y has 16 columns");
  expect_error([&] { wrapper.add_expand(y, mid, b, ranks, -1, true, cpu); },
               "slices cover columns [-1, 15)");
}

TEST_F(PunicaWrapper, OneColumnSliceOfAWiderOutput) {
  // y is column 5 of a wider output: one column, rows 9 apart. Every LoRA row must land in
  // its own row (the row stride is the view's stride(0), not its width).
  std::mt19937_64 rng(3);
  Wrapper wrapper(2, 8, 1, kCpu);
  Stream cpu;
  const std::vector<int32_t> slots = {1, -1, 0, 1};
  wrapper.update_metadata(slots, {}, cpu);
  SlotRanks ranks(1, 2, 4, kCpu);
  ranks.set_slot(0, 4, cpu);
  ranks.set_slot(1, 3, cpu);
  const std::vector<Tensor> a = {test::random_tensor({2, 4, 16}, DType::kF32, rng)};
  const std::vector<Tensor> b = {test::random_tensor({2, 1, 4}, DType::kF32, rng)};
  const Tensor x = test::random_tensor({4, 16}, DType::kF32, rng);
  Tensor big = test::random_tensor({4, 9}, DType::kF32, rng);
  const Tensor big0 = big.clone();
  Tensor column = big.narrow(1, 5, 1);
  Tensor ws = Tensor::empty({16}, DType::kF32);
  wrapper.add_lora_linear(column, x, a, b, ranks, 0.5f, ws, cpu);
  const std::vector<double> xs = x.to_double_vector();
  const std::vector<double> av = a[0].to_double_vector();
  const std::vector<double> bv = b[0].to_double_vector();
  for (int64_t t = 0; t < 4; ++t) {
    for (int64_t j = 0; j < 9; ++j) {
      double want = big0.item({t, j});
      const int32_t k = slots[static_cast<size_t>(t)];
      if (j == 5 && k >= 0) {
        for (int r = 0; r < ranks.get(0, k); ++r) {
          double mid = 0.0;
          for (int i = 0; i < 16; ++i) mid += xs[t * 16 + i] * av[(k * 4 + r) * 16 + i];
          want += 0.5 * mid * bv[k * 4 + r];
        }
        EXPECT_NEAR(big.item({t, j}), want, 1e-4 * (1 + std::fabs(want))) << t;
      } else {
        EXPECT_EQ(big.item({t, j}), want) << t << ", " << j;
      }
    }
  }
}

TEST_F(PunicaWrapper, BaseOnlyAndEmptyBatchesTouchNothing) {
  std::mt19937_64 rng(4);
  Wrapper wrapper(2, 8, 2, kCpu);
  Stream cpu;
  SlotRanks ranks(1, 2, 4, kCpu);
  ranks.set_slot(0, 4, cpu);
  ranks.set_slot(1, 4, cpu);
  const std::vector<Tensor> a = {test::random_tensor({2, 4, 16}, DType::kBF16, rng)};
  const std::vector<Tensor> b = {test::random_tensor({2, 8, 4}, DType::kBF16, rng)};
  Tensor ws = Tensor::empty({64}, DType::kF32);
  for (int n : {0, 5}) {
    wrapper.update_metadata(std::vector<int32_t>(static_cast<size_t>(n), -1),
                            std::vector<int32_t>(static_cast<size_t>(std::min(n, 2)), -1), cpu);
    const Tensor x = test::random_tensor({n, 16}, DType::kBF16, rng);
    Tensor y = test::random_tensor({n, 8}, DType::kBF16, rng);
    const Tensor y0 = y.clone();
    wrapper.add_lora_linear(y, x, a, b, ranks, 1.0f, ws, cpu);
    Tensor mid = test::random_tensor({1, n, 4}, DType::kF32, rng);
    const Tensor mid0 = mid.clone();
    wrapper.add_shrink(mid, x, a, ranks, 1.0f, cpu);
    wrapper.add_expand(y, mid, b, ranks, 0, false, cpu);
    wrapper.add_lora_embedding(y, Tensor::zeros({n}, DType::kI32),
                               a[0].transpose(1, 2).contiguous(), b[0], ranks, 1.0f, cpu);
    EXPECT_TRUE(test::bit_identical(y, y0)) << n << " tokens";
    EXPECT_TRUE(test::bit_identical(mid, mid0)) << n << " tokens";
  }
}

TEST(SlotRanks, SetValidatesSliceSlotAndRank) {
  Stream cpu;
  SlotRanks ranks(2, 3, 16, kCpu);
  ranks.set(1, 2, 16, cpu);
  EXPECT_EQ(ranks.get(1, 2), 16);
  EXPECT_EQ(ranks.get(0, 2), 0);
  ranks.set_slot(0, 5, cpu);
  EXPECT_EQ(ranks.get(0, 0), 5);
  EXPECT_EQ(ranks.get(1, 0), 5);
  expect_error([&] { ranks.set(2, 0, 1, cpu); }, "(slice 2, slot 0) outside [2, 3)");
  expect_error([&] { ranks.set(0, 3, 1, cpu); }, "(slice 0, slot 3) outside [2, 3)");
  expect_error([&] { ranks.set(0, 0, -1, cpu); },
               "LoRA rank -1 for slot 0 is outside [0, max_lora_rank 16]");
  expect_error([&] { ranks.set_slot(1, 17, cpu); }, "LoRA rank 17 for slot 1");
  expect_error([&] { SlotRanks(0, 3, 16, kCpu); }, "num_slices 0");
}

// Tuning overrides as text apply over the current table; a bad key or value is an error naming
// it, and the table stays as it was.
TEST(PunicaWrapperTuning, TextOverridesApplyOverTheTableAndErrorsNameTheKey) {
  Wrapper wrapper(4, 64, 8, kCpu);
  const int cluster = wrapper.lora_device().tuning.decode_cluster;
  wrapper.set_lora_tuning("decode_max_tokens=128,gather_group=1");
  EXPECT_EQ(wrapper.lora_device().tuning.decode_max_tokens, 128);
  EXPECT_EQ(wrapper.lora_device().tuning.gather_group, 1);
  EXPECT_EQ(wrapper.lora_device().tuning.decode_cluster, cluster);
  expect_error([&] { wrapper.set_lora_tuning("no_such_knob=1"); }, "unknown key 'no_such_knob'");
  expect_error([&] { wrapper.set_lora_tuning("gather_rows=12"); }, "gather_rows = 12");
  EXPECT_EQ(wrapper.lora_device().tuning.decode_max_tokens, 128);
  EXPECT_EQ(wrapper.lora_device().tuning.gather_rows, 0);
}

}  // namespace
}  // namespace loraplex
