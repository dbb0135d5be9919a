// Blocked CPU GEMM for y = x W^T.
//
// Many rows (prefill): each work item owns one [kTileM, kTileN] output tile and walks K in
// kTileK chunks. It packs its x rows (row-major) and its W rows transposed (k-major, so the
// tile's output columns are contiguous) to float, then runs a register-blocked micro-kernel
// whose inner loop updates MR x NR independent accumulators: independent lanes rather than a
// dot-product reduction, so the compiler vectorises it without reassociating float sums.
//
// Few rows (decode): W is read once, row by row, each row dotted with the (few) x rows using
// 16 explicit partial sums, again a vectorisable loop without reassociation.
//
// The kernels (gemm_cpu_kernels.inc) use GCC/Clang vector types and are compiled twice, for
// baseline x86-64 and for AVX2 (chosen at run time). Both builds do the same operations in the
// same order (no fused multiply-add), so results do not depend on the machine.
//
// An fp8 weight is dequantised where it is converted to float anyway (packing, or the row of the
// few-rows path): each element is its e4m3 value times its scale, one float product, which is
// exactly what torch computes for `q.float() * scale`; x is used as it is.

#include "loraplex/kernels/gemm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "loraplex/core/parallel.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LORAPLEX_GEMM_AVX2 1
#else
#define LORAPLEX_GEMM_AVX2 0
#endif
#define LORAPLEX_INLINE __attribute__((always_inline)) inline
// 32-byte vectors are passed by value only between force-inlined functions of this file, so
// the baseline build's ABI note about them (no AVX) does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loraplex::kernels::cpu {
namespace {

constexpr int64_t kTileM = 32;
constexpr int64_t kTileN = 64;
constexpr int64_t kTileK = 256;
constexpr int64_t kMicroM = 4;   // rows of the register block
constexpr int64_t kMicroN = 16;  // columns of the register block: two 8-float vectors
// Below this many rows W is streamed once instead of packed per row tile.
constexpr int64_t kFewRows = 8;
static_assert(kTileM % kMicroM == 0 && kTileN % kMicroN == 0);

typedef float Vec8 __attribute__((vector_size(32)));

// Inline element loads (the dtype.h ones are out of line); exact conversions.
LORAPLEX_INLINE float to_float(float v) { return v; }
LORAPLEX_INLINE float to_float(BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
LORAPLEX_INLINE float to_float(Half v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1fu;
  const uint32_t mant = v.bits & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &mag, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Built on first use (not at static initialisation, where dtype.cc's own table may not exist
// yet).
const float* e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[static_cast<size_t>(b)] = e4m3_bits_to_float(static_cast<uint8_t>(b));
    }
    return t;
  }();
  return table.data();
}

// Weight rows as floats: the activation type itself...
template <typename T>
struct PlainWeight {
  const T* w;
  int64_t row_stride;
  // dst[p * dst_stride] = w[r, c0 + p] for p < len.
  LORAPLEX_INLINE void row(int64_t r, int64_t c0, int64_t len, float* dst,
                           int64_t dst_stride) const {
    const T* src = w + r * row_stride + c0;
    for (int64_t p = 0; p < len; ++p) dst[p * dst_stride] = to_float(src[p]);
  }
};

// ... or e4m3 codes times their scales (Fp8WeightScales), one group of columns at a time.
struct Fp8Weight {
  const uint8_t* w;
  int64_t row_stride;
  Fp8WeightScales s;
  const float* values;  // e4m3_values()
  LORAPLEX_INLINE void row(int64_t r, int64_t c0, int64_t len, float* dst,
                           int64_t dst_stride) const {
    const uint8_t* src = w + r * row_stride;
    const float* scales = s.scale + (r / s.group_n) * s.stride_n;
    const int64_t end = c0 + len;
    for (int64_t c = c0; c < end;) {
      const int64_t g = c / s.group_k;
      const int64_t stop = std::min(end, (g + 1) * s.group_k);
      const float scale = scales[g * s.stride_k];
      for (; c < stop; ++c) dst[(c - c0) * dst_stride] = values[src[c]] * scale;
    }
  }
};

struct Scratch {
  std::vector<float> x;    // [kTileM, kTileK]
  std::vector<float> w;    // [kTileK, kTileN]
  std::vector<float> acc;  // [kTileM, kTileN]
  Scratch()
      : x(static_cast<size_t>(kTileM * kTileK)),
        w(static_cast<size_t>(kTileK * kTileN)),
        acc(static_cast<size_t>(kTileM * kTileN)) {}
};

LORAPLEX_INLINE Vec8 load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
LORAPLEX_INLINE void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

template <typename T>
void store_row(const GemmArgs& a, const float* acc, int64_t row, int64_t n0, int64_t count) {
  const T* bias = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y) + row * a.y_row_stride + n0;
  for (int64_t j = 0; j < count; ++j) {
    float v = acc[j];
    if (bias != nullptr) v += to_float(bias[n0 + j]);
    if (a.accumulate) v += to_float(y[j]);
    y[j] = store_float<T>(v);
  }
}

