// Shrink, and shrink + expand of one layer, as clusters of 8 CTAs splitting K.
//
// A cluster takes one work item: a tile of up to `m_tile` tokens of one active slot (rows
// gathered through the sorted token indices), all slices at once. Each CTA of the cluster
// stages its eighth of K for the tile's x rows and the slot's A rows (cp.async, zero-filled
// past the valid bytes, nothing loaded past a slot's rank) in one pass when it fits, and its
// warps split the MMA tiles and the K steps between them, so that no warp runs a long serial
// loop (on this GPU a single warp retires roughly one instruction per 10 cycles; the
// critical path, not the bytes, is what a small LoRA op waits for). The warps' partial
// sums are added in shared memory, then the 8 CTAs' sums through distributed shared memory
// after a cluster barrier.
//   shrink:  each CTA writes an eighth of the tile's fp32 (or 16-bit) intermediate;
//   fused:   each CTA expands its own share of the layer's output columns from the on-chip
//            intermediate (B staged in shared memory while the shrink runs, y prefetched to
//            L2) and writes y. With fewer tiles than clusters, a slot's columns are split
//            into parts; each part recomputes the small shrink (A comes from L2).
// Work items are counted on the device from the metadata and the launch configuration
// depends only on host-known sizes, so every launch is one capturable graph node.

#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace cg = cooperative_groups;

namespace loraplex::kernels::cuda {

/// Shrink through the cluster kernel when the arguments suit it (declared for shrink_expand.cu).
bool cluster_shrink_supported(const ShrinkArgs& args);
Status cluster_shrink(const ShrinkArgs& args, const LoraMetaView& meta, StreamHandle stream);

namespace {

constexpr int kCluster = 8;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTile = 64;             // tokens per work item at most
constexpr int kMaxRows = 256;            // num_slices * max_rank at most
constexpr int kMaxPairs = 4;             // (MMA tile, K group) pairs per warp at most
constexpr int kMaxParts = 16;            // column parts per slot at most (fused)
constexpr int kSmemTarget = 112 * 1024;  // two CTAs per SM
constexpr int kSmemMax = 220 * 1024;
constexpr int kDefaultMaxTokens = 32;

std::atomic<int> g_fused_max_tokens{kDefaultMaxTokens};

struct ClusterParams {
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
  int m_tile;     // tokens per work item: 16, 32 or 64
  int sgroups;    // 1: a work item covers every slice; num_slices: one slice each
  int k_chunk;    // K per CTA (a multiple of k_pass)
  int k_pass;     // K staged at once (a power of two >= 64)
  int cpr_shift;  // log2(k_pass / 8): 16-byte chunks per staged row
  int x_pitch;    // k_pass + 8 elements: fragment loads are bank-conflict free
  int region0;    // bytes of the staging region (x, A; later pair sums and v_sums)
  int off_part;   // byte offsets of the other shared arrays
  int off_b;
  int off_int;
  // shrink-only output
  void* out;
  bool out_f32;
  int64_t num_tokens;
  // fused expand
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t col_begin[kMaxSlices + 1];  // slices concatenated; col_begin[num_slices] = total
  int64_t y_col[kMaxSlices];          // first y column of each slice
  void* y;
  int64_t y_stride;
  bool add_inputs;
  bool stage_b;       // B rows of the CTA's columns staged in shared memory
  bool cache_ranks;   // the layer's ranks copied to shared memory up front
  bool cache_sorted;  // the batch's sorted token indices copied to shared memory up front
  int b_pitch;        // max_rank + 8
};

// Number of K groups the warps split the K steps into, for `units` MMA tiles: the fewest
// MMA steps per warp with at most kMaxPairs (tile, group) pairs per warp.
__device__ __forceinline__ int choose_kgroups(int units, int ksteps) {
  int best = 1;
  int best_cost = 1 << 30;
  for (int kg = 1; kg <= kWarps; kg *= 2) {
    const int per_warp = (units * kg + kWarps - 1) / kWarps;
    if (per_warp > kMaxPairs) break;
    const int cost = per_warp * ((ksteps + kg - 1) / kg);
    if (cost < best_cost) {
      best_cost = cost;
      best = kg;
    }
  }
  return best;
}

template <typename T, bool kExpand>
__global__ void __launch_bounds__(kThreads, 2) cluster_lora_kernel(ClusterParams p) {
  cg::cluster_group cluster = cg::this_cluster();
  const int crank = static_cast<int>(cluster.block_rank());
  const int cid = static_cast<int>(blockIdx.x) / kCluster;
  const int nclusters = static_cast<int>(gridDim.x) / kCluster;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int S = p.num_slices;
  const int MR = p.max_rank;
  const int G = p.sgroups;
  const int RA = (G == 1 ? S : 1) * MR;  // A rows of one work item
  const int mt = p.m_tile;
  const int xp = p.x_pitch;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);                 // [mt][xp], then the A rows [RA][xp]
  float* pair_sums = reinterpret_cast<float*>(smem_raw);  // [pairs][16 * 8], after the MMAs
  float* v_sums = reinterpret_cast<float*>(smem_raw);     // [mt][RA], after cluster sync 1
  float* part_sums = reinterpret_cast<float*>(smem_raw + p.off_part);     // [mt][RA]
  T* bs = reinterpret_cast<T*>(smem_raw + p.off_b);                       // [cols][b_pitch]
  const T** row_src = reinterpret_cast<const T**>(smem_raw + p.off_int);  // staged rows
  int* row_dst = reinterpret_cast<int*>(row_src + kMaxTile + kMaxRows);
  int* tok = row_dst + kMaxTile + kMaxRows;     // [kMaxTile]
  int* srank = tok + kMaxTile;                  // [kMaxSlices]
  int* tile_row = srank + kMaxSlices;           // [kMaxRows / 8]
  int* unit_row = tile_row + kMaxRows / 8;      // [kWarps * kMaxPairs]
  int* unit_a = unit_row + kWarps * kMaxPairs;  // [kWarps * kMaxPairs]
  const int ne = p.max_loras + 1;
  int* ids = unit_a + kWarps * kMaxPairs;  // [ne]
  int* counts = ids + ne;                  // [ne]
  int* starts = counts + ne;               // [ne]
  int* prefix = starts + ne;               // [ne + 1]
  int* rank_cache = prefix + ne + 1;       // [num_slices * max_loras] when p.cache_ranks
  int* sorted_cache = rank_cache + (p.cache_ranks ? S * p.max_loras : 0);  // [num_tokens]

