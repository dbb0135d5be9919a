// Fused MoE LoRA (w13 and w2, aligned and naive blocks, disabled adapters, non-local experts,
// offsets) and moe_lora_align_block_size on the CPU.

#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <sstream>

#include "kernels_cpu/op_cases.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::test {
namespace {

const Device kCpu = Device::cpu();

class FusedMoeLora : public ::testing::TestWithParam<MoeCase> {};

TEST_P(FusedMoeLora, MatchesDoubleReference) {
  const MoeProblem p = make_moe_problem(GetParam());
  const Tensor got = run_fused_moe(p, kCpu);
  EXPECT_TRUE(matches_reference(got, p.y0, reference_fused_moe(p), fused_moe_tolerance(p)));
}

INSTANTIATE_TEST_SUITE_P(, FusedMoeLora, ::testing::ValuesIn(moe_cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST_F(FusedMoeLora, NaiveAndAlignedBlocksAgreeBitwise) {
  // A pair's arithmetic does not depend on the block it is visited in.
  for (const MoeCase& c : {moe_cases()[0], moe_cases()[1], moe_cases()[4]}) {
    MoeProblem p = make_moe_problem(c);
    p.c.blocks = MoeBlocks::kNaive;
    const Tensor naive = run_fused_moe(p, kCpu);
    p.c.blocks = MoeBlocks::kAligned;
    const Tensor aligned = run_fused_moe(p, kCpu);
    EXPECT_TRUE(bit_identical(naive, aligned)) << case_name(c);
  }
}

TEST_F(FusedMoeLora, SlicesAreIndependentCalls) {
  // Three slices in one call equal three one-slice calls at their column offsets, bit for bit
  // (and a slice count beyond w13's two exercises the per-slice buffers).
  std::mt19937_64 rng(23);
  const int tokens = 9;
  const int top_k = 2;
  const int experts = 4;
  PunicaWrapper wrapper(3, 16, 1, kCpu);
  Stream cpu;
  wrapper.update_metadata(std::vector<int32_t>{0, 2, -1, 1, 0, 0, 2, -1, 1}, {}, cpu);
  wrapper.reserve_moe_lora(experts, top_k, 16);
  const Tensor topk = Tensor::from_vector(
      std::vector<int32_t>{0, 1, 2, 3, 1, 2, 3, 0, 0, 2, 1, 3, 2, 0, 3, 1, 0, 3}, {tokens, top_k});
  const MoeLoraAlignment al = wrapper.moe_lora_align_block_size(topk, experts, 16, Tensor(), cpu);
  SlotRanks ranks3(3, 3, 8, kCpu);
  std::vector<SlotRanks> ranks1;
  std::vector<Tensor> a;
  std::vector<Tensor> b;
  for (int s = 0; s < 3; ++s) {
    ranks1.emplace_back(1, 3, 8, kCpu);
    for (int k = 0; k < 3; ++k) {
      ranks3.set(s, k, 8 - 2 * s - k, cpu);
      ranks1.back().set(0, k, 8 - 2 * s - k, cpu);
    }
    a.push_back(random_tensor({3, experts, 8, 20}, DType::kBF16, rng));
    b.push_back(random_tensor({3, experts, 12, 8}, DType::kBF16, rng));
  }
  const Tensor x = random_tensor({tokens, 20}, DType::kBF16, rng);
  const Tensor y0 = random_tensor({tokens, top_k, 37}, DType::kBF16, rng);
  Tensor all = y0.clone();
  FusedMoeLoraOptions options;
  options.offset = 1;
  wrapper.add_lora_fused_moe(all, x, a, b, ranks3, Tensor(), al, options, cpu);
  Tensor each = y0.clone();
  for (int s = 0; s < 3; ++s) {
    options.offset = 1 + 12 * s;
    const Tensor as[1] = {a[s]};
    const Tensor bs[1] = {b[s]};
    wrapper.add_lora_fused_moe(each, x, as, bs, ranks1[s], Tensor(), al, options, cpu);
  }
  EXPECT_TRUE(bit_identical(all, each));
  EXPECT_FALSE(bit_identical(all, y0));
}

struct AlignCase {
  int num_tokens;
  int top_k;
  int num_experts;
  int block_size;
  int max_loras;
  SlotDistribution dist;
  double none_fraction;
  bool some_disabled;
  bool some_non_local;
};

std::string align_name(const AlignCase& c) {
  std::ostringstream os;
  os << "t" << c.num_tokens << "_k" << c.top_k << "_e" << c.num_experts << "_b" << c.block_size
     << "_l" << c.max_loras << "_" << distribution_name(c.dist)
     << (c.some_disabled ? "_disabled" : "") << (c.some_non_local ? "_ep" : "");
  return os.str();
}

MoeAlignment align_case(const AlignCase& c) {
  std::mt19937_64 rng(c.num_tokens * 131 + c.num_experts);
  const std::vector<int32_t> slots =
      make_slots(c.dist, c.num_tokens, c.max_loras, rng, c.none_fraction);
  std::vector<int32_t> experts(static_cast<size_t>(c.num_experts));
  std::iota(experts.begin(), experts.end(), 0);
  std::bernoulli_distribution non_local(c.some_non_local ? 0.2 : 0.0);
  std::vector<int32_t> topk;
  for (int t = 0; t < c.num_tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < c.top_k; ++k) topk.push_back(non_local(rng) ? -1 : experts[k]);
  }
  std::vector<int32_t> enabled(static_cast<size_t>(c.max_loras), 1);
  if (c.some_disabled) {
    for (int k = 1; k < c.max_loras; k += 2) enabled[static_cast<size_t>(k)] = 0;
  }
  return run_moe_align(c.num_tokens, c.top_k, c.num_experts, c.block_size, c.max_loras, slots, topk,
                       enabled, kCpu);
}

class MoeLoraAlign : public ::testing::TestWithParam<AlignCase> {};

TEST_P(MoeLoraAlign, MatchesVllmDefinition) {
  EXPECT_TRUE(check_alignment(align_case(GetParam())));
}

INSTANTIATE_TEST_SUITE_P(
    , MoeLoraAlign,
    ::testing::Values(AlignCase{1, 1, 8, 16, 1, SlotDistribution::kOneAdapter, 0.0, false, false},
                      AlignCase{77, 2, 8, 16, 4, SlotDistribution::kUniform, 0.2, true, false},
                      AlignCase{199, 4, 16, 32, 32, SlotDistribution::kZipf, 0.1, false, true},
                      AlignCase{1024, 8, 64, 64, 4, SlotDistribution::kSkewed, 0.05, false, false},
                      AlignCase{3, 6, 60, 16, 32, SlotDistribution::kAllDistinct, 0.0, true, true},
                      AlignCase{0, 2, 8, 16, 4, SlotDistribution::kUniform, 0.0, false, false}),
    [](const auto& info) { return align_name(info.param); });

TEST_F(MoeLoraAlign, HandWorkedExample) {
  // 4 tokens, top 2 of 4 experts, blocks of 4, 2 slots. Pairs p = 2t + k:
  //   t0 (slot 0): p0 -> e1, p1 -> e3     t1 (slot 1): p2 -> e0, p3 -> e1
  //   t2 (slot 0): p4 -> e3, p5 -> e1     t3 (slot -1): p6 -> e2, p7 -> e0
  const MoeAlignment al =
      run_moe_align(4, 2, 4, 4, 2, {0, 1, 0, -1}, {1, 3, 0, 1, 3, 1, 2, 0}, {1, 1}, kCpu);
  // Sizes: 8 pairs + 4 experts * 3 = 20 ids, 5 blocks.
  ASSERT_EQ(al.max_num_tokens_padded, 20);
  ASSERT_EQ(al.max_num_m_blocks, 5);
  const int32_t pad = 8;
  const std::vector<int32_t> slot0 = {0,   5,   pad, pad, 1,   4,   pad, pad, pad, pad,
                                      pad, pad, pad, pad, pad, pad, pad, pad, pad, pad};
  const std::vector<int32_t> slot1 = {2,   pad, pad, pad, 3,   pad, pad, pad, pad, pad,
                                      pad, pad, pad, pad, pad, pad, pad, pad, pad, pad};
  EXPECT_EQ(std::vector<int32_t>(al.sorted_ids.begin(), al.sorted_ids.begin() + 20), slot0);
  EXPECT_EQ(std::vector<int32_t>(al.sorted_ids.begin() + 20, al.sorted_ids.end()), slot1);
  EXPECT_EQ(al.expert_ids, (std::vector<int32_t>{1, 3, -1, -1, -1, 0, 1, -1, -1, -1}));
  EXPECT_EQ(al.num_tokens_post_pad, (std::vector<int32_t>{8, 8}));
  EXPECT_TRUE(check_alignment(al));
  // Disabling slot 1 empties its row.
  const MoeAlignment off =
      run_moe_align(4, 2, 4, 4, 2, {0, 1, 0, -1}, {1, 3, 0, 1, 3, 1, 2, 0}, {1, 0}, kCpu);
  EXPECT_EQ(off.num_tokens_post_pad, (std::vector<int32_t>{8, 0}));
  EXPECT_EQ(std::vector<int32_t>(off.expert_ids.begin() + 5, off.expert_ids.end()),
            std::vector<int32_t>(5, -1));
  EXPECT_TRUE(check_alignment(off));
}

TEST_F(MoeLoraAlign, BufferSizesCoverVllms) {
  struct Row {
    int64_t pairs;
    int experts;
    int block;
    int64_t vllm_padded;  // numel + E * (block - 1), or numel * block when numel < E
  };
  for (const Row& r : {Row{10, 8, 16, 130}, Row{3, 8, 16, 48}, Row{8192, 64, 64, 12224},
                       Row{1, 1, 1, 1}, Row{77, 60, 16, 977}}) {
    const kernels::MoeAlignSizes s = kernels::moe_align_sizes(r.pairs, r.experts, r.block);
    // vLLM's count rounded up to whole blocks (its pad_sorted_ids layout).
    EXPECT_EQ(s.max_num_tokens_padded, (r.vllm_padded + r.block - 1) / r.block * r.block)
        << r.pairs;
    EXPECT_EQ(s.max_num_m_blocks, (r.vllm_padded + r.block - 1) / r.block) << r.pairs;
  }
}

TEST_F(MoeLoraAlign, NaiveAssignmentRule) {
  // Alignment is skipped when tokens * top_k <= experts * max_loras.
  EXPECT_TRUE(kernels::moe_use_naive_blocks(32, 2, 8, 8));   // 64 <= 64
  EXPECT_FALSE(kernels::moe_use_naive_blocks(33, 2, 8, 8));  // 66 > 64
  EXPECT_TRUE(kernels::moe_use_naive_blocks(1, 1, 1, 1));
  EXPECT_FALSE(kernels::moe_use_naive_blocks(2, 1, 1, 1));
  EXPECT_TRUE(kernels::moe_use_naive_blocks(32, 8, 128, 8));  // Qwen3-30B-A3B, 32 decodes
  PunicaWrapper wrapper(8, 16, 1, kCpu);
  Stream cpu;
  wrapper.reserve_moe_lora(8, 2, 16);
  const Tensor enabled;
  wrapper.update_metadata(std::vector<int32_t>(4, 1), {}, cpu);
  const Tensor topk4 = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}, {4, 2});
  EXPECT_TRUE(wrapper.moe_lora_align_block_size(topk4, 8, 16, enabled, cpu).naive);
  EXPECT_FALSE(wrapper.moe_lora_align_block_size(topk4, 8, 16, enabled, cpu, false).naive);
  wrapper.update_metadata(std::vector<int32_t>(5, 1), {}, cpu);
  const Tensor topk5 =
      Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1}, {5, 2});
  EXPECT_TRUE(wrapper.moe_lora_align_block_size(topk5, 8, 16, enabled, cpu).naive);
  const MoeLoraAlignment al =
      wrapper.moe_lora_align_block_size(topk5, 8, 16, enabled, cpu, /*allow_naive=*/false);
  EXPECT_FALSE(al.naive);
  EXPECT_EQ(al.num_tokens_post_pad.item({1}), 16 * 8);  // slot 1: 8 experts, one block each
  EXPECT_EQ(al.num_tokens_post_pad.item({0}), 0);
}

