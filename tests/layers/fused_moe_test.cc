// Fused MoE with LoRA: the whole layer (routing, SiLU-gated experts, router-weighted sum, w13
// and w2 LoRA deltas) against a double-precision computation written from the definitions, for
// per-expert 2-D adapters and PEFT's 3-D expert parameters, at tensor-parallel sizes 1/2/4,
// fully sharded vs not, routing with exact ties and with every token on one expert (top-k
// renormalised or not), reset and validation, GPU and NCCL variants.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>

#include "layers/layer_test_util.h"
#include "loraplex/core/device.h"
#include "loraplex/layers/fused_moe.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using test::Backend;

constexpr int kExperts = 8;
constexpr int kTopK = 2;
constexpr int64_t kHidden = 64;
constexpr int64_t kInter = 96;
constexpr int kMaxLoras = 4;
constexpr int kMaxRank = 16;
constexpr DType kF32 = DType::kF32;

// One expert's LoRA of one projection, as matrices: a [r, in], b [out, r]; r == 0 = none.
struct ExpertLora {
  std::vector<double> a;
  std::vector<double> b;
  int64_t r = 0;
};

struct MoeProblem {
  int tokens = 29;
  Tensor x, router;
  std::vector<Tensor> w1, w3, w2;
  std::vector<int32_t> slots;
  std::vector<std::pair<int, MoeLoraWeights>> installs;
  // The reference's view of the final adapters: [slot][projection][expert].
  std::map<int, std::vector<std::vector<ExpertLora>>> final_lora;
  bool gate_up_3d = false;
  GateUpLayout layout = GateUpLayout::kConcatenated;
  int top_k = kTopK;
  bool renormalize = true;  // Mixtral; Qwen3-MoE with norm_topk_prob
};

ExpertLora as_matrices(const LoraSliceWeights& w) {
  ExpertLora e;
  if (!w.a.defined()) return e;
  e.a = w.a.contiguous().to_double_vector();
  e.b = w.b.contiguous().to_double_vector();
  e.r = w.a.size(0);
  return e;
}

std::vector<std::vector<ExpertLora>> matrices_of(const MoeLoraWeights& w) {
  std::vector<std::vector<ExpertLora>> out(3, std::vector<ExpertLora>(kExperts));
  const std::vector<LoraSliceWeights>* lists[3] = {&w.w1, &w.w3, &w.w2};
  for (int p = 0; p < 3; ++p) {
    for (size_t e = 0; e < lists[p]->size(); ++e) out[p][e] = as_matrices((*lists[p])[e]);
  }
  return out;
}

// A per-expert adapter of `rank(e)` for the projections in `targets` (w1, w3, w2).
MoeLoraWeights make_moe_adapter(const std::function<int(int)>& rank, const bool targets[3],
                                std::mt19937_64& rng) {
  MoeLoraWeights w;
  std::vector<LoraSliceWeights>* lists[3] = {&w.w1, &w.w3, &w.w2};
  for (int p = 0; p < 3; ++p) {
    if (!targets[p]) continue;
    const int64_t in = p < 2 ? kHidden : kInter;
    const int64_t out = p < 2 ? kInter : kHidden;
    for (int e = 0; e < kExperts; ++e) {
      const int r = rank(e);
      if (r == 0) {
        lists[p]->push_back({});
        continue;
      }
      lists[p]->push_back({test::random_tensor({r, in}, kF32, rng, 0.4f),
                           test::random_tensor({out, r}, kF32, rng, 0.2f)});
    }
  }
  return w;
}

// Regenerates token rows until the k-th and (k+1)-th router logits differ clearly, so that
// float rounding cannot change which experts the library and the reference pick.
void make_routing_unambiguous(MoeProblem& p, std::mt19937_64& rng) {
  for (int t = 0; t < p.tokens; ++t) {
    for (;;) {
      Tensor row = p.x.select(0, t);
      const std::vector<double> l = test::xwt_double(row.unsqueeze(0), p.router);
      std::vector<double> sorted = l;
      std::sort(sorted.begin(), sorted.end(), std::greater<double>());
      if (sorted[kTopK - 1] - sorted[kTopK] > 1e-2) break;
      row.copy_from(test::random_tensor({kHidden}, kF32, rng));
    }
  }
}

