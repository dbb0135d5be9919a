// The adapter manager writing slots of real LoRA layers through their stream overloads (on a
// GPU: pinned packed weights, copies and ranks on the manager's copy stream, Lease::wait_ready
// on the compute stream) against twin layers given the same adapters with the synchronous
// set_lora. Slots are rewritten (three adapters, two slots) and every lease's output must be
// identical to the twin's. The CPU variant always runs; the GPU one skips without a GPU.

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "adapter_test_support.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/layers/lora_linear.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

constexpr int kMaxLoras = 2;
constexpr int kMaxRank = 8;
constexpr int kTokens = 19;
constexpr int64_t kHidden = 64;
constexpr int64_t kHeadDim = 16;
constexpr int64_t kHeads = 4;
constexpr int64_t kKvHeads = 2;

const char* const kModules[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                "self_attn.o_proj"};

int64_t in_of(int m) { return m == 3 ? kHeads * kHeadDim : kHidden; }
int64_t out_of(int m) {
  if (m == 0) return kHeads * kHeadDim;
  return m == 3 ? kHidden : kKvHeads * kHeadDim;
}

// One decoder layer's attention projections: QKV (3 slices) and o_proj.
struct Attention {
  Attention(Device device, DType dt, const std::vector<Tensor>& base) {
    const LoraConfig cfg{kMaxLoras, kMaxRank, dt, false};
    qkv = std::make_unique<LoraLinear>(LinearSpec::qkv(kHidden, kHeadDim, kHeads, kKvHeads, dt),
                                       cfg, nullptr, device, kTokens);
    o = std::make_unique<LoraLinear>(LinearSpec::row(kHeads * kHeadDim, kHidden, dt), cfg, nullptr,
                                     device, kTokens);
    qkv->load_base({base[0], base[1], base[2]});
    o->load_base({base[3]});
  }
  std::unique_ptr<LoraLinear> qkv;
  std::unique_ptr<LoraLinear> o;
};

void check_manager_upload(Device device, DType dt) {
  if (device.is_cuda()) LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(77);
  std::vector<Tensor> base;
  for (int m = 0; m < 4; ++m) base.push_back(test::random_tensor({out_of(m), in_of(m)}, dt, rng));
  Attention managed(device, dt, base);
  Attention twin(device, dt, base);

  LoraTargetRegistry registry;
  const LoraLayerHandle qkv_h = LoraLayerHandle::of(*managed.qkv, "qkv_proj", 3);
  const LoraLayerHandle o_h = LoraLayerHandle::of(*managed.o, "o_proj", 1);
  for (int m = 0; m < 4; ++m) {
    LoraTarget t;
    t.module = std::string("model.layers.0.") + kModules[m];
    t.layer = m == 3 ? o_h : qkv_h;
    t.slice = m == 3 ? 0 : m;
    t.in_features = in_of(m);
    t.out_features = out_of(m);
    registry.add(t);
  }

  // Three adapters (lora_alpha == r: scale 1, so the packed B equals the file's B exactly);
  // "qv" targets only q_proj and v_proj.
  test::TempDir tmp;
  struct Written {
    int rank;
    std::vector<bool> targets;
    std::map<int, std::pair<Tensor, Tensor>> pairs;  // module -> (A, B)
  };
  std::map<std::string, Written> adapters = {{"all8", {8, {true, true, true, true}, {}}},
                                             {"qv3", {3, {true, false, true, false}, {}}},
                                             {"all5", {5, {true, true, true, true}, {}}}};
  for (auto& [name, w] : adapters) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    std::string targets;
    for (int m = 0; m < 4; ++m) {
      if (!w.targets[static_cast<size_t>(m)]) continue;
      const Tensor a = test::random_tensor({w.rank, in_of(m)}, dt, rng, 0.5f);
      const Tensor b = test::random_tensor({out_of(m), w.rank}, dt, rng, 0.3f);
      w.pairs[m] = {a, b};
      const std::string p = std::string("base_model.model.model.layers.0.") + kModules[m];
      tensors.push_back({p + ".lora_A.weight", a});
      tensors.push_back({p + ".lora_B.weight", b});
      const std::string module = kModules[m];
      targets += (targets.empty() ? "\"" : ", \"") + module.substr(module.find('.') + 1) + "\"";
    }
    test::write_adapter(tmp.sub(name),
                        "{\"r\": " + std::to_string(w.rank) + ", \"lora_alpha\": " +
                            std::to_string(w.rank) + ", \"target_modules\": [" + targets + "]}",
                        tensors);
  }

  AdapterManagerConfig config;
  config.max_loras = kMaxLoras;
  config.max_cpu_loras = 3;
  config.max_lora_rank = kMaxRank;
  config.lora_dtype = dt;
  config.device = device;
  AdapterManager manager(registry, config);
  for (const auto& [name, w] : adapters) manager.load(name, tmp.sub(name));

  const Stream compute = device.is_cuda() ? Stream::create(device) : Stream();
  PunicaWrapper punica(kMaxLoras, kTokens, 1, device);
  const Tensor x_host = test::random_tensor({kTokens, kHidden}, dt, rng);
  const Tensor attn_host = test::random_tensor({kTokens, kHeads * kHeadDim}, dt, rng);
  const Tensor x = x_host.to(device, compute);
  const Tensor attn = attn_host.to(device, compute);
  auto values = [&](const Tensor& t) {
    const Tensor host = t.to(Device::cpu(), compute);  // waits for the compute stream
    return host.to_double_vector();
  };

  // all8 and qv3 fill both slots; all5 then evicts the least recently used; all8 comes back.
  for (const char* name : {"all8", "qv3", "all5", "all8", "qv3"}) {
    SCOPED_TRACE(name);
    AdapterManager::Lease lease = manager.acquire(name);
    lease.wait_ready(compute);
    const Written& w = adapters.at(name);
    std::vector<LoraSliceWeights> qkv_slices(3);
    for (int m = 0; m < 3; ++m) {
      if (w.pairs.count(m))
        qkv_slices[static_cast<size_t>(m)] = {w.pairs.at(m).first, w.pairs.at(m).second};
    }
    twin.qkv->set_lora(lease.slot(), qkv_slices);
    if (w.pairs.count(3)) {
      twin.o->set_lora(lease.slot(), {{w.pairs.at(3).first, w.pairs.at(3).second}});
    } else {
      twin.o->reset_lora(lease.slot());
    }
    std::vector<int32_t> slots(kTokens, lease.slot());
    for (int t = 0; t < kTokens; t += 4) slots[static_cast<size_t>(t)] = -1;
    punica.update_metadata(slots, {}, compute);
    auto lock = manager.lock_layers();
    const std::vector<double> got_qkv = values(managed.qkv->forward(x, punica, compute));
    const std::vector<double> want_qkv = values(twin.qkv->forward(x, punica, compute));
    EXPECT_EQ(got_qkv, want_qkv);
    const std::vector<double> got_o = values(managed.o->forward(attn, punica, compute));
    const std::vector<double> want_o = values(twin.o->forward(attn, punica, compute));
    EXPECT_EQ(got_o, want_o);
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(managed.qkv->lora_rank(lease.slot(), s), w.pairs.count(s) ? w.rank : 0) << s;
    }
  }
}

TEST(AdapterManagerUpload, SlotsMatchSynchronouslyWrittenLayersOnCpu) {
  check_manager_upload(Device::cpu(), DType::kF32);
}

TEST(AdapterManagerUpload, SlotsMatchSynchronouslyWrittenLayers_Cuda) {
  check_manager_upload(Device::cuda(0), DType::kBF16);
}

}  // namespace
}  // namespace loraplex
