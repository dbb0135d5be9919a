// One LoRA layer (shrink + expand) for decode-sized batches as ONE persistent kernel; the
// shrink alone runs on the same kernel.
//
// Why this shape: at decode sizes the bytes (A and B of the active adapters) take a few
// microseconds at copy bandwidth, while every dependent step of a launch (a barrier, a round
// trip to memory) costs a large fraction of a microsecond and a kernel launch in a graph
// about 0.8 us. So the layer is one launch of at most one wave (the grid never exceeds the
// CTAs that fit at once), every warp works on its own work items without block barriers, and
// each work item issues all its 16-byte loads before it uses the first one.
//
// Work items, counted on the device from the metadata (absent slots and rank-0 slices cost
// nothing) and spread over the warps of the whole grid round-robin:
//   producer (slot, slice, pair of the slot's tokens, 16-row rank group, K chunk): the
//     partial shrink sums of those tokens and A rows over the K chunk, reduced across the warp
//     with shuffles and stored to the metadata's scratch (fixed order: deterministic, no
//     atomics on data); then a fence and an atomicAdd on the (slot, slice) arrival counter.
//   consumer (slot, slice, up to 4 of the slot's tokens, 256 output columns): issues its B and
//     y loads first (they do not depend on the shrink), waits (ld.acquire) until every producer
//     of its (slot, slice) has arrived, sums the K-chunk partials (L2-resident) in a fixed
//     order and writes y (+)= mid @ B^T with 16-byte accesses. Shrink alone: the consumer
//     writes the intermediate instead. The last consumer of a (slot, slice) resets its counter
//     to zero, so the next launch and every graph replay start from zero.
// Producer items precede consumer items in the item order and each warp takes its items in
// increasing order, so no warp waits while it still owns producer work; with every CTA
// resident at once (one wave) every wait ends.

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/cuda/lora_paths.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kKStep = 256;         // K elements a warp reads per step: 32 lanes x 8
constexpr int kMaxKChunks = 16;     // producer items along K at most
constexpr int kRankGroup = 16;      // A rows per producer item
constexpr int kConsumerTokens = 4;  // tokens per consumer item
constexpr int kCols = 256;          // output columns per consumer item: 32 lanes x 8
constexpr int kDefaultMaxTokens = 64;
constexpr int kMaxTokens = 2048;     // the sorted token indices are cached in shared memory
constexpr int kMaxRankTable = 8192;  // and the layer's ranks [num_slices, max_loras]

std::atomic<int> g_max_tokens{kDefaultMaxTokens};

struct DecodeParams {
  const void* x;
  int64_t x_stride;
  int64_t hidden;
  int num_slices;
  const void* a[kMaxSlices];
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  float scale;
  LoraMetaView meta;
  int num_tokens;
  int k_chunks;  // producer items along K
  int k_chunk;   // K elements per chunk, a multiple of kKStep
  int off_warp;  // bytes: start of the per-warp shared areas
  int warp_bytes;
  bool expand;  // true: y (+)= the layer's delta; false: the intermediate into `out`
  // expand
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t y_col[kMaxSlices];   // first y column of each slice
  int col_chunks[kMaxSlices];  // consumer column chunks of each slice
  void* y;
  int64_t y_stride;
  bool add_inputs;
  // shrink alone
  void* out;
  bool out_f32;
};

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

/// Element q (0..7) of eight 16-bit values as float; q must be a compile-time constant after
/// unrolling so that `v` stays in registers.
template <typename T>
__device__ __forceinline__ float elem(const uint4& v, int q) {
  const uint32_t w = reinterpret_cast<const uint32_t*>(&v)[q >> 1];
  const uint16_t h = static_cast<uint16_t>((q & 1) ? (w >> 16) : (w & 0xffffu));
  if constexpr (std::is_same_v<T, bf16>) {
    return __uint_as_float(static_cast<uint32_t>(h) << 16);
  } else {
    return __half2float(__ushort_as_half(h));
  }
}

/// One step of reduce_scatter32: lanes with bit kHalf clear keep values [0, kHalf), the
/// others [kHalf, 2 kHalf), each summed with its partner's copy.
template <int kHalf>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[32], int lane) {
  const bool upper = (lane & kHalf) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? v[i] : v[i + kHalf];
    const float keep = upper ? v[i + kHalf] : v[i];
    v[i] = keep + __shfl_xor_sync(kFullMask, send, kHalf);
  }
}

