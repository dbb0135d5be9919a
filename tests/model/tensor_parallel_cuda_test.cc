// The tensor-parallel model on GPUs over NCCL (skipped with fewer than 2 GPUs or without the
// CUDA backend): tp 2 (and 4 where there are 4 GPUs) give PEFT's tokens on the float32
// fixtures; decode steps replayed from CUDA graphs, the NCCL collectives captured on every
// rank's stream, give the tokens of eager steps, with adapters (float32); a rank that stalls before
// its collective is aborted at the step timeout (the other GPUs' NCCL kernels stop waiting).

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include "faulty_communicator.h"
#include "fixture_support.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/model/load_model.h"
#include "loraplex/model/random_adapter.h"
#include "loraplex/model/tensor_parallel.h"
#if LORAPLEX_WITH_CUDA
#include "loraplex/dist/nccl_communicator.h"
#endif

namespace loraplex::test {
namespace {

#define LORAPLEX_REQUIRE_GPUS(n)                                                  \
  do {                                                                            \
    if (cuda_device_count() < (n)) {                                              \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, " << cuda_device_count() \
                   << " present (or a build without CUDA)";                       \
    }                                                                             \
  } while (0)

TEST(TensorParallelCuda, FixturesMatchPeftOnTwoAndFourGpus) {
  LORAPLEX_REQUIRE_GPUS(2);
  for (const char* fixture :
       {"tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3", "tiny-qwen3-moe"}) {
    const auto expected = read_expected(fixture);
    std::vector<size_t> order(expected.size());
    std::iota(order.begin(), order.end(), 0);
    for (int tp : {2, 4}) {
      if (tp > cuda_device_count()) continue;
      if (std::string(fixture) == "tiny-qwen2" && tp == 4) continue;  // 6 heads
      for (bool fully_sharded : {false, true}) {
        engine::GenerateConfig cfg = fixture_config(fixture, expected, order);
        cfg.device = Device::cuda(0);
        cfg.dtype = DType::kF32;
        cfg.tensor_parallel_size = tp;
        cfg.fully_sharded_loras = fully_sharded;
        const engine::GenerateReport report = engine::run_generate(cfg);
        ASSERT_EQ(report.outputs.size(), expected.size());
        for (size_t i = 0; i < expected.size(); ++i) {
          EXPECT_EQ(report.outputs[i].output_token_ids, expected[i].output_token_ids)
              << fixture << " tp " << tp << (fully_sharded ? " fully sharded" : "") << " request "
              << i;
        }
      }
    }
  }
}

// A shape FlashInfer runs (head dim 64) in bfloat16.
model::ModelConfig graph_config() {
  model::ModelConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 512;
  c.eos_token_ids = {1};
  return c;
}

struct Seq {
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;
  int32_t slot = -1;
};

// Prefills every sequence, then `steps` - 1 greedy decodes of all of them in one batch.
std::vector<std::vector<int32_t>> generate(model::ModelExecutor& m, std::vector<Seq> seqs,
                                           int steps, bool* all_decodes_graphed) {
  std::vector<std::vector<int32_t>> out(seqs.size());
  std::vector<int32_t> cached(seqs.size(), 0);
  *all_decodes_graphed = true;
  for (int step = 0; step < steps; ++step) {
    model::StepBatch batch;
    for (size_t i = 0; i < seqs.size(); ++i) {
      model::SequenceStep q;
      q.tokens.assign(seqs[i].tokens.begin() + cached[i], seqs[i].tokens.end());
      q.start_position = cached[i];
      q.blocks = seqs[i].blocks;
      q.lora_slot = seqs[i].slot;
      q.sample = true;
      batch.seqs.push_back(q);
    }
    const model::StepResult r = m.execute(batch);
    if (step > 0) *all_decodes_graphed = *all_decodes_graphed && m.last_step().graph;
    for (size_t i = 0; i < seqs.size(); ++i) {
      cached[i] = static_cast<int32_t>(seqs[i].tokens.size());
      seqs[i].tokens.push_back(r.token_ids[i]);
      out[i].push_back(r.token_ids[i]);
    }
  }
  return out;
}

// Decode steps replayed from CUDA graphs (the collectives captured inside) against eager steps,
// with two adapters and a base-model sequence in the batch, at tp 1 and 2. In float32 every
// token must be equal. In bfloat16 a replay runs the bucket's padded batch (4 rows for 3
// sequences), and the LoRA kernels group the sorted tokens differently with the padding row in
// it (tensor cores where two tokens share a slot, FMA otherwise): sums in another order, so only
// the first decoded token is compared there.
void check_graph_steps_equal_eager_steps(const model::ModelConfig& c, const std::string& tag) {
  const std::string dir = ::testing::TempDir() + "/loraplex_tp_graph_adapter_" + tag;
  model::write_random_peft_adapter(dir + "0", c, 8, model::all_linear_targets(c), 11);
  model::write_random_peft_adapter(dir + "1", c, 16, model::all_linear_targets(c), 12);
  std::mt19937_64 rng(3);
  std::vector<Seq> seqs(3);
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].tokens.resize(5 + 7 * i);
    for (int32_t& t : seqs[i].tokens) t = static_cast<int32_t>(2 + rng() % 990);
    for (int32_t b = 0; b < 4; ++b) seqs[i].blocks.push_back(static_cast<int32_t>(4 * i) + b);
  }
  struct Case {
    int tp;
    DType dtype;
    bool fully_sharded;
  };
  const Case cases[] = {{1, DType::kF32, false},
                        {2, DType::kF32, false},
                        {2, DType::kF32, true},
                        {1, DType::kBF16, false},
                        {2, DType::kBF16, false}};
  for (const Case& k : cases) {
    if (k.tp > cuda_device_count()) continue;
    const std::string what = tag + " tp " + std::to_string(k.tp) + " " +
                             std::string(dtype_name(k.dtype)) +
                             (k.fully_sharded ? " fully sharded" : "");
    std::vector<std::vector<std::vector<int32_t>>> runs;
    for (bool graphs : {true, false}) {
      model::DecoderOptions o;
      o.dtype = k.dtype;
      o.device = Device::cuda(0);
      o.max_loras = 2;
      o.max_lora_rank = 16;
      o.max_num_tokens = 64;
      o.max_num_seqs = 4;
      o.kv_blocks = 16;
      o.kv_block_size = 16;
      o.cuda_graphs = graphs;
      o.tensor_parallel_size = k.tp;
      o.fully_sharded_loras = k.fully_sharded;
      auto m = model::create_random_model(c, o, 5);
      AdapterManagerConfig mc;
      mc.max_loras = 2;
      mc.max_lora_rank = 16;
      mc.lora_dtype = k.dtype;
      mc.device = Device::cuda(0);
      AdapterManager manager(m->targets(), mc);
      manager.load("a0", dir + "0");
      manager.load("a1", dir + "1");
      AdapterManager::Lease l0 = manager.acquire("a0");
      AdapterManager::Lease l1 = manager.acquire("a1");
      for (const Stream& s : m->streams()) {
        l0.wait_ready(s);
        l1.wait_ready(s);
      }
      std::vector<Seq> with_slots = seqs;
      with_slots[1].slot = l0.slot();
      with_slots[2].slot = l1.slot();
      bool graphed = false;
      runs.push_back(generate(*m, with_slots, 8, &graphed));
      EXPECT_EQ(graphed, graphs) << what;
      // A replay of the captured graphs with other contents (one sequence fewer: bucket 2).
      runs.push_back(generate(*m, {with_slots[0], with_slots[2]}, 6, &graphed));
      EXPECT_EQ(graphed, graphs) << what;
      // The adapters change the output.
      std::vector<Seq> base = with_slots;
      for (Seq& s : base) s.slot = -1;
      const auto without = generate(*m, base, 8, &graphed);
      const auto& with = runs[runs.size() - 2];
      // The random adapters' effect is small: in bfloat16 it may change no greedy token.
      if (k.dtype == DType::kF32) {
        EXPECT_TRUE(without[1] != with[1] || without[2] != with[2]) << what << ": no effect";
      }
      EXPECT_EQ(without[0], with[0]) << what << ": a base-model sequence saw the adapters";
    }
    if (k.dtype == DType::kF32) {
      EXPECT_EQ(runs[0], runs[2]) << "graph vs eager, " << what;
      EXPECT_EQ(runs[1], runs[3]) << "graph vs eager replay, " << what;
    } else {
      for (size_t r : {size_t{0}, size_t{1}}) {
        for (size_t i = 0; i < runs[r].size(); ++i) {
          EXPECT_EQ(runs[r][i][1], runs[r + 2][i][1])
              << "first decoded token, graph vs eager, " << what << ", sequence " << i;
        }
      }
      // Recorded for the reader: how many tokens of the bfloat16 runs agree.
      int equal = 0, total = 0;
      for (size_t r : {size_t{0}, size_t{1}}) {
        for (size_t i = 0; i < runs[r].size(); ++i) {
          for (size_t t = 0; t < runs[r][i].size(); ++t, ++total)
            equal += runs[r][i][t] == runs[r + 2][i][t];
        }
      }
      std::printf("%s: graph and eager agree on %d of %d tokens\n", what.c_str(), equal, total);
    }
  }
}

TEST(TensorParallelCuda, GraphStepsEqualEagerStepsWithAdaptersAppliedPerSequence) {
  LORAPLEX_REQUIRE_GPUS(2);
  check_graph_steps_equal_eager_steps(graph_config(), "dense");
}

// MoE decode steps route their pairs on the device and are captured like dense ones; the
// adapters cover attention and every expert. The tp 1 cases run on one GPU.
TEST(TensorParallelCuda, MoeGraphStepsEqualEagerStepsWithAdaptersAppliedPerSequence) {
  LORAPLEX_REQUIRE_GPUS(1);
  model::ModelConfig c = graph_config();
  c.arch = model::Architecture::kMixtral;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  check_graph_steps_equal_eager_steps(c, "moe");
}

TEST(TensorParallelCuda, AStalledRankIsAbortedAtTheTimeout) {
  LORAPLEX_REQUIRE_GPUS(2);
#if LORAPLEX_WITH_CUDA
  auto nccl = NcclCommunicator::create_group({0, 1});
  FaultyCommunicator faulty(*nccl[1], FaultyCommunicator::Mode::kStall);
  model::DecoderOptions o;
  o.device = Device::cuda(0);
  o.tensor_parallel_size = 2;
  o.kv_blocks = 8;
  o.kv_block_size = 4;
  o.step_timeout_s = 10.0;  // the first step (plans, NCCL connections) must fit
  const std::string dir = fixture_dir("tiny-llama") + "/model";
  auto m = model::TensorParallelDecoder::create(
      model::ModelConfig::from_file(dir + "/config.json"), o,
      [dir](const model::DecoderOptions& rank) { return model::Decoder::load(dir, rank); },
      {nccl[0].get(), &faulty});
  model::StepBatch b;
  model::SequenceStep s;
  s.tokens = {5, 17, 300, 42};
  s.blocks = {0, 1};
  s.sample = true;
  b.seqs.push_back(s);
  m->execute(b);
  faulty.arm();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    m->execute(b);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step_timeout_s 10"), std::string::npos) << e.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(waited, 10.0);
  EXPECT_LT(waited, 60.0);
  EXPECT_THROW(m->execute(b), Error);
#endif
}

}  // namespace
}  // namespace loraplex::test
