// lora_expand_fp8 (weight-only and W8A8, per-tensor/channel/block scales, e4m3 and e5m2) and
// the W8A8 intermediate quantisation through the Punica wrapper on the CPU.

#include <gtest/gtest.h>

#include <functional>

#include "kernels_cpu/op_cases.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::test {
namespace {

const Device kCpu = Device::cpu();

class LoraExpandFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(LoraExpandFp8, MatchesDoubleReference) {
  const Fp8Problem p = make_fp8_problem(GetParam());
  const Fp8Input in = fp8_expand_input(p, kCpu);
  if (in.in_scale.defined()) {
    EXPECT_TRUE(check_quantized(p, in));
  }
  const Tensor got = run_expand_fp8(p, in, kCpu);
  EXPECT_TRUE(matches_reference(got, p.y0, reference_expand_fp8(p, in), expand_fp8_tolerance(p)));
}

INSTANTIATE_TEST_SUITE_P(, LoraExpandFp8, ::testing::ValuesIn(fp8_cases()),
                         [](const auto& info) { return case_name(info.param); });

// A one-slice fp8 expand whose pieces the error tests replace one at a time.
struct Fp8Call {
  std::mt19937_64 rng{11};
  PunicaWrapper wrapper{2, 8, 1, Device::cpu()};
  Stream cpu;
  SlotRanks ranks{1, 2, 4, Device::cpu()};
  std::vector<Tensor> weights = {random_tensor({2, 6, 4}, DType::kF8E4M3, rng, 100.0f)};
  std::vector<Tensor> scales = {random_tensor({2, 6}, DType::kF32, rng, 0.01f)};
  Tensor mid = random_tensor({1, 3, 4}, DType::kF32, rng);
  Tensor y = random_tensor({3, 6}, DType::kBF16, rng);

  Fp8Call() {
    wrapper.update_metadata(std::vector<int32_t>{0, 1, -1}, {}, cpu);
    ranks.set_slot(0, 4, cpu);
    ranks.set_slot(1, 3, cpu);
  }
  Fp8LoraB b() const {
    Fp8LoraB f;
    f.weights = weights;
    f.scales = scales;
    f.scale_kind = kernels::Fp8ScaleKind::kPerChannel;
    return f;
  }
};

void expect_error(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(LoraExpandFp8, RejectsBadWeightsScalesAndIntermediates) {
  Fp8Call c;
  c.wrapper.add_expand_fp8(c.y, c.mid, c.b(), c.ranks, 0, true, c.cpu);
  {
    Fp8LoraB f = c.b();
    f.scale_kind = kernels::Fp8ScaleKind::kPerTensor;  // scales are [2, 6], per tensor is [2]
    expect_error([&] { c.wrapper.add_expand_fp8(c.y, c.mid, f, c.ranks, 0, true, c.cpu); },
                 "LoRA-B scale must be contiguous float32[2], got float32[2, 6]");
  }
  {
    const std::vector<Tensor> bf16 = {c.weights[0].to(DType::kBF16)};
    Fp8LoraB f = c.b();
    f.weights = bf16;
    expect_error([&] { c.wrapper.add_expand_fp8(c.y, c.mid, f, c.ranks, 0, true, c.cpu); },
                 "has dtype bfloat16, expected float8_e4m3 or float8_e5m2");
  }
  {
    const Tensor q = c.mid.to(DType::kF8E4M3);
    expect_error([&] { c.wrapper.add_expand_fp8(c.y, q, c.b(), c.ranks, 0, true, c.cpu); },
                 "intermediate scale is undefined");
    const Tensor bad_scale = Tensor::zeros({1, 2}, DType::kF32);
    expect_error(
        [&] { c.wrapper.add_expand_fp8(c.y, q, c.b(), c.ranks, 0, true, c.cpu, bad_scale); },
        "intermediate scale must be contiguous float32[1, 3]");
  }
  {
    const Tensor f16_mid = c.mid.to(DType::kF16);
    expect_error([&] { c.wrapper.add_expand_fp8(c.y, f16_mid, c.b(), c.ranks, 0, true, c.cpu); },
                 "intermediate dtype float16, expected float32, bfloat16 or fp8");
  }
  {
    Fp8LoraB f = c.b();
    f.scale_kind = kernels::Fp8ScaleKind::kPerBlock;
    f.group_n = 0;
    expect_error([&] { c.wrapper.add_expand_fp8(c.y, c.mid, f, c.ranks, 0, true, c.cpu); },
                 "block scale groups 0x128");
  }
  expect_error([&] { c.wrapper.add_expand_fp8(c.y, c.mid, c.b(), c.ranks, 1, true, c.cpu); },
               "slices cover columns [1, 7) but y has 6 columns");
}

TEST_F(LoraExpandFp8, QuantizeRejectsBadShapes) {
  Fp8Call c;
  Tensor q = Tensor::empty({1, 3, 4}, DType::kF8E5M2);
  Tensor scale = Tensor::empty({1, 3}, DType::kF32);
  c.wrapper.quantize_intermediate_fp8(q, scale, c.mid, c.ranks, c.cpu);
  Tensor q_bf16 = Tensor::empty({1, 3, 4}, DType::kBF16);
  expect_error([&] { c.wrapper.quantize_intermediate_fp8(q_bf16, scale, c.mid, c.ranks, c.cpu); },
               "output dtype bfloat16, expected float8_e4m3 or float8_e5m2");
  Tensor scale_bad = Tensor::empty({2}, DType::kF32);
  expect_error([&] { c.wrapper.quantize_intermediate_fp8(q, scale_bad, c.mid, c.ranks, c.cpu); },
               "scale must be contiguous float32[1], got float32[2]");
  const Tensor mid_bf16 = c.mid.to(DType::kBF16);
  expect_error([&] { c.wrapper.quantize_intermediate_fp8(q, scale, mid_bf16, c.ranks, c.cpu); },
               "input must be contiguous float32[1, 3, 4], got bfloat16[1, 3, 4]");
}

}  // namespace
}  // namespace loraplex::test
