// The CPU ops' inline conversions agree bit for bit with core's, and their dot product depends
// on its inputs only (not on alignment or what surrounds them).

#include "loraplex/kernels/cpu/cpu_common.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

namespace loraplex::kernels::cpu::detail {
namespace {

TEST(CpuConvert, HalfLoadsMatchCoreForEveryBitPattern) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float fast = to_float(Half{static_cast<uint16_t>(bits)});
    const float core = f16_bits_to_float(static_cast<uint16_t>(bits));
    ASSERT_EQ(std::bit_cast<uint32_t>(fast), std::bit_cast<uint32_t>(core)) << std::hex << bits;
  }
}

TEST(CpuConvert, BFloat16LoadsMatchCoreForEveryBitPattern) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float fast = to_float(BFloat16{static_cast<uint16_t>(bits)});
    const float core = bf16_bits_to_float(static_cast<uint16_t>(bits));
    ASSERT_EQ(std::bit_cast<uint32_t>(fast), std::bit_cast<uint32_t>(core)) << std::hex << bits;
  }
}

TEST(CpuConvert, StoresMatchCoreRounding) {
  // Every float exponent with many mantissas, plus ties, boundaries and specials.
  std::vector<uint32_t> patterns;
  std::mt19937 rng(1);
  for (uint32_t i = 0; i < (1u << 20); ++i) patterns.push_back(rng());
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t m : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x3000u, 0x7fffu, 0x8000u, 0x8001u,
                       0x18000u, 0x7fffffu, 0x7ff000u}) {
      patterns.push_back((e << 23) | m);
      patterns.push_back(0x80000000u | (e << 23) | m);
    }
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 6.1035156e-05f, 5.9604645e-08f,
                  2.9802322e-08f, 2.9802326e-08f, INFINITY, -INFINITY, NAN}) {
    patterns.push_back(std::bit_cast<uint32_t>(f));
  }
  for (uint32_t p : patterns) {
    const float f = std::bit_cast<float>(p);
    ASSERT_EQ(from_float<Half>(f).bits, float_to_f16_bits(f)) << std::hex << p;
    ASSERT_EQ(from_float<BFloat16>(f).bits, float_to_bf16_bits(f)) << std::hex << p;
  }
}

TEST(CpuConvert, DotDependsOnItsInputsOnly) {
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int n : {1, 15, 16, 17, 33, 4096}) {
    std::vector<float> a(static_cast<size_t>(n) + 5);
    std::vector<float> b(static_cast<size_t>(n) + 5);
    for (auto& v : a) v = u(rng);
    for (auto& v : b) v = u(rng);
    // The same values at another alignment give the same bits.
    std::vector<float> a2(a.begin(), a.begin() + n);
    std::vector<float> b2(b.begin(), b.begin() + n);
    a2.insert(a2.begin(), 3, 0.0f);
    b2.insert(b2.begin(), 3, 0.0f);
    const float d1 = dot(a.data(), b.data(), n);
    const float d2 = dot(a2.data() + 3, b2.data() + 3, n);
    EXPECT_EQ(std::bit_cast<uint32_t>(d1), std::bit_cast<uint32_t>(d2)) << n;
    double ref = 0.0;
    double mag = 0.0;
    for (int i = 0; i < n; ++i) {
      ref += static_cast<double>(a[i]) * b[i];
      mag += std::fabs(static_cast<double>(a[i]) * b[i]);
    }
    EXPECT_LE(std::fabs(d1 - ref), (n / 16.0 + 6) * std::ldexp(1.0, -24) * mag) << n;
  }
}

}  // namespace
}  // namespace loraplex::kernels::cpu::detail