  // Every entry of the metadata, the layer's ranks and (small batches) the sorted token
  // indices at once: entries past the active ones are -1 / 0, so the whole work list costs
  // one round trip to memory and the work items need no other before their data.
  for (int e = tid; e < ne; e += kThreads) {
    ids[e] = p.meta.active_lora_ids[e];
    counts[e] = p.meta.num_tokens_per_lora[e];
    starts[e] = p.meta.lora_token_start_loc[e];
  }
  if (p.cache_ranks) {
    for (int i = tid; i < S * p.max_loras; i += kThreads) rank_cache[i] = p.ranks[i];
  }
  if (p.cache_sorted) {
    for (int i = tid; i < p.num_tokens; i += kThreads) {
      sorted_cache[i] = p.meta.sorted_token_indices[i];
    }
  }
  __syncthreads();
  if (warp == 0) {
    int running = 0;
    for (int base = 0; base < ne; base += 32) {
      const int e = base + lane;
      int v = 0;
      if (e < ne && valid_slot(ids[e], p.max_loras)) v = (counts[e] + mt - 1) / mt;
      v = warp_inclusive_sum(v, lane);
      if (e < ne) prefix[e + 1] = running + v;
      running += __shfl_sync(kFullMask, v, 31);
    }
    if (lane == 0) prefix[0] = 0;
  }
  __syncthreads();
  const int tiles = prefix[ne];
  if (tiles == 0) return;  // the same in every CTA: no cluster barrier is left waiting
  const int parts = kExpand ? max(1, min(kMaxParts, nclusters / (tiles * G))) : 1;
  const int works = tiles * G * parts;

