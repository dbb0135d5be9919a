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
constexpr int kDefaultMaxTokens = 128;

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
  int m_tile;    // tokens per work item: 16, 32 or 64
  int k_chunk;   // K per CTA (a multiple of 64)
  int k_pass;    // K staged at once (a multiple of 64 dividing k_chunk)
  int x_pitch;   // k_pass + 8 elements: fragment loads are bank-conflict free
  int region0;   // bytes of the staging region (x, A; later pair sums and v_sums)
  int off_part;  // byte offsets of the other shared arrays
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
  bool stage_b;  // B rows of the CTA's columns staged in shared memory
  int b_pitch;   // max_rank + 8
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
  const int RA = S * MR;
  const int mt = p.m_tile;
  const int xp = p.x_pitch;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);  // [mt][xp], then A rows [RA][xp]
  T* as = xs + mt * xp;
  float* pair_sums = reinterpret_cast<float*>(smem_raw);  // [pairs][16 * 8], after the MMAs
  float* v_sums = reinterpret_cast<float*>(smem_raw);     // [mt][RA], after cluster sync 1
  float* part_sums = reinterpret_cast<float*>(smem_raw + p.off_part);  // [mt][RA]
  T* bs = reinterpret_cast<T*>(smem_raw + p.off_b);                    // [cols][b_pitch]
  int* tok = reinterpret_cast<int*>(smem_raw + p.off_int);             // [kMaxTile]
  int* srank = tok + kMaxTile;                                         // [kMaxSlices]
  int* tile_row = srank + kMaxSlices;                                  // [kMaxRows / 8]
  const int ne = p.max_loras + 1;
  int* ids = tile_row + kMaxRows / 8;  // [ne]
  int* counts = ids + ne;              // [ne]
  int* starts = counts + ne;           // [ne]
  int* prefix = starts + ne;           // [ne + 1]

  // Every entry of the metadata at once (entries past the active ones are -1 / 0), so the
  // work list costs one round trip to memory.
  for (int e = tid; e < ne; e += kThreads) {
    ids[e] = p.meta.active_lora_ids[e];
    counts[e] = p.meta.num_tokens_per_lora[e];
    starts[e] = p.meta.lora_token_start_loc[e];
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
  const int parts = kExpand ? max(1, min(kMaxParts, nclusters / tiles)) : 1;
  const int works = tiles * parts;

  const int64_t k_lo = static_cast<int64_t>(crank) * p.k_chunk;
  const int64_t k_hi = min(p.hidden, k_lo + p.k_chunk);
  const int passes = k_hi > k_lo ? static_cast<int>(ceil_div(k_hi - k_lo, p.k_pass)) : 0;
  const int ksteps = p.k_pass / 16;
  const int64_t n_groups = kExpand ? p.col_begin[S] / 8 : 0;
  const int64_t groups_per_cta = ceil_div(n_groups, static_cast<int64_t>(parts) * kCluster);
  const T* xg = static_cast<const T*>(p.x);

  for (int w = cid; w < works; w += nclusters) {
    const int tile = w / parts;
    const int part = w % parts;
    const int e = find_tile_entry(prefix, ne, tile);
    const int slot = ids[e];
    const int m0 = (tile - prefix[e]) * mt;
    const int n_tok = min(mt, counts[e] - m0);
    const int start = starts[e] + m0;
    __syncthreads();  // the previous work item is done with the shared arrays
    if (tid < kMaxTile) tok[tid] = tid < n_tok ? p.meta.sorted_token_indices[start + tid] : 0;
    if (tid < S) srank[tid] = p.ranks[tid * p.max_loras + slot];
    __syncthreads();
    int ta = 0;  // active MMA column tiles: ceil(rank_s / 8) per slice, as A-row offsets
    for (int s = 0; s < S; ++s) {
      const int n8 = (srank[s] + 7) / 8;
      if (tid < n8) tile_row[ta + tid] = s * MR + tid * 8;
      ta += n8;
    }
    int64_t g_lo = 0;
    int64_t g_hi = 0;
    if constexpr (kExpand) {
      const int64_t q = static_cast<int64_t>(part) * kCluster + crank;
      g_lo = min(n_groups, q * groups_per_cta);
      g_hi = min(n_groups, g_lo + groups_per_cta);
      // Stage this CTA's B rows (they do not depend on the shrink) in the first load group;
      // warm the L2 with its y rows.
      for (int s = 0; s < S; ++s) {
        const int64_t c_lo = max(g_lo * 8, p.col_begin[s]);
        const int64_t c_hi = min(g_hi * 8, p.col_begin[s + 1]);
        const int rk = srank[s];
        if (c_hi <= c_lo || rk == 0) continue;
        const T* bg =
            static_cast<const T*>(p.b[s]) + (slot * p.width[s] + (c_lo - p.col_begin[s])) * MR;
        if (p.stage_b) {
          const int chunks = (rk + 7) / 8;
          const int64_t total = (c_hi - c_lo) * chunks;
          for (int64_t i = tid; i < total; i += kThreads) {
            const int64_t c = i / chunks;
            const int ch = static_cast<int>(i % chunks);
            const int valid = min(8, rk - ch * 8);
            cp_async16(bs + (c_lo - g_lo * 8 + c) * p.b_pitch + ch * 8, bg + c * MR + ch * 8,
                       valid * 2);
          }
        } else if (2 * rk >= MR) {
          const char* b0 = reinterpret_cast<const char*>(bg);
          const int64_t lines = ceil_div((c_hi - c_lo) * MR * static_cast<int64_t>(sizeof(T)), 128);
          for (int64_t l = tid; l < lines; l += kThreads) prefetch_l2(b0 + l * 128);
        }
        if (p.add_inputs) {
          const int64_t row_bytes = (c_hi - c_lo) * static_cast<int64_t>(sizeof(T));
          const int64_t row_lines = row_bytes / 128 + 2;
          T* yg = static_cast<T*>(p.y);
          for (int64_t i = tid; i < n_tok * row_lines; i += kThreads) {
            const uintptr_t first = reinterpret_cast<uintptr_t>(
                yg + tok[i / row_lines] * p.y_stride + p.y_col[s] + (c_lo - p.col_begin[s]));
            const uintptr_t line = (first & ~uintptr_t{127}) + (i % row_lines) * 128;
            if (line < first + row_bytes) prefetch_l2(reinterpret_cast<const void*>(line));
          }
        }
      }
    }
    __syncthreads();  // tile_row is complete

    // ---- shrink: this CTA's K range ----
    const int mgroups = (n_tok + 15) / 16;
    const int units = mgroups * ta;
    const int kg = choose_kgroups(units, ksteps);
    const int pairs = units * kg;
    const int ks_per = (ksteps + kg - 1) / kg;
    int pair_row[kMaxPairs];  // first token row of the pair's 16-row group
    int pair_a[kMaxPairs];    // first A row (slice * max_rank + rank) of its 8-rank tile
    int pair_k[kMaxPairs];    // first K step of its group
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      const int pr = warp + i * kWarps;
      const int u = pr < pairs ? pr % units : 0;
      pair_row[i] = pr < pairs ? (u / ta) * 16 : 0;
      pair_a[i] = pr < pairs ? tile_row[u % ta] : 0;
      pair_k[i] = pr < pairs ? (pr / units) * ks_per : 0;
    }
    float acc[kMaxPairs][4];
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    const int xrows = mgroups * 16;
    const int cpr = p.k_pass / 8;  // 16-byte chunks per staged row
    for (int pass = 0; pass < passes; ++pass) {
      if (pass > 0) __syncthreads();  // every warp is done with the previous pass
      const int64_t k0 = k_lo + static_cast<int64_t>(pass) * p.k_pass;
      for (int i = tid; i < (xrows + RA) * cpr; i += kThreads) {
        const int row = i / cpr;
        const int ch = i - row * cpr;
        const int64_t k = k0 + ch * 8;
        const bool k_in = k < k_hi;
        if (row < xrows) {
          const bool ok = k_in && row < n_tok;
          cp_async16(xs + row * xp + ch * 8, ok ? xg + tok[row] * p.x_stride + k : xg, ok ? 16 : 0);
        } else {
          const int ra = row - xrows;
          const int s = ra / MR;
          const int r = ra - s * MR;
          if (r < ((srank[s] + 7) & ~7)) {
            const T* ag = static_cast<const T*>(p.a[s]);
            const bool ok = k_in && r < srank[s];
            cp_async16(as + ra * xp + ch * 8,
                       ok ? ag + (static_cast<int64_t>(slot) * MR + r) * p.hidden + k : ag,
                       ok ? 16 : 0);
          }
        }
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
          load_b_frag(bfr, as + pair_a[i] * xp + ks * 16, xp, lane);
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
      part_sums[((u / ta) * 16 + (el >> 3)) * RA + tile_row[u % ta] + (el & 7)] = p.scale * v;
    }
    cluster.sync();  // the partial sums of all 8 CTAs are complete

    if constexpr (!kExpand) {
      // Each CTA writes every 8th entry of the tile's intermediate.
      for (int i = crank * kThreads + tid; i < n_tok * RA; i += kCluster * kThreads) {
        const int m = i / RA;
        const int ra = i - m * RA;
        const int s = ra / MR;
        const int r = ra - s * MR;
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
      for (int s = 0; s < S; ++s) {
        if (p.col_begin[s] >= g_hi * 8 || p.col_begin[s + 1] <= g_lo * 8) continue;
        const int rk = srank[s];
        for (int i = tid; i < n_tok * rk; i += kThreads) {
          const int off = (i / rk) * RA + s * MR + i % rk;
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
        const int64_t col = g_lo * 8 + (i % npairs) * 2;
        int s = 0;
        while (col >= p.col_begin[s + 1]) ++s;
        const int64_t j = col - p.col_begin[s];
        const int rk = srank[s];
        if (rk == 0 && p.add_inputs) continue;
        const T* b0 = p.stage_b ? bs + (col - g_lo * 8) * p.b_pitch
                                : static_cast<const T*>(p.b[s]) + (slot * p.width[s] + j) * MR;
        const T* b1 = p.stage_b ? b0 + p.b_pitch : b0 + MR;
        const float* vrow = v_sums + m * RA + s * MR;
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
          o0 += to_float(yrow[0]);
          o1 += to_float(yrow[1]);
        }
        *reinterpret_cast<uint32_t*>(yrow) = pack2<T>(o0, o1);
      }
    }
  }
}

struct ClusterPlan {
  bool ok = false;
  int m_tile = 0;
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
  if (!half_dtype(s.dtype) || s.max_rank % 8 != 0 || s.num_slices * s.max_rank > kMaxRows)
    return false;
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !aligned16(s.x)) return false;
  for (int i = 0; i < s.num_slices; ++i) {
    if (!aligned16(s.lora_a[i])) return false;
  }
  return true;
}

