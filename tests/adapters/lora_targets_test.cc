#include "loraplex/adapters/lora_targets.h"

#include <gtest/gtest.h>

#include "adapter_test_support.h"
#include "loraplex/adapters/peft_adapter.h"

namespace loraplex {
namespace {

// A layer with only the plain set_lora / reset_lora.
struct PlainLayer {
  std::vector<int> sets;
  std::vector<int> resets;
  size_t last_slices = 0;
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
    sets.push_back(slot);
    last_slices = slices.size();
  }
  void reset_lora(int slot) { resets.push_back(slot); }
};

// A layer that also takes a stream: the handle must use those overloads.
struct StreamLayer {
  int plain = 0;
  int streamed = 0;
  void set_lora(int, const std::vector<LoraSliceWeights>&) { ++plain; }
  void reset_lora(int) { ++plain; }
  void set_lora(int, const std::vector<LoraSliceWeights>&, const Stream&) { ++streamed; }
  void reset_lora(int, const Stream&) { ++streamed; }
};

LoraTarget target(const std::string& module, LoraLayerHandle layer, int slice) {
  LoraTarget t;
  t.module = module;
  t.layer = std::move(layer);
  t.slice = slice;
  t.in_features = 8;
  t.out_features = 4;
  return t;
}

TEST(LoraLayerHandle, ForwardsToTheLayer) {
  PlainLayer plain;
  LoraLayerHandle h = LoraLayerHandle::of(plain, "plain", 2);
  EXPECT_EQ(h.name(), "plain");
  EXPECT_EQ(h.num_slices(), 2);
  h.set_lora(3, std::vector<LoraSliceWeights>(2), Stream());
  h.reset_lora(1, Stream());
  EXPECT_EQ(plain.sets, std::vector<int>{3});
  EXPECT_EQ(plain.last_slices, 2u);
  EXPECT_EQ(plain.resets, std::vector<int>{1});
  EXPECT_THROW(h.set_lora(0, std::vector<LoraSliceWeights>(3), Stream()), Error);

  PlainLayer old_spelling;
  LoraLayerHandle::of<LoraSliceWeights>(old_spelling, "old", 1)
      .set_lora(4, std::vector<LoraSlice>(1), Stream());
  EXPECT_EQ(old_spelling.sets, std::vector<int>{4});

  StreamLayer s;
  LoraLayerHandle hs = LoraLayerHandle::of(s, "s", 1);
  hs.set_lora(0, std::vector<LoraSliceWeights>(1), Stream());
  hs.reset_lora(0, Stream());
  EXPECT_EQ(s.streamed, 2);
  EXPECT_EQ(s.plain, 0);

  PlainLayer r0, r1;
  LoraLayerHandle hr = LoraLayerHandle::of_ranks<PlainLayer>({&r0, &r1}, "tp", 1);
  hr.set_lora(2, std::vector<LoraSliceWeights>(1), Stream());
  hr.reset_lora(5, Stream());
  EXPECT_EQ(r0.sets, std::vector<int>{2});
  EXPECT_EQ(r1.sets, std::vector<int>{2});
  EXPECT_EQ(r1.resets, std::vector<int>{5});
  EXPECT_FALSE(LoraLayerHandle().defined());
  EXPECT_TRUE(h == h);
  EXPECT_FALSE(h == hs);
}

TEST(LoraTargetRegistry, GroupsTargetsByLayer) {
  PlainLayer qkv_layer, o_layer;
  LoraLayerHandle qkv = LoraLayerHandle::of(qkv_layer, "qkv", 3);
  LoraLayerHandle o = LoraLayerHandle::of(o_layer, "o", 1);
  LoraTargetRegistry r;
  r.add(target("m.q_proj", qkv, 0));
  r.add(target("m.o_proj", o, 0));
  r.add(target("m.v_proj", qkv, 2));
  ASSERT_EQ(r.layers().size(), 2u);
  EXPECT_EQ(r.layer_index(*r.find_module("m.v_proj")), 0u);
  EXPECT_EQ(r.layer_index(*r.find_module("m.o_proj")), 1u);
  EXPECT_EQ(r.find_module("m.k_proj"), nullptr);
  EXPECT_TRUE(r.parameters_of("m.q_proj").empty());
  LoraTarget outside = target("x", qkv, 0);
  EXPECT_THROW(r.layer_index(outside), Error);
}

TEST(LoraTargetRegistry, RefusesInconsistentTargets) {
  PlainLayer l;
  LoraLayerHandle h = LoraLayerHandle::of(l, "qkv", 3);
  LoraTargetRegistry r;
  r.add(target("m.q_proj", h, 0));
  EXPECT_THROW(r.add(target("m.q_proj", h, 1)), Error) << "module twice";
  EXPECT_THROW(r.add(target("m.k_proj", h, 0)), Error) << "slice twice";
  EXPECT_THROW(r.add(target("m.k_proj", h, 3)), Error) << "slice out of range";
  EXPECT_THROW(r.add(target("m.k_proj", LoraLayerHandle(), 0)), Error) << "no layer";
  LoraTarget zero = target("m.k_proj", h, 1);
  zero.in_features = 0;
  EXPECT_THROW(r.add(zero), Error);
  LoraTarget expert = target("m.experts", h, 1);
  expert.kind = TargetKind::kExperts3d;
  EXPECT_THROW(r.add(expert), Error) << "3-D target without parameter / experts";
  expert.parameter = "down_proj";
  expert.num_experts = 4;
  r.add(expert);
  EXPECT_EQ(r.parameters_of("m.experts").size(), 1u);
  expert.slice = 2;
  EXPECT_THROW(r.add(expert), Error) << "parameter twice";
  EXPECT_THROW(r.add(target("m.experts", h, 2)), Error) << "module and parameters";
}

TEST(PeftAdapterConfig, ReadsConfigOnlyForMaxRank) {
  EXPECT_EQ(read_peft_adapter_config("pirate", test::kTinyLlamaAdapters + "/pirate").max_rank(),
            16);
  try {
    read_peft_adapter_config("ghost", "/nonexistent/ghost");
    ADD_FAILURE();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("adapter 'ghost'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("/nonexistent/ghost/adapter_config.json"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace loraplex
