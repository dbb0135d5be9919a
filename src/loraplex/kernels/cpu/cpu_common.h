#pragma once
// Building blocks of the CPU ops (internal to kernels/cpu): inline element conversions that
// agree bit for bit with core/dtype.h, fixed-order fp32 dot and panel loops, grouping of tokens by
// slot, per-thread scratch and cost-balanced splitting over the thread pool.
//
// Determinism: every output element is computed by the same sequence of fp32 operations
// whatever else is in the batch (its size, the neighbours' adapters, the thread count), so a
// token's result is bit-identical when the batch is permuted or mixed with other adapters.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels::cpu::detail {

inline float to_float(float v) { return v; }
inline float to_float(BFloat16 v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16);
}
inline float to_float(Half v) {
  // One exact multiply by 2^112 re-biases the exponent and scales subnormals correctly;
  // infinities and NaNs land at >= 2^16 and get the all-ones exponent (and payload) back.
  const float magic = std::bit_cast<float>(uint32_t{(254u - 15u) << 23});
  const float was_inf_nan = std::bit_cast<float>(uint32_t{(127u + 16u) << 23});
  const float f = std::bit_cast<float>(static_cast<uint32_t>(v.bits & 0x7fffu) << 13) * magic;
  uint32_t u = std::bit_cast<uint32_t>(f);
  if (f >= was_inf_nan) u |= 255u << 23;
  return std::bit_cast<float>(u | (static_cast<uint32_t>(v.bits & 0x8000u) << 16));
}

/// Correctly rounded (nearest even) store, identical to core's float_to_*_bits.
template <typename T>
inline T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    const uint32_t x = std::bit_cast<uint32_t>(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((x >> 16) | 0x40u)};
    return BFloat16{static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
  } else {
    static_assert(std::is_same_v<T, Half>);
    uint32_t x = std::bit_cast<uint32_t>(v);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    uint16_t bits;
    if (x >= 0x47800000u) {  // >= 2^16: infinity, or a NaN kept quiet
      bits = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x < (113u << 23)) {
      // Subnormal or zero: adding 0.5 rounds to a multiple of 2^-24 (nearest even) in the
      // FPU, and the low bits are then the half's subnormal code.
      const float sum = std::bit_cast<float>(x) + 0.5f;
      bits = static_cast<uint16_t>(std::bit_cast<uint32_t>(sum) - 0x3f000000u);
    } else {
      const uint32_t odd = (x >> 13) & 1u;
      bits = static_cast<uint16_t>((x - (112u << 23) + 0xfffu + odd) >> 13);
    }
    return Half{static_cast<uint16_t>(bits | sign)};
  }
}

template <typename T>
inline void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

