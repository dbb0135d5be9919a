#include "loraplex/adapters/adapter_manager.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "adapter_test_support.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

namespace fs = std::filesystem;
using test::kTinyLlamaAdapters;
using test::TinyLlamaTargets;

AdapterManagerConfig config(int max_loras, int max_cpu_loras = 0) {
  AdapterManagerConfig c;
  c.max_loras = max_loras;
  c.max_cpu_loras = max_cpu_loras;
  c.max_lora_rank = 16;
  c.lora_dtype = DType::kF32;
  return c;
}

std::string fixture(const std::string& name) { return kTinyLlamaAdapters + "/" + name; }

template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(AdapterManager, LoadListInfoUnload) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 4));
  AdapterInfo sql = m.load("sql", fixture("sql"));
  EXPECT_EQ(sql.rank, 8);
  EXPECT_EQ(sql.scale, 2.0);
  EXPECT_EQ(sql.modules.size(), 12u);
  EXPECT_EQ(sql.bytes, 3u * 4 * (2 * (8 * 128 + 128 * 8) + 2 * (8 * 128 + 64 * 8)));
  EXPECT_TRUE(sql.in_cpu_cache);
  EXPECT_EQ(sql.slot, -1);
  m.load("rslora", fixture("rslora"));
  const auto all = m.list();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].name, "rslora");
  EXPECT_EQ(all[0].scale, 4.0);
  EXPECT_EQ(all[1].name, "sql");
  EXPECT_TRUE(m.contains("sql"));
  EXPECT_TRUE(m.unload("sql"));
  EXPECT_FALSE(m.contains("sql"));
  EXPECT_FALSE(m.unload("sql"));
  EXPECT_FALSE(m.info("sql").has_value());
  EXPECT_EQ(m.list().size(), 1u);
}

TEST(AdapterManager, RefusesBadConfig) {
  TinyLlamaTargets t;
  EXPECT_THROW(AdapterManager(t.registry, config(0)), Error);
  EXPECT_THROW(AdapterManager(t.registry, config(4, 2)), Error);
  AdapterManagerConfig c = config(1);
  c.lora_dtype = DType::kI32;
  EXPECT_THROW(AdapterManager(t.registry, c), Error);
}

TEST(AdapterManager, FailedLoadChangesNothing) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 2));
  m.load("sql", fixture("sql"));
  int slot = -1;
  {
    auto lease = m.acquire("sql");
    slot = lease.slot();
  }
  const auto before = m.list();
  const auto slots_before = m.slot_contents();
  const int qkv_sets = t.layer_of("model.layers.0.self_attn.q_proj").set_calls();
  EXPECT_NE(error_of<Error>([&] { m.load("sql", fixture("pirate")); }).find("already loaded"),
            std::string::npos);
  AdapterManagerConfig small = config(1);
  small.max_lora_rank = 8;
  EXPECT_NE(error_of<Error>([&] { m.load("pirate", fixture("nonexistent")); }).find("pirate"),
            std::string::npos);
  // pirate (rank 16) is refused by a manager limited to rank 8; nothing else changes.
  AdapterManager m8(t.registry, small);
  m8.load("sql", fixture("sql"));
  EXPECT_NE(error_of<Error>([&] {
              m8.load("pirate", fixture("pirate"));
            }).find("exceeds max_lora_rank 8"),
            std::string::npos);
  EXPECT_EQ(m8.list().size(), 1u);

  EXPECT_EQ(m.list().size(), before.size());
  EXPECT_EQ(m.slot_contents(), slots_before);
  EXPECT_EQ(t.layer_of("model.layers.0.self_attn.q_proj").set_calls(), qkv_sets);
  auto lease = m.acquire("sql");
  EXPECT_EQ(lease.slot(), slot) << "still in its slot: no rewrite";
  EXPECT_EQ(t.layer_of("model.layers.0.self_attn.q_proj").set_calls(), qkv_sets);
}

