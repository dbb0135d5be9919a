// PagedAttention on the CPU (plan, then run over the step's flat arrays) against a naive
// double-precision attention, and plan()/run()'s validation. The GPU paths (FlashInfer, the
// fallback kernel, graph replay) are tested against the CPU in
// tests/kernels_cuda/paged_attention_cuda_test.cc.

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "attention_test_support.h"
#include "loraplex/core/error.h"
#include "loraplex/model/paged_attention.h"

namespace loraplex::model {
namespace {

using test::AttnSeq;

// Unit roundoff of the output dtype: the CPU accumulates in float32 and rounds once.
double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 0x1p-8;
    case DType::kF16:
      return 0x1p-11;
    default:
      return 1e-6;
  }
}

Tensor run_cpu(PagedAttention& pa, const test::AttentionScenario& s) {
  pa.plan(s.step, Stream());
  Tensor out =
      Tensor::empty({s.step.qo_indptr.back(), s.shape.num_heads * s.shape.head_dim}, s.shape.dtype);
  const ops::KvCacheView cache{s.num_blocks,     s.shape.block_size, s.shape.num_kv_heads,
                               s.shape.head_dim, s.k.data_ptr(),     s.v.data_ptr()};
  pa.run(s.q.data_ptr(), s.row_stride, cache, out.data_ptr(), Stream());
  return out;
}

template <typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

// A mixed step: whole prompts, prompt chunks that start mid-sequence (mid-block and at a block
// boundary), decodes at odd lengths; GQA 3; an odd head dim; the same object planned twice.
TEST(PagedAttentionStep, CpuEqualsDoubleAttention) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::mt19937_64 rng(2101);
    const AttentionShape shape{6, 2, 24, 4, dtype};
    PagedAttention pa(shape, Device::cpu(), 256, 8, 128);
    EXPECT_FALSE(pa.uses_flashinfer());
    const std::vector<std::vector<AttnSeq>> steps = {
        {{0, 9}, {11, 1}, {3, 1}, {0, 1}, {5, 6}, {8, 3}, {14, 77}},
        {{76, 1}, {0, 3}, {199, 1}, {33, 40}},
    };
    for (const auto& seqs : steps) {
      const test::AttentionScenario s = test::make_attention_scenario(shape, seqs, rng, 100);
      const Tensor out = run_cpu(pa, s);
      EXPECT_EQ(pa.num_tokens(), s.step.qo_indptr.back());
      const test::RelativeError e =
          test::relative_error(out, test::double_reference(s), shape.num_heads * shape.head_dim);
      const double u = unit_roundoff(dtype);
      EXPECT_LE(e.total, u) << dtype << ": relative error over the step";
      EXPECT_LE(e.worst_row, 2 * u) << dtype << ": worst row " << e.worst_row_index;
    }
  }
}

// The CPU path equals ops::cpu::paged_attention with a 2-D block table (the CUDA tests'
// reference) bit for bit: both run the same loops over the same blocks.
TEST(PagedAttentionStep, CpuEqualsTwoDimensionalTableReference) {
  std::mt19937_64 rng(2102);
  const AttentionShape shape{4, 4, 16, 16, DType::kBF16};
  PagedAttention pa(shape, Device::cpu(), 512, 4, 64);
  const test::AttentionScenario s =
      test::make_attention_scenario(shape, {{0, 77}, {300, 1}, {16, 16}, {1, 2}}, rng, 64);
  const Tensor out = run_cpu(pa, s);
  EXPECT_EQ(out.to_double_vector(), test::cpu_reference(s).to_double_vector());
}

class PagedAttentionChecks : public ::testing::Test {
 protected:
  // 2 sequences: 2 new tokens of 5 (2 pages), and 1 of 1 (1 page).
  AttentionStep good() const { return AttentionStep{{0, 2, 3}, {5, 1}, {0, 2, 3}, {3, 1, 0}}; }
  void plan(const AttentionStep& step, int64_t graph_batch = 0) {
    pa_.plan(step, Stream(), graph_batch);
  }
  void run(int64_t num_blocks, int64_t block_size = 4) {
    const ops::KvCacheView cache{num_blocks, block_size, 2, 8, k_.data(), v_.data()};
    pa_.run(q_.data(), 32, cache, out_.data(), Stream());
  }
  PagedAttention pa_{AttentionShape{4, 2, 8, 4, DType::kF32}, Device::cpu(), 16, 4, 8};
  std::vector<float> q_ = std::vector<float>(16 * 32, 0.5f);
  std::vector<float> k_ = std::vector<float>(8 * 4 * 16, 0.25f);
  std::vector<float> v_ = std::vector<float>(8 * 4 * 16, 0.75f);
  std::vector<float> out_ = std::vector<float>(16 * 32, 0.0f);
};