  const int64_t k_lo = static_cast<int64_t>(crank) * p.k_chunk;
  const int64_t k_hi = min(p.hidden, k_lo + p.k_chunk);
  const int passes = k_hi > k_lo ? static_cast<int>(ceil_div(k_hi - k_lo, p.k_pass)) : 0;
  const int ksteps = p.k_pass / 16;
  // Staging: each thread copies one 16-byte column chunk of every (kThreads / chunks)-th row.
  const int ch = tid & ((1 << p.cpr_shift) - 1);
  const int rsub = tid >> p.cpr_shift;
  const int rstep = kThreads >> p.cpr_shift;
  const T* xg = static_cast<const T*>(p.x);

  for (int w = cid; w < works; w += nclusters) {
    const int part = w % parts;
    const int group = (w / parts) % G;
    const int tile = w / (parts * G);
    const int s_lo = G == 1 ? 0 : group;
    const int s_hi = G == 1 ? S : group + 1;
    const int e = find_tile_entry(prefix, ne, tile);
    const int slot = ids[e];
    const int m0 = (tile - prefix[e]) * mt;
    const int n_tok = min(mt, counts[e] - m0);
    const int start = starts[e] + m0;
    __syncthreads();  // the previous work item is done with the shared arrays
    if (tid < kMaxTile) {
      tok[tid] = tid >= n_tok     ? 0
                 : p.cache_sorted ? sorted_cache[start + tid]
                                  : p.meta.sorted_token_indices[start + tid];
    }
    if (tid < S) {
      srank[tid] =
          p.cache_ranks ? rank_cache[tid * p.max_loras + slot] : p.ranks[tid * p.max_loras + slot];
    }
    __syncthreads();

    // Rows to stage: the tile's x rows (whole 16-row MMA groups; rows past the tile's tokens
    // zero-filled), then each slice's A rows of whole 8-rank MMA tiles (rows past the rank
    // zero-filled, rows past the last tile not staged at all).
    const int mgroups = (n_tok + 15) / 16;
    const int xrows = mgroups * 16;
    int ta = 0;
    int arows = 0;
    for (int s = s_lo; s < s_hi; ++s) {
      const int rk = srank[s];
      const int n8 = (rk + 7) / 8;
      const T* ag = static_cast<const T*>(p.a[s]) + static_cast<int64_t>(slot) * MR * p.hidden;
      if (tid < n8) tile_row[ta + tid] = (s - s_lo) * MR + tid * 8;
      for (int r = tid; r < n8 * 8; r += kThreads) {
        row_src[xrows + arows + r] = r < rk ? ag + r * p.hidden : nullptr;
        row_dst[xrows + arows + r] = mt + (s - s_lo) * MR + r;
      }
      ta += n8;
      arows += n8 * 8;
    }
    if (tid < xrows) {
      row_src[tid] = tid < n_tok ? xg + tok[tid] * p.x_stride : nullptr;
      row_dst[tid] = tid;
    }
    const int nrows = xrows + arows;
    const int units = mgroups * ta;  // MMA tiles of 16 tokens x 8 ranks

    int64_t g_lo = 0;
    int64_t g_hi = 0;
    if constexpr (kExpand) {
      // This CTA's share of the group's output columns, in 8-column groups.
      const int64_t c_first = p.col_begin[s_lo] / 8;
      const int64_t n_groups = (p.col_begin[s_hi] - p.col_begin[s_lo]) / 8;
      const int64_t per_cta = ceil_div(n_groups, static_cast<int64_t>(parts) * kCluster);
      const int64_t q = static_cast<int64_t>(part) * kCluster + crank;
      g_lo = c_first + min(n_groups, q * per_cta);
      g_hi = c_first + min(n_groups, (q + 1) * per_cta);
      // B rows of these columns do not depend on the shrink: staged with the first pass.
      const int64_t ncols = (g_hi - g_lo) * 8;
      if (p.stage_b) {
        for (int64_t c = tid; c < ncols; c += kThreads) {
          const int64_t col = g_lo * 8 + c;
          int s = s_lo;
          while (col >= p.col_begin[s + 1]) ++s;
          const int rk = srank[s];
          const T* src =
              static_cast<const T*>(p.b[s]) + (slot * p.width[s] + (col - p.col_begin[s])) * MR;
          for (int c8 = 0; c8 * 8 < rk; ++c8) {
            cp_async16(bs + c * p.b_pitch + c8 * 8, src + c8 * 8, min(8, rk - c8 * 8) * 2);
          }
        }
      }
      if (p.add_inputs) {
        // Warm the L2 with the y rows the expand reads.
        const int64_t row_bytes = ncols * static_cast<int64_t>(sizeof(T));
        const int64_t row_lines = row_bytes / 128 + 2;
        T* yg = static_cast<T*>(p.y);
        int s = s_lo;
        while (s + 1 < s_hi && g_lo * 8 >= p.col_begin[s + 1]) ++s;
        const int64_t y_first = p.y_col[s] + (g_lo * 8 - p.col_begin[s]);
        for (int64_t i = tid; i < n_tok * row_lines; i += kThreads) {
          const uintptr_t first =
              reinterpret_cast<uintptr_t>(yg + tok[i / row_lines] * p.y_stride + y_first);
          const uintptr_t line = (first & ~uintptr_t{127}) + (i % row_lines) * 128;
          if (line < first + row_bytes) prefetch_l2(reinterpret_cast<const void*>(line));
        }
      }
    }
    __syncthreads();  // row tables and tile_row are complete
    if (tid < units) {
      unit_row[tid] = (tid / ta) * 16;
      unit_a[tid] = tile_row[tid % ta];
    }
    __syncthreads();

    // ---- shrink: this CTA's K range; warps split the MMA tiles and the K steps ----
    const int kg = choose_kgroups(units, ksteps);
    const int pairs = units * kg;
    const int ks_per = (ksteps + kg - 1) / kg;
    int pair_row[kMaxPairs];
    int pair_a[kMaxPairs];
    int pair_k[kMaxPairs];
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      const int pr = warp + i * kWarps;
      const int u = pr < pairs ? pr % units : 0;
      pair_row[i] = pr < pairs ? unit_row[u] : 0;
      pair_a[i] = pr < pairs ? unit_a[u] + mt : 0;  // A rows follow the mt x rows
      pair_k[i] = pr < pairs ? (pr / units) * ks_per : 0;
    }
    float acc[kMaxPairs][4];
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    for (int pass = 0; pass < passes; ++pass) {
      if (pass > 0) __syncthreads();  // every warp is done with the previous pass
      const int64_t k = k_lo + static_cast<int64_t>(pass) * p.k_pass + ch * 8;
      const bool k_in = k < k_hi;
      for (int i = rsub; i < nrows; i += rstep) {
        const T* src = row_src[i];
        const bool ok = k_in && src != nullptr;
        cp_async16(xs + row_dst[i] * xp + ch * 8, ok ? src + k : xg, ok ? 16 : 0);
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kMaxPairs; ++i) {
        if (warp + i * kWarps >= pairs) continue;
        const int ks_end = min(ksteps, pair_k[i] + ks_per);
        for (int ks = pair_k[i]; ks < ks_end; ++ks) {
          uint32_t af[4];
          uint32_t bfr[2];
          load_a_frag(af, xs + pair_row[i] * xp + ks * 16, xp, lane);
          load_b_frag(bfr, xs + pair_a[i] * xp + ks * 16, xp, lane);
          mma_16816<T>(acc[i], af, bfr);
        }
      }
    }
    if (passes == 0) cp_async_commit();  // the B staging group, if any
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the staged x and A
    {
      const int g = lane >> 2;
      const int tq = (lane & 3) * 2;
#pragma unroll
      for (int i = 0; i < kMaxPairs; ++i) {
        const int pr = warp + i * kWarps;
        if (pr >= pairs) continue;
        float* dst = pair_sums + pr * 128;
        dst[g * 8 + tq] = acc[i][0];
        dst[g * 8 + tq + 1] = acc[i][1];
        dst[(g + 8) * 8 + tq] = acc[i][2];
        dst[(g + 8) * 8 + tq + 1] = acc[i][3];
      }
    }
    __syncthreads();
    for (int i = tid; i < units * 128; i += kThreads) {
      const int u = i >> 7;
      const int el = i & 127;
      float v = 0.0f;
      for (int gk = 0; gk < kg; ++gk) v += pair_sums[(gk * units + u) * 128 + el];
      part_sums[(unit_row[u] + (el >> 3)) * RA + unit_a[u] + (el & 7)] = p.scale * v;
    }
    cluster.sync();  // the partial sums of all 8 CTAs are complete

