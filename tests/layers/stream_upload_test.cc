// The stream overloads of set_lora / reset_lora (the adapter manager's asynchronous upload)
// against the synchronous ones, for every LoRA layer kind. Two identical layers get the same
// adapters, one through set_lora(slot, slices), the other through set_lora(slot, slices,
// copy_stream); slot ranks, weight stacks and outputs must be identical. On the CPU (and at
// tensor-parallel size 2, fully sharded) the stream path stages on the host; on a GPU its
// sources are pinned and in lora_dtype, so the weights are copied on the copy stream without
// a host wait and the compute stream waits for an event, while the synchronous layer gets
// pageable float32 sources (the staging path). A rejected stream set_lora changes nothing.

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>

#include "layers/layer_test_util.h"
#include "loraplex/core/allocator.h"
#include "loraplex/core/device.h"
#include "loraplex/layers/fused_moe.h"
#include "loraplex/layers/logits_processor.h"
#include "loraplex/layers/lora_linear.h"
#include "loraplex/layers/vocab_embedding.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using test::Backend;

constexpr int kMaxLoras = 4;
constexpr int kMaxRank = 16;
constexpr int kTokens = 23;

// Where the twin layers run: the device, a copy stream for the uploads and a compute stream.
struct Target {
  explicit Target(Device d)
      : device(d),
        copy(d.is_cuda() ? Stream::create(d) : Stream()),
        compute(d.is_cuda() ? Stream::create(d) : Stream()) {}
  Device device;
  Stream copy;
  Stream compute;

  // The compute stream waits for everything enqueued on the copy stream (Lease::wait_ready).
  void publish() const {
    if (!device.is_cuda()) return;
    Event uploaded;
    uploaded.record(copy);
    uploaded.wait_on(compute);
  }
  std::vector<double> values(const Tensor& t) const {
    compute.synchronize();
    return test::values_of(t);
  }
};

// What the stream path is given: in `dtype`, pinned when the layer is on a GPU.
Tensor stream_source(const Tensor& t, DType dtype, Device device) {
  if (!t.defined()) return t;
  Tensor out = device.is_cuda()
                   ? Tensor::empty_with(t.shape(), dtype, Device::cpu(), pinned_host_allocator())
                   : Tensor::empty(t.shape(), dtype);
  out.copy_from(t);
  return out;
}

// What the synchronous path is given: pageable float32 (converted by the layer).
Tensor sync_source(const Tensor& t) { return t.defined() ? t.to(DType::kF32) : t; }

std::vector<LoraSliceWeights> convert(const std::vector<LoraSliceWeights>& slices,
                                      const std::function<Tensor(const Tensor&)>& fn) {
  std::vector<LoraSliceWeights> out;
  for (const LoraSliceWeights& w : slices) out.push_back({fn(w.a), fn(w.b)});
  return out;
}

// One step of the install sequence: set `slices` into `slot`, or reset it when empty.
struct Install {
  int slot;
  std::vector<LoraSliceWeights> slices;
};

// Slot 0 at max rank; slot 1 rank 9, then a second adapter of rank 5 (7, ...); slot 2 rank 3
// with its first slice untargeted, reset, then installed again; slot 3 never (base only).
std::vector<Install> install_sequence(
    const std::function<std::vector<LoraSliceWeights>(const std::vector<int>&)>& make,
    int num_slices) {
  auto ranks = [&](const std::function<int(int)>& r) {
    std::vector<int> out;
    for (int s = 0; s < num_slices; ++s) out.push_back(r(s));
    return out;
  };
  std::vector<Install> seq;
  seq.push_back({0, make(ranks([](int) { return kMaxRank; }))});
  seq.push_back({1, make(ranks([](int) { return 9; }))});
  seq.push_back({2, make(ranks([&](int s) { return s == 0 && num_slices > 1 ? 0 : 3; }))});
  seq.push_back({1, make(ranks([](int s) { return 5 + 2 * s; }))});
  seq.push_back({2, {}});
  seq.push_back({2, make(ranks([](int s) { return 4 + s; }))});
  return seq;
}

