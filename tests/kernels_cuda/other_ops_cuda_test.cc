// FP8 expand and quantisation, embedding LoRA, MoE routing and fused MoE LoRA: GPU against the
// CPU reference on the same random inputs.

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "loraplex/kernels/dispatch/base_ops.h"
#include "loraplex/punica/lora_dispatch.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex {
namespace {

Device device_of(int dev) { return dev == 0 ? test::gpu() : Device::cpu(); }

Tensor host_result(const Tensor& t, int dev, const Stream& stream) {
  return dev == 0 ? test::on_cpu(t, stream) : t;
}

struct Fp8Case {
  DType y_dtype;
  DType w_dtype;
  kernels::Fp8ScaleKind kind;
  bool w8a8;
  bool per_token;
  DType in_dtype;  // weight-only: f32 or y's dtype
  int tokens;
  int max_loras;
  int max_rank;
  std::vector<int64_t> widths;
};

TEST(CudaExpandFp8, AllScaleKindsWeightOnlyAndW8A8MatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(808);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  using K = kernels::Fp8ScaleKind;
  const std::vector<Fp8Case> cases = {
      {DType::kBF16, DType::kF8E4M3, K::kPerTensor, false, true, DType::kF32, 19, 4, 16, {64, 32}},
      {DType::kF16, DType::kF8E5M2, K::kPerChannel, false, true, DType::kF16, 33, 3, 24, {40}},
      {DType::kBF16, DType::kF8E4M3, K::kPerBlock, false, true, DType::kF32, 7, 2, 64, {200, 56}},
      {DType::kBF16, DType::kF8E4M3, K::kPerChannel, true, true, DType::kF32, 50, 5, 16, {96}},
      {DType::kF32,
       DType::kF8E5M2,
       K::kPerBlock,
       true,
       false,
       DType::kF32,
       12,
       4,
       32,
       {48, 48, 16}},
      {DType::kF16, DType::kF8E4M3, K::kPerTensor, true, false, DType::kF32, 1, 1, 8, {8}},
  };
  for (const Fp8Case& c : cases) {
    const int slices = static_cast<int>(c.widths.size());
    const auto slots =
        test::make_slots(test::SlotDistribution::kUniform, c.tokens, c.max_loras, rng, 0.2);
    std::uniform_int_distribution<int32_t> rank_of(0, c.max_rank);
    std::vector<int32_t> ranks(static_cast<size_t>(slices * c.max_loras));
    for (auto& r : ranks) r = rank_of(rng);
    const int group_n = 32;
    const int group_k = 16;
    std::vector<Tensor> b;
    std::vector<Tensor> scales;
    int64_t width = 0;
    for (int64_t n : c.widths) {
      b.push_back(test::random_tensor({c.max_loras, n, c.max_rank}, c.w_dtype, rng, 2.0f));
      Shape sshape = {c.max_loras};
      if (c.kind == K::kPerChannel) sshape = {c.max_loras, n};
      if (c.kind == K::kPerBlock) {
        sshape = {c.max_loras, (n + group_n - 1) / group_n, (c.max_rank + group_k - 1) / group_k};
      }
      Tensor sc = test::random_tensor(sshape, DType::kF32, rng, 0.1f);
      for (int64_t i = 0; i < sc.numel(); ++i) sc.data<float>()[i] = std::fabs(sc.data<float>()[i]);
      scales.push_back(sc);
      width += n;
    }
    const DType in_dtype = c.w8a8 ? DType::kF8E4M3 : c.in_dtype;
    const Tensor in = test::random_tensor({slices, c.tokens, c.max_rank}, in_dtype, rng, 1.0f);
    Tensor in_scale =
        test::random_tensor({c.per_token ? slices * c.tokens : slices}, DType::kF32, rng, 0.05f);
    for (int64_t i = 0; i < in_scale.numel(); ++i)
      in_scale.data<float>()[i] = std::fabs(in_scale.data<float>()[i]);
    const Tensor y0 = test::random_tensor({c.tokens, width}, c.y_dtype, rng);
    Tensor out[2];
    for (int dev = 0; dev < 2; ++dev) {
      const Device device = device_of(dev);
      const Stream& s = dev == 0 ? stream : cpu;
      LoraBatchMeta meta(c.max_loras, c.tokens, device);
      meta.prepare(slots, s);
      const Tensor ranks_t = test::int_tensor(ranks).to(device, s);
      std::vector<Tensor> bd;
      std::vector<Tensor> sd;
      for (int i = 0; i < slices; ++i) {
        bd.push_back(b[static_cast<size_t>(i)].to(device, s));
        sd.push_back(scales[static_cast<size_t>(i)].to(device, s));
      }
      const Tensor in_d = in.to(device, s);
      const Tensor in_scale_d = in_scale.to(device, s);
      Tensor y = y0.clone().to(device, s);
      kernels::ExpandFp8Args a;
      a.base.dtype = c.y_dtype;
      a.base.num_tokens = c.tokens;
      a.base.in_dtype = c.w8a8 ? DType::kF32 : c.in_dtype;
      a.base.in = in_d.data_ptr();
      a.base.num_slices = slices;
      for (int i = 0; i < slices; ++i) {
        a.base.lora_b[i] = bd[static_cast<size_t>(i)].data_ptr();
        a.base.slice_width[i] = c.widths[static_cast<size_t>(i)];
        a.b_scale[i] = sd[static_cast<size_t>(i)].data<float>();
      }
      a.base.max_loras = c.max_loras;
      a.base.max_rank = c.max_rank;
      a.base.ranks = ranks_t.data<int32_t>();
      a.base.y = y.data_ptr();
      a.base.y_row_stride = width;
      a.weight_dtype = c.w_dtype;
      a.scale_kind = c.kind;
      a.group_n = group_n;
      a.group_k = group_k;
      a.w8a8 = c.w8a8;
      a.in_fp8_dtype = DType::kF8E4M3;
      a.in_scale_per_token = c.per_token;
      a.in_scale = in_scale_d.data<float>();
      throw_if_error(dispatch_lora_expand_fp8(a, meta.view(), s));
      out[dev] = host_result(y, dev, s);
    }
    const double rtol = test::default_rtol(c.y_dtype) + 1e-3;
    test::expect_matches(out[0], out[1], stream, rtol, rtol * 2,
                         std::string("fp8 ") + std::string(dtype_name(c.w_dtype)) + " kind " +
                             std::to_string(static_cast<int>(c.kind)) +
                             (c.w8a8 ? " w8a8" : " weight-only"));
  }
}

TEST(CudaQuantizeFp8, PerTokenAndPerSliceMatchCpuBitForBit) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(909);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  for (DType out_dtype : {DType::kF8E4M3, DType::kF8E5M2}) {
    for (bool per_token : {true, false}) {
      const int slices = 3;
      const int tokens = 77;
      const int max_loras = 6;
      const int max_rank = 40;
      const auto slots =
          test::make_slots(test::SlotDistribution::kZipf, tokens, max_loras, rng, 0.15);
      std::uniform_int_distribution<int32_t> rank_of(0, max_rank);
      std::vector<int32_t> ranks(static_cast<size_t>(slices * max_loras));
      for (auto& r : ranks) r = rank_of(rng);
      const Tensor in = test::random_tensor({slices, tokens, max_rank}, DType::kF32, rng, 3.0f);
      Tensor q[2];
      Tensor sc[2];
      for (int dev = 0; dev < 2; ++dev) {
        const Device device = device_of(dev);
        const Stream& s = dev == 0 ? stream : cpu;
        const Tensor mapping = test::int_tensor(slots).to(device, s);
        const Tensor ranks_t = test::int_tensor(ranks).to(device, s);
        const Tensor in_d = in.to(device, s);
        Tensor out = Tensor::zeros({slices, tokens, max_rank}, out_dtype).to(device, s);
        Tensor scale =
            Tensor::zeros({per_token ? slices * tokens : slices}, DType::kF32).to(device, s);
        kernels::QuantizeIntermediateArgs a;
        a.num_tokens = tokens;
        a.num_slices = slices;
        a.max_loras = max_loras;
        a.max_rank = max_rank;
        a.ranks = ranks_t.data<int32_t>();
        a.token_lora_mapping = mapping.data<int32_t>();
        a.in = in_d.data<float>();
        a.out_dtype = out_dtype;
        a.out = out.data_ptr();
        a.per_token = per_token;
        a.scale = scale.data<float>();
        throw_if_error(dispatch_quantize_intermediate_fp8(a, s));
        q[dev] = host_result(out, dev, s);
        sc[dev] = host_result(scale, dev, s);
      }
      const std::string what =
          std::string(dtype_name(out_dtype)) + (per_token ? " per token" : " per slice");
      test::expect_identical(q[0], q[1], stream, what + " values");
      test::expect_identical(sc[0], sc[1], stream, what + " scales");
    }
  }
}