MoeProblem make_base(uint64_t seed, int tokens, bool unambiguous = true) {
  std::mt19937_64 rng(seed);
  MoeProblem p;
  p.tokens = tokens;
  p.x = test::random_tensor({tokens, kHidden}, kF32, rng);
  p.router = test::random_tensor({kExperts, kHidden}, kF32, rng, 0.3f);
  for (int e = 0; e < kExperts; ++e) {
    p.w1.push_back(test::random_tensor({kInter, kHidden}, kF32, rng, 0.3f));
    p.w3.push_back(test::random_tensor({kInter, kHidden}, kF32, rng, 0.3f));
    p.w2.push_back(test::random_tensor({kHidden, kInter}, kF32, rng, 0.3f));
  }
  if (unambiguous) make_routing_unambiguous(p, rng);
  p.slots = test::mixed_slots(tokens, kMaxLoras, rng);
  return p;
}

// Slot 0: all projections, rank 16. Slot 1: rank 9 everywhere, then replaced by rank 5 on w1
// and w2 only with expert 3 untargeted. Slot 2: ranks 2..4 varying by expert. Slot 3: none.
MoeProblem make_problem(uint64_t seed, int tokens = 29, bool unambiguous = true) {
  MoeProblem p = make_base(seed, tokens, unambiguous);
  std::mt19937_64 rng(seed + 1);
  const bool all[3] = {true, true, true};
  const bool w1_w2[3] = {true, false, true};
  p.installs.push_back({0, make_moe_adapter([](int) { return 16; }, all, rng)});
  p.installs.push_back({1, make_moe_adapter([](int) { return 9; }, all, rng)});
  p.installs.push_back({2, make_moe_adapter([](int e) { return e % 3 + 2; }, all, rng)});
  p.installs.push_back({1, make_moe_adapter([](int e) { return e == 3 ? 0 : 5; }, w1_w2, rng)});
  for (const auto& [slot, w] : p.installs) p.final_lora[slot] = matrices_of(w);
  return p;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// y = A^T-free LoRA: out[o] += sum_j b[o, j] * (a[j] . in)
void add_expert_lora(const ExpertLora& l, const std::vector<double>& in, std::vector<double>& out) {
  if (l.r == 0) return;
  const auto n_in = static_cast<int64_t>(in.size());
  const auto n_out = static_cast<int64_t>(out.size());
  for (int64_t j = 0; j < l.r; ++j) {
    double mid = 0.0;
    for (int64_t i = 0; i < n_in; ++i) mid += l.a[j * n_in + i] * in[i];
    for (int64_t o = 0; o < n_out; ++o) out[o] += l.b[o * l.r + j] * mid;
  }
}

std::vector<double> reference(const MoeProblem& p) {
  const std::vector<double> logits = test::xwt_double(p.x, p.router);
  const std::vector<double> xv = p.x.to_double_vector();
  std::vector<std::vector<double>> w1, w3, w2;
  for (int e = 0; e < kExperts; ++e) {
    w1.push_back(p.w1[e].to_double_vector());
    w3.push_back(p.w3[e].to_double_vector());
    w2.push_back(p.w2[e].to_double_vector());
  }
  std::vector<double> y(static_cast<size_t>(p.tokens * kHidden), 0.0);
  for (int t = 0; t < p.tokens; ++t) {
    // softmax, top-k (ties to the lower expert id), renormalised when the problem says so
    std::vector<double> prob(kExperts);
    double mx = -1e300;
    for (int e = 0; e < kExperts; ++e) mx = std::max(mx, logits[t * kExperts + e]);
    double sum = 0.0;
    for (int e = 0; e < kExperts; ++e) sum += prob[e] = std::exp(logits[t * kExperts + e] - mx);
    for (double& v : prob) v /= sum;
    std::vector<int> order(kExperts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
    double picked = 0.0;
    for (int k = 0; k < p.top_k; ++k) picked += prob[order[k]];
    const std::vector<double> xt(xv.begin() + t * kHidden, xv.begin() + (t + 1) * kHidden);
    const int slot = p.slots[static_cast<size_t>(t)];
    const auto lora = p.final_lora.find(slot);
    for (int k = 0; k < p.top_k; ++k) {
      const int e = order[k];
      const double w = p.renormalize ? prob[e] / picked : prob[e];
      std::vector<double> gate(kInter, 0.0), up(kInter, 0.0);
      for (int64_t o = 0; o < kInter; ++o) {
        for (int64_t i = 0; i < kHidden; ++i) {
          gate[o] += w1[e][o * kHidden + i] * xt[i];
          up[o] += w3[e][o * kHidden + i] * xt[i];
        }
      }
      if (lora != p.final_lora.end()) {
        add_expert_lora(lora->second[0][e], xt, gate);
        add_expert_lora(lora->second[1][e], xt, up);
      }
      std::vector<double> h(kInter);
      for (int64_t o = 0; o < kInter; ++o) h[o] = silu(gate[o]) * up[o];
      std::vector<double> down(kHidden, 0.0);
      for (int64_t o = 0; o < kHidden; ++o) {
        for (int64_t i = 0; i < kInter; ++i) down[o] += w2[e][o * kInter + i] * h[i];
      }
      if (lora != p.final_lora.end()) add_expert_lora(lora->second[2][e], h, down);
      for (int64_t o = 0; o < kHidden; ++o) y[t * kHidden + o] += w * down[o];
    }
  }
  return y;
}

// The transformers-5 style 3-D base tensors built from the per-expert ones.
void base_3d(const MoeProblem& p, Tensor& gate_up, Tensor& down) {
  gate_up = Tensor::empty({kExperts, 2 * kInter, kHidden}, kF32);
  down = Tensor::empty({kExperts, kHidden, kInter}, kF32);
  for (int e = 0; e < kExperts; ++e) {
    for (int64_t o = 0; o < kInter; ++o) {
      const int64_t g = p.layout == GateUpLayout::kConcatenated ? o : 2 * o;
      const int64_t u = p.layout == GateUpLayout::kConcatenated ? kInter + o : 2 * o + 1;
      Tensor gr = gate_up.select(0, e).select(0, g);
      gr.copy_from(p.w1[e].select(0, o));
      Tensor ur = gate_up.select(0, e).select(0, u);
      ur.copy_from(p.w3[e].select(0, o));
    }
    Tensor d = down.select(0, e);
    d.copy_from(p.w2[e]);
  }
}

std::vector<double> run_moe(const MoeProblem& p, Backend backend, int tp, bool fully_sharded,
                            bool device_routing_on_cpu = false) {
  std::vector<std::vector<double>> outs(static_cast<size_t>(tp));
  test::run_ranks(backend, tp, [&](int rank, Communicator* comm) {
    const Device device = test::backend_device(backend, rank);
    const Stream stream = Stream::default_for(device);
    PunicaWrapper punica(kMaxLoras, p.tokens, 4, device);
    punica.update_metadata(p.slots, {}, stream);
    MoeSpec spec{kExperts, p.top_k, kHidden, kInter, kF32, p.renormalize};
    FusedMoeWithLora layer(spec, {kMaxLoras, kMaxRank, kF32, fully_sharded}, comm, device,
                           p.tokens);
    if (device_routing_on_cpu) layer.set_routing(FusedMoeWithLora::Routing::kDevice);
    if (p.gate_up_3d) {
      Tensor gate_up, down;
      base_3d(p, gate_up, down);
      layer.load_base_3d(p.router, gate_up, down, p.layout);
    } else {
      layer.load_base(p.router, p.w1, p.w3, p.w2);
    }
    for (const auto& [slot, w] : p.installs) layer.set_lora(slot, w);
    const Tensor y = layer.forward(p.x.to(device, stream), punica, stream);
    stream.synchronize();
    outs[static_cast<size_t>(rank)] = test::values_of(y);
  });
  for (int r = 1; r < tp; ++r) EXPECT_EQ(outs[static_cast<size_t>(r)], outs[0]) << "rank " << r;
  return outs[0];
}

void expect_matches(const std::vector<double>& got, const std::vector<double>& ref,
                    const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_LE(test::tolerance_ratio(got, ref, 1e-4, 2e-5 * test::max_abs(ref)), 1.0) << what;
}

void expect_same_split(const std::vector<double>& got, const std::vector<double>& want,
                       const std::vector<double>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(test::tolerance_ratio(got, want, 2e-5, 2e-6 * test::max_abs(ref)), 1.0) << what;
}

void check_moe(const MoeProblem& p, Backend backend, int tp, bool fully_sharded) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  const std::vector<double> ref = reference(p);
  const std::string name = std::string(test::backend_name(backend)) + " tp" + std::to_string(tp) +
                           (fully_sharded ? " fully sharded" : "");
  const std::vector<double> got = run_moe(p, backend, tp, fully_sharded);
  expect_matches(got, ref, name + " vs double reference");
  if (tp > 1 || fully_sharded || backend != Backend::kCpu) {
    const Backend single = backend == Backend::kNccl ? Backend::kCuda : backend;
    expect_same_split(got, run_moe(p, single, 1, false), ref, name + " vs the unsharded layer");
  }
}

TEST(FusedMoeLora, MatchesDoubleReference_tp1) {
  check_moe(make_problem(1), Backend::kCpu, 1, false);
}
TEST(FusedMoeLora, MatchesDoubleReference_tp2) {
  check_moe(make_problem(2), Backend::kCpu, 2, false);
}
TEST(FusedMoeLora, MatchesDoubleReference_tp4) {
  check_moe(make_problem(4), Backend::kCpu, 4, false);
}
TEST(FusedMoeLora, DecodeNaiveBlocks_tp2) {
  // 2 tokens x top-2 x 8 <= 8 experts x 4 slots: vLLM's naive block assignment.
  check_moe(make_problem(5, 2), Backend::kCpu, 2, false);
}
TEST(FusedMoeLoraSharded, MatchesNotSharded_tp1) {
  check_moe(make_problem(11), Backend::kCpu, 1, true);
}
TEST(FusedMoeLoraSharded, MatchesNotSharded_tp2) {
  check_moe(make_problem(12), Backend::kCpu, 2, true);
}
TEST(FusedMoeLoraSharded, MatchesNotSharded_tp4) {
  check_moe(make_problem(14), Backend::kCpu, 4, true);
}
TEST(FusedMoeLoraSharded, DecodeNaiveBlocks_tp4) {
  check_moe(make_problem(15, 2), Backend::kCpu, 4, true);
}
TEST(FusedMoeLora, Cuda_tp1) { check_moe(make_problem(1), Backend::kCuda, 1, false); }
// Above kDeviceRoutedMaxPairs a GPU step groups the pairs on the host, one GEMM per expert.
TEST(FusedMoeLora, CudaHostRoutedAboveTheDevicePairLimit) {
  constexpr int kTokens = FusedMoeWithLora::kDeviceRoutedMaxPairs / kTopK + 3;
  MoeSpec spec{kExperts, kTopK, kHidden, kInter, kF32, true};
  const FusedMoeWithLora cpu_layer(spec, {kMaxLoras, kMaxRank, kF32, false}, nullptr, Device::cpu(),
                                   kTokens);
  EXPECT_FALSE(cpu_layer.routes_on_device(1));
  LORAPLEX_REQUIRE_GPUS(1);
  const FusedMoeWithLora gpu_layer(spec, {kMaxLoras, kMaxRank, kF32, false}, nullptr,
                                   Device::cuda(0), kTokens);
  EXPECT_TRUE(gpu_layer.routes_on_device(kTokens - 4));
  EXPECT_FALSE(gpu_layer.routes_on_device(kTokens));
  check_moe(make_problem(16, kTokens), Backend::kCuda, 1, false);
}

// ---------------------------------------------------------------- routing

// Routing decided by input column 0 alone: router row e is c[e] there and zero elsewhere, and
// every token's x[0] is positive, so logit e = c[e] * x[t, 0] exactly (the other products are
// zeros) and equal c give equal logits whatever the summation order: exact ties.
MoeProblem make_routed_problem(uint64_t seed, const std::vector<float>& c, int top_k,
                               bool renormalize) {
  MoeProblem p = make_problem(seed, 29, false);
  p.top_k = top_k;
  p.renormalize = renormalize;
  std::fill_n(p.router.data<float>(), kExperts * kHidden, 0.0f);
  for (int e = 0; e < kExperts; ++e) p.router.data<float>()[e * kHidden] = c[e];
  for (int t = 0; t < p.tokens; ++t) {
    float& x0 = p.x.data<float>()[t * kHidden];
    x0 = 0.25f + std::abs(x0);
  }
  return p;
}

// Expert 2 first, then experts 1, 3 and 5 tie: top-2 takes expert 1 (the lowest id) and leaves
// 3 and 5; top-3 takes 1 and 3 with equal weights. The reference breaks ties by expert id.
const std::vector<float> kTiedRouter = {1.0f, 2.0f, 3.0f, 2.0f, 0.5f, 2.0f, -1.0f, 0.0f};
// Expert 5 far above the rest, which all tie: every token's first choice is expert 5, its
// second expert 0.
const std::vector<float> kOneExpertRouter = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 9.0f, 0.0f, 0.0f};

