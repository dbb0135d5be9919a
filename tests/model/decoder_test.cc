// The decoder's step on random weights of a tiny shape: a prompt run whole or in chunks gives
// the same tokens, a mixed batch gives what each sequence gives alone, the Qwen3 benchmark
// shapes' families run at a small size, and on a GPU the CUDA-graph decode steps give the same
// tokens as eager steps and as the CPU (float32).

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/adapters/peft_adapter.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/model_shapes.h"
#include "loraplex/model/random_adapter.h"
#include "support/gpu_check.h"

namespace loraplex::model {
namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 512;
  c.eos_token_ids = {1};
  return c;
}

// Mixtral's layout at tiny_config()'s sizes: 8 experts, top 2.
ModelConfig tiny_moe_config() {
  ModelConfig c = tiny_config();
  c.arch = Architecture::kMixtral;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  return c;
}

std::unique_ptr<Decoder> make(Device device, DType dtype, bool graphs = true, bool moe = false) {
  DecoderOptions o;
  o.dtype = dtype;
  o.device = device;
  o.max_num_tokens = 128;
  o.max_num_seqs = 8;
  o.kv_blocks = 64;
  o.kv_block_size = 16;
  o.cuda_graphs = graphs;
  return Decoder::create_random(moe ? tiny_moe_config() : tiny_config(), o, 1234);
}

std::vector<int32_t> prompt(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t& t : p) t = static_cast<int32_t>(2 + rng() % 998);
  return p;
}

// A sequence's state for a greedy run: its tokens so far and its blocks.
struct Seq {
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;
  int32_t cached = 0;  // positions already in the cache
};

// Runs `chunk` prompt tokens at a time (0 = whole prompt), then `steps` decodes, all sequences
// in one batch; returns every sequence's generated tokens.
std::vector<std::vector<int32_t>> generate(Decoder& d, std::vector<Seq> seqs, int chunk,
                                           int steps) {
  std::vector<std::vector<int32_t>> out(seqs.size());
  std::vector<size_t> prompt_len(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) prompt_len[i] = seqs[i].tokens.size();
  while (true) {
    StepBatch batch;
    std::vector<size_t> which;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      if (out[i].size() >= static_cast<size_t>(steps)) continue;
      SequenceStep q;
      const size_t left = s.tokens.size() - static_cast<size_t>(s.cached);
      const size_t take = s.cached < static_cast<int32_t>(prompt_len[i]) && chunk > 0
                              ? std::min(left, static_cast<size_t>(chunk))
                              : left;
      q.tokens.assign(s.tokens.begin() + s.cached,
                      s.tokens.begin() + s.cached + static_cast<std::ptrdiff_t>(take));
      q.start_position = s.cached;
      q.blocks = s.blocks;
      q.sample = s.cached + static_cast<int32_t>(take) == static_cast<int32_t>(s.tokens.size());
      s.cached += static_cast<int32_t>(take);
      batch.seqs.push_back(q);
      which.push_back(i);
    }
    if (batch.seqs.empty()) break;
    const StepResult r = d.execute(batch);
    size_t k = 0;
    for (size_t j = 0; j < which.size(); ++j) {
      if (!batch.seqs[j].sample) continue;
      out[which[j]].push_back(r.token_ids[k]);
      seqs[which[j]].tokens.push_back(r.token_ids[k]);
      ++k;
    }
  }
  return out;
}

// generate(d, seqs, 0, steps) with every decode launched before the step before it is
// collected, as the engine's asynchronous scheduling runs them: each decode's token is fed on
// the device from the previous step's ids (SequenceStep::feed_row).
std::vector<std::vector<int32_t>> generate_pipelined(Decoder& d, const std::vector<Seq>& seqs,
                                                     int steps) {
  std::vector<std::vector<int32_t>> out(seqs.size());
  StepBatch prefill;
  for (const Seq& s : seqs) {
    SequenceStep q;
    q.tokens = s.tokens;
    q.blocks = s.blocks;
    q.sample = true;
    prefill.seqs.push_back(q);
  }
  d.launch(prefill);
  const auto take = [&](const StepResult& r) {
    for (size_t i = 0; i < seqs.size(); ++i) out[i].push_back(r.token_ids.at(i));
  };
  for (int step = 1; step < steps; ++step) {
    StepBatch decode;
    for (size_t i = 0; i < seqs.size(); ++i) {
      SequenceStep q;
      q.tokens = {-1};  // not known here: fed
      q.feed_row = static_cast<int32_t>(i);
      q.start_position = static_cast<int32_t>(seqs[i].tokens.size()) + step - 1;
      q.blocks = seqs[i].blocks;
      q.sample = true;
      decode.seqs.push_back(q);
    }
    d.launch(decode);
    take(d.collect());  // the step before
  }
  take(d.collect());
  return out;
}

