// Vocab-parallel embedding with LoRA and the logits processor with lm_head LoRA: double
// references written from PEFT's definitions, tensor-parallel sizes 1/2/4 (vocab 203 does
// not divide by 2 or 4), fully sharded vs not, reset and validation, GPU and NCCL variants.

#include <gtest/gtest.h>

#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>

#include "layers/layer_test_util.h"
#include "loraplex/core/device.h"
#include "loraplex/layers/logits_processor.h"
#include "loraplex/layers/vocab_embedding.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using test::Backend;

constexpr int kMaxLoras = 4;
constexpr int kMaxRank = 16;
constexpr int64_t kVocab = 203;
constexpr int64_t kHidden = 64;

struct Adapters {
  std::vector<std::pair<int, LoraSliceWeights>> installs;  // in order; the last per slot counts
};

// Slot 0 rank 16, slot 1 rank 9 then replaced by rank 5, slot 2 rank 3, slot 3 empty.
// `a_cols` / `b_rows` are the adapter's A columns and B rows.
Adapters make_adapters(int64_t a_cols, int64_t b_rows, std::mt19937_64& rng) {
  Adapters out;
  for (const auto& [slot, r] : std::vector<std::pair<int, int>>{{0, 16}, {1, 9}, {2, 3}, {1, 5}}) {
    out.installs.push_back({slot,
                            {test::random_tensor({r, a_cols}, DType::kF32, rng, 0.5f),
                             test::random_tensor({b_rows, r}, DType::kF32, rng, 0.3f)}});
  }
  return out;
}

std::map<int, LoraSliceWeights> final_adapters(const Adapters& ad) {
  std::map<int, LoraSliceWeights> out;
  for (const auto& [slot, w] : ad.installs) out[slot] = w;
  return out;
}

// ---------------------------------------------------------------- embedding

struct EmbeddingProblem {
  Tensor weight;  // [vocab, hidden]
  std::vector<int32_t> ids;
  std::vector<int32_t> slots;
  Adapters adapters;  // a = lora_embedding_A [r, vocab], b = lora_embedding_B [hidden, r]
};

EmbeddingProblem make_embedding_problem(uint64_t seed) {
  std::mt19937_64 rng(seed);
  EmbeddingProblem p;
  p.weight = test::random_tensor({kVocab, kHidden}, DType::kF32, rng);
  std::uniform_int_distribution<int32_t> id(0, kVocab - 1);
  const int tokens = 41;
  for (int t = 0; t < tokens; ++t) p.ids.push_back(id(rng));
  // Shard edges at tp 2 (102) and tp 4 (51, 102, 153) and both ends of the vocabulary.
  const int32_t edges[] = {0, 50, 51, 101, 102, 152, 153, 202};
  for (size_t i = 0; i < std::size(edges); ++i) p.ids[i * 5] = edges[i];
  p.slots = test::mixed_slots(tokens, kMaxLoras, rng);
  p.adapters = make_adapters(kVocab, kHidden, rng);
  return p;
}

// y[t] = W[id_t] + sum_j A[j, id_t] B[:, j] for the token's adapter (PEFT's embedding LoRA).
std::vector<double> embedding_reference(const EmbeddingProblem& p) {
  const std::vector<double> w = p.weight.to_double_vector();
  std::vector<double> y;
  for (int32_t id : p.ids)
    y.insert(y.end(), w.begin() + id * kHidden, w.begin() + (id + 1) * kHidden);
  for (const auto& [slot, ad] : final_adapters(p.adapters)) {
    const std::vector<double> a = ad.a.to_double_vector();
    const std::vector<double> b = ad.b.to_double_vector();
    const int64_t r = ad.a.size(0);
    for (size_t t = 0; t < p.ids.size(); ++t) {
      if (p.slots[t] != slot) continue;
      for (int64_t h = 0; h < kHidden; ++h) {
        double acc = 0.0;
        for (int64_t j = 0; j < r; ++j) acc += a[j * kVocab + p.ids[t]] * b[h * r + j];
        y[t * kHidden + h] += acc;
      }
    }
  }
  return y;
}