TEST(FusedMoeRouting, TiesGoToTheLowestExpertId) {
  for (bool renormalize : {true, false}) {
    for (int top_k : {2, 3}) {
      SCOPED_TRACE("top_k " + std::to_string(top_k) + (renormalize ? " renormalised" : ""));
      check_moe(make_routed_problem(71, kTiedRouter, top_k, renormalize), Backend::kCpu, 1, false);
    }
  }
  check_moe(make_routed_problem(72, kTiedRouter, 2, false), Backend::kCpu, 2, false);
}

TEST(FusedMoeRouting, AllTokensOnOneExpert) {
  for (bool renormalize : {true, false}) {
    for (int top_k : {1, 2}) {
      SCOPED_TRACE("top_k " + std::to_string(top_k) + (renormalize ? " renormalised" : ""));
      check_moe(make_routed_problem(73, kOneExpertRouter, top_k, renormalize), Backend::kCpu, 1,
                false);
    }
  }
  check_moe(make_routed_problem(74, kOneExpertRouter, 1, true), Backend::kCpu, 2, true);
}

// Without renormalisation (Qwen3-MoE's norm_topk_prob false) the top-k weights are the softmax
// probabilities themselves: the output differs from the renormalised layer's.
TEST(FusedMoeRouting, RenormalisationChangesTheOutputAsTheReferenceSays) {
  MoeProblem p = make_problem(75);
  const std::vector<double> renormalised = run_moe(p, Backend::kCpu, 1, false);
  p.renormalize = false;
  check_moe(p, Backend::kCpu, 1, false);
  EXPECT_GT(test::tolerance_ratio(run_moe(p, Backend::kCpu, 1, false), renormalised, 1e-3, 1e-3),
            1.0);
}