TEST(CudaLoraEmbedding, MatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(1010);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    const int tokens = 45;
    const int max_loras = 4;
    const int max_rank = 24;
    const int64_t vocab = 1000;
    const int64_t hidden = 328;
    const auto slots =
        test::make_slots(test::SlotDistribution::kUniform, tokens, max_loras, rng, 0.2);
    std::uniform_int_distribution<int32_t> id_of(0, static_cast<int32_t>(vocab - 1));
    std::vector<int32_t> ids(static_cast<size_t>(tokens));
    for (auto& i : ids) i = id_of(rng);
    const Tensor a = test::random_tensor({max_loras, vocab, max_rank}, dtype, rng);
    const Tensor b = test::random_tensor({max_loras, hidden, max_rank}, dtype, rng, 0.2f);
    const Tensor y0 = test::random_tensor({tokens, hidden}, dtype, rng);
    Tensor out[2];
    for (int dev = 0; dev < 2; ++dev) {
      const Device device = device_of(dev);
      const Stream& s = dev == 0 ? stream : cpu;
      PunicaWrapper wrapper(max_loras, 64, 1, device);
      wrapper.update_metadata(slots, {}, s);
      SlotRanks ranks(1, max_loras, max_rank, device);
      for (int k = 0; k < max_loras; ++k) ranks.set(0, k, k == 1 ? 0 : (k == 2 ? 7 : max_rank), s);
      Tensor y = y0.clone().to(device, s);
      wrapper.add_lora_embedding(y, test::int_tensor(ids).to(device, s), a.to(device, s),
                                 b.to(device, s), ranks, 0.5f, s);
      out[dev] = host_result(y, dev, s);
    }
    const double rtol = test::default_rtol(dtype);
    test::expect_matches(out[0], out[1], stream, rtol, rtol * 2,
                         std::string("embedding ") + std::string(dtype_name(dtype)));
  }
}

