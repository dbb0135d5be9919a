// The tensor-parallel model on CPU threads (InProcessCommunicator): tp 1, 2 and 4 give PEFT's
// tokens on the tiny fixtures (fp32) through `generate`'s path, with and without fully sharded
// LoRA; the sharded replicas hold only their part of each weight; shapes that cannot be split
// are refused naming the value; a rank that fails or stalls mid-step stops the group with an
// error instead of a hang.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <string>

#include "../engine/engine_test_support.h"
#include "faulty_communicator.h"
#include "fixture_support.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/core/error.h"
#include "loraplex/dist/in_process_communicator.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/model_files.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/load_model.h"
#include "loraplex/model/random_adapter.h"
#include "loraplex/model/shard_layout.h"
#include "loraplex/model/tensor_parallel.h"

namespace loraplex::test {
namespace {

std::vector<size_t> identity_order(size_t n) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  return order;
}

[[maybe_unused]] bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct Case {
  std::string fixture;
  int tp;
  bool fully_sharded;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.fixture + "_tp" + std::to_string(info.param.tp) +
                     (info.param.fully_sharded ? "_fully_sharded" : "");
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

class TensorParallelGenerate : public ::testing::TestWithParam<Case> {};

// The whole fixture in one mixed batch (base model and every adapter, prefills and decodes),
// as `loraplex generate --tensor-parallel-size N` runs it, against PEFT's tokens.
TEST_P(TensorParallelGenerate, MatchesPeft) {
  const Case& c = GetParam();
  const auto expected = read_expected(c.fixture);
  const auto order = identity_order(expected.size());
  engine::GenerateConfig cfg = fixture_config(c.fixture, expected, order);
  cfg.tensor_parallel_size = c.tp;
  cfg.fully_sharded_loras = c.fully_sharded;
  const engine::GenerateReport report = engine::run_generate(cfg);
  ASSERT_EQ(report.outputs.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(report.outputs[i].output_token_ids, expected[i].output_token_ids)
        << c.fixture << " tp " << c.tp << " request " << i << " (" << expected[i].prompt << ", "
        << expected[i].adapter.value_or("base") << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, TensorParallelGenerate,
    ::testing::Values(Case{"tiny-llama", 1, false}, Case{"tiny-llama", 2, false},
                      Case{"tiny-llama", 4, false}, Case{"tiny-llama", 2, true},
                      Case{"tiny-llama", 4, true}, Case{"tiny-qwen2", 1, false},
                      Case{"tiny-qwen2", 2, false}, Case{"tiny-qwen2", 2, true},
                      Case{"tiny-mixtral", 1, false}, Case{"tiny-mixtral", 2, false},
                      Case{"tiny-mixtral", 4, false}, Case{"tiny-mixtral", 2, true},
                      Case{"tiny-mixtral", 4, true}, Case{"tiny-qwen3", 2, false},
                      Case{"tiny-qwen3", 4, true}, Case{"tiny-qwen3-moe", 2, false},
                      Case{"tiny-qwen3-moe", 4, true}),
    case_name);

// ---------------------------------------------------------------- what each rank holds

// Bytes of base weights rank r of tp should copy to its device (float32), from the config
// alone: its rows of the vocabulary, heads and MLP columns, whole norms and routers, KV heads
// replicated where there are fewer than ranks.
int64_t expected_rank_bytes(const model::ModelConfig& c, int tp, int r) {
  const int64_t h = c.hidden_size;
  const int64_t shard = (c.vocab_size + tp - 1) / tp;
  const int64_t vocab_rows = std::min(shard, c.vocab_size - r * shard);
  const int64_t q = c.q_size() / tp;
  const int64_t kv = std::max<int64_t>(1, c.num_kv_heads / tp) * c.head_dim;
  const int64_t inter = c.intermediate_size / tp;
  int64_t n = 2 * vocab_rows * h + h;  // embedding, lm_head (tied or not), final norm
  for (int64_t l = 0; l < c.num_layers; ++l) {
    n += 2 * h;                          // norms
    if (c.qk_norm) n += 2 * c.head_dim;  // q_norm and k_norm, whole on every rank
    n += (q + 2 * kv) * h + q * h;       // qkv, o
    if (c.qkv_bias) n += q + 2 * kv;
    if (c.is_moe()) {
      n += c.num_experts * h + c.num_experts * 3 * inter * h;
    } else {
      n += 3 * inter * h;
    }
  }
  return 4 * n;
}

TEST(TensorParallelShards, EachRankLoadsOnlyItsShard) {
  for (const char* fixture :
       {"tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3", "tiny-qwen3-moe"}) {
    const std::string dir = fixture_dir(fixture) + "/model";
    const model::ModelConfig c = model::ModelConfig::from_file(dir + "/config.json");
    for (int tp : {2, 4}) {
      if (c.num_heads % tp != 0) continue;
      model::DecoderOptions o;
      o.tensor_parallel_size = tp;
      o.kv_blocks = 8;
      o.kv_block_size = 4;
      std::unique_ptr<model::ModelExecutor> m = model::load_model(dir, o);
      auto& group = dynamic_cast<model::TensorParallelDecoder&>(*m);
      const int64_t kv_heads = std::max<int64_t>(1, c.num_kv_heads / tp);
      EXPECT_EQ(m->kv_block_bytes(), 2 * c.num_layers * 4 * kv_heads * c.head_dim * 4)
          << fixture << " tp " << tp;
      for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(group.rank(r).tp_rank(), r);
        EXPECT_EQ(group.rank(r).weight_bytes(), expected_rank_bytes(c, tp, r))
            << fixture << " tp " << tp << " rank " << r;
      }
    }
  }
}

// Random weights and random adapters (attention and every expert's w1, w2, w3, or Qwen3-MoE's
// gate_proj, up_proj, down_proj) of a small MoE shape: each rank keeps its shard of the same full
// tensors, so tp 2 and 4 compute what one device computes, with and without the adapter.
class TensorParallelRandomMoe : public ::testing::TestWithParam<model::Architecture> {};

TEST_P(TensorParallelRandomMoe, ExpertAdaptersEqualOneDevice) {
  model::ModelConfig c;
  c.arch = GetParam();
  const bool qwen = c.arch == model::Architecture::kQwen3Moe;
  c.vocab_size = 500;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = qwen ? 32 : 16;
  c.qk_norm = qwen;
  c.num_experts = qwen ? 6 : 4;
  c.num_experts_per_tok = qwen ? 3 : 2;
  c.moe_renormalize = !qwen;  // Qwen3-MoE with norm_topk_prob false
  c.max_position_embeddings = 256;
  const std::string dir =
      ::testing::TempDir() + "/loraplex_tp_moe_adapter_" + model::architecture_name(c.arch);
  const std::vector<std::string> targets = model::all_linear_targets(c);
  EXPECT_EQ(targets.back(), qwen ? "down_proj" : "w3");
  model::write_random_peft_adapter(dir, c, 8, targets, 21);
  std::vector<model::StepResult> results;
  for (int tp : {1, 2, 4}) {
    for (bool fully_sharded : {false, true}) {
      if (tp == 1 && fully_sharded) continue;
      model::DecoderOptions o;
      o.max_loras = 1;
      o.max_lora_rank = 8;
      o.kv_blocks = 16;
      o.kv_block_size = 4;
      o.tensor_parallel_size = tp;
      o.fully_sharded_loras = fully_sharded;
      auto m = model::create_random_model(c, o, 77);
      AdapterManagerConfig mc;
      mc.max_loras = 1;
      mc.max_lora_rank = 8;
      mc.lora_dtype = DType::kF32;
      AdapterManager manager(m->targets(), mc);
      const AdapterInfo info = manager.load("experts", dir);
      EXPECT_EQ(info.modules.size(), static_cast<size_t>(c.num_layers * (4 + 3 * c.num_experts)));
      AdapterManager::Lease lease = manager.acquire("experts");
      model::StepBatch b;
      for (int32_t slot : {-1, lease.slot()}) {
        model::SequenceStep s;
        s.tokens = {3, 141, 59, 265, 358, 97, 93};
        s.blocks = slot < 0 ? std::vector<int32_t>{0, 1} : std::vector<int32_t>{2, 3};
        s.lora_slot = slot;
        s.sample = true;
        b.seqs.push_back(s);
      }
      b.want_logprobs = true;
      results.push_back(m->execute(b));
      const model::StepResult& r = results.back();
      ASSERT_EQ(r.logprobs.size(), 2u);
      EXPECT_GT(std::abs(r.logprobs[0] - r.logprobs[1]), 1e-4) << "the adapter changed nothing";
      EXPECT_EQ(r.token_ids, results[0].token_ids) << "tp " << tp;
      for (size_t i = 0; i < 2; ++i) {
        EXPECT_NEAR(r.logprobs[i], results[0].logprobs[i], 1e-5) << "tp " << tp << " row " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TensorParallelRandomMoe,
                         ::testing::Values(model::Architecture::kMixtral,
                                           model::Architecture::kQwen3Moe),
                         [](const auto& info) {
                           return std::string(model::architecture_name(info.param));
                         });

// ---------------------------------------------------------------- refusals

model::ModelConfig small_config(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter) {
  model::ModelConfig c;
  c.vocab_size = 50;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.hidden_size = heads * head_dim;
  c.intermediate_size = inter;
  c.num_layers = 1;
  c.max_position_embeddings = 64;
  return c;
}

std::string creation_error(const model::ModelConfig& c, int tp, bool fully_sharded = false,
                           Device device = Device::cpu()) {
  model::DecoderOptions o;
  o.tensor_parallel_size = tp;
  o.fully_sharded_loras = fully_sharded;
  o.device = device;
  try {
    model::create_random_model(c, o, 1);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TensorParallelRefusals, ShapesThatCannotBeSplitNameTheValue) {
  const std::string heads = creation_error(small_config(6, 2, 8, 32), 4);
  EXPECT_TRUE(contains(heads, "tensor-parallel size 4") && contains(heads, "num_attention_heads 6"))
      << heads;
  const std::string kv = creation_error(small_config(6, 4, 8, 36), 3);
  EXPECT_TRUE(contains(kv, "tensor-parallel size 3") && contains(kv, "num_key_value_heads 4"))
      << kv;
  const std::string inter = creation_error(small_config(4, 2, 8, 30), 4);
  EXPECT_TRUE(contains(inter, "intermediate_size 30")) << inter;
  model::ModelConfig odd_hidden = small_config(2, 2, 8, 32);
  odd_hidden.hidden_size = 31;  // an explicit head_dim: hidden size and heads are independent
  const std::string hidden = creation_error(odd_hidden, 2, true);
  EXPECT_TRUE(contains(hidden, "hidden_size 31") && contains(hidden, "fully sharded")) << hidden;
  const std::string zero = creation_error(small_config(4, 2, 8, 32), 0);
  EXPECT_TRUE(contains(zero, "tensor-parallel size 0")) << zero;
  // The same shapes split where they can: KV heads replicated over ranks, or divided.
  EXPECT_EQ(creation_error(small_config(4, 2, 8, 32), 4), "");
  EXPECT_EQ(creation_error(small_config(8, 8, 4, 32), 4), "");
  EXPECT_EQ(creation_error(odd_hidden, 2, false), "");
}

TEST(TensorParallelRefusals, MoreRanksThanGpusNamesBoth) {
  const int present = cuda_device_count();
  const std::string e =
      creation_error(small_config(8, 8, 4, 32), present + 2, false, Device::cuda(0));
  EXPECT_TRUE(contains(e, "tensor-parallel size " + std::to_string(present + 2)) &&
              contains(e, std::to_string(present) + " CUDA device"))
      << e;
}

TEST(TensorParallelRefusals, ADecoderWithoutItsGroupIsRefused) {
  model::DecoderOptions o;
  o.tensor_parallel_size = 2;
  try {
    model::Decoder::load(fixture_dir("tiny-llama") + "/model", o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "tensor_parallel_size 2") && contains(e.what(), "load_model"))
        << e.what();
  }
}

// ---------------------------------------------------------------- failures mid-run

model::StepBatch one_prompt_step() {
  model::StepBatch b;
  model::SequenceStep s;
  s.tokens = {5, 17, 300, 42};
  s.blocks = {0, 1};
  s.sample = true;
  b.seqs.push_back(s);
  return b;
}

struct FaultyGroup {
  std::vector<std::unique_ptr<InProcessCommunicator>> inner;
  std::unique_ptr<FaultyCommunicator> faulty;
  std::unique_ptr<model::TensorParallelDecoder> model;
};

FaultyGroup faulty_group(FaultyCommunicator::Mode mode, double timeout_s) {
  FaultyGroup g;
  g.inner = InProcessCommunicator::create_group(2);
  g.faulty = std::make_unique<FaultyCommunicator>(*g.inner[1], mode);
  model::DecoderOptions o;
  o.tensor_parallel_size = 2;
  o.kv_blocks = 8;
  o.kv_block_size = 4;
  o.step_timeout_s = timeout_s;
  const std::string dir = fixture_dir("tiny-llama") + "/model";
  g.model = model::TensorParallelDecoder::create(
      model::ModelConfig::from_file(dir + "/config.json"), o,
      [dir](const model::DecoderOptions& rank) { return model::Decoder::load(dir, rank); },
      {g.inner[0].get(), g.faulty.get()});
  return g;
}

TEST(TensorParallelFailures, ARankThatFailsMidStepStopsTheGroup) {
  FaultyGroup g = faulty_group(FaultyCommunicator::Mode::kThrow, 60.0);
  const model::StepResult ok = g.model->execute(one_prompt_step());
  ASSERT_EQ(ok.token_ids.size(), 1u);
  // A batch the model refuses is not a failure of the group.
  model::StepBatch bad = one_prompt_step();
  bad.seqs[0].lora_slot = 7;
  EXPECT_THROW(g.model->execute(bad), Error);
  EXPECT_EQ(g.model->failure(), "");
  g.faulty->arm();
  try {
    g.model->execute(one_prompt_step());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "rank 1") && contains(e.what(), "injected device failure") &&
                contains(e.what(), "stopped"))
        << e.what();
  }
  EXPECT_NE(g.model->failure(), "");
  try {
    g.model->execute(one_prompt_step());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "stopped earlier")) << e.what();
  }
}

TEST(TensorParallelFailures, AStalledRankTimesOutInsteadOfHanging) {
  // Armed from the start: the short timeout would not fit a whole step under a sanitizer.
  FaultyGroup g = faulty_group(FaultyCommunicator::Mode::kStall, 0.3);
  g.faulty->arm();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g.model->execute(one_prompt_step());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "step_timeout_s 0.3") && contains(e.what(), "rank 1"))
        << e.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 10.0);
}