/// Transposing warp reduction: 32 values per lane in, lane l out with the warp-wide sum of
/// value l (31 shuffles instead of 32 x 5).
__device__ __forceinline__ float reduce_scatter32(float (&v)[32], int lane) {
  reduce_scatter_step<16>(v, lane);
  reduce_scatter_step<8>(v, lane);
  reduce_scatter_step<4>(v, lane);
  reduce_scatter_step<2>(v, lane);
  reduce_scatter_step<1>(v, lane);
  return v[0];
}

// Per-entry work, shared by the count and the lookup so that both agree.
__device__ __forceinline__ int producer_items(const DecodeParams& p, int count, int rank) {
  return rank > 0 ? ((count + 1) >> 1) * ((rank + kRankGroup - 1) / kRankGroup) * p.k_chunks : 0;
}
__device__ __forceinline__ int consumer_chunks(const DecodeParams& p, int s, int rank) {
  if (!p.expand) return rank > 0 ? 1 : 0;
  return (rank > 0 || !p.add_inputs) ? p.col_chunks[s] : 0;
}

struct Shared {
  const int* ids;
  const int* counts;
  const int* starts;
  const int* pre1;  // [ne + 1] producer items before each entry
  const int* pre2;  // [ne + 1] consumer items before each entry
  const int* rank_tab;
  const int* sorted;
  int ne;
};

template <typename T>
__device__ __forceinline__ void produce(const DecodeParams& p, const Shared& sh, int item,
                                        int lane) {
  const int e = find_tile_entry(sh.pre1, sh.ne, item);
  int local = item - sh.pre1[e];
  const int slot = sh.ids[e];
  const int count = sh.counts[e];
  int s = 0;
  int rank = 0;
  for (;; ++s) {
    rank = sh.rank_tab[s * p.max_loras + slot];
    const int n = producer_items(p, count, rank);
    if (local < n) break;
    local -= n;
  }
  const int nrg = (rank + kRankGroup - 1) / kRankGroup;
  const int kc = local % p.k_chunks;
  local /= p.k_chunks;
  const int rg = local % nrg;
  const int pair = local / nrg;
  const int pos = sh.starts[e] + pair * 2;
  const int t0 = sh.sorted[pos];
  const int t1 = pair * 2 + 1 < count ? sh.sorted[pos + 1] : -1;
  const int rows = min(kRankGroup, rank - rg * kRankGroup);
  const int64_t K = p.hidden;
  const int64_t k_lo = static_cast<int64_t>(kc) * p.k_chunk;
  const int64_t k_hi = min(K, k_lo + p.k_chunk);
  const T* xg = static_cast<const T*>(p.x);
  const T* x0 = xg + static_cast<int64_t>(t0) * p.x_stride;
  const T* x1 = xg + static_cast<int64_t>(t1 < 0 ? t0 : t1) * p.x_stride;
  const T* arow = static_cast<const T*>(p.a[s]) +
                  (static_cast<int64_t>(slot) * p.max_rank + rg * kRankGroup) * K;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[2][kRankGroup];
#pragma unroll
  for (int i = 0; i < kRankGroup; ++i) acc[0][i] = acc[1][i] = 0.0f;
  for (int64_t kb = k_lo; kb < k_hi; kb += kKStep) {
    const int64_t k = kb + lane * 8;
    const bool kin = k < k_hi;
    // Every load of the step before the first use: one memory round trip per step.
    uint4 av[kRankGroup];
#pragma unroll
    for (int i = 0; i < kRankGroup; ++i) av[i] = (kin && i < rows) ? ldg16(arow + i * K + k) : zero;
    const uint4 xv0 = kin ? ldg16(x0 + k) : zero;
    const uint4 xv1 = (kin && t1 >= 0) ? ldg16(x1 + k) : zero;
    float xf0[8];
    float xf1[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      xf0[q] = elem<T>(xv0, q);
      xf1[q] = elem<T>(xv1, q);
    }
#pragma unroll
    for (int i = 0; i < kRankGroup; ++i) {
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float a = elem<T>(av[i], q);
        acc[0][i] = fmaf(a, xf0[q], acc[0][i]);
        acc[1][i] = fmaf(a, xf1[q], acc[1][i]);
      }
    }
  }
  float v[32];
