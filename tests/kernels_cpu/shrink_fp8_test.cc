// add_shrink_fp8 (the shrink of fp8 adapter storage: e4m3 LoRA-A with a float32 scale per row)
// on the CPU against a double loop over the dequantized rows, with ranks per (slice, slot),
// tokens of no adapter and columns past a slot's rank left untouched.

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels_cpu/op_cases.h"
#include "loraplex/core/error.h"
#include "loraplex/punica/punica_wrapper.h"
#include "support/gpu_check.h"

namespace loraplex::test {
namespace {

struct ShrinkFp8Problem {
  int tokens = 37;
  int64_t hidden = 77;
  int slices = 3;
  int max_loras = 4;
  int max_rank = 8;
  std::vector<int32_t> slots;
  std::vector<std::vector<int32_t>> ranks;  // [slot][slice]
  Tensor x;
  std::vector<Tensor> a;       // per slice e4m3 [max_loras, max_rank, hidden]
  std::vector<Tensor> scales;  // per slice f32 [max_loras, max_rank]
};

ShrinkFp8Problem make(DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ShrinkFp8Problem p;
  p.slots = make_slots(SlotDistribution::kUniform, p.tokens, p.max_loras, rng, 0.25);
  std::uniform_int_distribution<int32_t> rank(0, p.max_rank);
  p.ranks.assign(static_cast<size_t>(p.max_loras), std::vector<int32_t>(3));
  for (auto& r : p.ranks) {
    for (int32_t& v : r) v = rank(rng);
  }
  p.x = random_tensor({p.tokens, p.hidden}, dtype, rng);
  for (int s = 0; s < p.slices; ++s) {
    p.a.push_back(random_tensor({p.max_loras, p.max_rank, p.hidden}, DType::kF8E4M3, rng, 100.f));
    p.scales.push_back(random_tensor({p.max_loras, p.max_rank}, DType::kF32, rng, 0.01f));
  }
  return p;
}

// Runs add_shrink_fp8 on `device` into an output filled with 7s.
Tensor run(const ShrinkFp8Problem& p, Device device) {
  const Stream stream = device.is_cpu() ? Stream() : Stream::create(device);
  PunicaWrapper w(p.max_loras, p.tokens, 1, device);
  w.update_metadata(p.slots, {}, stream);
  SlotRanks ranks(p.slices, p.max_loras, p.max_rank, device);
  for (int k = 0; k < p.max_loras; ++k) ranks.set_slot(k, p.ranks[static_cast<size_t>(k)], stream);
  std::vector<Tensor> a;
  std::vector<Tensor> s;
  for (int i = 0; i < p.slices; ++i) {
    a.push_back(p.a[static_cast<size_t>(i)].to(device, stream));
    s.push_back(p.scales[static_cast<size_t>(i)].to(device, stream));
  }
  Tensor out = Tensor::empty({p.slices, p.tokens, p.max_rank}, DType::kF32);
  for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] = 7.0f;
  Tensor dev_out = out.to(device, stream);
  w.add_shrink_fp8(dev_out, p.x.to(device, stream), a, s, ranks, stream);
  stream.synchronize();
  Tensor back = dev_out.to(Device::cpu(), stream);
  stream.synchronize();
  return back;
}

void expect_reference(const ShrinkFp8Problem& p, const Tensor& got, const std::string& what) {
  const std::vector<double> x = p.x.to_double_vector();
  const float* g = got.data<float>();
  for (int s = 0; s < p.slices; ++s) {
    const uint8_t* q = static_cast<const uint8_t*>(p.a[static_cast<size_t>(s)].data_ptr());
    const float* sc = p.scales[static_cast<size_t>(s)].data<float>();
    for (int t = 0; t < p.tokens; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      const int rank = slot < 0 ? 0 : p.ranks[static_cast<size_t>(slot)][static_cast<size_t>(s)];
      for (int r = 0; r < p.max_rank; ++r) {
        const float v = g[(s * p.tokens + t) * p.max_rank + r];
        if (r >= rank) {
          ASSERT_EQ(v, 7.0f) << what << ": slice " << s << " token " << t << " column " << r;
          continue;
        }
        double acc = 0.0;
        double mag = 0.0;
        const int64_t row = (static_cast<int64_t>(slot) * p.max_rank + r) * p.hidden;
        for (int64_t c = 0; c < p.hidden; ++c) {
          const double w =
              static_cast<double>(e4m3_bits_to_float(q[row + c])) * sc[slot * p.max_rank + r];
          acc += x[t * p.hidden + c] * w;
          mag += std::fabs(x[t * p.hidden + c] * w);
        }
        ASSERT_NEAR(v, acc, 1e-5 * mag + 1e-30) << what << ": slice " << s << " token " << t;
      }
    }
  }
}

TEST(LoraShrinkFp8, CpuMatchesDoubleLoopOnTheDequantizedRows) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const ShrinkFp8Problem p = make(dt, 61);
    expect_reference(p, run(p, Device::cpu()), std::string(dtype_name(dt)));
  }
}

TEST(LoraShrinkFp8, CudaMatchesDoubleLoopOnTheDequantizedRows) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const ShrinkFp8Problem p = make(dt, 62);
    expect_reference(p, run(p, Device::cuda(0)), std::string(dtype_name(dt)) + " cuda");
  }
}

TEST(LoraShrinkFp8, RefusesFloatStacksAndScalesOfTheWrongShape) {
  ShrinkFp8Problem p = make(DType::kF32, 63);
  PunicaWrapper w(p.max_loras, p.tokens, 1, Device::cpu());
  w.update_metadata(p.slots, {}, Stream());
  SlotRanks ranks(p.slices, p.max_loras, p.max_rank, Device::cpu());
  Tensor out = Tensor::zeros({p.slices, p.tokens, p.max_rank}, DType::kF32);
  std::vector<Tensor> float_a;
  for (const Tensor& a : p.a) float_a.push_back(a.to(DType::kF32));
  try {
    w.add_shrink_fp8(out, p.x, float_a, p.scales, ranks, Stream());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has dtype float32, expected float8_e4m3"),
              std::string::npos)
        << e.what();
  }
  std::vector<Tensor> short_scales = {p.scales[0].narrow(1, 0, 4), p.scales[1], p.scales[2]};
  try {
    w.add_shrink_fp8(out, p.x, p.a, short_scales, ranks, Stream());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scales of slice 0 must be contiguous float32 [4, 8]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace loraplex::test
