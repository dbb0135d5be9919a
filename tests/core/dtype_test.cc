#include "loraplex/core/dtype.h"

#include <gtest/gtest.h>
#include "loraplex/core/error.h"

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace loraplex {
namespace {

// Independent reference: the nearest of an explicit list of representable magnitudes, ties
// to the code with an even last bit, computed in double.
struct Codebook {
  std::vector<std::pair<double, uint32_t>> values;  // (magnitude, code), ascending
};

Codebook make_codebook(int man_bits, int bias, uint32_t max_code, double (*decode)(uint32_t)) {
  Codebook book;
  for (uint32_t code = 0; code <= max_code; ++code) book.values.push_back({decode(code), code});
  (void)man_bits;
  (void)bias;
  return book;
}

uint32_t nearest_even(const Codebook& book, double mag) {
  const auto& v = book.values;
  if (mag >= v.back().first) return v.back().second;
  for (size_t i = 0; i + 1 < v.size(); ++i) {
    const double lo = v[i].first;
    const double hi = v[i + 1].first;
    if (mag >= lo && mag <= hi) {
      const double dl = mag - lo;
      const double dh = hi - mag;
      if (dl < dh) return v[i].second;
      if (dh < dl) return v[i + 1].second;
      return (v[i].second & 1u) == 0 ? v[i].second : v[i + 1].second;
    }
  }
  return 0;
}

double decode_e4m3(uint32_t c) {
  const int e = static_cast<int>(c >> 3);
  const int m = static_cast<int>(c & 7);
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}
double decode_e5m2(uint32_t c) {
  const int e = static_cast<int>(c >> 2);
  const int m = static_cast<int>(c & 3);
  return e == 0 ? std::ldexp(m, -16) : std::ldexp(4 + m, e - 17);
}

std::vector<float> probe_values(const Codebook& book, uint64_t seed) {
  std::vector<float> xs;
  // Every representable value, every midpoint (an exact tie), and points just beside them.
  for (size_t i = 0; i < book.values.size(); ++i) {
    const double v = book.values[i].first;
    xs.push_back(static_cast<float>(v));
    if (i + 1 < book.values.size()) {
      const float mid = static_cast<float>((v + book.values[i + 1].first) / 2);
      xs.push_back(mid);
      xs.push_back(std::nextafter(mid, 0.0f));
      xs.push_back(std::nextafter(mid, INFINITY));
    }
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_mag(-22.0, 20.0);
  for (int i = 0; i < 20000; ++i) xs.push_back(static_cast<float>(std::exp2(log_mag(rng))));
  return xs;
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_from_name("bf16"), DType::kBF16);
  EXPECT_EQ(dtype_from_name(dtype_name(DType::kF8E5M2)), DType::kF8E5M2);
  try {
    dtype_from_name("float13");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float13"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos);
  }
}

TEST(DType, Float16RoundTripsEveryCode) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float f = f16_bits_to_float(static_cast<uint16_t>(bits));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_bits_to_float(float_to_f16_bits(f))));
      continue;
    }
    ASSERT_EQ(float_to_f16_bits(f), bits) << "value " << f;
  }
}