std::vector<Seq> three_sequences() {
  std::vector<Seq> seqs(3);
  const int lens[3] = {37, 5, 16};
  int32_t next_block = 3;
  for (int i = 0; i < 3; ++i) {
    seqs[i].tokens = prompt(lens[i], 100 + static_cast<uint64_t>(i));
    for (int b = 0; b < 4; ++b) seqs[i].blocks.push_back(next_block++ * 2 % 64);
  }
  return seqs;
}

TEST(RandomDecoder, ChunkedPrefillAndBatchingGiveTheSameTokens) {
  auto d = make(Device::cpu(), DType::kF32);
  const std::vector<Seq> seqs = three_sequences();
  const auto whole = generate(*d, seqs, 0, 6);
  EXPECT_EQ(generate(*d, seqs, 7, 6), whole);
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(generate(*d, {seqs[i]}, 0, 6)[0], whole[i]) << "sequence " << i << " alone";
  }
  // The same seed gives the same model.
  auto again = make(Device::cpu(), DType::kF32);
  EXPECT_EQ(generate(*again, seqs, 0, 6), whole);
}

TEST(RandomDecoder, PipelinedDecodesTakeTheirTokensFromTheStepBefore) {
  auto d = make(Device::cpu(), DType::kF32);
  const std::vector<Seq> seqs = three_sequences();
  EXPECT_EQ(generate_pipelined(*d, seqs, 6), generate(*d, seqs, 0, 6));
}

TEST(RandomDecoder, LaunchesAreBoundedAndFeedRowsChecked) {
  auto d = make(Device::cpu(), DType::kF32);
  StepBatch b;
  SequenceStep q;
  q.tokens = {-1};
  q.feed_row = 0;
  q.blocks = {0};
  q.sample = true;
  b.seqs.push_back(q);
  // Nothing launched yet: no ids to feed from.
  EXPECT_THROW(d->launch(b), Error);
  b.seqs[0].tokens = {5};
  b.seqs[0].feed_row = -1;
  d->launch(b);
  b.seqs[0].start_position = 1;
  b.seqs[0].tokens = {-1};
  b.seqs[0].feed_row = 1;  // the step before sampled one row
  EXPECT_THROW(d->launch(b), Error);
  b.seqs[0].feed_row = 0;
  d->launch(b);
  b.seqs[0].start_position = 2;
  EXPECT_THROW(d->launch(b), Error) << "a third step in flight";
  const StepResult first = d->collect();
  const StepResult second = d->collect();
  ASSERT_EQ(first.token_ids.size(), 1u);
  ASSERT_EQ(second.token_ids.size(), 1u);
  EXPECT_THROW(d->collect(), Error) << "nothing left to collect";
  // The same two steps with the token known on the host.
  auto again = make(Device::cpu(), DType::kF32);
  b.seqs[0].start_position = 0;
  b.seqs[0].tokens = {5};
  b.seqs[0].feed_row = -1;
  EXPECT_EQ(again->execute(b).token_ids, first.token_ids);
  b.seqs[0].start_position = 1;
  b.seqs[0].tokens = first.token_ids;
  EXPECT_EQ(again->execute(b).token_ids, second.token_ids);
}

TEST(RandomDecoder, BadBatchesAreNamed) {
  auto d = make(Device::cpu(), DType::kF32);
  StepBatch b;
  SequenceStep q;
  q.tokens = {5, 6, 7};
  q.blocks = {0};
  q.start_position = 15;  // reaches position 17: block 0 holds 16
  b.seqs.push_back(q);
  EXPECT_THROW(d->execute(b), Error);
  b.seqs[0].start_position = 0;
  b.seqs[0].tokens = {5, 1000};
  EXPECT_THROW(d->execute(b), Error);
  b.seqs[0].tokens = {5};
  b.seqs[0].lora_slot = 3;
  EXPECT_THROW(d->execute(b), Error);
}