// ---------------------------------------------------------------- through the engine

engine::EngineOptions engine_options(int tp) {
  engine::EngineOptions o = small_engine_options();
  o.tensor_parallel_size = tp;
  return o;
}

std::unique_ptr<engine::Engine> tiny_llama_engine(const engine::EngineOptions& o,
                                                  std::shared_ptr<StepLog> log = nullptr) {
  return make_fixture_engine("tiny-llama", o, true, Device::cpu(), std::move(log));
}

std::vector<engine::RequestOutput> run_all(engine::Engine& e,
                                           std::vector<engine::Request> requests) {
  std::vector<engine::RequestOutput> out;
  for (engine::RequestHandle& h : e.submit_all(std::move(requests))) out.push_back(h.wait());
  return out;
}

// Prompts split over steps, sequences preempted and recomputed, adapters swapped in and out
// of two slots on every rank: still PEFT's tokens.
TEST(TensorParallelEngine, ChunksPreemptionAndSlotSwapsMatchPeft) {
  const auto expected = read_expected("tiny-llama");
  for (int tp : {2, 4}) {
    engine::EngineOptions o = engine_options(tp);
    o.max_num_batched_tokens = 5;
    o.num_kv_blocks = 14;
    o.max_loras = 2;
    o.lora_drain_after_s = 0.0;
    auto e = tiny_llama_engine(o);
    std::vector<engine::Request> requests;
    for (const ExpectedLine& x : expected) requests.push_back(fixture_request(x));
    const auto out = run_all(*e, std::move(requests));
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(out[i].finish_reason, engine::FinishReason::kLength) << out[i].error;
      EXPECT_EQ(out[i].token_ids, expected[i].output_token_ids) << "tp " << tp << " request " << i;
    }
    const engine::EngineMetrics m = e->metrics();
    EXPECT_GT(m.preemptions_total, 0) << "tp " << tp;
    EXPECT_LE(m.max_step_tokens, 5);
    EXPECT_LE(m.max_step_adapters, 2);
  }
}

