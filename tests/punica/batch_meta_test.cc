#include "loraplex/punica/batch_meta.h"

#include <gtest/gtest.h>

#include <random>

namespace loraplex {
namespace {

// Reference written directly: stable sort of token indices by slot, then run lengths.
void expect_meta_matches(const std::vector<int32_t>& mapping, int max_loras,
                         const LoraBatchMeta::HostCopy& h) {
  std::vector<int32_t> order(mapping.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return mapping[a] < mapping[b]; });
  EXPECT_EQ(h.sorted_token_indices, order);
  std::vector<int32_t> ids;
  std::vector<int32_t> counts;
  for (int32_t t : order) {
    if (ids.empty() || ids.back() != mapping[t]) {
      ids.push_back(mapping[t]);
      counts.push_back(0);
    }
    ++counts.back();
  }
  ASSERT_EQ(h.num_active_loras, static_cast<int32_t>(ids.size()));
  int32_t start = 0;
  for (int i = 0; i < max_loras + 1; ++i) {
    const bool active = i < static_cast<int>(ids.size());
    EXPECT_EQ(h.active_lora_ids[i], active ? ids[i] : -1) << i;
    EXPECT_EQ(h.num_tokens_per_lora[i], active ? counts[i] : 0) << i;
    EXPECT_EQ(h.lora_token_start_loc[i], start) << i;
    if (active) start += counts[i];
  }
  EXPECT_EQ(h.lora_token_start_loc[max_loras + 1], start);
}

TEST(BatchMeta, MatchesVllmRunningExample) {
  // vLLM's example: max_loras 3, active ids [-1, 0, 2, 1] -> sorted [-1, 0, 1, 2].
  std::vector<int32_t> mapping;
  for (int i = 0; i < 3; ++i) mapping.push_back(-1);
  for (int i = 0; i < 10; ++i) mapping.push_back(0);
  for (int i = 0; i < 5; ++i) mapping.push_back(2);
  for (int i = 0; i < 2; ++i) mapping.push_back(1);
  LoraBatchMeta meta(3, 64, Device::cpu());
  Stream cpu;
  meta.prepare(mapping, cpu);
  const auto h = meta.to_host(cpu);
  EXPECT_EQ(h.active_lora_ids, (std::vector<int32_t>{-1, 0, 1, 2}));
  EXPECT_EQ(h.num_tokens_per_lora, (std::vector<int32_t>{3, 10, 2, 5}));
  EXPECT_EQ(h.lora_token_start_loc, (std::vector<int32_t>{0, 3, 13, 15, 20}));
  expect_meta_matches(mapping, 3, h);
  EXPECT_FALSE(meta.no_lora());
}

TEST(BatchMeta, RandomMappingsAndNoLoraFlag) {
  std::mt19937 rng(3);
  Stream cpu;
  for (int max_loras : {1, 4, 32}) {
    LoraBatchMeta meta(max_loras, 1024, Device::cpu());
    for (int n : {1, 3, 77, 199, 1024}) {
      std::uniform_int_distribution<int32_t> slot(-1, max_loras - 1);
      std::vector<int32_t> mapping(static_cast<size_t>(n));
      for (auto& m : mapping) m = slot(rng);
      meta.prepare(mapping, cpu);
      expect_meta_matches(mapping, max_loras, meta.to_host(cpu));
    }
    std::vector<int32_t> none(17, -1);
    meta.prepare(none, cpu);
    EXPECT_TRUE(meta.no_lora());
  }
}

TEST(BatchMeta, RejectsBadSlotsAndOversizedBatches) {
  LoraBatchMeta meta(4, 8, Device::cpu());
  Stream cpu;
  std::vector<int32_t> bad = {0, 4, 1};
  try {
    meta.prepare(bad, cpu);
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("token 1 has LoRA slot 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 4)"), std::string::npos) << msg;
  }
  std::vector<int32_t> too_many(9, 0);
  EXPECT_THROW(meta.prepare(too_many, cpu), Error);
}

}  // namespace
}  // namespace loraplex
