// Blocked CPU GEMM for y = x W^T. Each work item owns one [kTileM, kTileN] output tile and
// walks K in kTileK chunks: it packs its x rows (row-major) and its W rows transposed
// (k-major, so kTileN output columns are contiguous) to float, then runs a register-blocked
// micro-kernel whose inner loop updates kMicroN independent accumulators per row. Independent
// lanes (rather than a dot-product reduction) let the compiler vectorise without reassociating
// float sums, so results do not depend on compiler flags.

#include "loraplex/kernels/cpu/gemm_cpu.h"

#include <algorithm>
#include <vector>

#include "loraplex/core/parallel.h"

namespace loraplex::kernels::cpu {
namespace {

constexpr int64_t kTileM = 32;
constexpr int64_t kTileN = 64;
constexpr int64_t kTileK = 256;
constexpr int64_t kMicroM = 4;
constexpr int64_t kMicroN = 16;
static_assert(kTileM % kMicroM == 0 && kTileN % kMicroN == 0);

struct Scratch {
  std::vector<float> x;    // [kTileM, kTileK]
  std::vector<float> w;    // [kTileK, kTileN]
  std::vector<float> acc;  // [kTileM, kTileN]
};

// c[kMicroM, kMicroN] += xp[kMicroM rows of stride kc] * wp[kc, kTileN] (columns j0..).
inline void micro_kernel(const float* xp, int64_t kc, const float* wp, float* c) {
  float r[kMicroM][kMicroN];
  for (int64_t i = 0; i < kMicroM; ++i)
    for (int64_t j = 0; j < kMicroN; ++j) r[i][j] = c[i * kTileN + j];
  for (int64_t p = 0; p < kc; ++p) {
    const float* wrow = wp + p * kTileN;
    for (int64_t i = 0; i < kMicroM; ++i) {
      const float xv = xp[i * kc + p];
      for (int64_t j = 0; j < kMicroN; ++j) r[i][j] += xv * wrow[j];
    }
  }
  for (int64_t i = 0; i < kMicroM; ++i)
    for (int64_t j = 0; j < kMicroN; ++j) c[i * kTileN + j] = r[i][j];
}

template <typename T>
void gemm_tile(const GemmArgs& a, int64_t m0, int64_t n0, Scratch& s) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const int64_t mc = std::min(kTileM, a.m - m0);
  const int64_t nc = std::min(kTileN, a.n - n0);
  // Rows and columns past the edge are packed as zeros and computed but never stored.
  const int64_t mc_pad = (mc + kMicroM - 1) / kMicroM * kMicroM;
  const int64_t nc_pad = (nc + kMicroN - 1) / kMicroN * kMicroN;
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileK) {
    const int64_t kc = std::min(kTileK, a.k - k0);
    for (int64_t i = 0; i < mc_pad; ++i) {
      float* dst = s.x.data() + i * kc;
      if (i < mc) {
        const T* src = x + (m0 + i) * a.x_row_stride + k0;
        for (int64_t p = 0; p < kc; ++p) dst[p] = load_float(src[p]);
      } else {
        std::fill(dst, dst + kc, 0.0f);
      }
    }
    for (int64_t j = 0; j < nc_pad; ++j) {
      float* dst = s.w.data() + j;
      if (j < nc) {
        const T* src = w + (n0 + j) * a.w_row_stride + k0;
        for (int64_t p = 0; p < kc; ++p) dst[p * kTileN] = load_float(src[p]);
      } else {
        for (int64_t p = 0; p < kc; ++p) dst[p * kTileN] = 0.0f;
      }
    }
    for (int64_t i = 0; i < mc_pad; i += kMicroM) {
      for (int64_t j = 0; j < nc_pad; j += kMicroN) {
        micro_kernel(s.x.data() + i * kc, kc, s.w.data() + j, s.acc.data() + i * kTileN + j);
      }
    }
  }
  const T* bias = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y);
  for (int64_t i = 0; i < mc; ++i) {
    T* yrow = y + (m0 + i) * a.y_row_stride + n0;
    const float* crow = s.acc.data() + i * kTileN;
    for (int64_t j = 0; j < nc; ++j) {
      float v = crow[j];
      if (bias != nullptr) v += load_float(bias[n0 + j]);
      if (a.accumulate) v += load_float(yrow[j]);
      yrow[j] = store_float<T>(v);
    }
  }
}

template <typename T>
void gemm_typed(const GemmArgs& a) {
  const int64_t tiles_m = (a.m + kTileM - 1) / kTileM;
  const int64_t tiles_n = (a.n + kTileN - 1) / kTileN;
  // Column tiles vary fastest, so a decode step (one row tile) still spreads over threads.
  parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t lo, int64_t hi) {
    Scratch s;
    s.x.resize(static_cast<size_t>(kTileM * kTileK));
    s.w.resize(static_cast<size_t>(kTileK * kTileN));
    s.acc.resize(static_cast<size_t>(kTileM * kTileN));
    for (int64_t item = lo; item < hi; ++item) {
      gemm_tile<T>(a, (item / tiles_n) * kTileM, (item % tiles_n) * kTileN, s);
    }
  });
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
