// The GPU sampler (sampling_ops.h): a thread-block cluster samples one row at a time (as many
// clusters as fit the device at once, each taking every gridDim.y-th row). The cluster's blocks
// split the row into chunks that stay in shared memory (16032 floats per block at vocab 128256,
// 8 blocks), so the logits are read from global memory once; every later pass reads shared
// memory, and what the blocks must agree on (maxima, histograms, sums) is exchanged through
// distributed shared memory and merged by every block in rank order, so all blocks take the
// same decisions from the same bits.
//
// Per row:
//   1. load: l = logit / temperature (NaN -> -inf) into shared memory; the largest l with its
//      lowest id (banned ids are looked at only if one of them wins: then once more without
//      them); with logprobs, an online softmax of the raw logits (max and sum of exp, in
//      double). Greedy rows stop here: the id is that argmax.
//      A row with no allowed id takes the argmax of its raw logits (sample_row's rule).
//   2. top-k: radix select (4 passes of 8 bits) of the k-th largest l over order-preserving
//      keys of the float bits, with integer counts: exact, as std::nth_element.
//   3. weights w = exp(l - max) (sampling_math.h: the same bits as the CPU), -1 for dropped ids
//      (below the k-th largest l, or min_p: w < min_p, w being the probability over the largest).
//   4. top-p: radix select over the weights' bits of the largest w whose mass "w' >= w" reaches
//      top_p * total, with 64-bit fixed-point masses (integers: order-free, deterministic).
//   5. walk: each thread sums the weights of a contiguous run of ids in double, in id order;
//      a block-wide ordered prefix (scan) of those sums, block bases summed in rank order; the
//      one thread whose interval holds the target walks its run.
// No float atomics, no order-dependent sums: the same inputs give the same bits on every run.
//
// Agreement with the CPU (sample_row): l, the k-th largest l, the weights and the kept sets up
// to the top-p threshold are bit-identical. Two things are summed differently:
//  * the walk: both sides sum float weights in double, in different orders; each sum is within
//    n * 2^-53 of exact, relative to the kept total (n = vocab), so the ids differ only where the
//    target lies within about 2 n 2^-53 * total of a boundary (3e-11 * total at vocab 128256);
//  * top-p: a weight w enters the fixed-point mass as round(w * 2^F), F = 63 - bit_width(vocab)
//    (46 at vocab 128256), so a mass is within n * 2^-(F+1) of exact (9.1e-10 at vocab 128256;
//    the total is >= 1, the largest weight being 1); the thresholds differ only where top_p *
//    total lies that close to the mass above some weight.
// Out-of-range parameters cannot be rejected here (they are device memory): a temperature that
// is not > 0 means greedy, top_k < 0 means off, top_p outside (0, 1) and min_p outside (0, 1]
// mean off; ids outside [0, vocab) in `banned` are ignored.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <bit>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/model/sampling_math.h"
#include "loraplex/model/sampling_ops.h"

namespace loraplex::model::ops::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;  // radix digit of 8 bits; one bin per thread in the scans
constexpr int kMaxCluster = 8;
// A block's first element sits on a 16-byte boundary for every dtype (vector loads).
constexpr int64_t kChunkAlign = 8;
// Vocabulary per block below which fewer blocks share a row.
constexpr int64_t kMinChunk = 2048;
constexpr unsigned kFull = 0xffffffffu;
// 16-byte vectors each thread loads before using any.
constexpr int kBatch = 4;
// A block's histogram is kept in 32-bit words, whose shared atomics are native (64-bit ones
// are compare-and-swap loops): counts in kParts copies (lanes spread over them, fewer
// same-address conflicts), masses as kParts 16-bit digits summed separately.
constexpr int kParts = 4;

static_assert(kThreads == kBins, "the histogram scans give one bin to each thread");

// IEEE float operations for sampling_math.h: the _rn intrinsics are never fused into an FMA.
// (Host versions exist only so that the template compiles in nvcc's host pass.)
struct DeviceArith {
  __host__ __device__ static float add(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
  }
  __host__ __device__ static float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
  }
  __host__ __device__ static float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
  }
  __host__ __device__ static float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return fmaf(a, b, c);
