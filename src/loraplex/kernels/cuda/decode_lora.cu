// One LoRA layer (shrink + expand) for decode-sized batches as ONE persistent kernel; the
// shrink alone runs on the same kernel.
//
// Why this shape: at decode sizes the bytes (A and B of the active adapters) take a few
// microseconds at copy bandwidth, while every dependent step of a launch costs a large
// fraction of a microsecond: a round trip to memory, a block barrier, and above all the
// instructions of one warp (a warp with little independent work issues about one instruction
// per 10-25 cycles, so a warp that runs 1500 instructions takes several microseconds). So the
// layer is one launch of at most one wave (the grid never exceeds the CTAs that fit at once),
// each warp works on its own work items with no block barrier after the metadata, each item
// issues all its loads before it uses the first, and the arithmetic runs on tensor cores
// straight from registers (few instructions per byte):
//
//   producer (slot, slice, group of 8 of the slot's tokens, 16-row rank group, K chunk):
//     mma.m16n8k16 with A rows as the M operand and the tokens' x rows as the N operand, both
//     loaded with 16-byte loads straight into fragment registers. A dot product does not care
//     in which order K is summed, so lane (g, t) loads the 8 consecutive K of rows g and g+8
//     and of token g at 8 t and feeds them as the fragment's K positions {2t, 2t+1, 2t+8,
//     2t+9} of two MMAs: no shuffles, no shared memory. The partial sums (16 ranks x 8
//     tokens of one K chunk) go to the metadata's scratch (fixed order: deterministic, no
//     atomics on data); then a fence and an atomicAdd on the (slot, slice) arrival counter.
//   consumer (slot, slice, group of 8 tokens, a chunk of output columns): copies its B columns
//     and y rows into the warp's shared memory first (cp.async: they do not depend on the
//     shrink), waits (ld.acquire) until every producer of its (slot, slice) has arrived, sums
//     the K-chunk partials (L2-resident) in a fixed order into bf16 fragments and runs
//     mma.m16n8k16 (tokens as M, columns as N, ranks as K, the same K-order trick for B), adds
//     y and writes it back with 16-byte stores. Shrink alone: the consumer writes the
//     intermediate instead. The last consumer of a (slot, slice) resets its counter to zero,
//     so the next launch and every graph replay start from zero.
// Producer items precede consumer items in the item order and each warp takes its items in
// increasing order, so no warp waits while it still owns producer work; with every CTA
// resident at once (one wave) every wait ends. Absent slots and rank-0 slices have no items.

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"