void expect_error(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// A small w2 call (4 slots, 8 experts, top 2) whose pieces the error tests replace.
struct MoeCall {
  static constexpr int kTokens = 6;
  std::mt19937_64 rng{17};
  PunicaWrapper wrapper{4, 16, 1, Device::cpu()};
  Stream cpu;
  SlotRanks ranks{1, 4, 8, Device::cpu()};
  std::vector<int32_t> slots = {0, 1, -1, 3, 3, 0};
  Tensor topk =
      Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 1, 0, 2, 7}, {kTokens, 2});
  Tensor weights = random_tensor({kTokens, 2}, DType::kF32, rng);
  Tensor x = random_tensor({kTokens * 2, 24}, DType::kF32, rng);
  Tensor a = random_tensor({4, 8, 8, 24}, DType::kF32, rng);
  Tensor b = random_tensor({4, 8, 16, 8}, DType::kF32, rng);
  Tensor y = random_tensor({kTokens, 2, 16}, DType::kF32, rng);

  MoeCall() {
    wrapper.update_metadata(slots, {}, cpu);
    wrapper.reserve_moe_lora(8, 2, 16);
    for (int k = 0; k < 4; ++k) ranks.set_slot(k, 8 - k, cpu);
  }
  MoeLoraAlignment align(const Tensor& ids) {
    return wrapper.moe_lora_align_block_size(ids, 8, 16, Tensor(), cpu, false);
  }
};