#endif
  }
  __host__ __device__ static float floor(float a) { return floorf(a); }
  __host__ __device__ static float from_bits(uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(b);
#else
    return std::bit_cast<float>(b);
#endif
  }
};

// Logit element types: kVec elements per 16-byte vector, loaded raw and unpacked per element
// (a partial or unaligned vector is gathered element by element into the same layout).
struct F32 {
  using Storage = float;
  static constexpr int kVec = 4;
  static __device__ float one(const float* row, int64_t j) { return row[j]; }
  static __device__ uint4 gather(const float* row, int64_t j, int count) {
    uint32_t w[4] = {0, 0, 0, 0};
    for (int q = 0; q < count; ++q) w[q] = __float_as_uint(row[j + q]);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ float unpack(const uint4& v, int q) {
    const uint32_t w = q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
    return __uint_as_float(w);
  }
};
template <typename Bits>
struct Half16 {
  using Storage = uint16_t;
  static constexpr int kVec = 8;
  static __device__ float one(const uint16_t* row, int64_t j) { return Bits::cvt(row[j]); }
  static __device__ uint4 gather(const uint16_t* row, int64_t j, int count) {
    uint32_t w[4] = {0, 0, 0, 0};
    for (int q = 0; q < count; ++q) w[q / 2] |= static_cast<uint32_t>(row[j + q]) << (16 * (q % 2));
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ float unpack(const uint4& v, int q) {
    const uint32_t w = q / 2 == 0 ? v.x : q / 2 == 1 ? v.y : q / 2 == 2 ? v.z : v.w;
    return Bits::cvt(q % 2 == 0 ? (w & 0xffffu) : (w >> 16));
  }
};
struct F16Bits {
  static __device__ float cvt(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
};
struct BF16Bits {
  static __device__ float cvt(uint32_t bits) { return __uint_as_float(bits << 16); }
};
using F16 = Half16<F16Bits>;
using BF16 = Half16<BF16Bits>;

// Shared state of one block. The fields marked "cluster" are read by the other blocks of the
// cluster after a cluster barrier; each is written once per row (the histograms alternate).
struct Shared {
  unsigned long long hist[2][kBins];  // cluster: radix histograms (counts or fixed-point mass)
  unsigned parts[kParts][kBins];      // the block's histogram as 32-bit parts (see radix_select)
  float best_v;                       // cluster: largest l (banned ids included) ...
  int best_i;                         //          ... and its lowest id (INT_MAX: none)
  float raw_m;                        // cluster: raw logits' max ...
  double raw_s;                       //          ... and sum of exp(x - max)
  float allowed_v;                    // cluster: the same without banned ids (when one won)
  int allowed_i;
  float fallback_v;  // cluster: raw argmax (rows with no allowed id)
  int fallback_i;
  double total;  // cluster: kept mass of the block
  int last;      // cluster: last kept id of the block (-1: none)
  // Block-local scratch.
  float red_f[kWarps];
  int red_i[kWarps];
  float red_m[kWarps];
  double red_d[kWarps];
  unsigned long long red_u[kWarps];
  int sel_bin;
  unsigned long long sel_excl;
};

// (value, id) pairs: the larger value wins, ties to the lower id; (-inf, INT_MAX) is "none".
// The order is total, so any reduction order gives the same pair.
__device__ void merge_best(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

__device__ void block_best(float& v, int& i, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    merge_best(v, i, __shfl_xor_sync(kFull, v, o), __shfl_xor_sync(kFull, i, o));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    sh.red_f[warp] = v;
    sh.red_i[warp] = i;
  }
  __syncthreads();
  v = sh.red_f[0];
  i = sh.red_i[0];
  for (int w = 1; w < kWarps; ++w) merge_best(v, i, sh.red_f[w], sh.red_i[w]);
}

// Online softmax state (max m, sum s of exp(x - m)); the maximum itself weighs 1, so infinite
// maxima give no NaN (as token_logprob).
__device__ double softmax_scale(float from, float to) {
  return from == to ? 1.0 : static_cast<double>(expf(from - to));
}
__device__ void softmax_add(float& m, double& s, float x) {
  if (x > m) {
    s = s * softmax_scale(m, x) + 1.0;
    m = x;
  } else {
    s += softmax_scale(x, m);
  }
}
__device__ void softmax_merge(float& m, double& s, float om, double os) {
  const float mm = fmaxf(m, om);
  s = s * softmax_scale(m, mm) + os * softmax_scale(om, mm);
  m = mm;
}

// Fixed-tree block reductions: the same order on every run.
__device__ void block_softmax(float& m, double& s, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    softmax_merge(m, s, __shfl_xor_sync(kFull, m, o), __shfl_xor_sync(kFull, s, o));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    sh.red_m[warp] = m;
    sh.red_d[warp] = s;
  }
  __syncthreads();
  m = sh.red_m[0];
  s = sh.red_d[0];
  for (int w = 1; w < kWarps; ++w) softmax_merge(m, s, sh.red_m[w], sh.red_d[w]);
}

// Order-preserving keys of the float bits (larger float -> larger key); -0 counts as +0.
__device__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ float from_order_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The largest key K such that the weight of the row's elements with key >= K reaches `need`
// (weights: counts for top-k, fixed-point masses for top-p), by 4 passes of 8-bit digits from
// the top. `key_of(i, key, weight)` describes local element i (false: not counted); weights
// below 2^63, and a block's per-bin sums of each 16-bit digit fit 32 bits (chunks below 2^16
// ids); `count_only`: every weight is 1. With
// `top_p` > 0, `need` is ceil(top_p * total weight), found in the first pass. `pass` counts the
// histogram passes of the row (they alternate between two buffers, so one cluster barrier per
// pass suffices: a buffer is cleared two passes after its last remote read, with a barrier in
// between).
template <typename KeyOf>
__device__ uint32_t radix_select(Shared& sh, cg::cluster_group& cluster, int len,
                                 unsigned long long need, float top_p, bool count_only, int& pass,
                                 KeyOf key_of) {
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int ranks = static_cast<int>(cluster.num_blocks());
  uint32_t prefix = 0;
  unsigned long long above = 0;
  for (int digit = 0; digit < 4; ++digit, ++pass) {
    const int shift = 24 - 8 * digit;
    const uint32_t high = digit == 0 ? 0u : (0xffffffffu << (shift + 8));
    unsigned long long* h = sh.hist[pass & 1];
#pragma unroll
    for (int k = 0; k < kParts; ++k) sh.parts[k][tid] = 0;
    __syncthreads();  // also: every thread has read the previous pass's selection
    if (tid == 0) {
      sh.sel_bin = 0;
      sh.sel_excl = 0;
    }
#pragma unroll 4
    for (int i = tid; i < len; i += kThreads) {
      uint32_t key;
      unsigned long long w;
      if (!key_of(i, key, w) || (key & high) != prefix) continue;
      const uint32_t bin = (key >> shift) & 0xffu;
      if (count_only) {
        atomicAdd(&sh.parts[lane % kParts][bin], 1u);
      } else {
#pragma unroll
        for (int k = 0; k < kParts; ++k) {
          atomicAdd(&sh.parts[k][bin], static_cast<unsigned>((w >> (16 * k)) & 0xffffu));
        }
      }
    }
    __syncthreads();
    {
      unsigned long long v = 0;
#pragma unroll
      for (int k = 0; k < kParts; ++k) {
        v += static_cast<unsigned long long>(sh.parts[k][tid]) << (count_only ? 0 : 16 * k);
      }
      h[tid] = v;
    }
    cluster.sync();
    // Thread t owns bin 255 - t: an inclusive scan over threads is the mass from the top.
    const int bin = kBins - 1 - tid;
    unsigned long long v = 0;
    for (int q = 0; q < ranks; ++q) v += *cluster.map_shared_rank(&h[bin], q);
    unsigned long long incl = v;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long n = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += n;
    }
    if (lane == 31) sh.red_u[warp] = incl;
    __syncthreads();
    unsigned long long total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) incl += sh.red_u[w];
      total += sh.red_u[w];
    }
    if (digit == 0 && top_p > 0.0f) {
      const double want = ceil(static_cast<double>(top_p) * static_cast<double>(total));
      need = want >= static_cast<double>(total) ? total : static_cast<unsigned long long>(want);
    }
    const unsigned long long excl = incl - v;
    if (above + excl < need && above + incl >= need) {
      sh.sel_bin = bin;
      sh.sel_excl = excl;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.sel_bin) << shift;
    above += sh.sel_excl;
  }
  return prefix;
}