#pragma unroll
  for (int i = 0; i < kRankGroup; ++i) {
    v[i] = acc[0][i];
    v[kRankGroup + i] = acc[1][i];
  }
  const float total = reduce_scatter32(v, lane);  // token lane / 16, rank row lane % 16
  const int tok = lane < kRankGroup ? t0 : t1;
  const int r = rg * kRankGroup + (lane & (kRankGroup - 1));
  if (tok >= 0 && r < rank) {
    const int64_t idx =
        ((static_cast<int64_t>(kc) * p.num_slices + s) * p.num_tokens + tok) * p.max_rank + r;
    __stcg(p.meta.scratch + idx, total);
  }
  // Release: every lane's partial is visible GPU-wide before the arrival is counted.
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(p.meta.counters + e * p.num_slices + s, 1);
}

template <typename T>
__device__ __forceinline__ void consume(const DecodeParams& p, const Shared& sh, int item, int lane,
                                        float* mid, uint4* ystage) {
  const int e = find_tile_entry(sh.pre2, sh.ne, item);
  int local = item - sh.pre2[e];
  const int slot = sh.ids[e];
  const int count = sh.counts[e];
  const int quads = (count + kConsumerTokens - 1) / kConsumerTokens;
  int s = 0;
  int rank = 0;
  int per = 0;
  for (;; ++s) {
    rank = sh.rank_tab[s * p.max_loras + slot];
    per = consumer_chunks(p, s, rank);
    const int n = per * quads;
    if (local < n) break;
    local -= n;
  }
  const int chunk = local % per;
  const int quad = local / per;
  const int pos = sh.starts[e] + quad * kConsumerTokens;
  const int nt = min(kConsumerTokens, count - quad * kConsumerTokens);
  const int nrg = (rank + kRankGroup - 1) / kRankGroup;
  const int producers = producer_items(p, count, rank);
  int* counter = p.meta.counters + e * p.num_slices + s;
  const int R = p.max_rank;
  const int64_t kstride = static_cast<int64_t>(p.num_slices) * p.num_tokens * R;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  // Sum of the K-chunk partials of (token j, rank row r), in a fixed order.
  auto reduced = [&](int j, int r) {
    const float* src =
        p.meta.scratch + (static_cast<int64_t>(s) * p.num_tokens + sh.sorted[pos + j]) * R + r;
    float sum = 0.0f;
#pragma unroll
    for (int kc = 0; kc < kMaxKChunks; ++kc) {
      if (kc < p.k_chunks) sum += __ldcg(src + kc * kstride);
    }
    return p.scale * sum;
  };
  auto wait_for_producers = [&]() {
    while (ld_acquire_gpu(counter) < producers) {
    }
  };

  if (!p.expand) {
    wait_for_producers();
    for (int i = lane; i < nt * rank; i += 32) {
      const int j = i / rank;
      const int r = i - j * rank;
      const float v = reduced(j, r);
      const int64_t o = (static_cast<int64_t>(s) * p.num_tokens + sh.sorted[pos + j]) * R + r;
      if (p.out_f32) {
        static_cast<float*>(p.out)[o] = v;
      } else {
        static_cast<T*>(p.out)[o] = from_float<T>(v);
      }
    }
  } else {
    const int64_t col = static_cast<int64_t>(chunk) * kCols + lane * 8;
    const bool cin = col < p.width[s];  // widths are multiples of 8: all 8 columns or none
    T* yg = static_cast<T*>(p.y);
    const int64_t ycol = p.y_col[s] + col;
    // Loads that do not depend on the shrink go first: y into this warp's staging area,
    // B (8 columns x 16 ranks) into registers.
    if (p.add_inputs) {
#pragma unroll
      for (int j = 0; j < kConsumerTokens; ++j) {
        if (cin && j < nt) {
          cp_async16(ystage + j * 32 + lane,
                     yg + static_cast<int64_t>(sh.sorted[pos + j]) * p.y_stride + ycol, 16);
        }
      }
      cp_async_commit();
    }
    const T* bcol = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + col) * R;
    uint4 bv[8][2];
    auto load_b = [&](int r0) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          bv[c][h] = (cin && r0 + h * 8 < rank) ? ldg16(bcol + c * R + r0 + h * 8) : zero;
        }
      }
    };
    load_b(0);
    if (rank > 0) {
      wait_for_producers();
      for (int i = lane; i < nt * rank; i += 32) {
        const int j = i / rank;
        const int r = i - j * rank;
        mid[r * kConsumerTokens + j] = reduced(j, r);
      }
      __syncwarp();
    }
    float acc[kConsumerTokens][8];