TEST(RandomDecoder, RandomPeftAdaptersLoadAndMoveTheOutput) {
  DecoderOptions o;
  o.max_loras = 2;
  o.max_lora_rank = 8;
  o.max_num_tokens = 64;
  o.max_num_seqs = 4;
  o.kv_blocks = 16;
  const ModelConfig c = model_shape("tiny");
  auto d = Decoder::create_random(c, o, 9);
  const std::string dir = ::testing::TempDir() + "/loraplex_random_adapter";
  write_random_peft_adapter(dir, c, 8, all_linear_targets(), 3);
  AdapterManagerConfig mc;
  mc.max_loras = 2;
  mc.max_lora_rank = 8;
  AdapterManager manager(d->targets(), mc);
  const AdapterInfo info = manager.load("r", dir);
  EXPECT_EQ(info.rank, 8);
  EXPECT_EQ(info.modules.size(), 7u * static_cast<size_t>(c.num_layers));
  AdapterManager::Lease lease = manager.acquire("r");
  Seq s;
  s.tokens = prompt(20, 5);
  s.blocks = {0, 1, 2, 3};
  const auto base = generate(*d, {s}, 0, 8);
  // The same request once without and once with the adapter, in one batch.
  Seq with = s;
  with.blocks = {4, 5, 6, 7};
  StepBatch batch;
  for (const Seq* q : {&s, &with}) {
    SequenceStep step;
    step.tokens = q->tokens;
    step.blocks = q->blocks;
    step.sample = true;
    step.lora_slot = q == &with ? lease.slot() : -1;
    batch.seqs.push_back(step);
  }
  batch.want_logprobs = true;
  const StepResult r = d->execute(batch);
  EXPECT_EQ(r.token_ids[0], base[0][0]);
  ASSERT_EQ(r.logprobs.size(), 2u);
  EXPECT_NE(r.logprobs[0], r.logprobs[1]) << "the adapter changed nothing";
  EXPECT_THROW(write_random_peft_adapter(dir + "x", c, 8, {"qkv"}, 1), Error);
}

// One adapter slot of rank up to 4, 64 tokens and 4 sequences a step, 16 KV blocks.
DecoderOptions one_slot_options() {
  DecoderOptions o;
  o.max_loras = 1;
  o.max_lora_rank = 4;
  o.max_num_tokens = 64;
  o.max_num_seqs = 4;
  o.kv_blocks = 16;
  return o;
}

AdapterManagerConfig one_slot_manager() {
  AdapterManagerConfig mc;
  mc.max_loras = 1;
  mc.max_lora_rank = 4;
  return mc;
}

// One step with `s` twice, without and with the adapter in `slot` (greedy, log-probabilities).
StepResult without_and_with(Decoder& d, const Seq& s, int32_t slot) {
  StepBatch b;
  for (int32_t k : {-1, slot}) {
    SequenceStep q;
    q.tokens = s.tokens;
    q.blocks = k < 0 ? std::vector<int32_t>{2, 3} : std::vector<int32_t>{4, 5};
    q.lora_slot = k;
    q.sample = true;
    b.seqs.push_back(q);
  }
  b.want_logprobs = true;
  return d.execute(b);
}

// The Qwen3 benchmark shapes are the published models', and the same families at a small size
// run on the CPU from random weights, with a random adapter on every linear projection (the
// experts' for Qwen3-MoE); the decode floor's byte count is what the decoder uploads.
TEST(RandomDecoder, Qwen3ShapesAndTheirFamiliesAtTinyScale) {
  const ModelConfig dense = model_shape("qwen3-8b");
  EXPECT_EQ(dense.arch, Architecture::kQwen3);
  EXPECT_EQ(std::vector<int64_t>({dense.hidden_size, dense.num_layers, dense.num_heads,
                                  dense.num_kv_heads, dense.head_dim, dense.intermediate_size,
                                  dense.vocab_size}),
            std::vector<int64_t>({4096, 36, 32, 8, 128, 12288, 151936}));
  EXPECT_TRUE(dense.qk_norm);
  EXPECT_FALSE(dense.is_moe());
  const ModelConfig moe = model_shape("qwen3-30b-a3b");
  EXPECT_EQ(moe.arch, Architecture::kQwen3Moe);
  EXPECT_EQ(std::vector<int64_t>({moe.hidden_size, moe.num_layers, moe.num_heads, moe.num_kv_heads,
                                  moe.head_dim, moe.num_experts, moe.num_experts_per_tok,
                                  moe.intermediate_size, moe.vocab_size}),
            std::vector<int64_t>({2048, 48, 32, 4, 128, 128, 8, 768, 151936}));
  EXPECT_TRUE(moe.qk_norm);
  EXPECT_TRUE(moe.moe_renormalize);
  EXPECT_EQ(model_shape("qwen3-30b-a3b", 3).num_layers, 3);
  for (ModelConfig c : {dense, moe}) {
    c.vocab_size = 300;
    c.hidden_size = 64;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 32;
    c.intermediate_size = c.is_moe() ? 32 : 96;
    if (c.is_moe()) c.num_experts = 8;
    c.max_position_embeddings = 256;
    const std::string name = architecture_name(c.arch);
    auto d = Decoder::create_random(c, one_slot_options(), 5);
    EXPECT_EQ(d->weight_bytes(), decode_weight_bytes(c, DType::kF32) + c.vocab_size * 64 * 4)
        << name;
    Seq s;
    s.tokens = prompt(19, 8);
    for (int32_t& t : s.tokens) t %= 300;
    s.blocks = {0, 1};
    const auto whole = generate(*d, {s}, 0, 5);
    EXPECT_EQ(generate(*d, {s}, 4, 5), whole) << name;
    const std::string dir = ::testing::TempDir() + "/loraplex_random_" + name;
    write_random_peft_adapter(dir, c, 4, all_linear_targets(c), 6);
    AdapterManager manager(d->targets(), one_slot_manager());
    const AdapterInfo info = manager.load("r", dir);
    EXPECT_EQ(info.modules.size(),
              static_cast<size_t>(c.num_layers * (4 + 3 * (c.is_moe() ? c.num_experts : 1))))
        << name;
    AdapterManager::Lease lease = manager.acquire("r");
    const StepResult r = without_and_with(*d, s, lease.slot());
    EXPECT_EQ(r.token_ids[0], whole[0][0]) << name;
    EXPECT_GT(std::abs(r.logprobs[0] - r.logprobs[1]), 1e-5)
        << name << ": the adapter changed nothing";
  }
}