// Row r by the cluster; `buf` holds this block's chunk. Every path ends with a cluster barrier,
// after which the block's shared state may be reused for the next row.
template <typename E>
__device__ void sample_row(const SampleArgs& a, int64_t r, int64_t chunk, float* buf, Shared& sh,
                           cg::cluster_group& cluster, int& pass) {
  using S = typename E::Storage;
  constexpr int kVec = E::kVec;
  const int rank = static_cast<int>(cluster.block_rank());
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int64_t vocab = a.vocab;
  const int64_t c0 = min(vocab, rank * chunk);
  const int64_t c1 = min(vocab, c0 + chunk);
  const int len = static_cast<int>(c1 - c0);
  const S* row = static_cast<const S*>(a.logits) + r * a.row_stride;
  const bool aligned = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  const int32_t* banned = a.banned + r * kMaxBannedTokens;

  const float temperature = a.temperature[r];
  const int top_k = max(a.top_k[r], 0);
  const float top_p_in = a.top_p[r];
  const bool greedy = !(temperature > 0.0f) || top_k == 1;
  const bool use_top_k = !greedy && top_k > 0 && top_k < vocab;
  const float top_p = !greedy && top_p_in > 0.0f && top_p_in < 1.0f ? top_p_in : 0.0f;
  const float min_p_in = a.min_p == nullptr ? 0.0f : a.min_p[r];
  const float min_p = !greedy && min_p_in > 0.0f && min_p_in <= 1.0f ? min_p_in : 0.0f;
  const bool want_logprob = a.logprobs != nullptr;

  auto is_banned = [&](int64_t j) {
    bool hit = false;
#pragma unroll
    for (int q = 0; q < kMaxBannedTokens; ++q) hit |= banned[q] == j;
    return hit;
  };

  // 1. Load (and scale) this block's chunk once; argmax of the allowed ids; raw softmax.
  float best_v = -INFINITY;
  int best_i = INT_MAX;
  float raw_m = -INFINITY;
  double raw_s = 0.0;
  // kBatch vectors in flight per thread before any is used: one HBM latency per batch.
  const int64_t vectors = (len + kVec - 1) / kVec;
  for (int64_t v0 = tid; v0 < vectors; v0 += static_cast<int64_t>(kThreads) * kBatch) {
    uint4 raw[kBatch];
    int count[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t base = c0 + (v0 + b * kThreads) * kVec;
      count[b] = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(kVec), c1 - base)));
      if (aligned && count[b] == kVec) {
        raw[b] = __ldg(reinterpret_cast<const uint4*>(row + base));
      } else {
        raw[b] = E::gather(row, base, count[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t base = c0 + (v0 + b * kThreads) * kVec;
#pragma unroll
      for (int q = 0; q < kVec; ++q) {
        if (q >= count[b]) break;
        const int64_t j = base + q;
        const float xv = E::unpack(raw[b], q);
        const bool nan = isnan(xv);
        const float lv = nan ? -INFINITY : (greedy ? xv : __fdiv_rn(xv, temperature));
        // Banned ids are not checked here: only when one of them wins (below).
        if (lv > best_v) {
          best_v = lv;
          best_i = static_cast<int>(j);
        }
        if (!greedy) buf[j - c0] = lv;
        if (want_logprob && !nan) softmax_add(raw_m, raw_s, xv);
      }
    }
  }
  if (!greedy) {
    __syncthreads();  // after every store of the chunk
    if (tid < kMaxBannedTokens) {
      const int64_t b = banned[tid];
      if (b >= c0 && b < c1) buf[b - c0] = -INFINITY;
    }
  }
  block_best(best_v, best_i, sh);
  if (tid == 0) {
    sh.best_v = best_v;
    sh.best_i = best_i;
  }
  if (want_logprob) {
    block_softmax(raw_m, raw_s, sh);
    if (tid == 0) {
      sh.raw_m = raw_m;
      sh.raw_s = raw_s;
    }
  }
  cluster.sync();
  best_v = -INFINITY;
  best_i = INT_MAX;
  raw_m = -INFINITY;
  raw_s = 0.0;
  for (int q = 0; q < ranks; ++q) {
    const Shared* o = cluster.map_shared_rank(&sh, q);
    merge_best(best_v, best_i, o->best_v, o->best_i);
    if (want_logprob) softmax_merge(raw_m, raw_s, o->raw_m, o->raw_s);
  }
  if (best_i != INT_MAX && is_banned(best_i)) {
    // A banned id won: the argmax again, banned ids skipped (from the scaled chunk in shared
    // memory, where they are -inf already; greedy rows read the logits again).
    best_v = -INFINITY;
    best_i = INT_MAX;
    for (int64_t j = c0 + tid; j < c1; j += kThreads) {
      const float x = greedy ? E::one(row, j) : buf[j - c0];
      if (x > best_v && !is_banned(j)) {
        best_v = x;
        best_i = static_cast<int>(j);
      }
    }
    block_best(best_v, best_i, sh);
    if (tid == 0) {
      sh.allowed_v = best_v;
      sh.allowed_i = best_i;
    }
    cluster.sync();
    best_v = -INFINITY;
    best_i = INT_MAX;
    for (int q = 0; q < ranks; ++q) {
      const Shared* o = cluster.map_shared_rank(&sh, q);
      merge_best(best_v, best_i, o->allowed_v, o->allowed_i);
    }
  }

  // The picked id goes out from one thread of one block, with its log-probability.
  auto emit = [&](int id) {
    a.ids[r] = id;
    if (want_logprob) {
      const float x = E::one(row, id);
      const double lp = (x == raw_m ? 0.0 : static_cast<double>(x) - raw_m) - log(raw_s);
      a.logprobs[r] = static_cast<float>(lp);
    }
  };

  if (best_i == INT_MAX) {
    // No allowed id (all banned, NaN or -inf): the argmax of the raw logits, NaN never.
    float fv = -INFINITY;
    int fi = INT_MAX;
    for (int64_t j = c0 + tid; j < c1; j += kThreads) {
      const float x = E::one(row, j);
      if (!isnan(x) && (fi == INT_MAX || x > fv)) {
        fv = x;
        fi = static_cast<int>(j);
      }
    }
    block_best(fv, fi, sh);
    if (tid == 0) {
      sh.fallback_v = fv;
      sh.fallback_i = fi;
    }
    cluster.sync();
    if (rank == 0 && tid == 0) {
      fv = -INFINITY;
      fi = INT_MAX;
      for (int q = 0; q < ranks; ++q) {
        const Shared* o = cluster.map_shared_rank(&sh, q);
        merge_best(fv, fi, o->fallback_v, o->fallback_i);
      }
      emit(fi == INT_MAX ? 0 : fi);
    }
    cluster.sync();
    return;
  }
  if (greedy) {
    if (rank == 0 && tid == 0) emit(best_i);
    cluster.sync();
    return;
  }

  const float m = best_v;
  // 2. top-k: the k-th largest l of the row (ties at it kept).
  float kth = -INFINITY;
  if (use_top_k) {
    const uint32_t key =
        radix_select(sh, cluster, len, static_cast<unsigned long long>(top_k), 0.0f, true, pass,
                     [&](int i, uint32_t& k, unsigned long long& w) {
                       k = order_key(buf[i]);
                       w = 1;
                       return true;
                     });
    kth = from_order_key(key);
  }

  // 3. Weights of the kept ids (-1: dropped). From here each thread owns a contiguous run of
  // `per` ids (odd, so a warp's lanes read 32 different banks): its mass is summed in id order,
  // and the walk's prefix over threads is a block scan of those sums.
  const int per = ((len + kThreads - 1) / kThreads) | 1;
  const int t0 = min(len, tid * per);
  const int t1 = min(len, t0 + per);
  double mass = 0.0;
  int last = -1;
#pragma unroll 4
  for (int i = t0; i < t1; ++i) {
    const float l = buf[i];
    const float weight =
        l != -INFINITY && l >= kth ? sampling_detail::weight<DeviceArith>(l, m) : -1.0f;
    // min_p: the largest weight is 1, so a weight is its id's probability over the largest.
    const bool keep = weight >= 0.0f && weight >= min_p;
    const float w = keep ? weight : -1.0f;
    buf[i] = w;
    if (keep && top_p == 0.0f) {
      mass += w;
      last = i;
    }
  }

  // 4. top-p: the smallest weight of the most probable ids whose mass reaches top_p.
  float threshold = 0.0f;  // kept: weight >= threshold
  if (top_p > 0.0f) {
    const int frac_bits = 63 - static_cast<int>(64 - __clzll(static_cast<long long>(vocab)));
    const float scale = __uint_as_float(static_cast<uint32_t>(frac_bits + 127) << 23);
    const uint32_t key = radix_select(sh, cluster, len, 0, top_p, false, pass,
                                      [&](int i, uint32_t& k, unsigned long long& w) {
                                        const float f = buf[i];
                                        k = __float_as_uint(f);
                                        w = __float2ull_rn(__fmul_rn(f, scale));
                                        return f >= 0.0f;
                                      });
    threshold = __uint_as_float(key);
    for (int i = t0; i < t1; ++i) {
      const float w = buf[i];
      if (w >= threshold) {
        mass += w;
        last = i;
      }
    }
  }

  // 5. The walk. Block prefix of the threads' masses: thread t covers [excl, incl), and a
  // thread's excl is bitwise its predecessor's incl, so the intervals tile the block's mass.
  double incl = mass;
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) sh.red_d[warp] = incl;
  for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(kFull, last, o));
  if (lane == 0) sh.red_i[warp] = last;
  __syncthreads();
  double warp_base = 0.0;
  double block_mass = 0.0;
  int block_last = -1;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) warp_base = block_mass;
    block_mass += sh.red_d[w];
    block_last = max(block_last, sh.red_i[w]);
  }
  incl = warp_base + incl;
  double excl = __shfl_up_sync(kFull, incl, 1);
  if (lane == 0) excl = warp_base;
  if (tid == 0) {
    sh.total = block_mass;
    sh.last = block_last < 0 ? -1 : static_cast<int>(c0) + block_last;
  }
  cluster.sync();
  double base = 0.0;
  double total = 0.0;
  int row_last = -1;
  for (int q = 0; q < ranks; ++q) {
    const Shared* o = cluster.map_shared_rank(&sh, q);
    if (q == rank) base = total;
    total += o->total;
    row_last = max(row_last, o->last);
  }
  const double target = a.uniform[r] * total;
  if (!(target < total)) {
    // Past every kept id (rounding of uniform * total): the last kept id, as sample_row.
    if (rank == 0 && tid == 0) emit(row_last);
  } else if (base <= target && target < base + block_mass) {
    // This block holds the target; exactly one of its threads does.
    if (base + excl <= target && target < base + incl) {
      double cum = base + excl;
      int pick = -1;
      for (int i = t0; i < t1; ++i) {
        const float w = buf[i];
        if (!(w >= threshold)) continue;
        cum += w;
        pick = i;
        if (cum > target) break;
      }
      // Without a crossing (the sums in another order fell short) `pick` is the run's last
      // kept id.
      emit(static_cast<int>(c0) + pick);
    }
  }
  cluster.sync();
}