// Installs the sequence into both layers, the one synchronously, the other on the copy stream.
template <typename Layer, typename Slices>
void install_both(Layer& sync_layer, Layer& stream_layer, const std::vector<Install>& seq,
                  const std::function<Slices(const std::vector<LoraSliceWeights>&, bool)>& as,
                  const Target& target) {
  for (const Install& step : seq) {
    if (step.slices.empty()) {
      sync_layer.reset_lora(step.slot);
      stream_layer.reset_lora(step.slot, target.copy);
    } else {
      sync_layer.set_lora(step.slot, as(step.slices, false));
      stream_layer.set_lora(step.slot, as(step.slices, true), target.copy);
    }
  }
  target.publish();
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------ LoraLinear

int lora_slices(const LinearSpec& spec) {
  return spec.fused_lora ? 1 : static_cast<int>(spec.outputs.size());
}

int64_t lora_out(const LinearSpec& spec, int s) {
  if (!spec.fused_lora) return spec.outputs[static_cast<size_t>(s)].size;
  int64_t total = 0;
  for (const OutputSlice& o : spec.outputs) total += o.size;
  return total;
}

void check_linear(const LinearSpec& spec, Backend backend, int tp, bool fully_sharded) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  std::mt19937_64 rng(11 + tp);
  const DType dt = spec.dtype;
  std::vector<Tensor> weights;
  for (const OutputSlice& o : spec.outputs) {
    weights.push_back(test::random_tensor({o.size, spec.in_features}, dt, rng, 0.5f));
  }
  const Tensor x_full = test::random_tensor({kTokens, spec.in_features}, dt, rng);
  const std::vector<int32_t> slots = test::mixed_slots(kTokens, kMaxLoras, rng);
  const std::vector<Install> seq = install_sequence(
      [&](const std::vector<int>& ranks) {
        std::vector<LoraSliceWeights> slices;
        for (int s = 0; s < lora_slices(spec); ++s) {
          const int r = ranks[static_cast<size_t>(s)];
          if (r == 0) {
            slices.push_back({});
            continue;
          }
          slices.push_back({test::random_tensor({r, spec.in_features}, dt, rng, 0.5f),
                            test::random_tensor({lora_out(spec, s), r}, dt, rng, 0.2f)});
        }
        return slices;
      },
      lora_slices(spec));

  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Target target(test::backend_device(backend, rank));
    const LoraConfig cfg{kMaxLoras, kMaxRank, dt, fully_sharded};
    PunicaWrapper punica(kMaxLoras, kTokens, 1, target.device);
    punica.update_metadata(slots, {}, target.compute);
    LoraLinear sync_layer(spec, cfg, comm, target.device, kTokens);
    LoraLinear stream_layer(spec, cfg, comm, target.device, kTokens);
    sync_layer.load_base(weights);
    stream_layer.load_base(weights);
    install_both<LoraLinear, std::vector<LoraSliceWeights>>(
        sync_layer, stream_layer, seq,
        [&](const std::vector<LoraSliceWeights>& s, bool stream) {
          return stream
                     ? convert(s,
                               [&](const Tensor& t) { return stream_source(t, dt, target.device); })
                     : convert(s, sync_source);
        },
        target);
    for (int slot = 0; slot < kMaxLoras; ++slot) {
      for (int s = 0; s < sync_layer.num_lora_slices(); ++s) {
        EXPECT_EQ(stream_layer.lora_rank(slot, s), sync_layer.lora_rank(slot, s))
            << "slot " << slot << " slice " << s;
        // One slot at a time: a layer's A stack is a view of its weight storage, slots apart.
        EXPECT_EQ(target.values(stream_layer.lora_a(s).select(0, slot)),
                  target.values(sync_layer.lora_a(s).select(0, slot)));
        EXPECT_EQ(target.values(stream_layer.lora_b(s).select(0, slot)),
                  target.values(sync_layer.lora_b(s).select(0, slot)));
      }
    }
    Tensor x = x_full;
    if (spec.style == ParallelStyle::kRow) {
      const int64_t w = spec.in_features / tp;
      x = x_full.narrow(1, rank * w, w).contiguous();
    }
    x = x.to(target.device, target.compute);
    const std::vector<double> want = target.values(sync_layer.forward(x, punica, target.compute));
    const std::vector<double> got = target.values(stream_layer.forward(x, punica, target.compute));
    EXPECT_EQ(got, want) << spec.kind << " rank " << rank;
  });
}

