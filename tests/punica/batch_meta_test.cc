#include "loraplex/punica/batch_meta.h"

#include <gtest/gtest.h>

#include <random>

#include "support/random_data.h"

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

TEST(BatchMeta, EveryDistributionSizeAndSlotCount) {
  Stream cpu;
  std::mt19937_64 rng(11);
  for (int max_loras : {1, 4, 32}) {
    LoraBatchMeta meta(max_loras, 1024, Device::cpu());
    for (test::SlotDistribution d : test::kAllDistributions) {
      for (int n : {1, 3, 77, 199, 1024}) {
        const std::vector<int32_t> mapping = test::make_slots(d, n, max_loras, rng, 0.2);
        meta.prepare(mapping, cpu);
        SCOPED_TRACE(std::string(test::distribution_name(d)) + " tokens " + std::to_string(n) +
                     " max_loras " + std::to_string(max_loras));
        expect_meta_matches(mapping, max_loras, meta.to_host(cpu));
        bool none = true;
        for (int32_t s : mapping) none = none && s == -1;
        EXPECT_EQ(meta.no_lora(), none);
      }
    }
  }
}

TEST(BatchMeta, EmptyAndBaseOnlyBatches) {
  Stream cpu;
  LoraBatchMeta meta(4, 16, Device::cpu());
  meta.prepare(std::vector<int32_t>{}, cpu);
  EXPECT_TRUE(meta.no_lora());
  EXPECT_EQ(meta.num_tokens(), 0);
  auto h = meta.to_host(cpu);
  EXPECT_EQ(h.num_active_loras, 0);
  EXPECT_EQ(h.active_lora_ids, std::vector<int32_t>(5, -1));
  EXPECT_EQ(h.lora_token_start_loc, std::vector<int32_t>(6, 0));
  meta.prepare(std::vector<int32_t>(9, -1), cpu);
  EXPECT_TRUE(meta.no_lora());
  h = meta.to_host(cpu);
  EXPECT_EQ(h.num_active_loras, 1);
  EXPECT_EQ(h.active_lora_ids, (std::vector<int32_t>{-1, -1, -1, -1, -1}));
  EXPECT_EQ(h.num_tokens_per_lora, (std::vector<int32_t>{9, 0, 0, 0, 0}));
  EXPECT_EQ(h.lora_token_start_loc, (std::vector<int32_t>{0, 9, 9, 9, 9, 9}));
}

TEST(BatchMeta, ReusedAcrossStepsOfDifferentSizes) {
  // A smaller step after a larger one must not see the larger step's groups.
  Stream cpu;
  LoraBatchMeta meta(4, 64, Device::cpu());
  std::vector<int32_t> big(64);
  for (int i = 0; i < 64; ++i) big[static_cast<size_t>(i)] = i % 4;
  meta.prepare(big, cpu);
  const std::vector<int32_t> small = {2, -1, 2};
  meta.prepare(small, cpu);
  const auto h = meta.to_host(cpu);
  EXPECT_EQ(h.sorted_token_indices, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(h.active_lora_ids, (std::vector<int32_t>{-1, 2, -1, -1, -1}));
  EXPECT_EQ(h.num_tokens_per_lora, (std::vector<int32_t>{1, 2, 0, 0, 0}));
  EXPECT_EQ(h.lora_token_start_loc, (std::vector<int32_t>{0, 1, 3, 3, 3, 3}));
  EXPECT_EQ(h.num_active_loras, 2);
}

TEST(BatchMeta, PrepareFromBufferMatchesPrepare) {
  Stream cpu;
  std::mt19937_64 rng(13);
  const std::vector<int32_t> mapping =
      test::make_slots(test::SlotDistribution::kZipf, 77, 8, rng, 0.3);
  LoraBatchMeta a(8, 128, Device::cpu());
  LoraBatchMeta b(8, 128, Device::cpu());
  a.prepare(mapping, cpu);
  std::copy(mapping.begin(), mapping.end(), b.mapping_buffer().data<int32_t>());
  b.prepare_from_buffer(77, false, cpu);
  const auto ha = a.to_host(cpu);
  const auto hb = b.to_host(cpu);
  EXPECT_EQ(ha.sorted_token_indices, hb.sorted_token_indices);
  EXPECT_EQ(ha.active_lora_ids, hb.active_lora_ids);
  EXPECT_EQ(ha.num_tokens_per_lora, hb.num_tokens_per_lora);
  EXPECT_EQ(ha.lora_token_start_loc, hb.lora_token_start_loc);
  EXPECT_EQ(ha.num_active_loras, hb.num_active_loras);
  // A bad slot written straight into the buffer is still rejected.
  b.mapping_buffer().data<int32_t>()[5] = 8;
  EXPECT_THROW(b.prepare_from_buffer(77, false, cpu), Error);
  EXPECT_THROW(b.prepare_from_buffer(129, false, cpu), Error);
}

// LoraMetaView::settled: false from each build until an op using the metadata is enqueued on
// the build's stream (the first op after a build must not read the metadata early), and an
// empty batch never settles (its ops launch nothing).
TEST(BatchMeta, SettledFromTheSecondOpAfterEachBuild) {
  Stream cpu;
  LoraBatchMeta meta(4, 16, Device::cpu());
  EXPECT_FALSE(meta.view().settled);
  meta.prepare(std::vector<int32_t>{0, 3, -1, 0, 2}, cpu);
  EXPECT_FALSE(meta.view().settled);
  meta.note_op_enqueued(cpu);
  EXPECT_TRUE(meta.view().settled);
  meta.note_op_enqueued(cpu);
  EXPECT_TRUE(meta.view().settled);
  meta.prepare(std::vector<int32_t>{1, 1}, cpu);
  EXPECT_FALSE(meta.view().settled);
  meta.note_op_enqueued(cpu);
  EXPECT_TRUE(meta.view().settled);
  meta.prepare(std::vector<int32_t>{}, cpu);
  meta.note_op_enqueued(cpu);
  EXPECT_FALSE(meta.view().settled);
}

}  // namespace
}  // namespace loraplex