TEST_F(FusedMoeLora, RejectsAnAlignmentOfAnotherBatch) {
  MoeCall c;
  const MoeLoraAlignment al = c.align(c.topk);
  c.wrapper.add_lora_moe_w2(c.y, c.x, c.a, c.b, c.ranks, c.weights, al, c.cpu);
  // Same shape, other routing: the blocks list pairs of other experts.
  MoeLoraAlignment other = al;
  other.topk_ids = Tensor::from_vector(std::vector<int32_t>{1, 0, 3, 2, 5, 4, 7, 6, 0, 1, 7, 2},
                                       {MoeCall::kTokens, 2});
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, c.x, c.a, c.b, c.ranks, c.weights, other, c.cpu); },
      "the alignment does not match this batch");
  // New slots for the step after aligning: pairs of slot 0 now belong to other slots.
  c.wrapper.update_metadata(std::vector<int32_t>{1, 0, -1, 3, 3, 0}, {}, c.cpu);
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, c.x, c.a, c.b, c.ranks, c.weights, al, c.cpu); },
      "the alignment does not match this batch");
}

TEST_F(FusedMoeLora, RejectsBadArgumentsNamingTheValue) {
  MoeCall c;
  const MoeLoraAlignment al = c.align(c.topk);
  const Tensor bad_topk = Tensor::from_vector(
      std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 8, 1, 0, 2, 7}, {MoeCall::kTokens, 2});
  expect_error([&] { c.align(bad_topk); }, "pair 7 routes to expert 8, expected -1 or 0..7");
  expect_error([&] { c.wrapper.moe_lora_align_block_size(c.topk, 8, 32, Tensor(), c.cpu); },
               "block_size 32 outside the reserved 1..16");
  expect_error([&] { c.wrapper.moe_lora_align_block_size(c.topk, 9, 16, Tensor(), c.cpu); },
               "num_experts 9 outside the reserved 1..8");
  {
    PunicaWrapper fresh(4, 16, 1, kCpu);
    fresh.update_metadata(c.slots, {}, c.cpu);
    expect_error([&] { fresh.moe_lora_align_block_size(c.topk, 8, 16, Tensor(), c.cpu); },
                 "call reserve_moe_lora once");
  }
  Tensor y_k3 = random_tensor({MoeCall::kTokens, 3, 16}, DType::kF32, c.rng);
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(y_k3, c.x, c.a, c.b, c.ranks, c.weights, al, c.cpu); },
      "y must be [num_tokens 6, top_k 2, width]");
  const Tensor a_e7 = random_tensor({4, 7, 8, 24}, DType::kF32, c.rng);
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, c.x, a_e7, c.b, c.ranks, c.weights, al, c.cpu); },
      "LoRA-A must be contiguous float32[4, 8, 8, 24], got float32[4, 7, 8, 24]");
  const Tensor x_bf16 = c.x.to(DType::kBF16);
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, x_bf16, c.a, c.b, c.ranks, c.weights, al, c.cpu); },
      "x must be contiguous float32[12, 24], got bfloat16[12, 24]");
  expect_error([&] { c.wrapper.add_lora_moe_w2(c.y, c.x, c.a, c.b, c.ranks, Tensor(), al, c.cpu); },
               "topk_weights is undefined");
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, c.x, c.a, c.b, c.ranks, c.weights, al, c.cpu, 1); },
      "slices cover columns [1, 17) but y rows are 16 wide");
  const Tensor x_tokens = random_tensor({MoeCall::kTokens, 24}, DType::kF32, c.rng);
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, x_tokens, c.a, c.b, c.ranks, c.weights, al, c.cpu); },
      "x must be [num_tokens * top_k 12, intermediate]");
  SlotRanks big(1, 4, 16, kCpu);
  big.set_slot(2, 12, c.cpu);
  expect_error([&] { c.wrapper.add_lora_moe_w2(c.y, c.x, c.a, c.b, big, c.weights, al, c.cpu); },
               "slot 2 has rank 12, expected 0..8");
  const Tensor a_t = c.a.transpose(2, 3).contiguous().transpose(2, 3);
  expect_error(
      [&] { c.wrapper.add_lora_moe_w2(c.y, c.x, a_t, c.b, c.ranks, c.weights, al, c.cpu); },
      "(not contiguous)");
}

}  // namespace
}  // namespace loraplex::test
