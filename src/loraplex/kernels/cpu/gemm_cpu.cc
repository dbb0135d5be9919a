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

#include "loraplex/kernels/gemm.h"

#include <algorithm>
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

template <typename T>
using TilesFn = void (*)(const GemmArgs&, int64_t, int64_t);
template <typename T>
using FewRowsFn = void (*)(const GemmArgs&, const float*, int64_t, int64_t);

template <typename T>
void gemm_typed(const GemmArgs& a) {
  TilesFn<T> tiles = gemm_baseline::tiles<T>;
  FewRowsFn<T> few_rows = gemm_baseline::few_rows<T>;
#if LORAPLEX_GEMM_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && a.isa == GemmIsa::kAuto) {
    tiles = gemm_avx2::tiles<T>;
    few_rows = gemm_avx2::few_rows<T>;
  }
#endif
  if (a.m < kFewRows) {
    std::vector<float> xf(static_cast<size_t>(a.m * a.k));
    const T* x = static_cast<const T*>(a.x);
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t p = 0; p < a.k; ++p)
        xf[static_cast<size_t>(i * a.k + p)] = to_float(x[i * a.x_row_stride + p]);
    parallel_for(0, a.n, 16, [&](int64_t lo, int64_t hi) { few_rows(a, xf.data(), lo, hi); });
    return;
  }
  const int64_t tiles_m = (a.m + kTileM - 1) / kTileM;
  const int64_t tiles_n = (a.n + kTileN - 1) / kTileN;
  // Column tiles vary fastest, so one row tile still spreads over the threads.
  parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t lo, int64_t hi) { tiles(a, lo, hi); });
}

}  // namespace

Status gemm_xwt(const GemmArgs& a) {
  const char* op = "gemm_xwt";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.m >= 0 && a.n >= 0 && a.k >= 0, op, ": negative size (m ", a.m, ", n ", a.n,
                  ", k ", a.k, ")");
  LORAPLEX_ENSURE(a.x_row_stride >= a.k && a.w_row_stride >= a.k && a.y_row_stride >= a.n, op,
                  ": row strides (x ", a.x_row_stride, ", w ", a.w_row_stride, ", y ",
                  a.y_row_stride, ") must cover k ", a.k, " and n ", a.n);
  if (a.m == 0 || a.n == 0) return Status();
  LORAPLEX_ENSURE(a.y != nullptr && (a.k == 0 || (a.x != nullptr && a.w != nullptr)), op,
                  ": null operand");
  dispatch_activation_dtype(a.dtype,
                            [&](auto tag) { gemm_typed<typename decltype(tag)::type>(a); });
  return Status();
}

}  // namespace loraplex::kernels::cpu
