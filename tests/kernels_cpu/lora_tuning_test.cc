// The tuning tables of the CUDA LoRA kernels (kernels/planner/lora_tuning.h) are plain C++: their
// parsing and range checks run in every build.

#include "loraplex/kernels/planner/lora_tuning.h"

#include <gtest/gtest.h>

#include <string>

namespace loraplex {
namespace {

using kernels::planner::LoraTuning;

TEST(LoraTuning, ParsesKeysOverTheGivenTable) {
  LoraTuning t;
  ASSERT_TRUE(kernels::planner::parse_lora_tuning("cluster_size=4,prefill_ctas_per_sm=3", t).ok());
  EXPECT_EQ(t.cluster_size, 4);
  EXPECT_EQ(t.gather_rows, LoraTuning{}.gather_rows);
  EXPECT_EQ(t.prefill_k_split, LoraTuning{}.prefill_k_split);
  EXPECT_EQ(t.prefill_ctas_per_sm, 3);
  // A second parse keeps what the first set.
  ASSERT_TRUE(kernels::planner::parse_lora_tuning(
                  "gather_rows=16,prefill_k_split=8,expand_ctas_per_sm=2,decode_max_tokens=0", t)
                  .ok());
  EXPECT_EQ(t.expand_ctas_per_sm, 2);
  EXPECT_EQ(t.decode_max_tokens, 0);
  EXPECT_EQ(t.cluster_size, 4);
  EXPECT_EQ(t.gather_rows, 16);
  EXPECT_EQ(t.prefill_k_split, 8);
}

TEST(LoraTuning, RejectsMalformedTextNamingItAndKeepsTheTable) {
  LoraTuning t;
  t.gather_rows = 8;
  const Status unknown = kernels::planner::parse_lora_tuning("decode_rows=4", t);
  EXPECT_FALSE(unknown.ok());
  EXPECT_NE(unknown.message().find("decode_rows"), std::string::npos) << unknown.message();
  const Status not_int = kernels::planner::parse_lora_tuning("gather_rows=12x", t);
  EXPECT_FALSE(not_int.ok());
  EXPECT_NE(not_int.message().find("'12x'"), std::string::npos) << not_int.message();
  const Status no_eq = kernels::planner::parse_lora_tuning("gather_rows", t);
  EXPECT_FALSE(no_eq.ok());
  EXPECT_NE(no_eq.message().find("key=value"), std::string::npos) << no_eq.message();
  // A valid key before an invalid value changes nothing.
  const Status range = kernels::planner::parse_lora_tuning("cluster_size=8,gather_rows=4", t);
  EXPECT_FALSE(range.ok());
  EXPECT_EQ(t.gather_rows, 8);
  EXPECT_EQ(t.cluster_size, LoraTuning{}.cluster_size);
}

TEST(LoraTuning, CheckRejectsOutOfRangeValuesNamingThem) {
  // Each case changes one field of the defaults to a value out of its range.
  struct Bad {
    void (*set)(LoraTuning&);
    const char* field;
  };
  const Bad bad[] = {
      {[](LoraTuning& t) { t.gather_rows = 4; }, "gather_rows = 4"},
      {[](LoraTuning& t) { t.gather_rows = 32; }, "gather_rows = 32"},
      {[](LoraTuning& t) { t.decode_max_tokens = -1; }, "decode_max_tokens = -1"},
      {[](LoraTuning& t) { t.prefill_k_split = 16; }, "prefill_k_split = 16"},
      {[](LoraTuning& t) { t.prefill_ctas_per_sm = 0; }, "prefill_ctas_per_sm = 0"},
      {[](LoraTuning& t) { t.prefill_reduce = 3; }, "prefill_reduce = 3"},
      {[](LoraTuning& t) { t.prefill_stages = 2; }, "prefill_stages = 2"},
      {[](LoraTuning& t) { t.prefill_stages = 5; }, "prefill_stages = 5"},
      {[](LoraTuning& t) { t.prefill_sum = 3; }, "prefill_sum = 3"},
      {[](LoraTuning& t) { t.prefill_mma = 3; }, "prefill_mma = 3"},
      {[](LoraTuning& t) { t.prefill_wave_spare_sms = -1; }, "prefill_wave_spare_sms = -1"},
      {[](LoraTuning& t) { t.expand_ctas_per_sm = 17; }, "expand_ctas_per_sm = 17"},
      {[](LoraTuning& t) { t.gather_group = 4; }, "gather_group = 4"},
      {[](LoraTuning& t) { t.gather_max_token_ranks = -1; }, "gather_max_token_ranks = -1"},
      {[](LoraTuning& t) { t.gather_shrink = 3; }, "gather_shrink = 3"},
      {[](LoraTuning& t) { t.gather_rows = 12; }, "gather_rows = 12"},
      {[](LoraTuning& t) { t.decode_cluster = 3; }, "decode_cluster = 3"},
      {[](LoraTuning& t) { t.layer_pdl = 3; }, "layer_pdl = 3"},
      {[](LoraTuning& t) { t.cluster_size = 3; }, "cluster_size = 3"},
      {[](LoraTuning& t) { t.cluster_size = 32; }, "cluster_size = 32"},
  };
  for (const Bad& b : bad) {
    LoraTuning t;
    b.set(t);
    const Status s = kernels::planner::check_lora_tuning(t);
    EXPECT_FALSE(s.ok()) << b.field;
    EXPECT_NE(s.message().find(b.field), std::string::npos) << s.message();
  }
  EXPECT_TRUE(kernels::planner::check_lora_tuning(LoraTuning{}).ok());
  EXPECT_TRUE(kernels::planner::check_lora_tuning(kernels::planner::lora_tuning_for(9, 0)).ok());
}

TEST(LoraTuning, ReportsEveryFieldOnceInOrder) {
  LoraTuning t;
  t.cluster_size = 4;
  const auto values = kernels::planner::lora_tuning_values(t);
  ASSERT_FALSE(values.empty());
  EXPECT_EQ(values.front().first, "decode_max_tokens");
  int found = 0;
  for (const auto& [name, value] : values) {
    if (name == "cluster_size") {
      EXPECT_EQ(value, 4);
      ++found;
    }
    // Every reported name parses back.
    LoraTuning u;
    EXPECT_TRUE(kernels::planner::parse_lora_tuning(name + "=" + std::to_string(value), u).ok())
        << name;
  }
  EXPECT_EQ(found, 1);
}

}  // namespace
}  // namespace loraplex