// Shared memory layout for a token tile `mt` and staged K `kp`; expand_cols > 0 adds the B
// staging of that many columns.
ClusterPlan layout(const ShrinkArgs& s, int mt, int kc, int kp, int64_t expand_cols) {
  ClusterPlan plan;
  const int ra = s.num_slices * s.max_rank;
  const int xp = kp + 8;
  const int64_t stage = static_cast<int64_t>(mt + ra) * xp * 2;
  const int64_t pair_bytes = int64_t{kWarps} * kMaxPairs * 128 * 4;
  const int64_t sums = int64_t{mt} * ra * 4;
  plan.m_tile = mt;
  plan.k_chunk = kc;
  plan.k_pass = kp;
  plan.region0 = align16(std::max({stage, pair_bytes, sums}));
  plan.off_part = plan.region0;
  plan.off_b = plan.off_part + align16(sums);
  const int64_t b_bytes = expand_cols * (s.max_rank + 8) * 2;
  plan.off_int = plan.off_b + align16(b_bytes);
  const int ints = kMaxTile + kMaxSlices + kMaxRows / 8 + 4 * (s.max_loras + 1) + 1;
  plan.smem = plan.off_int + ints * 4;
  plan.stage_b = expand_cols > 0;
  return plan;
}

// Largest token tile (<= the batch, rounded to 16) and K pass that fit the shared memory.
ClusterPlan plan_cluster(const ShrinkArgs& s, int64_t expand_total_cols) {
  ClusterPlan none;
  if (!shrink_shape_ok(s) || s.num_tokens == 0) return none;
  const int ra = s.num_slices * s.max_rank;
  const int kc = static_cast<int>(ceil_div(ceil_div(s.hidden, kCluster), 64) * 64);
  const int64_t t16 = ceil_div(s.num_tokens, 16) * 16;
  // B columns one CTA expands when a slot's columns are split into a single part.
  const int64_t cols = expand_total_cols > 0 ? ceil_div(expand_total_cols / 8, kCluster) * 8 : 0;
  // Preference: two CTAs per SM, then K staged in one pass, then B staged, then the largest
  // token tile (fewer re-reads of A).
  for (int budget : {kSmemTarget, kSmemMax}) {
    for (int kp = kc; kp >= 64; kp /= 2) {
      if (kc % kp != 0) continue;
      for (int with_b = (cols > 0 ? 1 : 0); with_b >= 0; --with_b) {
        for (int mt = 64; mt >= 16; mt /= 2) {
          if (mt > t16 && mt > 16) continue;
          if ((mt / 16) * (ra / 8) > kWarps * kMaxPairs) continue;  // MMA tiles per warp
          ClusterPlan plan = layout(s, mt, kc, kp, with_b ? cols : 0);
          if (plan.smem > budget) continue;
          const int per_sm = plan.smem <= kSmemTarget ? 2 : 1;
          plan.clusters = std::max(1, per_sm * sm_count() / kCluster);
          plan.ok = true;
          return plan;
        }
      }
    }
  }
  return none;
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
  p.k_chunk = plan.k_chunk;
  p.k_pass = plan.k_pass;
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
  return p;
}

template <typename T, bool kExpand>
Status launch(const ClusterParams& p, const ClusterPlan& plan, int clusters, StreamHandle stream) {
  auto kernel = &cluster_lora_kernel<T, kExpand>;
  LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
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

bool cluster_shrink_supported(const ShrinkArgs& args) { return plan_cluster(args, 0).ok; }

Status cluster_shrink(const ShrinkArgs& s, const LoraMetaView& meta, StreamHandle stream) {
  const ClusterPlan plan = plan_cluster(s, 0);
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
  if (fused_args_ok(shrink, expand) && plan_cluster(shrink, total_width(expand)).ok) {
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
    const ClusterPlan plan = plan_cluster(shrink, total_width(expand));
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