TEST(FusedMoeRouting, Cuda_tp1) {
  check_moe(make_routed_problem(76, kTiedRouter, 3, false), Backend::kCuda, 1, false);
  check_moe(make_routed_problem(77, kOneExpertRouter, 2, true), Backend::kCuda, 1, false);
}
// The path a GPU takes for decode-sized steps (the pairs grouped by expert into a block table,
// the expert GEMMs over it, pair-major rows), run with the ops' CPU versions: the same outputs
// as the double reference, with LoRA, at tp 1/2/4, fully sharded, every token on one expert.
TEST(FusedMoeLora, DeviceRoutingMatchesDoubleReference) {
  struct Case {
    MoeProblem p;
    int tp;
    bool fully_sharded;
  };
  std::vector<Case> cases;
  cases.push_back({make_problem(81), 1, false});
  cases.push_back({make_problem(82), 2, false});
  cases.push_back({make_problem(83, 2), 4, true});
  cases.push_back({make_routed_problem(84, kOneExpertRouter, 2, true), 1, false});
  for (Case& c : cases) {
    const std::vector<double> ref = reference(c.p);
    const std::vector<double> got = run_moe(c.p, Backend::kCpu, c.tp, c.fully_sharded, true);
    expect_matches(got, ref, "device routing on the CPU, tp " + std::to_string(c.tp));
    expect_same_split(got, run_moe(c.p, Backend::kCpu, c.tp, c.fully_sharded), ref,
                      "device routing vs host routing, tp " + std::to_string(c.tp));
  }
}

