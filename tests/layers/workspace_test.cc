// LayerWorkspace: carving, sizing, and layers sharing one workspace give the same outputs as
// layers with workspaces of their own.

#include "loraplex/layers/workspace.h"

#include <gtest/gtest.h>

#include <random>

#include "layers/layer_test_util.h"
#include "loraplex/layers/fused_moe.h"
#include "loraplex/layers/logits_processor.h"
#include "loraplex/layers/lora_linear.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

TEST(LayerWorkspace, CarvesAlignedViewsAndMeasuresTheSame) {
  LayerWorkspace::Carver m = LayerWorkspace::measure();
  EXPECT_FALSE(m.take({3, 5}, DType::kF32).defined());
  m.take({7}, DType::kBF16);
  EXPECT_EQ(m.used(), 512u);  // 60 and 14 bytes, each rounded up to 256
  LayerWorkspace ws(Device::cpu());
  ws.reserve(m.used());
  LayerWorkspace::Carver c = ws.carver();
  const Tensor a = c.take({3, 5}, DType::kF32);
  const Tensor b = c.take({7}, DType::kBF16);
  EXPECT_EQ(a.shape(), (Shape{3, 5}));
  EXPECT_EQ(static_cast<const char*>(b.data_ptr()) - static_cast<const char*>(a.data_ptr()), 256);
  try {
    c.take({1}, DType::kF32);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too small"), std::string::npos) << e.what();
  }
}

TEST(LayerWorkspace, ReservationIsTheLargestLayerNeed) {
  auto ws = std::make_shared<LayerWorkspace>(Device::cpu());
  LoraConfig cfg{4, 16, DType::kF32, false};
  LoraLinear small(LinearSpec::column(64, 32, DType::kF32), cfg, nullptr, Device::cpu(), 8, ws);
  const size_t after_small = ws->reserved_bytes();
  EXPECT_GT(after_small, 0u);
  FusedMoeWithLora moe({8, 2, 64, 96, DType::kF32, true}, cfg, nullptr, Device::cpu(), 64, ws);
  EXPECT_GT(ws->reserved_bytes(), after_small);
  const size_t after_moe = ws->reserved_bytes();
  LoraLinear small2(LinearSpec::column(64, 32, DType::kF32), cfg, nullptr, Device::cpu(), 8, ws);
  EXPECT_EQ(ws->reserved_bytes(), after_moe);
}

// A decoder-like chain (qkv -> o_proj -> MoE -> logits) whose layers share one workspace must
// give exactly what the same layers with their own workspaces give.
TEST(LayerWorkspace, SharedByLayersGivesSameOutputs_tp2) {
  const int tokens = 19;
  const int64_t hidden = 64;
  std::mt19937_64 rng(17);
  const Tensor x = test::random_tensor({tokens, hidden}, DType::kF32, rng);
  const std::vector<int32_t> slots = test::mixed_slots(tokens, 4, rng);
  const Tensor wq = test::random_tensor({64, hidden}, DType::kF32, rng, 0.3f);
  const Tensor wk = test::random_tensor({16, hidden}, DType::kF32, rng, 0.3f);
  const Tensor wv = test::random_tensor({16, hidden}, DType::kF32, rng, 0.3f);
  const Tensor wo = test::random_tensor({hidden, 96}, DType::kF32, rng, 0.3f);
  const Tensor router = test::random_tensor({8, hidden}, DType::kF32, rng, 0.3f);
  std::vector<Tensor> w1, w3, w2;
  for (int e = 0; e < 8; ++e) {
    w1.push_back(test::random_tensor({96, hidden}, DType::kF32, rng, 0.3f));
    w3.push_back(test::random_tensor({96, hidden}, DType::kF32, rng, 0.3f));
    w2.push_back(test::random_tensor({hidden, 96}, DType::kF32, rng, 0.3f));
  }
  const Tensor lm_head = test::random_tensor({101, hidden}, DType::kF32, rng, 0.3f);
  std::vector<LoraSliceWeights> qkv_lora;
  for (int64_t out : {64, 16, 16}) {
    qkv_lora.push_back({test::random_tensor({5, hidden}, DType::kF32, rng, 0.4f),
                        test::random_tensor({out, 5}, DType::kF32, rng, 0.2f)});
  }
  const std::vector<LoraSliceWeights> o_lora{{test::random_tensor({7, 96}, DType::kF32, rng, 0.4f),
                                              test::random_tensor({hidden, 7}, DType::kF32, rng)}};

  auto run = [&](bool shared) {
    std::vector<std::vector<double>> out(2);
    test::run_ranks(test::Backend::kCpu, 2, [&](int rank, Communicator* comm) {
      const LoraConfig cfg{4, 16, DType::kF32, true};
      auto ws = shared ? std::make_shared<LayerWorkspace>(Device::cpu()) : nullptr;
      PunicaWrapper punica(4, tokens, tokens, Device::cpu());
      punica.update_metadata(slots, slots, Stream());
      LoraLinear qkv(LinearSpec::qkv(hidden, 8, 8, 2, DType::kF32, QkvLora::kPerSliceLora,
                                     /*gather_output=*/true),
                     cfg, comm, Device::cpu(), tokens, ws);
      LoraLinear o_proj(LinearSpec::row(96, hidden, DType::kF32), cfg, comm, Device::cpu(), tokens,
                        ws);
      FusedMoeWithLora moe({8, 2, hidden, 96, DType::kF32, true}, cfg, comm, Device::cpu(), tokens,
                           ws);
      LogitsProcessorWithLora logits(hidden, 101, DType::kF32, cfg, comm, Device::cpu(), tokens,
                                     ws);
      if (ws) ws->allocate();
      qkv.load_base({wq, wk, wv});
      o_proj.load_base({wo});
      moe.load_base(router, w1, w3, w2);
      logits.load_base(lm_head);
      qkv.set_lora(1, qkv_lora);
      o_proj.set_lora(2, o_lora);
      const Tensor h1 = qkv.forward(x, punica, Stream());
      const Tensor h2 = o_proj.forward(h1.narrow(1, rank * 48, 48).contiguous(), punica, Stream());
      const Tensor h3 = moe.forward(h2, punica, Stream());
      out[static_cast<size_t>(rank)] = test::values_of(logits.forward(h3, punica, Stream()));
    });
    EXPECT_EQ(out[0], out[1]);
    return out[0];
  };
  EXPECT_EQ(run(true), run(false));
}

}  // namespace
}  // namespace loraplex