    if constexpr (!kExpand) {
      // Each CTA writes every 8th entry of the tile's intermediate.
      for (int i = crank * kThreads + tid; i < n_tok * RA; i += kCluster * kThreads) {
        const int m = i / RA;
        const int ra = i - m * RA;
        const int s = s_lo + ra / MR;
        const int r = ra % MR;
        if (r >= srank[s]) continue;
        float v = 0.0f;
#pragma unroll
        for (int c = 0; c < kCluster; ++c) v += cluster.map_shared_rank(part_sums, c)[i];
        const int64_t o = (s * p.num_tokens + tok[m]) * MR + r;
        if (p.out_f32) {
          static_cast<float*>(p.out)[o] = v;
        } else {
          static_cast<T*>(p.out)[o] = from_float<T>(v);
        }
      }
      cluster.sync();  // no CTA reads another's partial sums any more
    } else {
      for (int s = s_lo; s < s_hi; ++s) {
        if (p.col_begin[s] >= g_hi * 8 || p.col_begin[s + 1] <= g_lo * 8) continue;
        const int rk = srank[s];
        for (int i = tid; i < n_tok * rk; i += kThreads) {
          const int off = (i / rk) * RA + (s - s_lo) * MR + i % rk;
          float v = 0.0f;
#pragma unroll
          for (int c = 0; c < kCluster; ++c) v += cluster.map_shared_rank(part_sums, c)[off];
          v_sums[off] = v;
        }
      }
      cluster.sync();  // no CTA reads another's partial sums any more; v_sums is complete
      // Two adjacent output columns of one token per thread.
      const int64_t npairs = (g_hi - g_lo) * 4;
      T* yg = static_cast<T*>(p.y);
      for (int64_t i = tid; i < n_tok * npairs; i += kThreads) {
        const int m = static_cast<int>(i / npairs);
        const int64_t c = (i % npairs) * 2;
        const int64_t col = g_lo * 8 + c;
        int s = s_lo;
        while (col >= p.col_begin[s + 1]) ++s;
        const int64_t j = col - p.col_begin[s];
        const int rk = srank[s];
        if (rk == 0 && p.add_inputs) continue;
        const T* b0 = p.stage_b ? bs + c * p.b_pitch
                                : static_cast<const T*>(p.b[s]) + (slot * p.width[s] + j) * MR;
        const T* b1 = p.stage_b ? b0 + p.b_pitch : b0 + MR;
        const float* vrow = v_sums + m * RA + (s - s_lo) * MR;
        float o0 = 0.0f;
        float o1 = 0.0f;
        for (int r0 = 0; r0 < rk; r0 += 8) {
          float bv0[8];
          float bv1[8];
          unpack8<T>(*reinterpret_cast<const uint4*>(b0 + r0), bv0);
          unpack8<T>(*reinterpret_cast<const uint4*>(b1 + r0), bv1);
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            if (r0 + q < rk) {
              const float v = vrow[r0 + q];
              o0 += v * bv0[q];
              o1 += v * bv1[q];
            }
          }
        }
        T* yrow = yg + tok[m] * p.y_stride + p.y_col[s] + j;
        if (p.add_inputs) {
          const float2 old = unpack2<T>(*reinterpret_cast<const uint32_t*>(yrow));
          o0 += old.x;
          o1 += old.y;
        }
        *reinterpret_cast<uint32_t*>(yrow) = pack2<T>(o0, o1);
      }
    }
  }
}