TEST(FusedMoeLora, Nccl_tp2) { check_moe(make_problem(2), Backend::kNccl, 2, false); }
TEST(FusedMoeLoraSharded, Nccl_tp2) { check_moe(make_problem(12), Backend::kNccl, 2, true); }

// ---------------------------------------------------------------- PEFT 3-D experts

// Packs per-expert matrices the way PEFT's ParamWrapper stores them, written from its
// definition: A [r * E, in] with row e * r + j = A_e[j]; B [out, r * E] with column
// j * E + e = B_e[:, j].
void pack_peft(const std::vector<Tensor>& a, const std::vector<Tensor>& b, Tensor& pa, Tensor& pb) {
  const int64_t r = a[0].size(0);
  const int64_t in = a[0].size(1);
  const int64_t out = b[0].size(0);
  pa = Tensor::empty({r * kExperts, in}, kF32);
  pb = Tensor::empty({out, r * kExperts}, kF32);
  for (int e = 0; e < kExperts; ++e) {
    for (int64_t j = 0; j < r; ++j) {
      for (int64_t i = 0; i < in; ++i)
        pa.data<float>()[(e * r + j) * in + i] = a[e].data<float>()[j * in + i];
      for (int64_t o = 0; o < out; ++o) {
        pb.data<float>()[o * r * kExperts + j * kExperts + e] = b[e].data<float>()[o * r + j];
      }
    }
  }
}