struct MoeCase {
  DType dtype;
  int tokens;
  int top_k;
  int experts;
  int max_loras;
  int max_rank;
  int64_t k_dim;
  int64_t n;
  int slices;
  bool w2;  // rows of x are pairs, routed weight multiplied
  int block_size;
  bool add_inputs;
};

// Routing at Mixtral's and Qwen3-MoE's widths (8 and 128 experts, more than a warp's lanes),
// with tied logits (integers / 4, so many rows hold equal probabilities): the same experts in
// the same order as the CPU, ties to the lower id, and the same weights.
TEST(CudaTopkSoftmax, SameExpertsAndWeightsAsCpuWithTies) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(515);
  Stream stream = Stream::create(test::gpu());
  const Stream cpu = Stream::default_for(Device::cpu());
  struct Case {
    int experts;
    int top_k;
    bool renormalize;
    DType dtype;
  };
  for (const Case& c : {Case{8, 2, true, DType::kBF16}, Case{128, 8, false, DType::kBF16},
                        Case{128, 8, true, DType::kF32}, Case{60, 4, true, DType::kF16},
                        Case{128, 1, false, DType::kF32}}) {
    const int64_t tokens = 37;
    std::uniform_int_distribution<int> level(-12, 12);
    std::vector<float> values(static_cast<size_t>(tokens * c.experts));
    for (float& v : values) v = static_cast<float>(level(rng)) / 4.0f;
    const Tensor logits = Tensor::from_vector(values, {tokens, c.experts}).to(c.dtype);
    Tensor ids[2];
    Tensor weights[2];
    for (int dev = 0; dev < 2; ++dev) {
      const Stream& s = dev == 0 ? stream : cpu;
      const Tensor in = logits.to(device_of(dev), s);
      ids[dev] = Tensor::empty({tokens, c.top_k}, DType::kI32, device_of(dev));
      weights[dev] = Tensor::empty({tokens, c.top_k}, DType::kF32, device_of(dev));
      kernels::TopkSoftmaxArgs a;
      a.dtype = c.dtype;
      a.logits = in.data_ptr();
      a.logits_stride = c.experts;
      a.num_tokens = tokens;
      a.num_experts = c.experts;
      a.top_k = c.top_k;
      a.renormalize = c.renormalize;
      a.ids = ids[dev].data<int32_t>();
      a.weights = weights[dev].data<float>();
      throw_if_error(kernels::dispatch_topk_softmax(a, s));
    }
    const std::string what = std::to_string(c.experts) + " experts, top " +
                             std::to_string(c.top_k) + ", " + std::string(dtype_name(c.dtype));
    test::expect_identical(ids[0], ids[1], stream, what + ": ids");
    test::expect_matches(weights[0], weights[1], stream, 1e-5, 1e-7, what + ": weights");
  }
}