TEST(AdapterManager, AcquireWritesEveryLayerOfTheSlot) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 2));
  m.load("sql", fixture("sql"));
  m.load("rslora", fixture("rslora"));
  auto rs = m.acquire("rslora");
  auto sql = m.acquire("sql");
  EXPECT_NE(rs.slot(), sql.slot());
  // sql: attention layers set, the MLP and embedding layers reset (exactly no effect).
  auto& qkv = t.layer_of("model.layers.2.self_attn.k_proj");
  ASSERT_EQ(qkv.slot(sql.slot()).size(), 3u);
  EXPECT_TRUE(qkv.slot(sql.slot())[1].a.defined());
  EXPECT_TRUE(t.layer_of("model.layers.2.mlp.up_proj").slot(sql.slot()).empty());
  EXPECT_TRUE(t.layer_of("model.embed_tokens").slot(sql.slot()).empty());
  EXPECT_TRUE(t.layer_of("lm_head").slot(sql.slot()).empty());
  // rslora: the reverse.
  EXPECT_TRUE(qkv.slot(rs.slot()).empty());
  const auto gate_up = t.layer_of("model.layers.2.mlp.up_proj").slot(rs.slot());
  ASSERT_EQ(gate_up.size(), 2u);
  EXPECT_EQ(gate_up[0].a.shape(), (Shape{4, 128}));
  EXPECT_EQ(gate_up[1].b.shape(), (Shape{320, 4}));
  EXPECT_EQ(m.info("sql")->slot, sql.slot());
  EXPECT_EQ(m.info("sql")->leases, 1);
}

TEST(AdapterManager, SlotsAreReusedThenEvictedLeastRecentlyUsed) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 4));
  for (const char* n : {"sql", "pirate", "rslora"}) m.load(n, fixture(n));
  const int a = m.acquire("sql").slot();
  const int b = m.acquire("pirate").slot();
  EXPECT_NE(a, b);
  auto& q = t.layer_of("model.layers.0.self_attn.q_proj");
  const int sets = q.set_calls();
  EXPECT_EQ(m.acquire("sql").slot(), a);  // touches sql
  EXPECT_EQ(q.set_calls(), sets) << "an adapter already in a slot is not rewritten";
  EXPECT_EQ(m.acquire("rslora").slot(), b) << "pirate is the least recently used";
  EXPECT_EQ(m.info("pirate")->slot, -1);
  EXPECT_EQ(m.slot_contents()[static_cast<size_t>(b)], "rslora");
  EXPECT_EQ(m.acquire("pirate").slot(), a) << "now sql is the least recently used";
}

TEST(AdapterManager, CapacityErrorWhenEverySlotIsPinned) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 4));
  for (const char* n : {"sql", "pirate", "rslora"}) m.load(n, fixture(n));
  auto l1 = m.acquire("sql");
  auto l2 = m.acquire("pirate");
  auto l2b = m.acquire("pirate");
  const std::string msg = error_of<AdapterCapacityError>([&] { m.acquire("rslora"); });
  EXPECT_NE(msg.find("adapter 'rslora'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("all 2 GPU adapter slots"), std::string::npos) << msg;
  EXPECT_EQ(m.acquire("sql").slot(), l1.slot()) << "adapters in slots stay available";
  l2.release();
  EXPECT_THROW(m.acquire("rslora"), AdapterCapacityError) << "pirate is still leased once";
  l2b = AdapterManager::Lease();
  auto l3 = m.acquire("rslora");
  EXPECT_EQ(l3.slot(), 1 - l1.slot());
}

TEST(AdapterManager, NotLoadedError) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(1));
  const std::string msg = error_of<AdapterNotLoadedError>([&] { m.acquire("ghost"); });
  EXPECT_NE(msg.find("adapter 'ghost' is not loaded"), std::string::npos) << msg;
}

TEST(AdapterManager, UnloadWhileLeasedKeepsTheSlotUntilReleased) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 2));
  m.load("sql", fixture("sql"));
  auto lease = m.acquire("sql");
  const int slot = lease.slot();
  EXPECT_TRUE(m.unload("sql"));
  EXPECT_THROW(m.acquire("sql"), AdapterNotLoadedError);
  EXPECT_EQ(m.slot_contents()[static_cast<size_t>(slot)], "sql");
  // The same name loaded again is a new adapter in another slot; the old lease is untouched.
  m.load("sql", fixture("sql"));
  auto fresh = m.acquire("sql");
  EXPECT_NE(fresh.slot(), slot);
  lease.release();
  EXPECT_EQ(m.slot_contents()[static_cast<size_t>(slot)], "");
  EXPECT_EQ(m.info("sql")->slot, fresh.slot());
}