// Slot 0 (rank 6) and slot 2 (rank 3) as PEFT 3-D adapters on gate_up_proj and down_proj;
// slot 1 a 2-D adapter, to mix both kinds in one batch.
MoeProblem make_peft_problem(uint64_t seed, GateUpLayout layout) {
  MoeProblem p = make_base(seed, 29);
  p.gate_up_3d = true;
  p.layout = layout;
  std::mt19937_64 rng(seed + 7);
  for (const auto& [slot, r] : std::vector<std::pair<int, int>>{{0, 6}, {2, 3}}) {
    std::vector<Tensor> gu_a, gu_b, dn_a, dn_b;
    for (int e = 0; e < kExperts; ++e) {
      gu_a.push_back(test::random_tensor({r, kHidden}, kF32, rng, 0.4f));
      gu_b.push_back(test::random_tensor({2 * kInter, r}, kF32, rng, 0.2f));
      dn_a.push_back(test::random_tensor({r, kInter}, kF32, rng, 0.4f));
      dn_b.push_back(test::random_tensor({kHidden, r}, kF32, rng, 0.2f));
    }
    Tensor gua, gub, dna, dnb;
    pack_peft(gu_a, gu_b, gua, gub);
    pack_peft(dn_a, dn_b, dna, dnb);
    MoeLoraWeights w;
    split_gate_up_lora(peft_3d_expert_lora(gua, gub, kExperts), kInter, layout, w.w1, w.w3);
    w.w2 = peft_3d_expert_lora(dna, dnb, kExperts);
    p.installs.push_back({slot, w});
    // The reference reads gate / up rows of each expert's B by the base layer's layout.
    std::vector<std::vector<ExpertLora>> m(3, std::vector<ExpertLora>(kExperts));
    for (int e = 0; e < kExperts; ++e) {
      const std::vector<double> a = gu_a[e].to_double_vector();
      const std::vector<double> b = gu_b[e].to_double_vector();
      for (int s = 0; s < 2; ++s) {
        ExpertLora& l = m[s][e];
        l.a = a;
        l.r = r;
        for (int64_t o = 0; o < kInter; ++o) {
          const int64_t row = layout == GateUpLayout::kConcatenated ? s * kInter + o : 2 * o + s;
          l.b.insert(l.b.end(), b.begin() + row * r, b.begin() + (row + 1) * r);
        }
      }
      m[2][e] = {dn_a[e].to_double_vector(), dn_b[e].to_double_vector(), r};
    }
    p.final_lora[slot] = m;
  }
  const bool all[3] = {true, true, true};
  MoeLoraWeights two_d = make_moe_adapter([](int) { return 4; }, all, rng);
  p.installs.push_back({1, two_d});
  p.final_lora[1] = matrices_of(two_d);
  return p;
}