LinearSpec merged_qkv(DType dt) { return LinearSpec::qkv(64, 8, 8, 2, dt); }
LinearSpec qkv_fused(DType dt) { return LinearSpec::qkv(64, 8, 8, 2, dt, QkvLora::kFusedLora); }
LinearSpec gate_up(DType dt) { return LinearSpec::merged_column(48, {80, 80}, dt); }
LinearSpec row(DType dt) { return LinearSpec::row(96, 40, dt); }

TEST(LoraLinearStreamUpload, MergedQkvMatchesSync) {
  check_linear(merged_qkv(DType::kF32), Backend::kCpu, 1, false);
}
TEST(LoraLinearStreamUpload, FusedQkvMatchesSync_tp2) {
  check_linear(qkv_fused(DType::kBF16), Backend::kCpu, 2, false);
}
TEST(LoraLinearStreamUpload, RowMatchesSync_tp2) {
  check_linear(row(DType::kF32), Backend::kCpu, 2, false);
}
TEST(LoraLinearStreamUpload, FullyShardedMatchesSync_tp2) {
  check_linear(gate_up(DType::kF32), Backend::kCpu, 2, true);
  check_linear(row(DType::kF32), Backend::kCpu, 2, true);
}
TEST(LoraLinearStreamUpload, PinnedOnCopyStreamMatchesSync_Cuda) {
  check_linear(merged_qkv(DType::kBF16), Backend::kCuda, 1, false);
  check_linear(qkv_fused(DType::kBF16), Backend::kCuda, 1, false);
  check_linear(gate_up(DType::kF16), Backend::kCuda, 1, false);
  check_linear(row(DType::kBF16), Backend::kCuda, 1, false);
  check_linear(gate_up(DType::kBF16), Backend::kCuda, 1, true);
}

TEST(LoraLinearStreamUpload, RejectedAdapterLeavesSlotUnchanged) {
  std::mt19937_64 rng(3);
  const LinearSpec spec = merged_qkv(DType::kF32);
  LoraLinear layer(spec, {kMaxLoras, kMaxRank, DType::kF32, false}, nullptr, Device::cpu(),
                   kTokens);
  std::vector<Tensor> weights;
  for (const OutputSlice& o : spec.outputs)
    weights.push_back(test::random_tensor({o.size, 64}, DType::kF32, rng));
  layer.load_base(weights);
  auto adapter = [&](int r, int64_t b0_rows) {
    std::vector<LoraSliceWeights> s;
    for (int i = 0; i < 3; ++i) {
      const int64_t rows = i == 0 ? b0_rows : spec.outputs[static_cast<size_t>(i)].size;
      s.push_back({test::random_tensor({r, 64}, DType::kF32, rng),
                   test::random_tensor({rows, r}, DType::kF32, rng)});
    }
    return s;
  };
  const Stream cpu;
  layer.set_lora(1, adapter(6, 64), cpu);
  PunicaWrapper punica(kMaxLoras, kTokens, 1, Device::cpu());
  punica.update_metadata(test::mixed_slots(kTokens, kMaxLoras, rng), {}, cpu);
  const Tensor x = test::random_tensor({kTokens, 64}, DType::kF32, rng);
  const std::vector<double> before = test::values_of(layer.forward(x, punica, cpu));
  expect_error([&] { layer.set_lora(1, adapter(5, 63), cpu); }, "LoRA-B is [63, 5]");
  expect_error([&] { layer.set_lora(1, adapter(17, 64), cpu); }, "adapter rank 17");
  expect_error([&] { layer.set_lora(4, adapter(5, 64), cpu); }, "slot 4 outside [0, max_loras 4)");
  expect_error([&] { layer.set_lora(1, {{}, {}}, cpu); }, "got 2 slices, expected 3");
  expect_error([&] { layer.set_lora(1, adapter(5, 64), Stream::default_for(Device::cuda(0))); },
               "copy stream is on cuda:0, the layer is on cpu");
  expect_error([&] { layer.reset_lora(1, Stream::default_for(Device::cuda(0))); },
               "copy stream is on cuda:0");
  expect_error([&] { layer.reset_lora(-1, cpu); }, "reset_lora slot -1");
  for (int s = 0; s < 3; ++s) EXPECT_EQ(layer.lora_rank(1, s), 6);
  EXPECT_EQ(test::values_of(layer.forward(x, punica, cpu)), before);
}

// --------------------------------------------------------------- embedding and logits