TEST(AdapterManager, CpuCacheEvictsAndAcquireReloads) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(1, 2));
  m.load("sql", fixture("sql"));
  m.load("pirate", fixture("pirate"));
  m.load("rslora", fixture("rslora"));
  EXPECT_FALSE(m.info("sql")->in_cpu_cache);
  EXPECT_TRUE(m.info("pirate")->in_cpu_cache);
  EXPECT_TRUE(m.info("rslora")->in_cpu_cache);
  {
    auto lease = m.acquire("sql");  // reloaded from disk
    EXPECT_EQ(t.layer_of("model.layers.1.self_attn.o_proj").slot(lease.slot())[0].a.shape(),
              (Shape{8, 128}));
  }
  EXPECT_TRUE(m.info("sql")->in_cpu_cache);
  EXPECT_FALSE(m.info("pirate")->in_cpu_cache) << "the least recently used one went";
  m.prefetch("pirate").get();
  EXPECT_TRUE(m.info("pirate")->in_cpu_cache);
  EXPECT_THROW(m.prefetch("ghost").get(), AdapterNotLoadedError);
}

TEST(AdapterManager, ReloadFailureNamesTheFileAndKeepsTheManagerUsable) {
  TinyLlamaTargets t;
  test::TempDir tmp;
  fs::copy(fixture("sql"), tmp.sub("sql"));
  AdapterManager m(t.registry, config(1, 1));
  m.load("sql", tmp.sub("sql"));
  m.load("rslora", fixture("rslora"));  // evicts sql from the CPU cache
  fs::remove(tmp.sub("sql") + "/adapter_model.safetensors");
  const std::string msg = error_of<Error>([&] { m.acquire("sql"); });
  EXPECT_NE(msg.find("adapter 'sql'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(tmp.sub("sql") + "/adapter_model.safetensors"), std::string::npos) << msg;
  EXPECT_TRUE(m.contains("sql"));
  EXPECT_EQ(m.acquire("rslora").slot(), 0);
  // The file put back is another file (new inode and time): loaded again, it serves.
  fs::copy(fixture("sql") + "/adapter_model.safetensors", tmp.sub("sql"));
  EXPECT_NE(error_of<Error>([&] { m.acquire("sql"); }).find("changed on disk"), std::string::npos);
  m.unload("sql");
  m.load("sql", tmp.sub("sql"));
  EXPECT_EQ(m.acquire("sql").slot(), 0);
}

// Files replaced after the adapter left the CPU cache: the reload refuses rather than serve
// other weights under the same name; untouched files reload as before.
TEST(AdapterManager, ReloadRefusesFilesChangedSinceTheLoad) {
  TinyLlamaTargets t;
  test::TempDir tmp;
  fs::copy(fixture("sql"), tmp.sub("sql"));
  fs::copy(fixture("pirate"), tmp.sub("pirate"));
  AdapterManager m(t.registry, config(1, 1));
  m.load("sql", tmp.sub("sql"));
  m.load("pirate", tmp.sub("pirate"));  // evicts sql from the CPU cache
  EXPECT_FALSE(m.info("sql")->in_cpu_cache);
  { EXPECT_EQ(m.acquire("sql").slot(), 0); }     // unchanged: reloads
  m.load("rslora", fixture("rslora"));           // evicts sql again
  { EXPECT_EQ(m.acquire("rslora").slot(), 0); }  // and takes its GPU slot
  EXPECT_FALSE(m.info("sql")->in_cpu_cache);
  EXPECT_EQ(m.info("sql")->slot, -1);
  // Another adapter's weights copied over sql's (same shapes, other values).
  const std::string weights = tmp.sub("sql") + "/adapter_model.safetensors";
  fs::remove(weights);
  fs::copy(tmp.sub("pirate") + "/adapter_model.safetensors", weights);
  const std::string msg = error_of<Error>([&] { m.acquire("sql"); });
  EXPECT_NE(msg.find("adapter 'sql'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("changed on disk"), std::string::npos) << msg;
  EXPECT_NE(msg.find(weights), std::string::npos) << msg;
  EXPECT_THROW(m.prefetch("sql").get(), Error);
  EXPECT_TRUE(m.contains("sql"));
  // A config rewritten in place (same inode, new size and time) counts too.
  m.load("pirate2", tmp.sub("pirate"));
  m.load("vocab", fixture("vocab"));  // evicts pirate2 from the CPU cache
  ASSERT_FALSE(m.info("pirate2")->in_cpu_cache);
  ASSERT_EQ(m.info("pirate2")->slot, -1);
  const std::string config_file = tmp.sub("pirate") + "/adapter_config.json";
  fs::permissions(config_file, fs::perms::owner_write, fs::perm_options::add);
  {
    std::ofstream f(config_file, std::ios::app);
    f << "\n";
  }
  EXPECT_NE(error_of<Error>([&] { m.acquire("pirate2"); }).find("adapter_config.json"),
            std::string::npos);
}

// A layer that refuses an adapter (as a real layer refuses a rank above its max_lora_rank):
// the acquire fails, the slot it was writing is freed, and every other slot is untouched.
TEST(AdapterManager, FailedActivationFreesTheSlotAndLeavesOthersAlone) {
  test::RecordingLayer inner("qkv", 3);
  int refused = 0;
  LoraLayerHandle picky(
      "picky_qkv", 3,
      [&](int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream) {
        for (const auto& s : slices) {
          if (s.a.defined() && s.a.size(0) > 8) {
            ++refused;
            LORAPLEX_FAIL("picky_qkv: rank ", s.a.size(0), " above 8");
          }
        }
        inner.handle().set_lora(slot, slices, stream);
      },
      [&](int slot, const Stream& stream) { inner.handle().reset_lora(slot, stream); });
  LoraTargetRegistry registry;
  const char* names[] = {"q_proj", "k_proj", "v_proj"};
  for (int s = 0; s < 3; ++s) {
    LoraTarget t;
    t.module = std::string("model.layers.0.self_attn.") + names[s];
    t.layer = picky;
    t.slice = s;
    t.in_features = 128;
    t.out_features = s == 0 ? 128 : 64;
    registry.add(t);
  }
  test::TempDir tmp;
  // q/k/v of layer 0 only, at rank 8 (accepted) and rank 16 (refused by the layer).
  std::mt19937_64 rng(3);
  for (const auto& [name, rank] : {std::pair{"r8", 8}, std::pair{"r16", 16}}) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (int s = 0; s < 3; ++s) {
      const std::string p = std::string("base_model.model.model.layers.0.self_attn.") + names[s];
      tensors.emplace_back(p + ".lora_A.weight",
                           test::random_tensor({rank, 128}, DType::kF32, rng));
      tensors.emplace_back(p + ".lora_B.weight",
                           test::random_tensor({s == 0 ? 128 : 64, rank}, DType::kF32, rng));
    }
    test::write_adapter(tmp.sub(name),
                        "{\"r\": " + std::to_string(rank) +
                            ", \"lora_alpha\": 8, \"target_modules\": [\"q_proj\", \"k_proj\", "
                            "\"v_proj\"]}",
                        tensors);
  }
  AdapterManager m(registry, config(2, 2));
  m.load("r8", tmp.sub("r8"));
  m.load("r16", tmp.sub("r16"));
  auto lease = m.acquire("r8");
  const std::vector<LoraSliceWeights> before = inner.slot(lease.slot());
  const std::string msg = error_of<Error>([&] { m.acquire("r16"); });
  EXPECT_NE(msg.find("rank 16 above 8"), std::string::npos) << msg;
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(m.info("r16")->slot, -1);
  EXPECT_EQ(m.slot_contents()[static_cast<size_t>(1 - lease.slot())], "");
  const std::vector<LoraSliceWeights> after = inner.slot(lease.slot());
  ASSERT_EQ(after.size(), 3u);
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(after[s].a.data_ptr(), before[s].a.data_ptr());
  EXPECT_EQ(m.acquire("r8").slot(), lease.slot());
  EXPECT_THROW(m.acquire("r16"), Error) << "refused again, not half-activated";
  EXPECT_EQ(refused, 2);
}

TEST(AdapterManager, LoadAsync) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 4));
  auto f1 = m.load_async("sql", fixture("sql"));
  auto f2 = m.load_async("vocab", fixture("vocab"));
  auto f3 = m.load_async("bad", fixture("missing"));
  EXPECT_EQ(f1.get().rank, 8);
  EXPECT_EQ(f2.get().scale, 1.0);
  EXPECT_THROW(f3.get(), Error);
  EXPECT_EQ(m.list().size(), 2u);
  auto lease = m.acquire("vocab");
  const auto embed = t.layer_of("model.embed_tokens").slot(lease.slot());
  ASSERT_EQ(embed.size(), 1u);
  EXPECT_EQ(embed[0].a.shape(), (Shape{8, 1024}));
  EXPECT_EQ(embed[0].b.shape(), (Shape{128, 8}));
}

TEST(AdapterManager, ConcurrentAcquiresOfOneAdapterWriteItOnce) {
  TinyLlamaTargets t;
  AdapterManager m(t.registry, config(2, 2));
  m.load("pirate", fixture("pirate"));
  m.unload("pirate");
  m.load("pirate", fixture("pirate"));
  auto& q = t.layer_of("model.layers.0.self_attn.q_proj");
  const int before = q.set_calls();
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      auto lease = m.acquire("pirate");
      if (lease.valid()) ++ok;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(q.set_calls(), before + 1);
}

}  // namespace
}  // namespace loraplex