// The group's launch returns once every rank has enqueued the step: the engine plans the next
// step while the ranks run, and feeds each rank's decode tokens from its own ids.
TEST(TensorParallelEngine, AsynchronousSchedulingOnAndOffMatchPeft) {
  const auto expected = read_expected("tiny-llama");
  for (const bool async : {true, false}) {
    engine::EngineOptions o = engine_options(2);
    o.async_scheduling = async;
    auto log = std::make_shared<StepLog>();
    auto e = tiny_llama_engine(o, log);
    std::vector<engine::Request> requests;
    for (const ExpectedLine& x : expected) requests.push_back(fixture_request(x));
    const auto out = run_all(*e, std::move(requests));
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(out[i].token_ids, expected[i].output_token_ids) << "async " << async << " " << i;
    }
    e.reset();
    EXPECT_EQ(log->fed_tokens > 0, async);
    EXPECT_EQ(log->launched_while_running > 0, async);
  }
}

// Seeded sampling and log-probabilities: the ranks sample the gathered logits with the same
// draws, so a sharded model samples what one device samples.
TEST(TensorParallelEngine, SamplingAndLogprobsEqualOneDevice) {
  const auto expected = read_expected("tiny-llama");
  std::vector<std::vector<engine::RequestOutput>> runs;
  for (int tp : {1, 2, 4}) {
    auto e = tiny_llama_engine(engine_options(tp));
    std::vector<engine::Request> requests;
    for (size_t i = 0; i < expected.size(); ++i) {
      engine::Request r = fixture_request(expected[i]);
      r.options.temperature = 0.9f;
      r.options.top_k = 40;
      r.options.top_p = 0.95f;
      r.options.seed = 100 + i;
      r.options.logprobs = true;
      requests.push_back(r);
    }
    runs.push_back(run_all(*e, std::move(requests)));
  }
  int differs_from_greedy = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    differs_from_greedy += runs[0][i].token_ids != expected[i].output_token_ids;
    for (size_t k = 1; k < runs.size(); ++k) {
      EXPECT_EQ(runs[k][i].token_ids, runs[0][i].token_ids) << "run " << k << " request " << i;
      ASSERT_EQ(runs[k][i].logprobs.size(), runs[0][i].logprobs.size());
      for (size_t j = 0; j < runs[0][i].logprobs.size(); ++j) {
        EXPECT_NEAR(runs[k][i].logprobs[j], runs[0][i].logprobs[j], 1e-4)
            << "run " << k << " request " << i << " token " << j;
      }
    }
  }
  EXPECT_GT(differs_from_greedy, 0) << "the sampled runs must not all be greedy";
}