// Persistent clusters: cluster y samples rows y, y + gridDim.y, ... (launching a cluster per row
// would pay the cluster launch for every row).
template <typename E>
__global__ void __launch_bounds__(kThreads, 3) sample_kernel(SampleArgs a, int64_t chunk) {
  extern __shared__ float4 dynamic_smem[];
  __shared__ Shared sh;
  cg::cluster_group cluster = cg::this_cluster();
  int pass = 0;
  for (int64_t r = blockIdx.y; r < a.num_rows; r += gridDim.y) {
    sample_row<E>(a, r, chunk, reinterpret_cast<float*>(dynamic_smem), sh, cluster, pass);
  }
}

template <typename Fn>
Status dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(F32{});
    case DType::kF16:
      return fn(F16{});
    case DType::kBF16:
      return fn(BF16{});
    default:
      return invalid_argument("sample: logits dtype ", dtype,
                              ", expected float32, float16 or bfloat16");
  }
}

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  return Status(StatusCode::kCudaError,
                detail::concat("sample: ", what, ": ", cudaGetErrorString(err)));
}

// How many clusters of the launch fit on the device at once (a query, cached per kernel,
// device and shape: the first call of the op is a warm-up outside any capture in practice).
template <typename Kernel>
Status resident_clusters(Kernel* kernel, const cudaLaunchConfig_t& cfg, int& clusters) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t, unsigned>, int> done;
  int device = 0;
  LORAPLEX_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  std::lock_guard<std::mutex> lock(mutex);
  int& n =
      done[{reinterpret_cast<const void*>(kernel), device, cfg.dynamicSmemBytes, cfg.gridDim.x}];
  if (n == 0) {
    LORAPLEX_RETURN_IF_ERROR(cuda_status(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg),
                                         "cudaOccupancyMaxActiveClusters"));
    LORAPLEX_ENSURE(n > 0, "sample: no cluster of ", cfg.gridDim.x, " blocks with ",
                    cfg.dynamicSmemBytes, " bytes of shared memory fits this device");
  }
  clusters = n;
  return Status();
}

}  // namespace