std::vector<double> run_embedding(const EmbeddingProblem& p, Backend backend, int tp,
                                  bool fully_sharded) {
  std::vector<std::vector<double>> outs(static_cast<size_t>(tp));
  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Device device = test::backend_device(backend, rank);
    const Stream stream = Stream::default_for(device);
    const int tokens = static_cast<int>(p.ids.size());
    PunicaWrapper punica(kMaxLoras, tokens, 4, device);
    punica.update_metadata(p.slots, {}, stream);
    VocabEmbeddingWithLora layer(kVocab, kHidden, DType::kF32,
                                 {kMaxLoras, kMaxRank, DType::kF32, fully_sharded}, comm, device,
                                 tokens);
    layer.load_base(p.weight);
    for (const auto& [slot, w] : p.adapters.installs) layer.set_lora(slot, {w});
    const Tensor ids = Tensor::from_vector(p.ids, {tokens}).to(device, stream);
    const Tensor y = layer.forward(ids, punica, stream);
    stream.synchronize();
    outs[static_cast<size_t>(rank)] = test::values_of(y);
  });
  for (int r = 1; r < tp; ++r) EXPECT_EQ(outs[static_cast<size_t>(r)], outs[0]) << "rank " << r;
  return outs[0];
}

void check_embedding(Backend backend, int tp, bool fully_sharded) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  const EmbeddingProblem p = make_embedding_problem(21 + tp);
  const std::vector<double> ref = embedding_reference(p);
  const std::vector<double> got = run_embedding(p, backend, tp, fully_sharded);
  EXPECT_LE(test::tolerance_ratio(got, ref, 1e-5, 1e-5 * test::max_abs(ref)), 1.0)
      << test::backend_name(backend) << " tp" << tp;
  if (tp > 1 || fully_sharded) {
    const std::vector<double> one =
        run_embedding(p, backend == Backend::kNccl ? Backend::kCuda : backend, 1, false);
    EXPECT_LE(test::tolerance_ratio(got, one, 1e-6, 1e-6 * test::max_abs(ref)), 1.0)
        << "tp" << tp << (fully_sharded ? " fully sharded" : "") << " vs the unsharded layer";
  }
}

TEST(VocabEmbeddingLora, MatchesDoubleReference_tp1) { check_embedding(Backend::kCpu, 1, false); }
TEST(VocabEmbeddingLora, MatchesDoubleReference_tp2) { check_embedding(Backend::kCpu, 2, false); }
TEST(VocabEmbeddingLora, MatchesDoubleReference_tp4) { check_embedding(Backend::kCpu, 4, false); }
TEST(VocabEmbeddingLora, FullyShardedMatchesNotSharded_tp2) {
  check_embedding(Backend::kCpu, 2, true);
}
TEST(VocabEmbeddingLora, FullyShardedMatchesNotSharded_tp4) {
  check_embedding(Backend::kCpu, 4, true);
}
TEST(VocabEmbeddingLora, Cuda_tp1) { check_embedding(Backend::kCuda, 1, false); }
TEST(VocabEmbeddingLora, Nccl_tp2) { check_embedding(Backend::kNccl, 2, false); }
TEST(VocabEmbeddingLora, NcclFullySharded_tp2) { check_embedding(Backend::kNccl, 2, true); }