struct ClusterPlan {
  bool ok = false;
  int m_tile = 0;
  int sgroups = 1;
  int k_chunk = 0;
  int k_pass = 0;
  int region0 = 0;
  int off_part = 0;
  int off_b = 0;
  int off_int = 0;
  int smem = 0;
  bool stage_b = false;
  int clusters = 0;
};

bool half_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16; }

int align16(int64_t bytes) { return static_cast<int>(ceil_div(bytes, 16) * 16); }

bool shrink_shape_ok(const ShrinkArgs& s) {
  if (!half_dtype(s.dtype) || s.max_rank % 8 != 0 || s.max_rank > kMaxRows) return false;
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !aligned16(s.x)) return false;
  for (int i = 0; i < s.num_slices; ++i) {
    if (!aligned16(s.lora_a[i])) return false;
  }
  return true;
}

constexpr int kRankCacheInts = 4096;
constexpr int kSortedCacheInts = 2048;
bool cache_ranks(const ShrinkArgs& s) { return s.num_slices * s.max_loras <= kRankCacheInts; }
bool cache_sorted(const ShrinkArgs& s) { return s.num_tokens <= kSortedCacheInts; }
int cache_ints(const ShrinkArgs& s) {
  return (cache_ranks(s) ? s.num_slices * s.max_loras : 0) +
         (cache_sorted(s) ? static_cast<int>(s.num_tokens) : 0);
}