// Odd on the CPU (the last vocab shard at tp 2 is padded); 16-byte rows in bf16 on a GPU.
constexpr int64_t kVocab = 37;
constexpr int64_t kGpuVocab = 40;
constexpr int64_t kHidden = 24;

std::vector<Install> one_slice_sequence(int64_t a_cols, int64_t b_rows, DType dt,
                                        std::mt19937_64& rng) {
  return install_sequence(
      [&](const std::vector<int>& ranks) {
        const int r = ranks[0];
        return std::vector<LoraSliceWeights>{{test::random_tensor({r, a_cols}, dt, rng, 0.5f),
                                              test::random_tensor({b_rows, r}, dt, rng, 0.3f)}};
      },
      1);
}

void check_embedding(Backend backend, int tp, bool fully_sharded, DType dt) {
  const int64_t vocab = backend == Backend::kCpu ? kVocab : kGpuVocab;
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  std::mt19937_64 rng(21 + tp);
  const Tensor table = test::random_tensor({vocab, kHidden}, dt, rng);
  const std::vector<Install> seq = one_slice_sequence(vocab, kHidden, dt, rng);
  std::vector<int32_t> ids(kTokens);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  const std::vector<int32_t> slots = test::mixed_slots(kTokens, kMaxLoras, rng);
  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Target target(test::backend_device(backend, rank));
    const LoraConfig cfg{kMaxLoras, kMaxRank, dt, fully_sharded};
    PunicaWrapper punica(kMaxLoras, kTokens, 1, target.device);
    punica.update_metadata(slots, {}, target.compute);
    VocabEmbeddingWithLora sync_layer(vocab, kHidden, dt, cfg, comm, target.device, kTokens);
    VocabEmbeddingWithLora stream_layer(vocab, kHidden, dt, cfg, comm, target.device, kTokens);
    sync_layer.load_base(table);
    stream_layer.load_base(table);
    install_both<VocabEmbeddingWithLora, std::vector<LoraSliceWeights>>(
        sync_layer, stream_layer, seq,
        [&](const std::vector<LoraSliceWeights>& s, bool stream) {
          return stream
                     ? convert(s,
                               [&](const Tensor& t) { return stream_source(t, dt, target.device); })
                     : convert(s, sync_source);
        },
        target);
    for (int slot = 0; slot < kMaxLoras; ++slot)
      EXPECT_EQ(stream_layer.lora_rank(slot), sync_layer.lora_rank(slot)) << slot;
    const Tensor id_t = Tensor::from_vector(ids, {kTokens}).to(target.device, target.compute);
    const std::vector<double> want =
        target.values(sync_layer.forward(id_t, punica, target.compute));
    const std::vector<double> got =
        target.values(stream_layer.forward(id_t, punica, target.compute));
    EXPECT_EQ(got, want) << "rank " << rank;
  });
}

void check_logits(Backend backend, int tp, bool fully_sharded, DType dt) {
  const int64_t vocab = backend == Backend::kCpu ? kVocab : kGpuVocab;
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  constexpr int kSeqs = 9;
  std::mt19937_64 rng(31 + tp);
  const Tensor head = test::random_tensor({vocab, kHidden}, dt, rng);
  const std::vector<Install> seq = one_slice_sequence(kHidden, vocab, dt, rng);
  const Tensor h = test::random_tensor({kSeqs, kHidden}, dt, rng);
  const std::vector<int32_t> seq_slots = test::mixed_slots(kSeqs, kMaxLoras, rng);
  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Target target(test::backend_device(backend, rank));
    const LoraConfig cfg{kMaxLoras, kMaxRank, dt, fully_sharded};
    PunicaWrapper punica(kMaxLoras, kSeqs, kSeqs, target.device);
    punica.update_metadata(seq_slots, seq_slots, target.compute);
    LogitsProcessorWithLora sync_layer(kHidden, vocab, dt, cfg, comm, target.device, kSeqs);
    LogitsProcessorWithLora stream_layer(kHidden, vocab, dt, cfg, comm, target.device, kSeqs);
    sync_layer.load_base(head);
    stream_layer.load_base(head);
    install_both<LogitsProcessorWithLora, std::vector<LoraSliceWeights>>(
        sync_layer, stream_layer, seq,
        [&](const std::vector<LoraSliceWeights>& s, bool stream) {
          return stream
                     ? convert(s,
                               [&](const Tensor& t) { return stream_source(t, dt, target.device); })
                     : convert(s, sync_source);
        },
        target);
    for (int slot = 0; slot < kMaxLoras; ++slot)
      EXPECT_EQ(stream_layer.lora_rank(slot), sync_layer.lora_rank(slot)) << slot;
    const Tensor x = h.to(target.device, target.compute);
    const std::vector<double> want = target.values(sync_layer.forward(x, punica, target.compute));
    const std::vector<double> got = target.values(stream_layer.forward(x, punica, target.compute));
    EXPECT_EQ(got, want) << "rank " << rank;
  });
}