namespace gemm_baseline {
#include "loraplex/kernels/cpu/gemm_cpu_kernels.inc"
}  // namespace gemm_baseline

#if LORAPLEX_GEMM_AVX2
#pragma GCC push_options
#pragma GCC target("avx2")
namespace gemm_avx2 {
#include "loraplex/kernels/cpu/gemm_cpu_kernels.inc"
}  // namespace gemm_avx2
#pragma GCC pop_options
#endif

template <typename T, typename W>
using TilesFn = void (*)(const GemmArgs&, const W&, int64_t, int64_t);
template <typename T, typename W>
using FewRowsFn = void (*)(const GemmArgs&, const W&, const float*, int64_t, int64_t);

template <typename T, typename W>
void gemm_typed(const GemmArgs& a, const W& wl) {
  TilesFn<T, W> tiles = gemm_baseline::tiles<T, W>;
  FewRowsFn<T, W> few_rows = gemm_baseline::few_rows<T, W>;
#if LORAPLEX_GEMM_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && a.isa == GemmIsa::kAuto) {
    tiles = gemm_avx2::tiles<T, W>;
    few_rows = gemm_avx2::few_rows<T, W>;
  }
#endif
  if (a.m < kFewRows) {
    std::vector<float> xf(static_cast<size_t>(a.m * a.k));
    const T* x = static_cast<const T*>(a.x);
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t p = 0; p < a.k; ++p)
        xf[static_cast<size_t>(i * a.k + p)] = to_float(x[i * a.x_row_stride + p]);
    parallel_for(0, a.n, 16, [&](int64_t lo, int64_t hi) { few_rows(a, wl, xf.data(), lo, hi); });
    return;
  }
  const int64_t tiles_m = (a.m + kTileM - 1) / kTileM;
  const int64_t tiles_n = (a.n + kTileN - 1) / kTileN;
  // Column tiles vary fastest, so one row tile still spreads over the threads.
  parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t lo, int64_t hi) { tiles(a, wl, lo, hi); });
}

}  // namespace

Status gemm_xwt(const GemmArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_gemm_args(a));
  if (a.m == 0 || a.n == 0) return Status();
  LORAPLEX_ENSURE(a.y != nullptr && (a.k == 0 || (a.x != nullptr && a.w != nullptr)),
                  "gemm_xwt: null operand");
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.w_dtype == DType::kF8E4M3) {
      gemm_typed<T>(a, Fp8Weight{static_cast<const uint8_t*>(a.w), a.w_row_stride, a.w_scales,
                                 e4m3_values()});
    } else {
      gemm_typed<T>(a, PlainWeight<T>{static_cast<const T*>(a.w), a.w_row_stride});
    }
  });
  return Status();
}

}  // namespace loraplex::kernels::cpu