// Shared memory layout for a token tile `mt`, `ra` A rows per work item and K staged `kp`
// at a time; b_cols > 0 adds the staging of that many B rows.
ClusterPlan layout(const ShrinkArgs& s, int mt, int ra, int kc, int kp, int64_t b_cols) {
  ClusterPlan plan;
  const int64_t stage = static_cast<int64_t>(mt + ra) * (kp + 8) * 2;
  const int64_t pair_bytes = int64_t{kWarps} * kMaxPairs * 128 * 4;
  const int64_t sums = int64_t{mt} * ra * 4;
  plan.m_tile = mt;
  plan.k_chunk = kc;
  plan.k_pass = kp;
  plan.region0 = align16(std::max({stage, pair_bytes, sums}));
  plan.off_part = plan.region0;
  plan.off_b = plan.off_part + align16(sums);
  plan.off_int = plan.off_b + align16(b_cols * (s.max_rank + 8) * 2);
  const int64_t table = int64_t{kMaxTile + kMaxRows} * (8 + 4);
  const int ints = kMaxTile + kMaxSlices + kMaxRows / 8 + 2 * kWarps * kMaxPairs +
                   4 * (s.max_loras + 1) + 1 + cache_ints(s);
  plan.smem = static_cast<int>(plan.off_int + table + ints * 4);
  plan.stage_b = b_cols > 0;
  return plan;
}

// The first layout that fits, preferring two CTAs per SM, then K in one pass, then B staged
// on chip, then the largest token tile (<= the batch rounded to 16; fewer re-reads of A).
ClusterPlan first_fit(const ShrinkArgs& s, int ra, int64_t b_cols) {
  const int kc = static_cast<int>(ceil_div(ceil_div(s.hidden, kCluster), 64) * 64);
  int kp_max = 64;
  while (kp_max < kc && kp_max < 1024) kp_max *= 2;
  const int64_t t16 = ceil_div(s.num_tokens, 16) * 16;
  for (int budget : {kSmemTarget, kSmemMax}) {
    for (int kp = kp_max; kp >= 64; kp /= 2) {
      for (int with_b = b_cols > 0 ? 1 : 0; with_b >= 0; --with_b) {
        for (int mt = 64; mt >= 16; mt /= 2) {
          if (mt > t16 && mt > 16) continue;
          if ((mt / 16) * (ra / 8) > kWarps * kMaxPairs) continue;  // MMA tiles per warp
          ClusterPlan plan = layout(s, mt, ra, kc, kp, with_b ? b_cols : 0);
          if (plan.smem > budget) continue;
          const int per_sm = plan.smem <= kSmemTarget ? 2 : 1;
          plan.clusters = std::max(1, per_sm * sm_count() / kCluster);
          plan.ok = true;
          return plan;
        }
      }
    }
  }
  return ClusterPlan{};
}