TEST(VocabEmbeddingStreamUpload, MatchesSync) {
  check_embedding(Backend::kCpu, 1, false, DType::kF32);
}
TEST(VocabEmbeddingStreamUpload, FullyShardedMatchesSync_tp2) {
  check_embedding(Backend::kCpu, 2, true, DType::kBF16);
}
TEST(VocabEmbeddingStreamUpload, PinnedOnCopyStreamMatchesSync_Cuda) {
  check_embedding(Backend::kCuda, 1, false, DType::kBF16);
}
TEST(LogitsStreamUpload, MatchesSync) { check_logits(Backend::kCpu, 1, false, DType::kF32); }
TEST(LogitsStreamUpload, FullyShardedMatchesSync_tp2) {
  check_logits(Backend::kCpu, 2, true, DType::kBF16);
}
TEST(LogitsStreamUpload, PinnedOnCopyStreamMatchesSync_Cuda) {
  check_logits(Backend::kCuda, 1, false, DType::kBF16);
}

TEST(LogitsStreamUpload, RejectsACopyStreamOfAnotherDevice) {
  LogitsProcessorWithLora layer(kHidden, kVocab, DType::kF32,
                                {kMaxLoras, kMaxRank, DType::kF32, false}, nullptr, Device::cpu(),
                                4);
  expect_error([&] { layer.reset_lora(0, Stream::default_for(Device::cuda(0))); },
               "LogitsProcessorWithLora: copy stream is on cuda:0");
  VocabEmbeddingWithLora embed(kVocab, kHidden, DType::kF32,
                               {kMaxLoras, kMaxRank, DType::kF32, false}, nullptr, Device::cpu(),
                               4);
  expect_error([&] { embed.set_lora(0, {{}}, Stream::default_for(Device::cuda(0))); },
               "VocabEmbeddingWithLora: copy stream is on cuda:0");
}

// ------------------------------------------------------------------------------ fused MoE

constexpr int kExperts = 4;
constexpr int64_t kMoeHidden = 32;
constexpr int64_t kInter = 40;

// Per-expert ranks r(e) = ranks[p] - e (0 = expert untargeted) for each projection p; a
// projection with rank 0 is not targeted at all.
MoeLoraWeights moe_adapter(const std::vector<int>& ranks, DType dt, std::mt19937_64& rng) {
  MoeLoraWeights w;
  std::vector<LoraSliceWeights>* lists[3] = {&w.w1, &w.w3, &w.w2};
  for (int p = 0; p < 3; ++p) {
    if (ranks[static_cast<size_t>(p)] == 0) continue;
    const int64_t in = p < 2 ? kMoeHidden : kInter;
    const int64_t out = p < 2 ? kInter : kMoeHidden;
    for (int e = 0; e < kExperts; ++e) {
      const int r = std::max(0, ranks[static_cast<size_t>(p)] - e);
      lists[p]->push_back(r == 0 ? LoraSliceWeights{}
                                 : LoraSliceWeights{test::random_tensor({r, in}, dt, rng, 0.4f),
                                                    test::random_tensor({out, r}, dt, rng, 0.2f)});
    }
  }
  return w;
}

// The MoE slices travel as MoeLoraWeights; Install keeps them flattened (w1, w3, w2 experts).
std::vector<LoraSliceWeights> flatten(const MoeLoraWeights& w) {
  std::vector<LoraSliceWeights> out;
  for (const auto* list : {&w.w1, &w.w3, &w.w2}) {
    for (int e = 0; e < kExperts; ++e)
      out.push_back(list->empty() ? LoraSliceWeights{} : (*list)[static_cast<size_t>(e)]);
  }
  return out;
}

