// The kernel tuning knobs (kernels/cuda/kernel_tuning.h) are plain C++: their parsing and
// range checks run in every build.

#include "loraplex/kernels/cuda/kernel_tuning.h"

#include <gtest/gtest.h>

#include <string>

namespace loraplex {
namespace {

using kernels::cuda::KernelTuning;

TEST(KernelTuning, ParsesEveryKeyOverTheDefaults) {
  KernelTuning t;
  ASSERT_TRUE(
      kernels::cuda::parse_kernel_tuning("decode_k_chunks=4,prefill_ctas_per_sm=3", t).ok());
  EXPECT_EQ(t.decode_k_chunks, 4);
  EXPECT_EQ(t.decode_cols, KernelTuning{}.decode_cols);
  EXPECT_EQ(t.prefill_k_split, KernelTuning{}.prefill_k_split);
  EXPECT_EQ(t.prefill_ctas_per_sm, 3);
  ASSERT_TRUE(kernels::cuda::parse_kernel_tuning(
                  "decode_cols=256,prefill_k_split=8,expand_ctas_per_sm=2,decode_ctas_per_sm=1", t)
                  .ok());
  EXPECT_EQ(t.expand_ctas_per_sm, 2);
  EXPECT_EQ(t.decode_ctas_per_sm, 1);
  EXPECT_EQ(t.decode_k_chunks, KernelTuning{}.decode_k_chunks);
  EXPECT_EQ(t.decode_cols, 256);
  EXPECT_EQ(t.prefill_k_split, 8);
}

TEST(KernelTuning, RejectsMalformedTextNamingIt) {
  KernelTuning t;
  const Status unknown = kernels::cuda::parse_kernel_tuning("decode_rows=4", t);
  EXPECT_FALSE(unknown.ok());
  EXPECT_NE(unknown.message().find("decode_rows"), std::string::npos) << unknown.message();
  const Status not_int = kernels::cuda::parse_kernel_tuning("decode_cols=12x", t);
  EXPECT_FALSE(not_int.ok());
  EXPECT_NE(not_int.message().find("'12x'"), std::string::npos) << not_int.message();
  const Status no_eq = kernels::cuda::parse_kernel_tuning("decode_cols", t);
  EXPECT_FALSE(no_eq.ok());
  EXPECT_NE(no_eq.message().find("key=value"), std::string::npos) << no_eq.message();
}

TEST(KernelTuning, SetRejectsOutOfRangeValuesAndKeepsTheOldOnes) {
  const KernelTuning before = kernels::cuda::kernel_tuning();
  // Each case changes one field of the defaults to a value out of its range.
  struct Bad {
    void (*set)(KernelTuning&);
    const char* field;
  };
  const Bad bad[] = {
      {[](KernelTuning& t) { t.decode_k_chunks = 3; }, "decode_k_chunks = 3"},
      {[](KernelTuning& t) { t.decode_k_chunks = 32; }, "decode_k_chunks = 32"},
      {[](KernelTuning& t) { t.decode_cols = 4; }, "decode_cols = 4"},
      {[](KernelTuning& t) { t.decode_cols = 512; }, "decode_cols = 512"},
      {[](KernelTuning& t) { t.prefill_k_split = 16; }, "prefill_k_split = 16"},
      {[](KernelTuning& t) { t.prefill_ctas_per_sm = 0; }, "prefill_ctas_per_sm = 0"},
      {[](KernelTuning& t) { t.prefill_max_ctas_per_sm = 5; }, "prefill_max_ctas_per_sm = 5"},
      {[](KernelTuning& t) { t.prefill_reduce = 3; }, "prefill_reduce = 3"},
      {[](KernelTuning& t) { t.prefill_stages = 2; }, "prefill_stages = 2"},
      {[](KernelTuning& t) { t.prefill_stages = 7; }, "prefill_stages = 7"},
      {[](KernelTuning& t) { t.expand_ctas_per_sm = 17; }, "expand_ctas_per_sm = 17"},
      {[](KernelTuning& t) { t.expand_pipelined = 3; }, "expand_pipelined = 3"},
      {[](KernelTuning& t) { t.decode_ctas_per_sm = 5; }, "decode_ctas_per_sm = 5"},
      {[](KernelTuning& t) { t.decode_persistent = 2; }, "decode_persistent = 2"},
      {[](KernelTuning& t) { t.gather_group = 3; }, "gather_group = 3"},
      {[](KernelTuning& t) { t.gather_max_token_ranks = 0; }, "gather_max_token_ranks = 0"},
      {[](KernelTuning& t) { t.gather_shrink = 3; }, "gather_shrink = 3"},
      {[](KernelTuning& t) { t.gather_rows = 12; }, "gather_rows = 12"},
      {[](KernelTuning& t) { t.decode_cluster = 3; }, "decode_cluster = 3"},
      {[](KernelTuning& t) { t.layer_pdl = 3; }, "layer_pdl = 3"},
      {[](KernelTuning& t) { t.cluster_size = 3; }, "cluster_size = 3"},
      {[](KernelTuning& t) { t.cluster_size = 32; }, "cluster_size = 32"},
      {[](KernelTuning& t) { t.split_pdl = 2; }, "split_pdl = 2"},
      {[](KernelTuning& t) { t.prefill_mma_first = 2; }, "prefill_mma_first = 2"},
  };
  for (const Bad& b : bad) {
    KernelTuning t;
    b.set(t);
    const Status s = kernels::cuda::set_kernel_tuning(t);
    EXPECT_FALSE(s.ok()) << b.field;
    EXPECT_NE(s.message().find(b.field), std::string::npos) << s.message();
    const KernelTuning now = kernels::cuda::kernel_tuning();
    EXPECT_EQ(now.decode_k_chunks, before.decode_k_chunks);
    EXPECT_EQ(now.decode_cols, before.decode_cols);
    EXPECT_EQ(now.prefill_k_split, before.prefill_k_split);
    EXPECT_EQ(now.prefill_ctas_per_sm, before.prefill_ctas_per_sm);
    EXPECT_EQ(now.expand_ctas_per_sm, before.expand_ctas_per_sm);
    EXPECT_EQ(now.decode_ctas_per_sm, before.decode_ctas_per_sm);
  }
  const KernelTuning good{.decode_k_chunks = 8, .decode_cols = 64, .prefill_k_split = 2};
  ASSERT_TRUE(kernels::cuda::set_kernel_tuning(good).ok());
  EXPECT_EQ(kernels::cuda::kernel_tuning().decode_cols, 64);
  ASSERT_TRUE(kernels::cuda::set_kernel_tuning(before).ok());
}

}  // namespace
}  // namespace loraplex
