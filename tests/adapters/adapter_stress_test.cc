// Concurrency stress for the adapter manager with real LoRA layers: 8 threads load, use and
// unload 200 generated adapters (mixed ranks and targets) against 8 GPU slots and a CPU cache
// of 32. Every use runs the layers' forward on the leased slot and compares with that
// adapter's own expected output (computed in double from the generated weights), so a slot
// holding a half-written or wrong adapter is caught; the only other outcomes allowed are a
// clean "not loaded" or capacity error. Built as its own executable so it can run under
// ASan and TSan (-DLORAPLEX_SANITIZE=address / thread).

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>

#include "adapter_test_support.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/layers/lora_linear.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

constexpr int kAdapters = 200;
constexpr int kThreads = 8;
constexpr int kRoundsPerThread = 150;
constexpr int kMaxLoras = 8;
constexpr int kMaxCpuLoras = 32;
constexpr int kMaxRank = 16;
constexpr int kTokens = 5;
constexpr int64_t kHidden = 48;
constexpr int64_t kHeadDim = 8;
constexpr int64_t kHeads = 4;
constexpr int64_t kKvHeads = 2;
constexpr int64_t kInter = 40;

struct Module {
  const char* name;  // PEFT module suffix
  int layer;         // 0 = qkv, 1 = gate_up
  int slice;
  int64_t out;
};
const Module kModules[] = {
    {"self_attn.q_proj", 0, 0, kHeads* kHeadDim},
    {"self_attn.k_proj", 0, 1, kKvHeads* kHeadDim},
    {"self_attn.v_proj", 0, 2, kKvHeads* kHeadDim},
    {"mlp.gate_proj", 1, 0, kInter},
    {"mlp.up_proj", 1, 1, kInter},
};
const std::string kPrefix = "model.layers.0.";

// One generated adapter and the outputs it must produce on the shared input.
struct Generated {
  std::string name;
  std::string dir;
  std::vector<double> qkv;      // [tokens, q + 2 kv]
  std::vector<double> gate_up;  // [tokens, 2 inter]
};