MoeLoraWeights unflatten(const std::vector<LoraSliceWeights>& flat) {
  MoeLoraWeights w;
  std::vector<LoraSliceWeights>* lists[3] = {&w.w1, &w.w3, &w.w2};
  for (int p = 0; p < 3; ++p) {
    bool any = false;
    for (int e = 0; e < kExperts; ++e)
      any = any || flat[static_cast<size_t>(p * kExperts + e)].a.defined();
    if (!any) continue;
    lists[p]->assign(flat.begin() + p * kExperts, flat.begin() + (p + 1) * kExperts);
  }
  return w;
}

void check_moe(Backend backend, int tp, bool fully_sharded, DType dt) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  std::mt19937_64 rng(41 + tp);
  MoeSpec spec;
  spec.num_experts = kExperts;
  spec.top_k = 2;
  spec.hidden = kMoeHidden;
  spec.intermediate = kInter;
  spec.dtype = dt;
  const Tensor router = test::random_tensor({kExperts, kMoeHidden}, dt, rng, 0.3f);
  std::vector<Tensor> w1, w3, w2;
  for (int e = 0; e < kExperts; ++e) {
    w1.push_back(test::random_tensor({kInter, kMoeHidden}, dt, rng, 0.3f));
    w3.push_back(test::random_tensor({kInter, kMoeHidden}, dt, rng, 0.3f));
    w2.push_back(test::random_tensor({kMoeHidden, kInter}, dt, rng, 0.3f));
  }
  // Slot 0: every projection; slot 1: w1 and w2 (then all); slot 2: only w3, reset, w2.
  std::vector<Install> seq;
  seq.push_back({0, flatten(moe_adapter({kMaxRank, kMaxRank, kMaxRank}, dt, rng))});
  seq.push_back({1, flatten(moe_adapter({9, 0, 5}, dt, rng))});
  seq.push_back({2, flatten(moe_adapter({0, 3, 0}, dt, rng))});
  seq.push_back({1, flatten(moe_adapter({4, 6, 7}, dt, rng))});
  seq.push_back({2, {}});
  seq.push_back({2, flatten(moe_adapter({0, 0, 2}, dt, rng))});
  const Tensor x_host = test::random_tensor({kTokens, kMoeHidden}, dt, rng);
  const std::vector<int32_t> slots = test::mixed_slots(kTokens, kMaxLoras, rng);
  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Target target(test::backend_device(backend, rank));
    const LoraConfig cfg{kMaxLoras, kMaxRank, dt, fully_sharded};
    PunicaWrapper punica(kMaxLoras, kTokens, 1, target.device);
    punica.update_metadata(slots, {}, target.compute);
    FusedMoeWithLora sync_layer(spec, cfg, comm, target.device, kTokens);
    FusedMoeWithLora stream_layer(spec, cfg, comm, target.device, kTokens);
    sync_layer.load_base(router, w1, w3, w2);
    stream_layer.load_base(router, w1, w3, w2);
    install_both<FusedMoeWithLora, MoeLoraWeights>(
        sync_layer, stream_layer, seq,
        [&](const std::vector<LoraSliceWeights>& s, bool stream) {
          return unflatten(
              stream
                  ? convert(s, [&](const Tensor& t) { return stream_source(t, dt, target.device); })
                  : convert(s, sync_source));
        },
        target);
    for (int slot = 0; slot < kMaxLoras; ++slot) {
      for (int p = 0; p < 3; ++p)
        EXPECT_EQ(stream_layer.lora_rank(slot, p), sync_layer.lora_rank(slot, p)) << slot;
    }
    const Tensor x = x_host.to(target.device, target.compute);
    const std::vector<double> want = target.values(sync_layer.forward(x, punica, target.compute));
    const std::vector<double> got = target.values(stream_layer.forward(x, punica, target.compute));
    EXPECT_EQ(got, want) << "rank " << rank;
  });
}

TEST(FusedMoeStreamUpload, MatchesSync) { check_moe(Backend::kCpu, 1, false, DType::kF32); }
TEST(FusedMoeStreamUpload, FullyShardedMatchesSync_tp2) {
  check_moe(Backend::kCpu, 2, true, DType::kF32);
}
TEST(FusedMoeStreamUpload, PinnedOnCopyStreamMatchesSync_Cuda) {
  check_moe(Backend::kCuda, 1, false, DType::kBF16);
}

}  // namespace
}  // namespace loraplex