void expect_error_containing(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(VocabEmbeddingLora, ResetAndRejectedSetLoraKeepState_tp2) {
  const EmbeddingProblem p = make_embedding_problem(5);
  for (bool fs : {false, true}) {
    test::run_ranks(Backend::kCpu, 2, [&](int, Communicator* comm) {
      const int tokens = static_cast<int>(p.ids.size());
      PunicaWrapper punica(kMaxLoras, tokens, 4, Device::cpu());
      punica.update_metadata(p.slots, {}, Stream());
      VocabEmbeddingWithLora layer(kVocab, kHidden, DType::kF32,
                                   {kMaxLoras, kMaxRank, DType::kF32, fs}, comm, Device::cpu(),
                                   tokens);
      layer.load_base(p.weight);
      const Tensor ids = Tensor::from_vector(p.ids, {tokens});
      const std::vector<double> base = test::values_of(layer.forward(ids, punica, Stream()));
      for (const auto& [slot, w] : p.adapters.installs) layer.set_lora(slot, {w});
      const std::vector<double> lora = test::values_of(layer.forward(ids, punica, Stream()));
      EXPECT_NE(lora, base);
      std::mt19937_64 rng(1);
      const Tensor a_bad = test::random_tensor({4, kVocab + 1}, DType::kF32, rng);
      const Tensor b = test::random_tensor({kHidden, 4}, DType::kF32, rng);
      expect_error_containing([&] { layer.set_lora(1, {{a_bad, b}}); }, "LoRA-A is [4, 204]");
      const Tensor a17 = test::random_tensor({17, kVocab}, DType::kF32, rng);
      const Tensor b17 = test::random_tensor({kHidden, 17}, DType::kF32, rng);
      expect_error_containing([&] { layer.set_lora(1, {{a17, b17}}); }, "max_lora_rank 16");
      EXPECT_EQ(layer.lora_rank(1), 5);
      EXPECT_EQ(test::values_of(layer.forward(ids, punica, Stream())), lora);
      for (int slot = 0; slot < kMaxLoras; ++slot) layer.reset_lora(slot);
      EXPECT_EQ(test::values_of(layer.forward(ids, punica, Stream())), base);
    });
  }
}

TEST(VocabEmbeddingLora, RejectsTokenOutsideVocabulary) {
  PunicaWrapper punica(kMaxLoras, 2, 2, Device::cpu());
  const std::vector<int32_t> slots{0, -1};
  punica.update_metadata(slots, {}, Stream());
  VocabEmbeddingWithLora layer(kVocab, kHidden, DType::kF32, {kMaxLoras, kMaxRank, DType::kF32},
                               nullptr, Device::cpu(), 2);
  std::mt19937_64 rng(2);
  layer.load_base(test::random_tensor({kVocab, kHidden}, DType::kF32, rng));
  const Tensor ids = Tensor::from_vector<int32_t>({3, static_cast<int32_t>(kVocab)}, {2});
  expect_error_containing([&] { layer.forward(ids, punica, Stream()); }, "outside the vocabulary");
}

// ---------------------------------------------------------------- logits

struct LogitsProblem {
  Tensor lm_head;  // [vocab, hidden]
  Tensor bias;     // [vocab]
  Tensor hidden;   // [seqs, hidden]
  std::vector<int32_t> token_slots;
  std::vector<int32_t> sampler_slots;
  Adapters adapters;  // a [r, hidden], b [vocab, r]
};

LogitsProblem make_logits_problem(uint64_t seed) {
  std::mt19937_64 rng(seed);
  LogitsProblem p;
  p.lm_head = test::random_tensor({kVocab, kHidden}, DType::kF32, rng, 0.5f);
  p.bias = test::random_tensor({kVocab}, DType::kF32, rng);
  p.hidden = test::random_tensor({9, kHidden}, DType::kF32, rng);
  p.sampler_slots = test::mixed_slots(9, kMaxLoras, rng);
  // A token mapping unrelated to the sampled rows: logits must use the sampler mapping.
  p.token_slots = test::mixed_slots(23, kMaxLoras, rng);
  p.adapters = make_adapters(kHidden, kVocab, rng);
  return p;
}

std::vector<double> logits_reference(const LogitsProblem& p) {
  std::vector<double> y = test::xwt_double(p.hidden, p.lm_head);
  const std::vector<double> b = p.bias.to_double_vector();
  for (int64_t s = 0; s < 9; ++s)
    for (int64_t v = 0; v < kVocab; ++v) y[s * kVocab + v] += b[v];
  for (const auto& [slot, ad] : final_adapters(p.adapters)) {
    test::add_lora_double(y, kVocab, 0, p.hidden, ad.a, ad.b, p.sampler_slots, slot);
  }
  return y;
}

std::vector<double> run_logits(const LogitsProblem& p, Backend backend, int tp,
                               bool fully_sharded) {
  std::vector<std::vector<double>> outs(static_cast<size_t>(tp));
  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Device device = test::backend_device(backend, rank);
    const Stream stream = Stream::default_for(device);
    PunicaWrapper punica(kMaxLoras, 23, 9, device);
    punica.update_metadata(p.token_slots, p.sampler_slots, stream);
    LogitsProcessorWithLora layer(kHidden, kVocab, DType::kF32,
                                  {kMaxLoras, kMaxRank, DType::kF32, fully_sharded}, comm, device,
                                  9);
    layer.load_base(p.lm_head, p.bias);
    for (const auto& [slot, w] : p.adapters.installs) layer.set_lora(slot, {w});
    const Tensor y = layer.forward(p.hidden.to(device, stream), punica, stream);
    stream.synchronize();
    outs[static_cast<size_t>(rank)] = test::values_of(y);
  });
  for (int r = 1; r < tp; ++r) EXPECT_EQ(outs[static_cast<size_t>(r)], outs[0]) << "rank " << r;
  return outs[0];
}