// Shrink only: a work item covers every slice (x read once per tile) or one slice (more
// tokens per tile, so A is re-read less); the one with fewer bytes moved into the SMs wins.
ClusterPlan plan_shrink(const ShrinkArgs& s) {
  if (!shrink_shape_ok(s) || s.num_tokens == 0) return ClusterPlan{};
  ClusterPlan best;
  double best_bytes = 0;
  for (int groups : {1, s.num_slices}) {
    const int ra = (groups == 1 ? s.num_slices : 1) * s.max_rank;
    if (ra > kMaxRows) continue;
    ClusterPlan plan = first_fit(s, ra, 0);
    if (!plan.ok) continue;
    plan.sgroups = groups;
    const double x_bytes = static_cast<double>(s.num_tokens) * s.hidden * 2 * groups;
    const double a_bytes = static_cast<double>(ceil_div(s.num_tokens, plan.m_tile)) * s.num_slices *
                           s.max_rank * s.hidden * 2;
    const double passes_penalty = plan.k_pass < plan.k_chunk ? 1.25 : 1.0;
    const double bytes = (x_bytes + a_bytes) * passes_penalty;
    if (!best.ok || bytes < best_bytes) {
      best = plan;
      best_bytes = bytes;
    }
    if (s.num_slices == 1) break;
  }
  return best;
}

// Fused layer: every slice in one work item (the whole layer's intermediate on chip).
ClusterPlan plan_fused(const ShrinkArgs& s, int64_t total_cols) {
  if (!shrink_shape_ok(s) || s.num_tokens == 0) return ClusterPlan{};
  const int ra = s.num_slices * s.max_rank;
  if (ra > kMaxRows) return ClusterPlan{};
  ClusterPlan plan = first_fit(s, ra, ceil_div(total_cols / 8, kCluster) * 8);
  plan.sgroups = 1;
  // Fused pays off only with B on chip and K in one pass; otherwise shrink + expand kernels.
  if (!plan.stage_b || plan.k_pass < plan.k_chunk) plan.ok = false;
  return plan;
}

ClusterParams make_params(const ShrinkArgs& s, const LoraMetaView& meta, const ClusterPlan& plan) {
  ClusterParams p{};
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
  p.m_tile = plan.m_tile;
  p.sgroups = plan.sgroups;
  p.k_chunk = plan.k_chunk;
  p.k_pass = plan.k_pass;
  int shift = 0;
  while ((8 << shift) < plan.k_pass) ++shift;
  p.cpr_shift = shift;
  p.x_pitch = plan.k_pass + 8;
  p.region0 = plan.region0;
  p.off_part = plan.off_part;
  p.off_b = plan.off_b;
  p.off_int = plan.off_int;
  p.out = s.out;
  p.out_f32 = s.out_dtype == DType::kF32;
  p.num_tokens = s.num_tokens;
  p.stage_b = plan.stage_b;
  p.b_pitch = s.max_rank + 8;
  p.cache_ranks = cache_ranks(s);
  p.cache_sorted = cache_sorted(s);
  return p;
}

// Clusters of this kernel that fit on the GPU at once (a cluster must sit within one GPC, so
// this is below SMs * CTAs-per-SM / 8); cached per (kernel, shared memory size, device).
int max_active_clusters(const void* kernel, cudaLaunchConfig_t cfg) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, size_t, int>, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, cfg.dynamicSmemBytes, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess || n < 1) {
    cudaGetLastError();
    n = 0;  // unknown: the caller keeps its own estimate
  }
  cache[key] = n;
  return n;
}