TEST(CudaMoeLora, AlignmentMatchesCpuExactlyAndFusedOpMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(1111);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  const std::vector<MoeCase> cases = {
      {DType::kBF16, 5, 2, 32, 4, 16, 256, 128, 2, false, 16, true},   // naive (small batch)
      {DType::kBF16, 70, 2, 8, 4, 16, 256, 128, 2, false, 16, true},   // aligned, w13
      {DType::kF16, 90, 4, 16, 3, 8, 128, 96, 1, true, 32, true},      // aligned, w2
      {DType::kF32, 33, 3, 6, 2, 12, 40, 24, 2, false, 16, false},     // aligned, overwrite
      {DType::kBF16, 2, 1, 64, 8, 16, 64, 32, 1, true, 16, true},      // naive, w2
      {DType::kBF16, 300, 2, 300, 3, 8, 32, 16, 1, false, 16, true},   // many experts
      {DType::kBF16, 9, 2, 4, 3, 6, 50, 30, 2, false, 16, true},       // rows of odd width
      {DType::kBF16, 400, 2, 8, 8, 16, 512, 700, 2, false, 16, true},  // prefill-sized blocks
      // From 4,096 routed pairs the tensor-core shrink (bf16/f16, K in 16s, max_rank in 8s).
      {DType::kBF16, 2100, 2, 8, 4, 24, 128, 96, 2, false, 16, true},  // tensor cores, w13
      {DType::kF16, 1100, 4, 16, 3, 32, 96, 136, 1, true, 16, false},  // tensor cores, w2
  };
  for (const MoeCase& c : cases) {
    const int64_t pairs = static_cast<int64_t>(c.tokens) * c.top_k;
    const bool naive = kernels::moe_use_naive_blocks(c.tokens, c.top_k, c.experts, c.max_loras);
    const auto slots =
        test::make_slots(test::SlotDistribution::kUniform, c.tokens, c.max_loras, rng, 0.2);
    std::uniform_int_distribution<int32_t> expert_of(-1, c.experts - 1);
    std::vector<int32_t> topk(static_cast<size_t>(pairs));
    for (auto& e : topk) e = expert_of(rng);
    std::vector<int32_t> enabled(static_cast<size_t>(c.max_loras), 1);
    enabled[0] = c.max_loras > 1 ? 0 : 1;
    std::uniform_int_distribution<int32_t> rank_of(0, c.max_rank);
    std::vector<int32_t> ranks(static_cast<size_t>(c.slices * c.max_loras));
    for (auto& r : ranks) r = rank_of(rng);
    const float a_scale = 1.0f / std::sqrt(static_cast<float>(c.k_dim));
    std::vector<Tensor> a;
    std::vector<Tensor> b;
    for (int s = 0; s < c.slices; ++s) {
      a.push_back(test::random_tensor({c.max_loras, c.experts, c.max_rank, c.k_dim}, c.dtype, rng,
                                      a_scale));
      b.push_back(
          test::random_tensor({c.max_loras, c.experts, c.n, c.max_rank}, c.dtype, rng, 0.3f));
    }
    const Tensor x = test::random_tensor({c.w2 ? pairs : c.tokens, c.k_dim}, c.dtype, rng);
    const Tensor weights = test::random_tensor({pairs}, DType::kF32, rng);
    const int64_t width = c.slices * c.n + 8;
    const Tensor out0 = test::random_tensor({pairs, width}, c.dtype, rng);
    const kernels::MoeAlignSizes sizes = kernels::moe_align_sizes(pairs, c.experts, c.block_size);
    Tensor sorted[2];
    Tensor expert_ids[2];
    Tensor post[2];
    Tensor out[2];
    for (int dev = 0; dev < 2; ++dev) {
      const Device device = device_of(dev);
      const Stream& s = dev == 0 ? stream : cpu;
      const Tensor mapping = test::int_tensor(slots).to(device, s);
      const Tensor topk_d = test::int_tensor(topk).to(device, s);
      const Tensor enabled_d = test::int_tensor(enabled).to(device, s);
      const Tensor ranks_d = test::int_tensor(ranks).to(device, s);
      Tensor sorted_d =
          Tensor::empty({c.max_loras, sizes.max_num_tokens_padded}, DType::kI32, device);
      Tensor experts_d = Tensor::empty({c.max_loras, sizes.max_num_m_blocks}, DType::kI32, device);
      Tensor post_d = Tensor::empty({c.max_loras}, DType::kI32, device);
      kernels::MoeAlignArgs al;
      al.num_tokens = c.tokens;
      al.top_k = c.top_k;
      al.num_experts = c.experts;
      al.block_size = c.block_size;
      al.max_loras = c.max_loras;
      al.topk_ids = topk_d.data<int32_t>();
      al.token_lora_mapping = mapping.data<int32_t>();
      al.adapter_enabled = enabled_d.data<int32_t>();
      al.max_num_tokens_padded = sizes.max_num_tokens_padded;
      al.max_num_m_blocks = sizes.max_num_m_blocks;
      al.sorted_ids = sorted_d.data<int32_t>();
      al.expert_ids = experts_d.data<int32_t>();
      al.num_tokens_post_pad = post_d.data<int32_t>();
      throw_if_error(dispatch_moe_lora_align(al, s));
      std::vector<Tensor> ad;
      std::vector<Tensor> bd;
      for (int i = 0; i < c.slices; ++i) {
        ad.push_back(a[static_cast<size_t>(i)].to(device, s));
        bd.push_back(b[static_cast<size_t>(i)].to(device, s));
      }
      const Tensor x_d = x.to(device, s);
      const Tensor w_d = weights.to(device, s);
      Tensor o = out0.clone().to(device, s);
      kernels::FusedMoeLoraArgs f;
      f.dtype = c.dtype;
      f.num_tokens = c.tokens;
      f.top_k = c.top_k;
      f.num_experts = c.experts;
      f.hidden_in = c.k_dim;
      f.x = x_d.data_ptr();
      f.x_rows_are_pairs = c.w2;
      f.num_slices = c.slices;
      for (int i = 0; i < c.slices; ++i) {
        f.lora_a[i] = ad[static_cast<size_t>(i)].data_ptr();
        f.lora_b[i] = bd[static_cast<size_t>(i)].data_ptr();
      }
      f.n = c.n;
      f.max_loras = c.max_loras;
      f.max_rank = c.max_rank;
      f.ranks = ranks_d.data<int32_t>();
      f.token_lora_mapping = mapping.data<int32_t>();
      f.adapter_enabled = enabled_d.data<int32_t>();
      f.topk_ids = topk_d.data<int32_t>();
      f.topk_weights = w_d.data<float>();
      f.mul_routed_weight = c.w2;
      f.naive_blocks = naive;
      f.overlap_preceding_kernel = naive;  // the op's inputs were copied, not computed
      f.block_size = c.block_size;
      f.max_num_tokens_padded = sizes.max_num_tokens_padded;
      f.max_num_m_blocks = sizes.max_num_m_blocks;
      f.sorted_ids = sorted_d.data<int32_t>();
      f.expert_ids = experts_d.data<int32_t>();
      f.num_tokens_post_pad = post_d.data<int32_t>();
      Tensor mid = Tensor::empty({kernels::fused_moe_lora_mid_floats(pairs, c.slices, c.max_rank)},
                                 DType::kF32, device);
      f.lora_mid = mid.data<float>();
      f.out = o.data_ptr();
      f.out_row_width = width;
      f.offset = 8;
      f.add_inputs = c.add_inputs;
      throw_if_error(dispatch_fused_moe_lora(f, s));
      sorted[dev] = host_result(sorted_d, dev, s);
      expert_ids[dev] = host_result(experts_d, dev, s);
      post[dev] = host_result(post_d, dev, s);
      out[dev] = host_result(o, dev, s);
    }
    const std::string what = std::string("moe ") + std::string(dtype_name(c.dtype)) + " T" +
                             std::to_string(c.tokens) + " E" + std::to_string(c.experts) +
                             (naive ? " naive" : " aligned") + (c.w2 ? " w2" : " w13");
    test::expect_identical(sorted[0], sorted[1], stream, what + " sorted_ids");
    test::expect_identical(expert_ids[0], expert_ids[1], stream, what + " expert_ids");
    test::expect_identical(post[0], post[1], stream, what + " num_tokens_post_pad");
    const double rtol = test::default_rtol(c.dtype);
    test::expect_matches(out[0], out[1], stream, rtol, rtol * 2, what + " output");
  }
}

}  // namespace
}  // namespace loraplex