#pragma unroll
    for (int j = 0; j < kConsumerTokens; ++j) {
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[j][c] = 0.0f;
    }
    for (int rg = 0; rg < nrg; ++rg) {
      if (rg > 0) load_b(rg * kRankGroup);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          // Columns past the slot's rank are never used (B there may hold anything).
          if (rg * kRankGroup + h * 8 + q < rank) {
            const float4 m =
                *reinterpret_cast<const float4*>(mid + (rg * kRankGroup + h * 8 + q) * 4);
#pragma unroll
            for (int c = 0; c < 8; ++c) {
              const float b = elem<T>(bv[c][h], q);
              acc[0][c] = fmaf(m.x, b, acc[0][c]);
              acc[1][c] = fmaf(m.y, b, acc[1][c]);
              acc[2][c] = fmaf(m.z, b, acc[2][c]);
              acc[3][c] = fmaf(m.w, b, acc[3][c]);
            }
          }
        }
      }
    }
    if (p.add_inputs) cp_async_wait<0>();
#pragma unroll
    for (int j = 0; j < kConsumerTokens; ++j) {
      if (cin && j < nt) {
        float o[8];
        if (p.add_inputs) {
          unpack8<T>(ystage[j * 32 + lane], o);
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c) o[c] = 0.0f;
        }
#pragma unroll
        for (int c = 0; c < 8; ++c) o[c] += acc[j][c];
        *reinterpret_cast<uint4*>(yg + static_cast<int64_t>(sh.sorted[pos + j]) * p.y_stride +
                                  ycol) = pack8<T>(o);
      }
    }
  }
  if (rank > 0) {
    // Count this consumer; the last one of the (slot, slice) leaves the counter at zero.
    __syncwarp();
    if (lane == 0) {
      const int consumers = quads * per;
      const int old = atomicAdd(counter, 1);
      if (old == producers + consumers - 1) atomicExch(counter, 0);
    }
  }
  __syncwarp();  // the warp's shared areas are free for its next item
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) decode_lora_kernel(DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int ne = p.max_loras + 1;
  const int S = p.num_slices;
  int* ids = reinterpret_cast<int*>(smem_raw);
  int* counts = ids + ne;
  int* starts = counts + ne;
  int* pre1 = starts + ne;
  int* pre2 = pre1 + ne + 1;
  int* rank_tab = pre2 + ne + 1;
  int* sorted = rank_tab + S * p.max_loras;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;

  // One round trip: the metadata, the layer's ranks and the sorted token indices together.
  for (int e = tid; e < ne; e += kThreads) {
    ids[e] = p.meta.active_lora_ids[e];
    counts[e] = p.meta.num_tokens_per_lora[e];
    starts[e] = p.meta.lora_token_start_loc[e];
  }
  for (int i = tid; i < S * p.max_loras; i += kThreads) rank_tab[i] = p.ranks[i];
  for (int i = tid; i < p.num_tokens; i += kThreads) sorted[i] = p.meta.sorted_token_indices[i];
  __syncthreads();
  if (warp == 0) {
    int run1 = 0;
    int run2 = 0;
    for (int base = 0; base < ne; base += 32) {
      const int e = base + lane;
      int n1 = 0;
      int n2 = 0;
      if (e < ne && valid_slot(ids[e], p.max_loras)) {
        const int slot = ids[e];
        const int count = counts[e];
        const int quads = (count + kConsumerTokens - 1) / kConsumerTokens;
        for (int s = 0; s < S; ++s) {
          const int rank = rank_tab[s * p.max_loras + slot];
          n1 += producer_items(p, count, rank);
          n2 += consumer_chunks(p, s, rank) * quads;
        }
      }
      const int i1 = warp_inclusive_sum(n1, lane);
      const int i2 = warp_inclusive_sum(n2, lane);
      if (e < ne) {
        pre1[e + 1] = run1 + i1;
        pre2[e + 1] = run2 + i2;
      }
      run1 += __shfl_sync(kFullMask, i1, 31);
      run2 += __shfl_sync(kFullMask, i2, 31);
    }
    if (lane == 0) {
      pre1[0] = 0;
      pre2[0] = 0;
    }
  }
  __syncthreads();
  const Shared sh{ids, counts, starts, pre1, pre2, rank_tab, sorted, ne};
  const int n1 = pre1[ne];
  const int total = n1 + pre2[ne];
  unsigned char* area = smem_raw + p.off_warp + warp * p.warp_bytes;
  float* mid = reinterpret_cast<float*>(area);  // [max_rank][kConsumerTokens]
  uint4* ystage = reinterpret_cast<uint4*>(area + p.max_rank * kConsumerTokens * 4);
  // Consecutive items go to different CTAs, so that few items still spread over the SMs.
  const int nwarps = static_cast<int>(gridDim.x) * kWarps;
  for (int item = warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x); item < total;
       item += nwarps) {
    if (item < n1) {
      produce<T>(p, sh, item, lane);
    } else {
      consume<T>(p, sh, item - n1, lane, mid, ystage);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

bool half_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16; }

bool shrink_ok(const ShrinkArgs& s, const LoraMetaView& meta) {
  if (!half_dtype(s.dtype) || s.max_rank % 8 != 0 || s.max_rank < 8) return false;
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !aligned16(s.x)) return false;
  if (s.num_tokens > kMaxTokens || s.num_tokens > g_max_tokens.load()) return false;
  if (int64_t{s.num_slices} * s.max_loras > kMaxRankTable) return false;
  for (int i = 0; i < s.num_slices; ++i) {
    if (!aligned16(s.lora_a[i])) return false;
  }
  if (meta.scratch == nullptr || meta.counters == nullptr) return false;
  if (meta.num_counters < int64_t{s.max_loras + 1} * s.num_slices) return false;
  const int64_t steps = ceil_div(s.hidden, kKStep);
  const int64_t chunks = ceil_div(steps, ceil_div(steps, kMaxKChunks));
  return chunks * s.num_slices * s.num_tokens * s.max_rank <= meta.scratch_floats;
}