/// y = acc, or y = acc + y rounded once when `add`.
template <typename T>
inline void store_row(const float* acc, int64_t n, bool add, T* y) {
  if (add) {
    for (int64_t i = 0; i < n; ++i) y[i] = from_float<T>(acc[i] + to_float(y[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = from_float<T>(acc[i]);
  }
}

/// Four floats in one SSE/NEON register (GCC/Clang vector extension). Explicit vectors keep
/// the lane order of every sum fixed without -ffast-math.
using Vec4 = float __attribute__((vector_size(16)));
inline Vec4 load4(const float* p) {
  Vec4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

/// Sum of a[i] * b[i] in 16 interleaved fp32 partial sums, then a fixed tree: the rounding
/// depends on n alone.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec4 acc[4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int q = 0; q < 4; ++q) acc[q] += load4(a + i + 4 * q) * load4(b + i + 4 * q);
  }
  float lanes[16];
  std::memcpy(lanes, acc, sizeof(lanes));
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  }
  return lanes[0];
}

/// Scratch buffers per thread: enough for a few row buffers plus two per slice.
inline constexpr int kScratchBuffers = 4 + 2 * kMaxSlices;
/// Per-thread float scratch buffer `index` (0..kScratchBuffers-1) of at least n floats,
/// reused across calls so that the ops do not allocate every step. Valid until the next call
/// with the same index on this thread.
float* scratch(int index, int64_t n);

/// The tokens with a slot >= 0, stably ordered by slot (counting sort). Slots must already be
/// validated to lie in [-1, max_loras).
void lora_tokens_by_slot(const int32_t* mapping, int64_t num_tokens, int max_loras,
                         std::vector<int32_t>& order);

/// The LoRA tokens of a call (slot >= 0), ordered by slot.
struct LoraTokens {
  const int32_t* tokens = nullptr;
  int64_t count = 0;
  std::vector<int32_t> storage;  // when the order is built here
};

/// The LoRA tokens from the batch metadata (host memory), after checking that it was built
/// for this call and that every listed token is in range.
Status tokens_from_meta(const LoraMetaView& meta, int64_t num_tokens, int max_loras, const char* op,
                        LoraTokens& out);
/// The LoRA tokens of a validated mapping, grouped by slot here.
void tokens_from_mapping(const int32_t* mapping, int64_t num_tokens, int max_loras,
                         LoraTokens& out);

/// Runs fn(lo, hi) over [0, n) split into at most num_cpu_threads() contiguous ranges of
/// about equal total cost (prefix[i] = cost of items [0, i), size n + 1). Ranges get at least
/// `min_part_cost` each so that small problems stay on the calling thread.
void parallel_for_balanced(const std::vector<int64_t>& prefix, int64_t min_part_cost,
                           const std::function<void(int64_t, int64_t)>& fn);

/// Caches one converted weight block per (key) on a thread, so consecutive work items of the
/// same slot (and expert) convert their weights once.
struct WeightCache {
  int64_t key = -1;
  float* data = nullptr;
};

/// Multiply-adds below which a part is not worth a thread.
inline constexpr int64_t kMinPartCost = int64_t{1} << 15;

/// Expand weights are packed in panels of kPanel output columns: panel p holds
/// [rank][kPanel] floats for columns p*kPanel.., the last panel zero-padded. A panel's
/// accumulators then live in registers across the whole rank loop.
inline constexpr int kPanel = 16;
inline int64_t panel_floats(int64_t n, int64_t rank) {
  return (n + kPanel - 1) / kPanel * kPanel * rank;
}

/// Packs bt for `rank` and `n` columns from get(j, r) = B[j][r].
template <typename Get>
void pack_panels(int64_t n, int32_t rank, float* bt, const Get& get) {
  const int64_t padded = (n + kPanel - 1) / kPanel * kPanel;
  for (int64_t j = 0; j < padded; ++j) {
    float* lane = bt + (j / kPanel) * rank * kPanel + j % kPanel;
    for (int32_t r = 0; r < rank; ++r) lane[r * kPanel] = j < n ? get(j, r) : 0.0f;
  }
}

/// y[j] (+)= sum over r < rank of v[r] * B[j][r] for j < n, B packed by pack_panels. Each
/// column sums r in order, so the result depends on nothing but that column's inputs.
template <typename T>
void expand_row(const float* v, int32_t rank, const float* bt, int64_t n, bool add, T* y) {
  static_assert(kPanel == 16, "expand_row keeps one panel in four Vec4 accumulators");
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const float* panel = bt + (j0 / kPanel) * rank * kPanel;
    Vec4 acc[4] = {};
    for (int32_t r = 0; r < rank; ++r) {
      const float vr = v[r];
      for (int q = 0; q < 4; ++q) acc[q] += vr * load4(panel + r * kPanel + 4 * q);
    }
    float lanes[kPanel];
    std::memcpy(lanes, acc, sizeof(lanes));
    store_row(lanes, n - j0 < kPanel ? n - j0 : kPanel, add, y + j0);
  }
}

/// The expand of ExpandArgs over the LoRA tokens tokens[0, count) (ordered by slot, each with
/// a slot >= 0): y[t, off_s : off_s + n_s] (+)= v_s(t) @ B_s[slot]^T, split over the pool by
/// cost. The caller supplies the operands as fp32:
///   load_v(s, t, rank, v): v[r] for r < rank, the token's intermediate;
///   load_bt(s, slot, rank, bt): B_s[slot][:, :rank] packed by pack_panels (cached per thread
///   while consecutive tokens share the slot).
/// A slot of rank 0 adds nothing (and writes zeros without add_inputs: its delta is zero).
template <typename T, typename LoadV, typename LoadBt>
void expand_rows(const ExpandArgs& a, const int32_t* mapping, const int32_t* tokens, int64_t count,
                 const LoadV& load_v, const LoadBt& load_bt) {
  std::vector<int64_t> prefix(static_cast<size_t>(count) + 1, 0);
  for (int64_t i = 0; i < count; ++i) {
    const int32_t slot = mapping[tokens[i]];
    int64_t cost = 0;
    for (int s = 0; s < a.num_slices; ++s) {
      cost += (a.ranks[s * a.max_loras + slot] + 1) * a.slice_width[s];
    }
    prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + cost;
  }
  T* y = static_cast<T*>(a.y);
  parallel_for_balanced(prefix, kMinPartCost, [&](int64_t lo, int64_t hi) {
    float* v = scratch(0, a.max_rank);
    WeightCache cache[kMaxSlices];
    for (int s = 0; s < a.num_slices; ++s) {
      cache[s].data = scratch(1 + s, panel_floats(a.slice_width[s], a.max_rank));
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = tokens[i];
      const int32_t slot = mapping[t];
      int64_t col = a.offset_start;
      for (int s = 0; s < a.num_slices; ++s) {
        const int64_t n = a.slice_width[s];
        const int32_t rank = a.ranks[s * a.max_loras + slot];
        if (rank == 0 && a.add_inputs) {
          col += n;  // exactly no effect, not even on the sign of a zero
          continue;
        }
        if (rank > 0) {
          if (cache[s].key != slot) {
            load_bt(s, slot, rank, cache[s].data);
            cache[s].key = slot;
          }
          load_v(s, t, rank, v);
        }
        expand_row(v, rank, cache[s].data, n, a.add_inputs, y + t * a.y_row_stride + col);
        col += n;
      }
    }
  });
}

}  // namespace loraplex::kernels::cpu::detail