Status sample(const SampleArgs& a, const Stream& stream) {
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.vocab >= 1 && a.row_stride >= a.vocab, "sample: num_rows ",
                  a.num_rows, ", vocab ", a.vocab, ", row_stride ", a.row_stride,
                  " (need num_rows >= 0, vocab >= 1, row_stride >= vocab)");
  LORAPLEX_ENSURE(a.vocab <= kMaxGpuSampleVocab, "sample: vocab ", a.vocab,
                  " is above the GPU sampler's limit of ", kMaxGpuSampleVocab);
  if (a.num_rows == 0) return Status();
  LORAPLEX_ENSURE(a.logits != nullptr && a.temperature != nullptr && a.top_k != nullptr &&
                      a.top_p != nullptr && a.uniform != nullptr && a.banned != nullptr &&
                      a.ids != nullptr,
                  "sample: a required pointer is null");
  const int64_t blocks = std::min<int64_t>(kMaxCluster, (a.vocab + kMinChunk - 1) / kMinChunk);
  const int64_t per_block = (a.vocab + blocks - 1) / blocks;
  const int64_t chunk = (per_block + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  const int smem = static_cast<int>(chunk * static_cast<int64_t>(sizeof(float)));
  return dispatch(a.dtype, [&](auto e) -> Status {
    using E = decltype(e);
    auto* kernel = &sample_kernel<E>;
    LORAPLEX_RETURN_IF_ERROR(
        kernels::cuda::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(a.num_rows));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = static_cast<cudaStream_t>(stream.handle());
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(blocks);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    LORAPLEX_RETURN_IF_ERROR(resident_clusters(kernel, cfg, clusters));
    cfg.gridDim.y = static_cast<unsigned>(std::min<int64_t>(a.num_rows, clusters));
    return cuda_status(cudaLaunchKernelEx(&cfg, kernel, a, chunk), "sample_kernel launch");
  });
}

}  // namespace loraplex::model::ops::cuda