template <typename T, bool kExpand>
Status launch(const ClusterParams& p, const ClusterPlan& plan, int clusters, StreamHandle stream) {
  auto kernel = &cluster_lora_kernel<T, kExpand>;
  LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem));
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  // More clusters than fit at once would run as a second wave behind the first.
  const int fit = max_active_clusters(reinterpret_cast<const void*>(kernel), cfg);
  if (fit > 0) clusters = std::min(clusters, fit);
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  LORAPLEX_RETURN_IF_ERROR(
      cuda_status(cudaLaunchKernelEx(&cfg, kernel, p), "cluster_lora_kernel launch"));
  return launch_status("cluster_lora_kernel");
}

bool fused_args_ok(const ShrinkArgs& s, const ExpandArgs& e) {
  if (e.dtype != s.dtype || s.num_slices != e.num_slices || s.max_rank != e.max_rank) return false;
  if (s.num_tokens > g_fused_max_tokens.load()) return false;
  if (e.y_row_stride % 8 != 0 || e.offset_start % 8 != 0 || !aligned16(e.y)) return false;
  for (int i = 0; i < s.num_slices; ++i) {
    if (!aligned16(e.lora_b[i]) || e.slice_width[i] % 8 != 0) return false;
  }
  return true;
}

int64_t total_width(const ExpandArgs& e) {
  int64_t n = 0;
  for (int i = 0; i < e.num_slices; ++i) n += e.slice_width[i];
  return n;
}

}  // namespace

bool cluster_shrink_supported(const ShrinkArgs& args) { return plan_shrink(args).ok; }

Status cluster_shrink(const ShrinkArgs& s, const LoraMetaView& meta, StreamHandle stream) {
  const ClusterPlan plan = plan_shrink(s);
  LORAPLEX_ENSURE(plan.ok, "cluster_shrink: arguments not supported");
  const ClusterParams p = make_params(s, meta, plan);
  // No more clusters than work tiles can keep busy.
  const int64_t tiles =
      ceil_div(s.num_tokens, plan.m_tile) + std::min<int64_t>(s.num_tokens, s.max_loras);
  const int clusters = static_cast<int>(std::min<int64_t>(plan.clusters, tiles));
  if (s.dtype == DType::kBF16) return launch<bf16, false>(p, plan, clusters, stream);
  return launch<f16, false>(p, plan, clusters, stream);
}

void set_fused_linear_max_tokens(int max_tokens) {
  g_fused_max_tokens.store(max_tokens < 0 ? kDefaultMaxTokens : max_tokens);
}

std::string lora_linear_path(const ShrinkArgs& shrink, const ExpandArgs& expand) {
  if (fused_args_ok(shrink, expand) && plan_fused(shrink, total_width(expand)).ok) {
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
  LORAPLEX_ENSURE(meta.num_tokens == shrink.num_tokens, "lora_linear: metadata built for ",
                  meta.num_tokens, " tokens, the call has ", shrink.num_tokens);
  if (shrink.num_tokens == 0) return Status();
  if (fused_args_ok(shrink, expand)) {
    const ClusterPlan plan = plan_fused(shrink, total_width(expand));
    if (plan.ok) {
      ClusterParams p = make_params(shrink, meta, plan);
      p.col_begin[0] = 0;
      for (int i = 0; i < expand.num_slices; ++i) {
        p.b[i] = expand.lora_b[i];
        p.width[i] = expand.slice_width[i];
        p.col_begin[i + 1] = p.col_begin[i] + expand.slice_width[i];
        p.y_col[i] = expand.offset_start + p.col_begin[i];
      }
      p.y = expand.y;
      p.y_stride = expand.y_row_stride;
      p.add_inputs = expand.add_inputs;
      if (shrink.dtype == DType::kBF16) return launch<bf16, true>(p, plan, plan.clusters, stream);
      return launch<f16, true>(p, plan, plan.clusters, stream);
    }
  }
  LORAPLEX_RETURN_IF_ERROR(lora_shrink(shrink, meta, stream));
  return lora_expand(expand, meta, stream);
}

}  // namespace loraplex::kernels::cuda