TEST(DType, Float16RoundsToNearestEven) {
  // 2049 lies exactly between 2048 and 2050 (f16 spacing 2 there): ties go to 2048 (even).
  EXPECT_EQ(f16_bits_to_float(float_to_f16_bits(2049.0f)), 2048.0f);
  EXPECT_EQ(f16_bits_to_float(float_to_f16_bits(2051.0f)), 2052.0f);
  EXPECT_EQ(f16_bits_to_float(float_to_f16_bits(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_bits_to_float(float_to_f16_bits(65520.0f))));
  // Smallest subnormal 2^-24; half of it is a tie that rounds to zero.
  EXPECT_EQ(f16_bits_to_float(float_to_f16_bits(std::ldexp(1.0f, -25))), 0.0f);
  EXPECT_EQ(f16_bits_to_float(float_to_f16_bits(std::ldexp(1.5f, -25))), std::ldexp(1.0f, -24));
}

TEST(DType, BFloat16RoundsToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t x = any(rng);
    const float f = std::bit_cast<float>(x);
    if (std::isnan(f)) continue;
    const float r = bf16_bits_to_float(float_to_bf16_bits(f));
    // Reference: the two bf16 neighbours by truncation, then the nearer (ties to even).
    const float lo = std::bit_cast<float>(x & 0xffff0000u);
    const uint32_t lo_bits = x >> 16;
    const float hi = bf16_bits_to_float(static_cast<uint16_t>(lo_bits + 1));
    const double dl = std::fabs(static_cast<double>(f) - lo);
    // Past the largest finite value the next step is 2^128, which rounds to infinity.
    const double hi_value = std::isinf(hi) ? std::copysign(std::ldexp(1.0, 128), hi) : hi;
    const double dh = std::fabs(hi_value - f);
    const float expect = dl < dh ? lo : (dh < dl ? hi : ((lo_bits & 1) ? hi : lo));
    ASSERT_EQ(std::bit_cast<uint32_t>(r), std::bit_cast<uint32_t>(expect)) << f;
  }
}

TEST(DType, Fp8E4M3MatchesNearestEvenReference) {
  const Codebook book = make_codebook(3, 7, 0x7e, decode_e4m3);
  EXPECT_EQ(book.values.back().first, 448.0);
  for (float x : probe_values(book, 11)) {
    const uint32_t expect = nearest_even(book, x);
    ASSERT_EQ(float_to_e4m3_bits(x), expect) << "x=" << x;
    ASSERT_EQ(float_to_e4m3_bits(-x), expect | 0x80u) << "x=" << -x;
    ASSERT_EQ(e4m3_bits_to_float(static_cast<uint8_t>(expect)),
              static_cast<float>(decode_e4m3(expect)));
  }
}

TEST(DType, Fp8E5M2MatchesNearestEvenReference) {
  const Codebook book = make_codebook(2, 15, 0x7b, decode_e5m2);
  EXPECT_EQ(book.values.back().first, 57344.0);
  for (float x : probe_values(book, 12)) {
    const uint32_t expect = nearest_even(book, x);
    ASSERT_EQ(float_to_e5m2_bits(x), expect) << "x=" << x;
    ASSERT_EQ(float_to_e5m2_bits(-x), expect | 0x80u) << "x=" << -x;
  }
}

TEST(DType, Fp8SaturatesAndKeepsNaN) {
  EXPECT_EQ(e4m3_bits_to_float(float_to_e4m3_bits(1e6f)), 448.0f);
  EXPECT_EQ(e4m3_bits_to_float(float_to_e4m3_bits(-INFINITY)), -448.0f);
  EXPECT_EQ(e4m3_bits_to_float(float_to_e4m3_bits(464.0f)), 448.0f);  // above max, below 480
  EXPECT_EQ(float_to_e4m3_bits(std::nanf("")), 0x7f);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0xff)));
  EXPECT_EQ(e5m2_bits_to_float(float_to_e5m2_bits(INFINITY)), 57344.0f);
  EXPECT_EQ(e5m2_bits_to_float(float_to_e5m2_bits(1e9f)), 57344.0f);
  EXPECT_TRUE(std::isinf(e5m2_bits_to_float(0x7c)));
  EXPECT_TRUE(std::isnan(e5m2_bits_to_float(float_to_e5m2_bits(std::nanf("")))));
}

TEST(DType, Fp8DecodeCoversEveryCode) {
  int e4m3_nans = 0;
  int e5m2_nans = 0;
  for (int b = 0; b < 256; ++b) {
    const float a = e4m3_bits_to_float(static_cast<uint8_t>(b));
    const float c = e5m2_bits_to_float(static_cast<uint8_t>(b));
    e4m3_nans += std::isnan(a);
    e5m2_nans += std::isnan(c);
    if (!std::isnan(a)) {
      EXPECT_EQ(float_to_e4m3_bits(a), b);
    }
  }
  EXPECT_EQ(e4m3_nans, 2);  // S.1111.111
  EXPECT_EQ(e5m2_nans, 6);  // S.11111.{01,10,11}
}

}  // namespace
}  // namespace loraplex