void check_logits(Backend backend, int tp, bool fully_sharded) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  const LogitsProblem p = make_logits_problem(31 + tp);
  const std::vector<double> ref = logits_reference(p);
  const std::vector<double> got = run_logits(p, backend, tp, fully_sharded);
  EXPECT_LE(test::tolerance_ratio(got, ref, 1e-4, 2e-5 * test::max_abs(ref)), 1.0)
      << test::backend_name(backend) << " tp" << tp;
  if (tp > 1 || fully_sharded) {
    const std::vector<double> one =
        run_logits(p, backend == Backend::kNccl ? Backend::kCuda : backend, 1, false);
    EXPECT_LE(test::tolerance_ratio(got, one, 2e-5, 2e-6 * test::max_abs(ref)), 1.0)
        << "tp" << tp << (fully_sharded ? " fully sharded" : "") << " vs the unsharded layer";
  }
}

TEST(LogitsLora, MatchesDoubleReference_tp1) { check_logits(Backend::kCpu, 1, false); }
TEST(LogitsLora, MatchesDoubleReference_tp2) { check_logits(Backend::kCpu, 2, false); }
TEST(LogitsLora, MatchesDoubleReference_tp4) { check_logits(Backend::kCpu, 4, false); }
TEST(LogitsLora, FullyShardedMatchesNotSharded_tp2) { check_logits(Backend::kCpu, 2, true); }
TEST(LogitsLora, FullyShardedMatchesNotSharded_tp4) { check_logits(Backend::kCpu, 4, true); }
TEST(LogitsLora, Cuda_tp1) { check_logits(Backend::kCuda, 1, false); }
TEST(LogitsLora, Nccl_tp2) { check_logits(Backend::kNccl, 2, false); }
TEST(LogitsLora, NcclFullySharded_tp2) { check_logits(Backend::kNccl, 2, true); }

TEST(LogitsLora, ResetAndRejectedSetLoraKeepState_tp2) {
  const LogitsProblem p = make_logits_problem(8);
  for (bool fs : {false, true}) {
    test::run_ranks(Backend::kCpu, 2, [&](int, Communicator* comm) {
      PunicaWrapper punica(kMaxLoras, 23, 9, Device::cpu());
      punica.update_metadata(p.token_slots, p.sampler_slots, Stream());
      LogitsProcessorWithLora layer(kHidden, kVocab, DType::kF32,
                                    {kMaxLoras, kMaxRank, DType::kF32, fs}, comm, Device::cpu(), 9);
      layer.load_base(p.lm_head, p.bias);
      const std::vector<double> base = test::values_of(layer.forward(p.hidden, punica, Stream()));
      for (const auto& [slot, w] : p.adapters.installs) layer.set_lora(slot, {w});
      const std::vector<double> lora = test::values_of(layer.forward(p.hidden, punica, Stream()));
      EXPECT_NE(lora, base);
      std::mt19937_64 rng(1);
      const Tensor a = test::random_tensor({4, kHidden}, DType::kF32, rng);
      const Tensor b_bad = test::random_tensor({kVocab - 1, 4}, DType::kF32, rng);
      expect_error_containing([&] { layer.set_lora(2, {{a, b_bad}}); }, "LoRA-B is [202, 4]");
      expect_error_containing([&] { layer.set_lora(2, {{a, Tensor()}}); }, "both be given");
      expect_error_containing([&] { layer.set_lora(-1, {{}}); }, "slot outside");
      EXPECT_EQ(layer.lora_rank(2), 3);
      EXPECT_EQ(test::values_of(layer.forward(p.hidden, punica, Stream())), lora);
      for (int slot = 0; slot < kMaxLoras; ++slot) layer.reset_lora(slot);
      EXPECT_EQ(test::values_of(layer.forward(p.hidden, punica, Stream())), base);
    });
  }
}

}  // namespace
}  // namespace loraplex