// The *-fp8 shapes are FP8-dynamic checkpoints of the same models: float8_e4m3 projections with
// per-channel scales, about half the bytes a bf16 decode step reads. tiny-fp8 runs on the CPU
// from random codes and scales, with LoRA beside the fp8 base.
TEST(RandomDecoder, Fp8ShapesHaveFp8ProjectionsAndRunWithLora) {
  const ModelConfig big = model_shape("llama3-8b-fp8");
  EXPECT_TRUE(big.quant.quantized());
  EXPECT_EQ(big.quant.weight_scale, Fp8WeightScale::kPerChannel);
  EXPECT_EQ(big.hidden_size, model_shape("llama3-8b").hidden_size);
  const double ratio =
      static_cast<double>(decode_weight_bytes(big, DType::kBF16)) /
      static_cast<double>(decode_weight_bytes(model_shape("llama3-8b"), DType::kBF16));
  EXPECT_GT(ratio, 0.5);
  EXPECT_LT(ratio, 0.6);  // the bf16 lm_head is 1 GB of the 8B model's 16
  EXPECT_TRUE(model_shape("llama3-70b-fp8", 2).quant.quantized());

  const ModelConfig c = model_shape("tiny-fp8");
  const DecoderOptions o = one_slot_options();
  auto d = Decoder::create_random(c, o, 11);
  // Uploaded: fp8 projections (their scales go separately), f32 norms, lm_head and embedding.
  const int64_t h = c.hidden_size;
  const int64_t rows = c.q_size() + 2 * c.kv_size() + h + 2 * c.intermediate_size + h;
  EXPECT_EQ(d->weight_bytes(),
            decode_weight_bytes(c, DType::kF32) - 4 * rows * c.num_layers + c.vocab_size * h * 4);
  Seq s;
  s.tokens = prompt(19, 8);
  s.blocks = {0, 1};
  const auto whole = generate(*d, {s}, 0, 5);
  EXPECT_EQ(generate(*d, {s}, 4, 5), whole);
  EXPECT_NE(whole, generate(*Decoder::create_random(model_shape("tiny"), o, 11), {s}, 0, 5))
      << "the fp8 codes and scales are not the float model's weights";
  const std::string dir = ::testing::TempDir() + "/loraplex_random_fp8";
  write_random_peft_adapter(dir, c, 4, all_linear_targets(c), 6);
  AdapterManager manager(d->targets(), one_slot_manager());
  manager.load("r", dir);
  AdapterManager::Lease lease = manager.acquire("r");
  const StepResult r = without_and_with(*d, s, lease.slot());
  EXPECT_EQ(r.token_ids[0], whole[0][0]);
  EXPECT_GT(std::abs(r.logprobs[0] - r.logprobs[1]), 1e-5) << "the adapter changed nothing";
}