bool expand_ok(const ShrinkArgs& s, const ExpandArgs& e) {
  if (e.dtype != s.dtype || e.num_slices != s.num_slices || e.max_rank != s.max_rank ||
      e.max_loras != s.max_loras || e.num_tokens != s.num_tokens)
    return false;
  if (e.y_row_stride % 8 != 0 || e.offset_start % 8 != 0 || !aligned16(e.y)) return false;
  for (int i = 0; i < e.num_slices; ++i) {
    if (e.slice_width[i] % 8 != 0 || !aligned16(e.lora_b[i])) return false;
  }
  return true;
}

// Blocks of `kernel` that fit on one SM with `smem` bytes, cached per (kernel, smem, device).
int blocks_per_sm(const void* kernel, int smem) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, smem, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess ||
      n < 1) {
    cudaGetLastError();
    n = 1;
  }
  cache[key] = n;
  return n;
}

Status launch(const ShrinkArgs& s, const ExpandArgs* e, const LoraMetaView& meta,
              StreamHandle stream) {
  DecodeParams p{};
  p.x = s.x;
  p.x_stride = s.x_row_stride;
  p.hidden = s.hidden;
  p.num_slices = s.num_slices;
  for (int i = 0; i < s.num_slices; ++i) p.a[i] = s.lora_a[i];
  p.max_loras = s.max_loras;
  p.max_rank = s.max_rank;
  p.ranks = s.ranks;
  p.scale = s.scale;
  p.meta = meta;
  p.num_tokens = static_cast<int>(s.num_tokens);
  const int64_t steps = ceil_div(s.hidden, kKStep);
  p.k_chunk = static_cast<int>(ceil_div(steps, kMaxKChunks) * kKStep);
  p.k_chunks = static_cast<int>(ceil_div(s.hidden, p.k_chunk));
  p.expand = e != nullptr;
  int col_chunks = 0;
  if (e != nullptr) {
    int64_t col = e->offset_start;
    for (int i = 0; i < e->num_slices; ++i) {
      p.b[i] = e->lora_b[i];
      p.width[i] = e->slice_width[i];
      p.y_col[i] = col;
      col += e->slice_width[i];
      p.col_chunks[i] = static_cast<int>(ceil_div(e->slice_width[i], kCols));
      col_chunks += p.col_chunks[i];
    }
    p.y = e->y;
    p.y_stride = e->y_row_stride;
    p.add_inputs = e->add_inputs;
  } else {
    p.out = s.out;
    p.out_f32 = s.out_dtype == DType::kF32;
  }
  const int ne = s.max_loras + 1;
  const int ints = 3 * ne + 2 * (ne + 1) + s.num_slices * s.max_loras + p.num_tokens;
  p.off_warp = static_cast<int>(ceil_div(int64_t{ints} * 4, 16) * 16);
  p.warp_bytes = s.max_rank * kConsumerTokens * 4 + (p.expand ? kConsumerTokens * 32 * 16 : 0);
  const int smem = p.off_warp + kWarps * p.warp_bytes;

  // Work items at most (every active slot at max_rank), so that the grid stays within them.
  const int64_t active = std::min<int64_t>(s.num_tokens, s.max_loras);
  const int64_t pairs = (s.num_tokens + active + 1) / 2;
  const int64_t quads = (s.num_tokens + 3 * active + 3) / 4;
  const int64_t producers =
      pairs * s.num_slices * ceil_div(s.max_rank, kRankGroup) * int64_t{p.k_chunks};
  const int64_t consumers = quads * (p.expand ? col_chunks : s.num_slices);
  auto run = [&](auto kernel) -> Status {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem));
    // One wave at most: every consumer's wait relies on its producers being resident.
    const int64_t fit =
        int64_t{blocks_per_sm(reinterpret_cast<const void*>(kernel), smem)} * sm_count();
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min(fit, producers + consumers)));
    kernel<<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
    return launch_status("decode_lora_kernel");
  };
  if (s.dtype == DType::kBF16) return run(&decode_lora_kernel<bf16>);
  return run(&decode_lora_kernel<f16>);
}

}  // namespace