TEST_F(PagedAttentionChecks, PlanNamesTheSequenceAndValue) {
  plan(good());
  AttentionStep s = good();
  s.kv_len[1] = 0;
  expect_error([&] { plan(s); }, "sequence 1 has kv_len 0, shorter than its qo_len 1");
  s = good();
  s.page_indptr = {0, 1, 2};
  s.page_indices = {3, 1};
  expect_error([&] { plan(s); }, "sequence 0 has 1 pages for kv_len 5, expected ceil(5 / 4) = 2");
  s = good();
  s.page_indptr = {0, 2, 4};
  s.page_indices = {3, 1, 0, 2};
  expect_error([&] { plan(s); }, "sequence 1 has 2 pages for kv_len 1");
  s = good();
  s.qo_indptr = {0, 2, 2};
  expect_error([&] { plan(s); }, "sequence 1 has qo_len 0");
  s = good();
  s.page_indices[2] = -1;
  expect_error([&] { plan(s); }, "sequence 1 page 0 is block -1");
  s = good();
  s.page_indices.push_back(4);
  expect_error([&] { plan(s); }, "page_indices has 4 entries, page_indptr says 3");
  s = good();
  s.qo_indptr = {0, 2};
  expect_error([&] { plan(s); }, "qo_indptr has 2 and page_indptr 3 entries for 2 sequences");
  s = good();
  s.qo_indptr = {1, 2, 3};
  expect_error([&] { plan(s); }, "qo_indptr[0] 1");
}

TEST_F(PagedAttentionChecks, PlanRefusesStepsLargerThanTheConstructionLimits) {
  AttentionStep s{{0, 1, 2, 3, 4, 5}, {1, 1, 1, 1, 1}, {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4}};
  expect_error([&] { plan(s); }, "the step has 5 sequences, more than max_num_seqs 4");
  s = AttentionStep{{0, 17}, {17}, {0, 5}, {0, 1, 2, 3, 4}};
  expect_error([&] { plan(s); }, "the step has 17 tokens, more than max_num_tokens 16");
  s = AttentionStep{{0, 1}, {36}, {0, 9}, {0, 1, 2, 3, 4, 5, 6, 7, 0}};
  expect_error([&] { plan(s); }, "the step has 9 pages, more than max_pages_per_step 8");
}

TEST_F(PagedAttentionChecks, GraphBatchStepsArePaddedPureDecodes) {
  expect_error([&] { plan(good(), 2); }, "sequence 0 has qo_len 2 in a graph_batch step");
  const AttentionStep decode{{0, 1, 2}, {5, 1}, {0, 2, 3}, {3, 1, 0}};
  expect_error([&] { plan(decode, 3); }, "a graph_batch 3 step has 2 sequences");
  expect_error([&] { plan(decode, 5); }, "graph_batch 5, expected 0..4");
  plan(decode, 2);
  run(8);
}

TEST_F(PagedAttentionChecks, RunChecksThePlanAndTheCache) {
  expect_error([&] { run(8); }, "without a successful plan()");
  plan(good());
  expect_error([&] { run(8, 16); }, "cache of block size 16");
  expect_error([&] { run(3); }, "the planned step uses block 3, outside the cache's 3 blocks");
  run(4);
  // run() saw 4 blocks: a later graph plan naming block 4 is refused (a replay would read it
  // without run() checking); an eager plan is checked by its run() against its own cache.
  const AttentionStep decode{{0, 1, 2}, {5, 1}, {0, 2, 3}, {4, 1, 0}};
  expect_error([&] { plan(decode, 2); }, "sequence 0 page 0 is block 4, expected 0..3");
  // A failed plan leaves nothing planned.
  expect_error([&] { run(8); }, "without a successful plan()");
  plan(decode);
  expect_error([&] { run(4); }, "uses block 4, outside the cache's 4 blocks");
  run(5);
}

TEST(PagedAttentionStep, ConstructorChecksTheShape) {
  expect_error(
      [] {
        PagedAttention({6, 4, 8, 4, DType::kF32}, Device::cpu(), 8, 2, 4);
      },
      "6 heads and 4 kv heads");
  expect_error(
      [] {
        PagedAttention({4, 2, 8, 4, DType::kI32}, Device::cpu(), 8, 2, 4);
      },
      "expected float32, float16 or bfloat16");
  expect_error(
      [] {
        PagedAttention({4, 2, 8, 0, DType::kF32}, Device::cpu(), 8, 2, 4);
      },
      "block_size 0");
}

}  // namespace
}  // namespace loraplex::model