TEST(RandomDecoderCuda, GraphStepsEqualEagerStepsAndTheCpu) {
  LORAPLEX_REQUIRE_GPU();
  const std::vector<Seq> seqs = three_sequences();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto graphs = make(Device::cuda(0), dt, true);
    auto eager = make(Device::cuda(0), dt, false);
    const auto g = generate(*graphs, seqs, 0, 8);
    EXPECT_TRUE(graphs->last_step().graph);
    EXPECT_EQ(graphs->last_step().padded_tokens, 4);
    EXPECT_FALSE(eager->last_step().graph);
    EXPECT_EQ(g, generate(*eager, seqs, 0, 8)) << dtype_name(dt);
    // Replays of captured graphs with other contents (one sequence fewer: bucket 2).
    EXPECT_EQ(generate(*graphs, {seqs[0], seqs[2]}, 0, 8),
              generate(*eager, {seqs[0], seqs[2]}, 0, 8));
    if (dt == DType::kF32) {
      EXPECT_EQ(g, generate(*make(Device::cpu(), dt), seqs, 0, 8));
    }
  }
}

// MoE decode steps route on the device, so they are captured too; graph, eager and the CPU
// (which routes on the host) give the same tokens.
TEST(RandomDecoderCuda, MoeGraphStepsEqualEagerStepsAndTheCpu) {
  LORAPLEX_REQUIRE_GPU();
  const std::vector<Seq> seqs = three_sequences();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto graphs = make(Device::cuda(0), dt, true, true);
    auto eager = make(Device::cuda(0), dt, false, true);
    const auto g = generate(*graphs, seqs, 0, 8);
    EXPECT_TRUE(graphs->last_step().graph) << dtype_name(dt);
    EXPECT_FALSE(eager->last_step().graph);
    EXPECT_EQ(g, generate(*eager, seqs, 0, 8)) << dtype_name(dt);
    EXPECT_EQ(generate(*graphs, {seqs[0], seqs[2]}, 0, 8),
              generate(*eager, {seqs[0], seqs[2]}, 0, 8));
    if (dt == DType::kF32) {
      EXPECT_EQ(g, generate(*make(Device::cpu(), dt, true, true), seqs, 0, 8));
    }
  }
}

// The MoE layer stages its expert weights on the host before uploading them, so the loader
// leaves exactly those in pageable memory (pinning is a slow driver call: a 128-expert adapter
// is mostly expert weights) and pins the rest, which is uploaded straight from the packing.
TEST(RandomDecoderCuda, PackedExpertWeightsArePageableAndTheRestPinned) {
  LORAPLEX_REQUIRE_GPU();
  auto d = make(Device::cuda(0), DType::kBF16, false, true);
  const ModelConfig c = tiny_moe_config();
  const std::string dir = ::testing::TempDir() + "/loraplex_moe_pinning_adapter";
  write_random_peft_adapter(dir, c, 8, all_linear_targets(c), 3);
  AdapterLoadOptions o;
  o.max_lora_rank = 8;
  o.dtype = DType::kBF16;
  o.pinned = true;
  const PackedAdapter packed = load_peft_adapter("a", dir, d->targets(), o);
  int staged = 0;
  int pinned = 0;
  for (const LoraTarget& t : d->targets().targets()) {
    EXPECT_EQ(t.staged_on_host, t.module.find(".experts") != std::string::npos) << t.module;
    const auto& layer = packed.layers[d->targets().layer_index(t)];
    if (layer.empty() || !layer[static_cast<size_t>(t.slice)].a.defined()) continue;
    const LoraSliceWeights& w = layer[static_cast<size_t>(t.slice)];
    EXPECT_EQ(w.a.is_pinned(), !t.staged_on_host) << t.module;
    EXPECT_EQ(w.b.is_pinned(), !t.staged_on_host) << t.module;
    ++(t.staged_on_host ? staged : pinned);
  }
  EXPECT_EQ(staged, 3 * c.num_experts * c.num_layers);
  EXPECT_EQ(pinned, 4 * c.num_layers);
}

// Decode graphs fed from the step before (captured on their first, pipelined use, whose eager
// warm-up run and replay read the same fed tokens) give the eager steps' tokens.
TEST(RandomDecoderCuda, PipelinedGraphStepsTakeTheirTokensFromTheStepBefore) {
  LORAPLEX_REQUIRE_GPU();
  const std::vector<Seq> seqs = three_sequences();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto graphs = make(Device::cuda(0), dt, true);
    auto eager = make(Device::cuda(0), dt, false);
    const auto want = generate(*eager, seqs, 0, 8);
    EXPECT_EQ(generate_pipelined(*graphs, seqs, 8), want) << dtype_name(dt);
    EXPECT_TRUE(graphs->last_step().graph);
    EXPECT_EQ(generate_pipelined(*graphs, seqs, 8), want) << dtype_name(dt) << ", replayed";
    EXPECT_EQ(generate_pipelined(*eager, seqs, 8), want) << dtype_name(dt) << ", eager";
  }
}

}  // namespace
}  // namespace loraplex::model
