#include "loraplex/core/dtype.h"

#include <array>
#include <bit>
#include <cmath>
#include <string>

#include "loraplex/core/error.h"

namespace loraplex {
namespace {

// Rounds `value >> shift` to nearest, ties to even. `shift` is in [1, 31].
uint32_t shift_right_rne(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// Magnitude code of |f| in a format with M mantissa bits and exponent bias BIAS, rounded to
// nearest even; may exceed the largest finite code (the caller saturates or makes infinity).
// `a` is the float's bits without the sign and is finite.
template <int M, int BIAS>
uint32_t round_magnitude(uint32_t a) {
  const int exp = static_cast<int>(a >> 23) - 127;
  const uint32_t mant = a & 0x7fffffu;
  constexpr int kMinExp = 1 - BIAS;
  if (exp >= kMinExp) {
    if (exp > 2 * BIAS + 2) return 0xffffffffu;  // far beyond any finite code
    const uint32_t biased = static_cast<uint32_t>(exp + BIAS);
    // Rounding may carry into the exponent field, which is the correct next binade.
    return (biased << M) + shift_right_rne(mant, 23 - M);
  }
  // Subnormal in the target: count units of 2^(kMinExp - M).
  const int shift = 23 + kMinExp - M - exp;
  if (shift >= 25) return 0;  // below half the smallest subnormal
  return shift_right_rne(mant | 0x800000u, shift);
}

template <int M, int BIAS>
uint8_t float_to_fp8_satfinite(float value, uint32_t max_code) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;  // NaN
  uint32_t code = a == 0x7f800000u ? max_code : round_magnitude<M, BIAS>(a);
  if (code > max_code) code = max_code;
  return static_cast<uint8_t>(sign | code);
}

float make_float(bool negative, float magnitude) { return negative ? -magnitude : magnitude; }

std::array<float, 256> build_e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exp = (b >> 3) & 0xf;
    const int mant = b & 7;
    float mag;
    if (exp == 15 && mant == 7) {
      mag = std::nanf("");
    } else if (exp == 0) {
      mag = std::ldexp(static_cast<float>(mant), -9);
    } else {
      mag = std::ldexp(static_cast<float>(8 + mant), exp - 7 - 3);
    }
    t[b] = make_float(b & 0x80, mag);
  }
  return t;
}

std::array<float, 256> build_e5m2_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exp = (b >> 2) & 0x1f;
    const int mant = b & 3;
    float mag;
    if (exp == 31) {
      mag = mant == 0 ? INFINITY : std::nanf("");
    } else if (exp == 0) {
      mag = std::ldexp(static_cast<float>(mant), -16);
    } else {
      mag = std::ldexp(static_cast<float>(4 + mant), exp - 15 - 2);
    }
    t[b] = make_float(b & 0x80, mag);
  }
  return t;
}

const std::array<float, 256> kE4M3Table = build_e4m3_table();
const std::array<float, 256> kE5M2Table = build_e5m2_table();

}  // namespace

uint16_t float_to_f16_bits(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN stays a (quiet) NaN
  if (a >= 0x47800000u) return sign | 0x7c00u;  // >= 2^16 or infinity
  // Codes at or past 0x7c00 after rounding are infinity, which is IEEE overflow.
  return static_cast<uint16_t>(sign | round_magnitude<10, 15>(a));
}

float f16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  const uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint8_t float_to_e4m3_bits(float value) { return float_to_fp8_satfinite<3, 7>(value, 0x7eu); }
float e4m3_bits_to_float(uint8_t bits) { return kE4M3Table[bits]; }
uint8_t float_to_e5m2_bits(float value) { return float_to_fp8_satfinite<2, 15>(value, 0x7bu); }
float e5m2_bits_to_float(uint8_t bits) { return kE5M2Table[bits]; }

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kU8:
      return 1;
    case DType::kI64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF8E4M3:
      return "float8_e4m3";
    case DType::kF8E5M2:
      return "float8_e5m2";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kU8:
      return "uint8";
  }
  return "unknown";
}

DType dtype_from_name(std::string_view name) {
  struct Alias {
    std::string_view text;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"float32", DType::kF32},        {"f32", DType::kF32},
      {"fp32", DType::kF32},           {"float", DType::kF32},
      {"float16", DType::kF16},        {"f16", DType::kF16},
      {"fp16", DType::kF16},           {"half", DType::kF16},
      {"bfloat16", DType::kBF16},      {"bf16", DType::kBF16},
      {"float8_e4m3", DType::kF8E4M3}, {"e4m3", DType::kF8E4M3},
      {"float8_e5m2", DType::kF8E5M2}, {"e5m2", DType::kF8E5M2},
      {"int32", DType::kI32},          {"int64", DType::kI64},
      {"uint8", DType::kU8},
  };
  for (const Alias& alias : kAliases) {
    if (alias.text == name) return alias.dtype;
  }
  LORAPLEX_FAIL("unknown dtype '", std::string(name),
                "', expected one of float32, float16, bfloat16, float8_e4m3, float8_e5m2, "
                "int32, int64, uint8");
}

bool is_floating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16 || is_fp8(dtype);
}

bool is_fp8(DType dtype) { return dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2; }

std::ostream& operator<<(std::ostream& os, DType dtype) { return os << dtype_name(dtype); }

}  // namespace loraplex