class AdapterStress : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(2024);
    const LoraConfig cfg{kMaxLoras, kMaxRank, DType::kF32, false};
    qkv_ = std::make_unique<LoraLinear>(
        LinearSpec::qkv(kHidden, kHeadDim, kHeads, kKvHeads, DType::kF32), cfg, nullptr,
        Device::cpu(), kTokens);
    gate_up_ = std::make_unique<LoraLinear>(
        LinearSpec::merged_column(kHidden, {kInter, kInter}, DType::kF32), cfg, nullptr,
        Device::cpu(), kTokens);
    std::vector<Tensor> base[2];
    for (const Module& m : kModules)
      base[m.layer].push_back(test::random_tensor({m.out, kHidden}, DType::kF32, rng, 0.5f));
    qkv_->load_base(base[0]);
    gate_up_->load_base(base[1]);
    LoraLayerHandle handles[2] = {LoraLayerHandle::of(*qkv_, "qkv", 3),
                                  LoraLayerHandle::of(*gate_up_, "gate_up", 2)};
    for (const Module& m : kModules) {
      LoraTarget t;
      t.module = kPrefix + m.name;
      t.layer = handles[m.layer];
      t.slice = m.slice;
      t.in_features = kHidden;
      t.out_features = m.out;
      registry_.add(t);
    }
    x_ = test::random_tensor({kTokens, kHidden}, DType::kF32, rng);
    const std::vector<double> xv = x_.to_double_vector();

    // The base outputs, then each adapter's own.
    std::vector<double> base_out[2];
    for (int l = 0; l < 2; ++l) {
      int64_t width = 0;
      for (const Tensor& w : base[l]) width += w.size(0);
      base_out[l].assign(static_cast<size_t>(kTokens * width), 0.0);
      int64_t col = 0;
      for (const Tensor& w : base[l]) {
        const std::vector<double> wv = w.to_double_vector();
        for (int64_t t = 0; t < kTokens; ++t)
          for (int64_t j = 0; j < w.size(0); ++j) {
            double acc = 0;
            for (int64_t k = 0; k < kHidden; ++k) acc += xv[t * kHidden + k] * wv[j * kHidden + k];
            base_out[l][static_cast<size_t>(t * width + col + j)] = acc;
          }
        col += w.size(0);
      }
    }
    for (int i = 0; i < kAdapters; ++i) {
      Generated g;
      // Appended rather than "a" + to_string(i): GCC 12 warns falsely (-Wrestrict) on that.
      g.name = "a";
      g.name += std::to_string(i);
      g.dir = tmp_.sub(g.name);
      const int rank = 1 + static_cast<int>(rng() % kMaxRank);
      const double alpha = static_cast<double>(1 + rng() % 32);
      const bool rslora = rng() % 4 == 0;
      const double scale = rslora ? alpha / std::sqrt(rank) : alpha / rank;
      unsigned mask = 0;
      while (mask == 0) mask = static_cast<unsigned>(rng() % 32);
      std::vector<std::pair<std::string, Tensor>> tensors;
      std::string targets;
      g.qkv = base_out[0];
      g.gate_up = base_out[1];
      int64_t col[2] = {0, 0};
      const int64_t width[2] = {kHeads * kHeadDim + 2 * kKvHeads * kHeadDim, 2 * kInter};
      for (size_t mi = 0; mi < std::size(kModules); ++mi) {
        const Module& m = kModules[mi];
        if ((mask >> mi) & 1u) {
          Tensor a = test::random_tensor({rank, kHidden}, DType::kF32, rng, 0.5f);
          Tensor b = test::random_tensor({m.out, rank}, DType::kF32, rng, 0.3f);
          tensors.emplace_back("base_model.model." + kPrefix + m.name + ".lora_A.weight", a);
          tensors.emplace_back("base_model.model." + kPrefix + m.name + ".lora_B.weight", b);
          const std::string full = m.name;
          if (!targets.empty()) targets.append(", ");
          targets.append("\"").append(full.substr(full.find('.') + 1)).append("\"");
          const std::vector<double> av = a.to_double_vector();
          const std::vector<double> bv = b.to_double_vector();
          std::vector<double>& y = m.layer == 0 ? g.qkv : g.gate_up;
          for (int64_t t = 0; t < kTokens; ++t) {
            for (int64_t j = 0; j < m.out; ++j) {
              double acc = 0;
              for (int r = 0; r < rank; ++r) {
                double xa = 0;
                for (int64_t k = 0; k < kHidden; ++k)
                  xa += xv[t * kHidden + k] * av[r * kHidden + k];
                acc += xa * bv[j * rank + r];
              }
              y[static_cast<size_t>(t * width[m.layer] + col[m.layer] + j)] += scale * acc;
            }
          }
        }
        col[m.layer] += m.out;
      }
      const std::string config = "{\"peft_type\": \"LORA\", \"r\": " + std::to_string(rank) +
                                 ", \"lora_alpha\": " + std::to_string(alpha) +
                                 ", \"use_rslora\": " + (rslora ? "true" : "false") +
                                 ", \"target_modules\": [" + targets + "]}";
      test::write_adapter(g.dir, config, tensors);
      adapters_.push_back(std::move(g));
    }
  }

  test::TempDir tmp_;
  std::unique_ptr<LoraLinear> qkv_;
  std::unique_ptr<LoraLinear> gate_up_;
  LoraTargetRegistry registry_;
  Tensor x_;
  std::vector<Generated> adapters_;
};

