#pragma once
// Element types and correctly rounded scalar conversions (round to nearest, ties to even).
// The 16- and 8-bit types are plain bit containers on the host so that CPU code, the
// safetensors reader and CUDA kernels all agree on the memory layout.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string_view>
#include <type_traits>

namespace loraplex {

enum class DType : uint8_t { kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kI32, kI64, kU8 };

/// Bytes per element.
size_t dtype_size(DType dtype);
/// Short name used in messages and on the command line: "float32", "bfloat16", "float8_e4m3".
std::string_view dtype_name(DType dtype);
/// Parses dtype_name() output and the common aliases ("f32", "bf16", "fp16", "half", ...);
/// throws loraplex::Error naming the text and the accepted names.
DType dtype_from_name(std::string_view name);
bool is_floating(DType dtype);
bool is_fp8(DType dtype);
std::ostream& operator<<(std::ostream& os, DType dtype);

// Scalar conversions. Narrowing conversions round to nearest even. f16 and bf16 overflow to
// infinity (IEEE); fp8 saturates finite overflow and infinities to +-max, as CUDA's
// __NV_SATFINITE does. NaN maps to the canonical NaN of the target.
uint16_t float_to_f16_bits(float value);
float f16_bits_to_float(uint16_t bits);
// Inline: adapters and random weights convert billions of elements through these.
inline uint16_t float_to_bf16_bits(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + bias) >> 16);
}
inline float bf16_bits_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}
/// OCP E4M3FN: bias 7, max 448, no infinities, NaN = S.1111.111.
uint8_t float_to_e4m3_bits(float value);
float e4m3_bits_to_float(uint8_t bits);
/// E5M2: bias 15, max 57344, IEEE-style infinities and NaNs.
uint8_t float_to_e5m2_bits(float value);
float e5m2_bits_to_float(uint8_t bits);

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

struct Half {
  uint16_t bits;
  static Half from_float(float v) { return Half{float_to_f16_bits(v)}; }
  float to_float() const { return f16_bits_to_float(bits); }
};
struct BFloat16 {
  uint16_t bits;
  static BFloat16 from_float(float v) { return BFloat16{float_to_bf16_bits(v)}; }
  float to_float() const { return bf16_bits_to_float(bits); }
};
struct Fp8E4M3 {
  uint8_t bits;
  static Fp8E4M3 from_float(float v) { return Fp8E4M3{float_to_e4m3_bits(v)}; }
  float to_float() const { return e4m3_bits_to_float(bits); }
};
struct Fp8E5M2 {
  uint8_t bits;
  static Fp8E5M2 from_float(float v) { return Fp8E5M2{float_to_e5m2_bits(v)}; }
  float to_float() const { return e5m2_bits_to_float(bits); }
};

/// The DType of a host element type.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<Half> {
  static constexpr DType value = DType::kF16;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct DTypeOf<Fp8E4M3> {
  static constexpr DType value = DType::kF8E4M3;
};
template <>
struct DTypeOf<Fp8E5M2> {
  static constexpr DType value = DType::kF8E5M2;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kI64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::kU8;
};
template <typename T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

/// Loads one element of any floating host type as float.
inline float load_float(float v) { return v; }
inline float load_float(Half v) { return v.to_float(); }
inline float load_float(BFloat16 v) { return v.to_float(); }
inline float load_float(Fp8E4M3 v) { return v.to_float(); }
inline float load_float(Fp8E5M2 v) { return v.to_float(); }

/// Stores a float into any floating host type, correctly rounded.
template <typename T>
T store_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return T::from_float(v);
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

/// Calls `fn(TypeTag<T>{})` with T the host type of `dtype`, for the activation dtypes
/// f32/f16/bf16; returns false (and calls nothing) for any other dtype. One dispatch helper
/// instead of a switch in every op.
template <typename Fn>
bool dispatch_activation_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(TypeTag<float>{});
      return true;
    case DType::kF16:
      fn(TypeTag<Half>{});
      return true;
    case DType::kBF16:
      fn(TypeTag<BFloat16>{});
      return true;
    default:
      return false;
  }
}

/// As dispatch_activation_dtype, for the two fp8 formats.
template <typename Fn>
bool dispatch_fp8_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF8E4M3:
      fn(TypeTag<Fp8E4M3>{});
      return true;
    case DType::kF8E5M2:
      fn(TypeTag<Fp8E5M2>{});
      return true;
    default:
      return false;
  }
}

}  // namespace loraplex