bool decode_shrink_applies(const ShrinkArgs& args, const LoraMetaView& meta) {
  return args.num_tokens > 0 && shrink_ok(args, meta);
}

Status decode_shrink(const ShrinkArgs& args, const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_ENSURE(decode_shrink_applies(args, meta), "decode_shrink: arguments not supported");
  return launch(args, nullptr, meta, stream);
}

void set_fused_linear_max_tokens(int max_tokens) {
  g_max_tokens.store(max_tokens < 0 ? kDefaultMaxTokens : max_tokens);
}

std::string lora_linear_path(const ShrinkArgs& shrink, const ExpandArgs& expand,
                             const LoraMetaView& meta) {
  if (shrink.num_tokens > 0 && shrink_ok(shrink, meta) && expand_ok(shrink, expand)) {
    return "fused";
  }
  return half_dtype(shrink.dtype) ? "split" : "generic";
}

Status lora_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                   StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(shrink));
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(expand));
  LORAPLEX_ENSURE(shrink.num_tokens == expand.num_tokens, "lora_linear: shrink has ",
                  shrink.num_tokens, " tokens, expand ", expand.num_tokens);
  LORAPLEX_RETURN_IF_ERROR(
      check_meta_view(meta, shrink.num_tokens, shrink.max_loras, "lora_linear"));
  if (shrink.num_tokens == 0) return Status();
  if (shrink_ok(shrink, meta) && expand_ok(shrink, expand)) {
    return launch(shrink, &expand, meta, stream);
  }
  LORAPLEX_RETURN_IF_ERROR(lora_shrink(shrink, meta, stream));
  return lora_expand(expand, meta, stream);
}

}  // namespace loraplex::kernels::cuda