TEST(FusedMoeLora3d, PeftLayoutMatchesDoubleReference_tp1) {
  check_moe(make_peft_problem(41, GateUpLayout::kConcatenated), Backend::kCpu, 1, false);
}
TEST(FusedMoeLora3d, PeftLayoutMatchesDoubleReference_tp2) {
  check_moe(make_peft_problem(42, GateUpLayout::kConcatenated), Backend::kCpu, 2, false);
}
TEST(FusedMoeLora3d, InterleavedGateUp_tp2) {
  check_moe(make_peft_problem(43, GateUpLayout::kInterleaved), Backend::kCpu, 2, false);
}
TEST(FusedMoeLora3dSharded, MatchesNotSharded_tp4) {
  check_moe(make_peft_problem(44, GateUpLayout::kConcatenated), Backend::kCpu, 4, true);
}

TEST(FusedMoeLora3d, PeftConversionFollowsParamWrapperDelta) {
  // PEFT's delta for expert e is sum_r B.reshape(out, r, E)[o, r, e] * A.reshape(E, r, in)[e, r,
  // i]; the converted slices must give exactly that product.
  std::mt19937_64 rng(3);
  const int64_t r = 3, in = 5, out = 4;
  const Tensor a = test::random_tensor({r * kExperts, in}, kF32, rng);
  const Tensor b = test::random_tensor({out, r * kExperts}, kF32, rng);
  const std::vector<LoraSliceWeights> slices = peft_3d_expert_lora(a, b, kExperts);
  ASSERT_EQ(slices.size(), static_cast<size_t>(kExperts));
  for (int e = 0; e < kExperts; ++e) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double peft = 0.0;
        double ours = 0.0;
        for (int64_t j = 0; j < r; ++j) {
          peft += b.item({o, j * kExperts + e}) * a.item({e * r + j, i});
          ours += slices[e].b.item({o, j}) * slices[e].a.item({j, i});
        }
        EXPECT_EQ(ours, peft) << "expert " << e << " (" << o << ", " << i << ")";
      }
    }
  }
  try {
    peft_3d_expert_lora(a.narrow(0, 0, r * kExperts - 1), b, kExperts);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("not a positive multiple of 8 experts"),
              std::string::npos)
        << err.what();
  }
}

// ---------------------------------------------------------------- reset and validation

void expect_error_containing(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(FusedMoeLora, ResetAndRejectedSetLoraKeepState_tp2) {
  const MoeProblem p = make_problem(61);
  for (bool fs : {false, true}) {
    test::run_ranks(Backend::kCpu, 2, [&](int, Communicator* comm) {
      PunicaWrapper punica(kMaxLoras, p.tokens, 4, Device::cpu());
      punica.update_metadata(p.slots, {}, Stream());
      MoeSpec spec{kExperts, kTopK, kHidden, kInter, kF32, true};
      FusedMoeWithLora layer(spec, {kMaxLoras, kMaxRank, kF32, fs}, comm, Device::cpu(), p.tokens);
      layer.load_base(p.router, p.w1, p.w3, p.w2);
      const std::vector<double> base = test::values_of(layer.forward(p.x, punica, Stream()));
      for (const auto& [slot, w] : p.installs) layer.set_lora(slot, w);
      const std::vector<double> lora = test::values_of(layer.forward(p.x, punica, Stream()));
      EXPECT_NE(lora, base);
      std::mt19937_64 rng(2);
      const bool all[3] = {true, true, true};
      MoeLoraWeights bad_shape = make_moe_adapter([](int) { return 4; }, all, rng);
      bad_shape.w2[5].a = test::random_tensor({4, kInter + 1}, kF32, rng);
      expect_error_containing([&] { layer.set_lora(2, bad_shape); }, "w2 (down) expert 5");
      MoeLoraWeights too_big = make_moe_adapter([](int) { return kMaxRank + 1; }, all, rng);
      expect_error_containing([&] { layer.set_lora(2, too_big); }, "max_lora_rank 16");
      MoeLoraWeights short_list = make_moe_adapter([](int) { return 4; }, all, rng);
      short_list.w3.pop_back();
      expect_error_containing([&] { layer.set_lora(2, short_list); }, "has 7 experts, expected 8");
      EXPECT_EQ(layer.lora_rank(2, 0), 4);
      EXPECT_EQ(test::values_of(layer.forward(p.x, punica, Stream())), lora);
      for (int slot = 0; slot < kMaxLoras; ++slot) layer.reset_lora(slot);
      EXPECT_EQ(test::values_of(layer.forward(p.x, punica, Stream())), base);
    });
  }
}

}  // namespace
}  // namespace loraplex