namespace loraplex::kernels::cuda {
namespace {

using namespace persistent_kernel;

struct DecodeParams {
  const void* x;
  int64_t x_stride;
  int64_t hidden;
  int num_slices;
  const void* a[kMaxSlices];
  int max_loras;
  int max_rank;
  int a_slot_rows;  // rows of A between slots (ShrinkArgs::a_slot_rows)
  const int32_t* ranks;
  float scale;
  LoraMetaView meta;
  int num_tokens;
  int k_chunks;  // a power of two
  int k_shift;   // log2(k_chunks)
  int k_chunk;   // K per chunk, a multiple of kWindow
  int off_warp;  // bytes: start of the per-warp shared areas
  int warp_bytes;
  bool expand;  // true: y (+)= the layer's delta; false: the intermediate into `out`
  // expand
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t y_col[kMaxSlices];   // first y column of each slice
  int col_chunks[kMaxSlices];  // consumer column chunks of each slice
  int cols;                    // columns per consumer item (a power of two)
  int cols_shift;              // log2(cols / 8)
  int off_y;                   // bytes from a warp's area: staged y rows [kTokens][cols + 8]
  int off_frag;                // bytes from a warp's area: intermediate fragments
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

// Per-entry work, shared by the count and the lookup so that both agree.
__device__ __forceinline__ int producer_items(const DecodeParams& p, int groups, int rank) {
  return rank > 0 ? groups * ((rank + kRankGroup - 1) / kRankGroup) * p.k_chunks : 0;
}
__device__ __forceinline__ int consumer_chunks(const DecodeParams& p, int s, int rank) {
  if (!p.expand) return rank > 0 ? 1 : 0;
  return (rank > 0 || !p.add_inputs) ? p.col_chunks[s] : 0;
}

struct Shared {
  const int* ids;
  const int* counts;
  const int* starts;
  const int* rank_tab;
  const int* sorted;
};

// A warp's exclusive prefix of work items over the metadata entries, entries lane and
// 32 + lane in two registers each (no shared memory, no barrier).
struct WorkPrefix {
  int excl[2];
  int n[2];
  int total;
};

__device__ __forceinline__ WorkPrefix make_prefix(int n0, int n1, int lane) {
  WorkPrefix w;
  const int i0 = warp_inclusive_sum(n0, lane);
  const int t0 = __shfl_sync(kFullMask, i0, 31);
  const int i1 = warp_inclusive_sum(n1, lane) + t0;
  w.excl[0] = i0 - n0;
  w.excl[1] = i1 - n1;
  w.n[0] = n0;
  w.n[1] = n1;
  w.total = __shfl_sync(kFullMask, i1, 31);
  return w;
}

/// The entry that holds `item` (< w.total); `local` becomes the item's index within it.
__device__ __forceinline__ int find_entry(const WorkPrefix& w, int item, int& local) {
  int half = 0;
  unsigned m = __ballot_sync(kFullMask, w.excl[0] <= item && item < w.excl[0] + w.n[0]);
  if (m == 0) {
    half = 1;
    m = __ballot_sync(kFullMask, w.excl[1] <= item && item < w.excl[1] + w.n[1]);
  }
  const int src = __ffs(static_cast<int>(m)) - 1;
  local = item - __shfl_sync(kFullMask, half ? w.excl[1] : w.excl[0], src);
  return half * 32 + src;
}

template <typename T>
__device__ __forceinline__ void produce(const DecodeParams& p, const Shared& sh,
                                        const WorkPrefix& w, int item, int lane) {
  int local = 0;
  const int e = find_entry(w, item, local);
  const int slot = sh.ids[e];
  const int count = sh.counts[e];
  const int groups = (count + kTokens - 1) / kTokens;
  int s = 0;
  int rank = 0;
  for (;; ++s) {
    rank = sh.rank_tab[s * p.max_loras + slot];
    const int n = producer_items(p, groups, rank);
    if (local < n) break;
    local -= n;
  }
  const int kc = local & (p.k_chunks - 1);
  local >>= p.k_shift;
  const int nrg = (rank + kRankGroup - 1) / kRankGroup;
  const int rg = local % nrg;
  const int grp = local / nrg;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int ti = grp * kTokens + g;  // this lane's token (MMA column g)
  const int tok = ti < count ? sh.sorted[sh.starts[e] + ti] : -1;
  const int r_lo = rg * kRankGroup + g;  // this lane's A rows (MMA rows g and g + 8)
  const int r_hi = r_lo + 8;
  const bool lo_ok = r_lo < rank;
  const bool hi_ok = r_hi < rank;
  const int64_t K = p.hidden;
  const T* a_lo =
      static_cast<const T*>(p.a[s]) + (static_cast<int64_t>(slot) * p.a_slot_rows + r_lo) * K;
  const T* a_hi = a_lo + 8 * K;
  const T* xr = static_cast<const T*>(p.x) + static_cast<int64_t>(tok < 0 ? 0 : tok) * p.x_stride;
  const int64_t k_lo = static_cast<int64_t>(kc) * p.k_chunk;
  const int64_t k_hi = min(K, k_lo + p.k_chunk);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t kb = k_lo; kb < k_hi; kb += kWindow * kWindows) {
    uint4 al[kWindows];
    uint4 ah[kWindows];
    uint4 xv[kWindows];
#pragma unroll
    for (int i = 0; i < kWindows; ++i) {
      const int64_t k = kb + i * kWindow + t * 8;
      const bool ok = k < k_hi;
      al[i] = ok && lo_ok ? ldg16(a_lo + k) : zero;
      ah[i] = ok && hi_ok ? ldg16(a_hi + k) : zero;
      xv[i] = ok && tok >= 0 ? ldg16(xr + k) : zero;
    }
#pragma unroll
    for (int i = 0; i < kWindows; ++i) {
      const uint32_t f0[4] = {al[i].x, ah[i].x, al[i].y, ah[i].y};
      const uint32_t b0[2] = {xv[i].x, xv[i].y};
      mma_16816<T>(acc, f0, b0);
      const uint32_t f1[4] = {al[i].z, ah[i].z, al[i].w, ah[i].w};
      const uint32_t b1[2] = {xv[i].z, xv[i].w};
      mma_16816<T>(acc, f1, b1);
    }
  }
  // acc: (row r_lo | r_hi) x (tokens 2t, 2t + 1 of the group), held by lanes g = 2t, 2t + 1.
  const int tok0 = __shfl_sync(kFullMask, tok, (2 * t) << 2);
  const int tok1 = __shfl_sync(kFullMask, tok, (2 * t + 1) << 2);
  float* part =
      p.meta.scratch + (static_cast<int64_t>(kc) * p.num_slices + s) * p.num_tokens * p.max_rank;
  if (tok0 >= 0) {
    if (lo_ok) __stcg(part + static_cast<int64_t>(tok0) * p.max_rank + r_lo, acc[0]);
    if (hi_ok) __stcg(part + static_cast<int64_t>(tok0) * p.max_rank + r_hi, acc[2]);
  }
  if (tok1 >= 0) {
    if (lo_ok) __stcg(part + static_cast<int64_t>(tok1) * p.max_rank + r_lo, acc[1]);
    if (hi_ok) __stcg(part + static_cast<int64_t>(tok1) * p.max_rank + r_hi, acc[3]);
  }
  // Release: every lane's partial is visible GPU-wide before the arrival is counted.
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(p.meta.counters + e * p.num_slices + s, 1);
}

/// Masks for the two fragment registers of ranks r0 + 4t .. r0 + 4t + 3 (low half first):
/// ranks at or past `rank` become zero (their B values may be anything, NaN included).
__device__ __forceinline__ void rank_masks(int r, int rank, uint32_t& m0, uint32_t& m1) {
  m0 = (r < rank ? 0x0000ffffu : 0u) | (r + 1 < rank ? 0xffff0000u : 0u);
  m1 = (r + 2 < rank ? 0x0000ffffu : 0u) | (r + 3 < rank ? 0xffff0000u : 0u);
}

template <typename T>
__device__ __forceinline__ void consume(const DecodeParams& p, const Shared& sh,
                                        const WorkPrefix& w, int item, int lane,
                                        unsigned char* area) {
  int local = 0;
  const int e = find_entry(w, item, local);
  const int slot = sh.ids[e];
  const int count = sh.counts[e];
  const int groups = (count + kTokens - 1) / kTokens;
  int s = 0;
  int rank = 0;
  int per = 0;
  for (;; ++s) {
    rank = sh.rank_tab[s * p.max_loras + slot];
    per = consumer_chunks(p, s, rank);
    const int n = per * groups;
    if (local < n) break;
    local -= n;
  }
  const int chunk = local % per;
  const int grp = local / per;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int pos = sh.starts[e] + grp * kTokens;
  const int nt = min(kTokens, count - grp * kTokens);
  const int tok = g < nt ? sh.sorted[pos + g] : -1;  // this lane's token (MMA row g)
  const int producers = producer_items(p, groups, rank);
  int* counter = p.meta.counters + e * p.num_slices + s;
  const int R = p.max_rank;
  const int nks = (rank + 15) >> 4;  // MMA steps of 16 ranks
  const int64_t kstride = static_cast<int64_t>(p.num_slices) * p.num_tokens * R;
  const float* part =
      p.meta.scratch + (static_cast<int64_t>(s) * p.num_tokens + (tok < 0 ? 0 : tok)) * R;

  T* bst = reinterpret_cast<T*>(area);                        // [cols][R], as in memory
  T* yst = reinterpret_cast<T*>(area + p.off_y);              // [kTokens][cols + 8]
  uint2* frag = reinterpret_cast<uint2*>(area + p.off_frag);  // [nks][32]
  const int cols = p.cols;
  const int ypitch = cols + 8;
  int64_t c0 = 0;
  int ncols = 0;
  T* yg = static_cast<T*>(p.y);
  if (p.expand) {
    // Loads that do not depend on the shrink first: the B columns (one contiguous block) and
    // the y rows of the group's tokens, into the warp's shared memory.
    c0 = static_cast<int64_t>(chunk) * cols;
    ncols = static_cast<int>(min(static_cast<int64_t>(cols), p.width[s] - c0));
    if (rank > 0) {
      const T* bsrc = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + c0) * R;
      for (int i = lane; i * 8 < ncols * R; i += 32) cp_async16(bst + i * 8, bsrc + i * 8, 16);
    }
    if (p.add_inputs) {
      const int per_row = cols >> 3;
      for (int i = lane; i < kTokens * per_row; i += 32) {
        const int row = i >> p.cols_shift;
        const int ch = i & (per_row - 1);
        if (row < nt && ch * 8 < ncols) {
          cp_async16(yst + row * ypitch + ch * 8,
                     yg + static_cast<int64_t>(sh.sorted[pos + row]) * p.y_stride + p.y_col[s] +
                         c0 + ch * 8,
                     16);
        }
      }
    }
    cp_async_commit();
  }
  if (rank > 0) {
    while (ld_acquire_gpu(counter) < producers) {
    }
    // The intermediate of token g, ranks r0 + 4t .. + 3: the K-chunk partials summed in a
    // fixed order, ranks past the slot's rank zero.
    for (int ks = 0; ks < nks; ++ks) {
      const int r = ks * 16 + t * 4;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (tok >= 0 && r < rank) {
#pragma unroll
        for (int kc = 0; kc < kMaxKChunks; ++kc) {
          if (kc < p.k_chunks) {
            const float4 q = __ldcg(reinterpret_cast<const float4*>(part + kc * kstride + r));
            v.x += q.x;
            v.y += q.y;
            v.z += q.z;
            v.w += q.w;
          }
        }
      }
      v.x = r < rank ? p.scale * v.x : 0.0f;
      v.y = r + 1 < rank ? p.scale * v.y : 0.0f;
      v.z = r + 2 < rank ? p.scale * v.z : 0.0f;
      v.w = r + 3 < rank ? p.scale * v.w : 0.0f;
      if (!p.expand) {
        if (tok >= 0) {
          const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            if (r + q < rank) {
              const int64_t o = (static_cast<int64_t>(s) * p.num_tokens + tok) * R + r + q;
              if (p.out_f32) {
                static_cast<float*>(p.out)[o] = vals[q];
              } else {
                static_cast<T*>(p.out)[o] = from_float<T>(vals[q]);
              }
            }
          }
        }
      } else {
        frag[ks * 32 + lane] = make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
      }
    }
  }
  if (p.expand) {
    cp_async_wait<0>();
    __syncwarp();  // every lane's staged B, y and fragments are visible to the warp
    const int ntiles = ncols >> 3;
    for (int j0 = 0; j0 < ntiles; j0 += 8) {
      float acc[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      for (int ks = 0; ks < nks; ++ks) {
        const uint2 fa = frag[ks * 32 + lane];
        const uint32_t a[4] = {fa.x, 0u, fa.y, 0u};  // rows g + 8 (no token) are zero
        uint32_t m0 = 0;
        uint32_t m1 = 0;
        rank_masks(ks * 16 + t * 4, rank, m0, m1);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j0 + j < ntiles) {
            const uint2 bv =
                *reinterpret_cast<const uint2*>(bst + ((j0 + j) * 8 + g) * R + ks * 16 + t * 4);
            const uint32_t b[2] = {bv.x & m0, bv.y & m1};
            mma_16816<T>(acc[j], a, b);
          }
        }
      }
      // acc[j][0..1]: token g, columns (j0 + j) * 8 + 2t, + 1.
      if (g < nt) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j0 + j < ntiles) {
            uint32_t* cell = reinterpret_cast<uint32_t*>(yst + g * ypitch + (j0 + j) * 8 + 2 * t);
            float v0 = acc[j][0];
            float v1 = acc[j][1];
            if (p.add_inputs) {
              const float2 old = unpack2<T>(*cell);
              v0 += old.x;
              v1 += old.y;
            }
            *cell = pack2<T>(v0, v1);
          }
        }
      }
    }
    __syncwarp();
    const int per_row = cols >> 3;
    for (int i = lane; i < kTokens * per_row; i += 32) {
      const int row = i >> p.cols_shift;
      const int ch = i & (per_row - 1);
      if (row < nt && ch * 8 < ncols) {
        *reinterpret_cast<uint4*>(yg + static_cast<int64_t>(sh.sorted[pos + row]) * p.y_stride +
                                  p.y_col[s] + c0 + ch * 8) =
            *reinterpret_cast<const uint4*>(yst + row * ypitch + ch * 8);
      }
    }
  }
  if (rank > 0) {
    // Count this consumer; the last one of the (slot, slice) leaves the counter at zero.
    __syncwarp();
    if (lane == 0) {
      const int consumers = groups * per;
      const int old = atomicAdd(counter, 1);
      if (old == producers + consumers - 1) atomicExch(counter, 0);
    }
  }
  __syncwarp();  // the warp's shared area is free for its next item
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) decode_lora_kernel(DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int ne = p.max_loras + 1;
  const int S = p.num_slices;
  int* ids = reinterpret_cast<int*>(smem_raw);
  int* counts = ids + ne;
  int* starts = counts + ne;
  int* rank_tab = starts + ne;
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
  // Every warp counts the work itself (no second barrier): entries lane and 32 + lane.
  int n1[2] = {0, 0};
  int n2[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int e = h * 32 + lane;
    if (e < ne && valid_slot(ids[e], p.max_loras)) {
      const int slot = ids[e];
      const int groups = (counts[e] + kTokens - 1) / kTokens;
      for (int s = 0; s < S; ++s) {
        const int rank = rank_tab[s * p.max_loras + slot];
        n1[h] += producer_items(p, groups, rank);
        n2[h] += consumer_chunks(p, s, rank) * groups;
      }
    }
  }
  const WorkPrefix w1 = make_prefix(n1[0], n1[1], lane);
  const WorkPrefix w2 = make_prefix(n2[0], n2[1], lane);
  const Shared sh{ids, counts, starts, rank_tab, sorted};
  const int total = w1.total + w2.total;
  unsigned char* area = smem_raw + p.off_warp + warp * p.warp_bytes;
  // Consecutive items go to different CTAs, so that few items still spread over the SMs.
  const int nwarps = static_cast<int>(gridDim.x) * kWarps;
  for (int item = warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x); item < total;
       item += nwarps) {
    if (item < w1.total) {
      produce<T>(p, sh, w1, item, lane);
    } else {
      consume<T>(p, sh, w2, item - w1.total, lane, area);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

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

}  // namespace

Status launch_persistent(const PersistentPlan& plan, const ShrinkArgs& s, const ExpandArgs* e,
                         const LoraMetaView& meta, StreamHandle stream) {
  DecodeParams p{};
  p.x = s.x;
  p.x_stride = s.x_row_stride;
  p.hidden = s.hidden;
  p.num_slices = s.num_slices;
  for (int i = 0; i < s.num_slices; ++i) p.a[i] = s.lora_a[i];
  p.max_loras = s.max_loras;
  p.max_rank = s.max_rank;
  p.a_slot_rows = a_slot_rows(s);
  p.ranks = s.ranks;
  p.scale = s.scale;
  p.meta = meta;
  p.num_tokens = static_cast<int>(s.num_tokens);
  p.k_chunks = plan.k_chunks;
  p.k_shift = plan.k_shift;
  p.k_chunk = plan.k_chunk;
  p.expand = plan.expand;
  if (e != nullptr) {
    p.cols = plan.cols;
    p.cols_shift = plan.cols_shift;
    int64_t col = e->offset_start;
    for (int i = 0; i < e->num_slices; ++i) {
      p.b[i] = e->lora_b[i];
      p.width[i] = e->slice_width[i];
      p.y_col[i] = col;
      col += e->slice_width[i];
      p.col_chunks[i] = plan.col_chunks[i];
    }
    p.y = e->y;
    p.y_stride = e->y_row_stride;
    p.add_inputs = e->add_inputs;
    p.off_y = plan.off_y;
    p.off_frag = plan.off_frag;
  } else {
    p.out = s.out;
    p.out_f32 = s.out_dtype == DType::kF32;
  }
  p.warp_bytes = plan.warp_bytes;
  p.off_warp = plan.off_warp;
  auto run = [&](auto kernel) -> Status {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem));
    // One wave at most: every consumer's wait relies on its producers being resident.
    const int64_t fit =
        int64_t{blocks_per_sm(reinterpret_cast<const void*>(kernel), plan.smem)} * plan.sm_count;
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min(fit, plan.items)));
    kernel<<<grid, kThreads, plan.smem, static_cast<cudaStream_t>(stream)>>>(p);
    return launch_status("decode_lora_kernel");
  };
  if (s.dtype == DType::kBF16) return run(&decode_lora_kernel<bf16>);
  return run(&decode_lora_kernel<f16>);
}

}  // namespace loraplex::kernels::cuda