TEST(TensorParallelEngine, AFailedRankEndsItsRequestsWithTheError) {
  FaultyGroup g = faulty_group(FaultyCommunicator::Mode::kThrow, 60.0);
  const std::string dir = fixture_dir("tiny-llama") + "/model";
  const model::ModelConfig config = g.model->config();
  // The limits the group was built for (faulty_group's options).
  engine::EngineOptions o = engine_options(2);
  o.num_kv_blocks = 8;
  o.max_num_batched_tokens = g.model->options().max_num_tokens;
  o.max_num_seqs = g.model->options().max_num_seqs;
  o.max_loras = 1;
  o.max_lora_rank = g.model->options().max_lora_rank;
  engine::Engine e(std::move(g.model), engine::read_tokenizer(dir),
                   engine::read_eos_token_ids(dir, config), o);
  engine::Request r;
  r.prompt_ids = {5, 17, 300, 42};
  r.options.max_tokens = 3;
  r.options.temperature = 0.0f;
  r.options.ignore_eos = true;
  EXPECT_EQ(e.submit(r).wait().finish_reason, engine::FinishReason::kLength);
  g.faulty->arm();
  const engine::RequestOutput failed = e.submit(r).wait();
  EXPECT_EQ(failed.finish_reason, engine::FinishReason::kError);
  EXPECT_TRUE(contains(failed.error, "rank 1") && contains(failed.error, "injected"))
      << failed.error;
  const engine::RequestOutput later = e.submit(r).wait();
  EXPECT_EQ(later.finish_reason, engine::FinishReason::kError);
  EXPECT_TRUE(contains(later.error, "stopped earlier")) << later.error;
}

}  // namespace
}  // namespace loraplex::test