TEST_F(AdapterStress, LoadUseUnloadFromEightThreads) {
  AdapterManagerConfig c;
  c.max_loras = kMaxLoras;
  c.max_cpu_loras = kMaxCpuLoras;
  c.max_lora_rank = kMaxRank;
  c.lora_dtype = DType::kF32;
  AdapterManager manager(registry_, c);
  for (int i = 0; i < kAdapters; i += 2) manager.load(adapters_[i].name, adapters_[i].dir);

  PunicaWrapper punica(kMaxLoras, kTokens, 1, Device::cpu());
  std::atomic<int> uses{0}, not_loaded{0}, capacity{0}, loads{0}, already{0}, unloads{0}, wrong{0},
      other{0};
  auto check = [&](const AdapterManager::Lease& lease, const Generated& g) {
    auto lock = manager.lock_layers();
    const std::vector<int32_t> slots(kTokens, lease.slot());
    punica.update_metadata(slots, {}, Stream());
    const Tensor y1 = qkv_->forward(x_, punica, Stream());
    const double r1 = test::tolerance_ratio(y1.to_double_vector(), g.qkv, 1e-5, 1e-5);
    const Tensor y2 = gate_up_->forward(x_, punica, Stream());
    const double r2 = test::tolerance_ratio(y2.to_double_vector(), g.gate_up, 1e-5, 1e-5);
    if (!(r1 <= 1.0 && r2 <= 1.0)) {
      ++wrong;
      ADD_FAILURE() << g.name << " in slot " << lease.slot() << ": tolerance ratios " << r1 << ", "
                    << r2;
    }
    ++uses;
  };
  auto worker = [&](int id) {
    std::mt19937_64 rng(static_cast<uint64_t>(id) * 7919 + 1);
    std::vector<std::pair<AdapterManager::Lease, size_t>> held;
    for (int round = 0; round < kRoundsPerThread; ++round) {
      // Skewed popularity: a few hot adapters (shared slots, contention) and a long tail
      // (evictions, reloads from disk).
      const int i =
          rng() % 3 == 0 ? static_cast<int>(rng() % 12) : static_cast<int>(rng() % kAdapters);
      const Generated& g = adapters_[static_cast<size_t>(i)];
      const int op = static_cast<int>(rng() % 100);
      try {
        if (op < 15) {
          try {
            manager.load(g.name, g.dir);
            ++loads;
          } catch (const Error& e) {
            if (std::string(e.what()).find("already loaded") == std::string::npos) throw;
            ++already;
          }
        } else if (op < 25) {
          if (manager.unload(g.name)) ++unloads;
        } else {
          AdapterManager::Lease lease = manager.acquire(g.name);
          check(lease, g);
          // A lease held since an earlier round must still see its own adapter, whatever the
          // other threads loaded, evicted or unloaded since.
          if (!held.empty()) check(held.front().first, adapters_[held.front().second]);
          // Keep some leases for a while: pinned slots make eviction and capacity errors
          // happen while other threads load and acquire.
          if (rng() % 3 == 0 && held.size() < 2)
            held.emplace_back(std::move(lease), static_cast<size_t>(i));
        }
      } catch (const AdapterNotLoadedError&) {
        ++not_loaded;
      } catch (const AdapterCapacityError&) {
        ++capacity;
      } catch (const std::exception& e) {
        ++other;
        ADD_FAILURE() << "unexpected error for " << g.name << ": " << e.what();
      }
      if (!held.empty() && rng() % 4 == 0) held.erase(held.begin());
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();

  std::printf(
      "uses %d, not loaded %d, capacity %d, loads %d (already loaded %d), unloads %d, wrong %d\n",
      uses.load(), not_loaded.load(), capacity.load(), loads.load(), already.load(), unloads.load(),
      wrong.load());
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(uses.load(), kThreads * kRoundsPerThread / 4);

  // Quiescent state: no leases, cache bounds respected, slots hold loaded adapters only.
  const auto all = manager.list();
  int cached = 0;
  for (const AdapterInfo& info : all) {
    EXPECT_EQ(info.leases, 0) << info.name;
    cached += info.in_cpu_cache ? 1 : 0;
  }
  EXPECT_LE(cached, kMaxCpuLoras);
  for (const std::string& s : manager.slot_contents())
    if (!s.empty()) {
      EXPECT_TRUE(manager.contains(s)) << s;
    }
  // Every loaded adapter still works, one after another through the slots.
  for (const AdapterInfo& info : all) {
    auto lease = manager.acquire(info.name);
    const Generated& g = adapters_[static_cast<size_t>(std::stoi(info.name.substr(1)))];
    auto lock = manager.lock_layers();
    punica.update_metadata(std::vector<int32_t>(kTokens, lease.slot()), {}, Stream());
    test::expect_close(qkv_->forward(x_, punica, Stream()), g.qkv, 1e-5, 1e-5, g.name + " qkv");
    test::expect_close(gate_up_->forward(x_, punica, Stream()), g.gate_up, 1e-5, 1e-5,
                       g.name + " gate_up");
  }
}

TEST_F(AdapterStress, ConcurrentLoadsOfOneNameAdmitExactlyOne) {
  AdapterManagerConfig c;
  c.max_loras = kMaxLoras;
  c.max_cpu_loras = kMaxCpuLoras;
  c.max_lora_rank = kMaxRank;
  c.lora_dtype = DType::kF32;
  AdapterManager manager(registry_, c);
  std::atomic<int> ok{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        // Different directories under one name: whichever wins, only one is loaded.
        manager.load("shared", adapters_[static_cast<size_t>(t)].dir);
        ++ok;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("already loaded"), std::string::npos) << e.what();
        ++refused;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 1);
  EXPECT_EQ(refused.load(), kThreads - 1);
  ASSERT_EQ(manager.list().size(), 1u);
  const std::string dir = manager.info("shared")->dir;
  const Generated* g = nullptr;
  for (const Generated& a : adapters_)
    if (a.dir == dir) g = &a;
  ASSERT_NE(g, nullptr);
  PunicaWrapper punica(kMaxLoras, kTokens, 1, Device::cpu());
  auto lease = manager.acquire("shared");
  auto lock = manager.lock_layers();
  punica.update_metadata(std::vector<int32_t>(kTokens, lease.slot()), {}, Stream());
  test::expect_close(qkv_->forward(x_, punica, Stream()), g->qkv, 1e-5, 1e-5, "shared qkv");
}

}  // namespace
}  // namespace loraplex
