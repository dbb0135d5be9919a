// Shrink on tensor cores for batches larger than the decode kernel's (prefill).
//
// A work item is one tile of up to 64 (128) tokens of one active slot (rows gathered through
// the sorted token indices) against the A rows of EVERY slice of that slot at once (slices
// concatenated, each cut at its own rank rounded up to 8), so x is read once per layer, not
// once per slice. k_split CTAs take one item; each streams its share of K through a cp.async
// pipeline of 3-4 stages (the next stages' loads are in flight while the tensor cores work on
// the current one) and multiplies it in one of the two forms below. The
// split over K gives the grid enough CTAs when a batch has few tiles. The fp32 partial tiles
// meet either in a cluster (the item's CTAs form one: after a cluster barrier each adds a share
// of the tile over the cluster's shared memory) or, for grids larger than the SM count, in
// global memory (the last CTA of the item to arrive on its counter adds them): clusters of 4
// could not use every SM. Both add the parts in the same fixed order: deterministic, and the
// same bits either way.
//
// Two forms of the MMA (tuning value prefill_mma): mma.sync m16n8k16 on 64-token tiles (8 warps as
// 4 row groups x 2 column sets, fragments through ldmatrix from padded rows), and wgmma (sm_90a)
// on 128-token tiles (2 warpgroups of 64 rows, every column, both operands read by the tensor
// cores from 128-byte-swizzled shared memory). The wgmma form reads each A row from shared memory
// once per 64 tokens instead of once per 16 and each slot's A rows from L2 once per 128 tokens
// instead of once per 64, so its K loop is faster (docs/decisions.md, "Kernel details
// measured"). Its longer tiles make fewer items, hence longer reductions and grids that fit the
// SMs differently, so the planner (kernels/planner/lora_plan.cc) picks the form per shape.
//
// The grid is the host's upper bound of tiles times k_split; CTAs whose tile does not exist in
// this batch (counted on the device from the metadata) return at once, so the launch
// configuration depends only on host-known sizes and the launch is capturable.

#include <cooperative_groups.h>

#include <type_traits>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"
#include "loraplex/kernels/cuda/wgmma_ops.cuh"

namespace cg = cooperative_groups;

namespace loraplex::kernels::cuda {
namespace {

using namespace prefill_kernel;
// Tokens per tile: 4 mma.sync row groups of 16, or 2 warpgroups of 64.
template <bool kWg>
constexpr int kTileM = kWg ? kTileWg : kTileMma;
// The 8 warps share a tile as 4 row groups of 16 rows x 2 column sets: warp w takes rows
// (w % 4) * 16 .. + 16 and the column tiles w / 4, w / 4 + 2, ... (kTilesPerWarp at most). Two
// row groups of 32 rows x 4 column sets (each B fragment load feeding two MMAs) gained little for
// the large variant and lost much more at a few hundred tokens with many adapters, where ptxas
// spilled (docs/decisions.md, "Kernel details measured").
constexpr int kColSets = 2;
// stage_pairs may read the 16 rows past the last stage (the unused half of a pair's x4 load);
// the row sources that always follow the stage region cover them.
static_assert((kTileM<false> + kMaxRows) * 8 >= kColSets * 8 * kPitch * 2,
              "a pair's spare rows stay in shared memory");

// One stage of this warp's MMAs: kPairs pairs of its column tiles (an x4 load each), as
// straight-line code. The second tile of the last pair may lie past the item's tiles (its rows:
// at most 16 past the stage, still inside the CTA's shared memory); its sums are never stored.
// Branching per tile instead (x4 or x2 load, MMA or not) cost ~5 instructions per MMA: a
// warp-synchronising barrier and a branch around every .aligned instruction, and B fragments
// moved into common registers.
template <typename T, int kTilesPerWarp, int kPairs>
__device__ __forceinline__ void stage_pairs(float (&acc)[kTilesPerWarp * 4], uint32_t a_at,
                                            uint32_t b_at) {
  constexpr uint32_t kPairBytes = 2 * kColSets * 8 * kPitch * 2;  // the warp's next two tiles
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    uint32_t af[4];
    ldmatrix_x4_at(af, a_at + kk * 2);
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      uint32_t bf[4];
      ldmatrix_x4_at(bf, b_at + q * kPairBytes + kk * 2);
      const uint32_t b0[2] = {bf[0], bf[1]};
      const uint32_t b1[2] = {bf[2], bf[3]};
      mma_16816<T>(*reinterpret_cast<float(*)[4]>(acc + 8 * q), af, b0);
      mma_16816<T>(*reinterpret_cast<float(*)[4]>(acc + 8 * q + 4), af, b1);
    }
  }
}

// Picks the pair count once per stage.
template <typename T, int kTilesPerWarp, int kPairs = kTilesPerWarp / 2>
__device__ __forceinline__ void stage_mma(int pairs, float (&acc)[kTilesPerWarp * 4], uint32_t a_at,
                                          uint32_t b_at) {
  if constexpr (kPairs > 0) {
    if (pairs == kPairs) {
      stage_pairs<T, kTilesPerWarp, kPairs>(acc, a_at, b_at);
    } else {
      stage_mma<T, kTilesPerWarp, kPairs - 1>(pairs, acc, a_at, b_at);
    }
  }
}

// Calls f(row, column, v0, v1) for each pair of this thread's accumulators that lies in one of
// the item's ntiles column tiles. Both forms keep 8-column blocks in the m16n8 accumulator layout
// (rows g and g + 8 of a warp's 16 rows): mma.sync tile i of this warp is column tile
// cset + kColSets i; in the wgmma form block i is column tile i, and warp w holds rows
// 64 (w / 4) + 16 (w % 4) .. + 16.
template <bool kWg, int kAccTiles, typename F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[kAccTiles * 4], int ntiles, F f) {
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int rg = kWg ? warp : warp % (8 / kColSets);
  const int cset = kWg ? 0 : warp / (8 / kColSets);
  const int row = rg * 16 + (lane >> 2);
  const int tq = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < kAccTiles; ++i) {
    const int j = kWg ? i : cset + kColSets * i;
    if (j < ntiles) {
      f(row, j * 8 + tq, acc[4 * i], acc[4 * i + 1]);
      f(row + 8, j * 8 + tq, acc[4 * i + 2], acc[4 * i + 3]);
    }
  }
}

struct PrefillParams {
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
  void* out;
  bool out_f32;
  bool out_vec;  // out aligned for one store per quad (16 bytes fp32, 8 bytes 16-bit)
  int64_t num_tokens;
  int k_chunk;       // K per CTA of a cluster, a multiple of kBK
  int stage_bytes;   // (kM + a_rows) * kPitch * 2; (kM + N) * 128 in the wgmma form
  int red_pitch;     // floats per row of the partial tile
  bool cache_ranks;  // the rank table is copied to shared memory (num_slices x max_loras small)
  int region;        // bytes of the stages (later the partial tile); the tables follow
  int off_rows;      // bytes: the staged rows' source pointers
  uint64_t* trace;   // per-CTA timeline (kernel_trace.h) or nullptr
  // Split-K through global memory instead of a cluster: each CTA's fp32 partial tile goes to
  // the metadata's scratch ([item][k part][kM][part_pitch]), the last of a tile's CTAs to
  // arrive (the metadata's counter per tile) adds them in part order and resets the counter.
  bool global_reduce;
  // With global_reduce: every CTA only stores its part; prefill_sum_kernel, launched next with
  // PDL, adds the parts (many CTAs per item instead of the item's last CTA alone).
  bool defer_sum;
  // The next launch after this shrink (and its sum kernel) is the layer's expand under PDL.
  bool expand_follows;
  int k_split;
  int part_pitch;
};

// Stores four consecutive values of one output row at element o (scaled, in the output dtype):
// `width` of them (fewer past the slice's rank), as one 16- (fp32) or 8-byte store where `vec`
// (all four inside the rank, the output aligned for it: ranks and their tiles are multiples of 8,
// so a quad never straddles two slices). Four scalar stores with their index arithmetic each
// made the reduction much slower (docs/decisions.md, "Kernel details measured").
template <typename T>
__device__ __forceinline__ void store_quad(const PrefillParams& p, int64_t o, int width, bool vec,
                                           float4 v) {
  const float e[4] = {p.scale * v.x, p.scale * v.y, p.scale * v.z, p.scale * v.w};
  if (vec) {
    if (p.out_f32) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + o) =
          make_float4(e[0], e[1], e[2], e[3]);
    } else {
      *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + o) =
          make_uint2(pack2<T>(e[0], e[1]), pack2<T>(e[2], e[3]));
    }
    return;
  }
  for (int j = 0; j < width; ++j) {
    if (p.out_f32) {
      static_cast<float*>(p.out)[o + j] = e[j];
    } else {
      static_cast<T*>(p.out)[o + j] = from_float<T>(e[j]);
    }
  }
}

// Parts 0..kParts-1 added in that order (every reduction adds them so: the same bits).
template <int kParts>
__device__ __forceinline__ float4 sum_in_order(const float4 (&v)[kParts]) {
  float4 sum = v[0];
#pragma unroll
  for (int q = 1; q < kParts; ++q) {
    sum.x += v[q].x;
    sum.y += v[q].y;
    sum.z += v[q].z;
    sum.w += v[q].w;
  }
  return sum;
}

// kRows rows of reduce_parts' column quad c, mb + u row_step (u < kRows, every one inside the
// tile): kParts parts summed in order 0..kParts-1, all loads issued before the sums (one round
// trip), each row stored at col_at + token * max_rank. Every loaded value is used: a load whose
// row is not stored could still be in flight when its thread leaves the cluster barrier that
// lets the CTA it reads from exit.
template <typename T, int kRows, int kParts, typename Load>
__device__ __forceinline__ void sum_block(const PrefillParams& p, int mb, int row_step, int c,
                                          int64_t col_at, int width, bool vec, const int* tok,
                                          Load load) {
  float4 v[kRows][kParts];
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
#pragma unroll
    for (int q = 0; q < kParts; ++q) v[u][q] = load(q, mb + u * row_step, c);
  }
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    store_quad<T>(p, col_at + static_cast<int64_t>(tok[mb + u * row_step]) * p.max_rank, width, vec,
                  sum_in_order(v[u]));
  }
}

// The rows m0, m0 + row_step, ... (< mrows) of the column quad: kRows at a time while they last,
// then one at a time.
template <typename T, int kRows, int kParts, typename Load>
__device__ __forceinline__ void sum_rows(const PrefillParams& p, int m0, int row_step, int mrows,
                                         int c, int64_t col_at, int width, bool vec, const int* tok,
                                         Load load) {
  int mb = m0;
  for (; mb + (kRows - 1) * row_step < mrows; mb += kRows * row_step) {
    sum_block<T, kRows, kParts>(p, mb, row_step, c, col_at, width, vec, tok, load);
  }
  if constexpr (kRows > 1) {
    for (; mb < mrows; mb += row_step) {
      sum_block<T, 1, kParts>(p, mb, row_step, c, col_at, width, vec, tok, load);
    }
  }
}

// Rows at a time for kParts parts: kRows, fewer where that would take more than 16 float4
// registers (64).
template <int kRows, int kParts>
constexpr int kRowsAtOnce = (kRows * kParts <= 16) ? kRows : (16 / kParts > 1 ? 16 / kParts : 1);

// Splits on the part count (1..kMaxParts), so that the loads of sum_rows are straight-line code.
template <typename T, int kRows, int kParts = 1, typename Load>
__device__ __forceinline__ void sum_rows_for(int ks, const PrefillParams& p, int m0, int row_step,
                                             int mrows, int c, int64_t col_at, int width, bool vec,
                                             const int* tok, Load load) {
  if constexpr (kParts <= kMaxParts) {
    if (ks == kParts) {
      sum_rows<T, kRowsAtOnce<kRows, kParts>, kParts>(p, m0, row_step, mrows, c, col_at, width, vec,
                                                      tok, load);
    } else {
      sum_rows_for<T, kRows, kParts + 1>(ks, p, m0, row_step, mrows, c, col_at, width, vec, tok,
                                         load);
    }
  }
}

// Sums the ks partial tiles of an item (mrows x ntiles * 8 floats each) and stores the output.
// Thread `first` of `step` takes one quad of columns, c = 4 (first % quads), and the rows
// first / quads + k (step / quads): what depends on the column (its slice, its rank, its output
// offset, whether it is one vector store) is worked out once, so a row costs its loads, its sums
// and one store. A flat walk over the tile's quads (a new row and column, hence slice, rank and
// offset, for every quad, and every part's load behind a predicate) took ~200 instructions per
// quad and, with two warps per scheduler in the big wgmma form, most of the reduction's time.
// load(q, m, c) gives part q's four values at row m from column c. Parts are added in order
// 0..ks-1 wherever they come from, so every reduction gives the same bits (sum_quads too).
template <typename T, int kRows, typename Load>
__device__ __forceinline__ void reduce_parts(const PrefillParams& p, int first, int step, int mrows,
                                             int ntiles, int ks, const int* tok,
                                             const int* tile_slice, const int* tile_r0,
                                             const int* srank, Load load) {
  const int quads = ntiles * 2;
  const int row_step = step / quads;  // >= 2: at most 64 quads (256 A rows), 128 threads or more
  const int m0 = first / quads;
  if (m0 >= row_step) return;  // the threads past the last whole row of quads
  const int c = (first - m0 * quads) * 4;
  const int s = tile_slice[c >> 3];
  const int r = tile_r0[c >> 3] + (c & 7);
  const int rank = srank[s];
  if (r >= rank) return;  // columns past the slice's rank are not stored
  const int width = min(4, rank - r);
  const int64_t col_at = static_cast<int64_t>(s) * p.num_tokens * p.max_rank + r;
  sum_rows_for<T, kRows>(ks, p, m0, row_step, mrows, c, col_at, width, width == 4 && p.out_vec, tok,
                         load);
}

// The deferred sum kernel's reduction: kParts parts of a tile of mrows <= 16 rows, thread
// `first` of `step` taking quads first, first + step, ... of the tile (row-major), kQuads of
// them with all kQuads x kParts loads issued at once (one round trip: kParts <= 8, <= 2 quads a
// thread). The same sums as reduce_parts, in the same order. reduce_parts' layout (a fixed
// column per thread, the same loads here) measured slower in this short kernel, which is one
// latency chain.
template <typename T, int kQuads, int kParts, typename Load>
__device__ __forceinline__ void sum_quads(const PrefillParams& p, int first, int step, int mrows,
                                          int ntiles, const int* tok, const int* tile_slice,
                                          const int* tile_r0, const int* srank, Load load) {
  const int quads = ntiles * 2;
  const int n = mrows * quads;
  for (int i0 = first; i0 < n; i0 += kQuads * step) {
    float4 v[kQuads][kParts];
#pragma unroll
    for (int u = 0; u < kQuads; ++u) {
      const int i = i0 + u * step;
      const int m = i / quads;
#pragma unroll
      for (int q = 0; q < kParts; ++q) {
        if (i < n) v[u][q] = load(q, m, (i - m * quads) * 4);
      }
    }
#pragma unroll
    for (int u = 0; u < kQuads; ++u) {
      const int i = i0 + u * step;
      if (i >= n) break;
      const float4 sum = sum_in_order(v[u]);
      const int m = i / quads;
      const int c = (i - m * quads) * 4;
      const int s = tile_slice[c >> 3];
      const int r = tile_r0[c >> 3] + (c & 7);
      const int rank = srank[s];
      if (r < rank) {
        const int width = min(4, rank - r);
        const int64_t o = (static_cast<int64_t>(s) * p.num_tokens + tok[m]) * p.max_rank + r;
        store_quad<T>(p, o, width, width == 4 && p.out_vec, sum);
      }
    }
  }
}

// Work item `item` of tiles of kM tokens (build_tile_prefix's prefix and entries over ne
// entries): its slot, its token count and the sorted position of its first token.
struct TileItem {
  int slot;
  int mrows;
  int start;
};
__device__ __forceinline__ TileItem tile_item(const int* prefix, const int* entries, int ne,
                                              int item, int kM) {
  const int e = find_tile_entry(prefix, ne, item);
  const int m0 = (item - prefix[e]) * kM;
  return {entries[e], min(kM, entries[ne + e] - m0), entries[2 * ne + e] + m0};
}

// Column tiles: 8 A rows of one slice each, up to that slice's rank rounded up to 8. Run by one
// thread; returns the tile count.
__device__ __forceinline__ int column_tiles(const int* srank, int num_slices, int* tile_slice,
                                            int* tile_r0) {
  int n = 0;
  for (int s = 0; s < num_slices; ++s) {
    for (int r = 0; r < srank[s]; r += 8) {
      tile_slice[n] = s;
      tile_r0[n] = r;
      ++n;
    }
  }
  return n;
}

// From this many rows an item's partial tile is stored through shared memory (whole rows).
constexpr int kStagedPartRows = 64;

// The split-K reduction through global memory (PrefillParams::global_reduce): no cluster, so
// the CTAs land on any SM (clusters of 4 used 124 of the H200's 132 SMs and put 3 CTAs on 8
// of them). Part q of the item's row m lives at scratch row q * num_tokens + start + m (start:
// the item's first sorted position), so the scratch holds k_split x num_tokens rows whatever the
// tiles: a bound of (tiles + slots) x 128 rows per part overflowed it at 32 adapters x 256
// tokens (q/k/v, rank 16) and sent the reduction to clusters of 8 (two waves).
template <typename T, bool kWg, int kAccTiles, int kRows, bool kTrace>
__device__ __forceinline__ void reduce_through_global(const PrefillParams& p,
                                                      const float (&acc)[kAccTiles * 4], float* red,
                                                      int item, int ks, int crank, int start,
                                                      int ntiles, int mrows, const int* tok,
                                                      const int* tile_slice, const int* tile_r0,
                                                      const int* srank) {
  const int tid = static_cast<int>(threadIdx.x);
  const int pp = p.part_pitch;
  float* part = p.meta.scratch + (static_cast<int64_t>(crank) * p.num_tokens + start) * pp;
  // Rows past the item's tokens belong to the next item (or past the batch).
  if (mrows < kStagedPartRows) {
    for_each_acc<kWg, kAccTiles>(acc, ntiles, [&](int row, int col, float v0, float v1) {
      if (row < mrows) *reinterpret_cast<float2*>(part + row * pp + col) = make_float2(v0, v1);
    });
  } else {
    // Long tiles go through shared memory (free after the K loop), so that the global stores
    // are whole rows of 16-byte quads instead of 8 bytes per thread and 32 per row and warp
    // instruction, a little faster for long tiles. Short ones (many adapters, a few hundred
    // tokens each) measured slower that way: the extra barrier and shared-memory round trip cost
    // more than the stores they merge.
    for_each_acc<kWg, kAccTiles>(acc, ntiles, [&](int row, int col, float v0, float v1) {
      *reinterpret_cast<float2*>(red + row * p.red_pitch + col) = make_float2(v0, v1);
    });
    __syncthreads();
    const int quads = ntiles * 2;
    for (int i = tid; i < mrows * quads; i += kThreads) {
      const int m = i / quads;
      const int c = (i - m * quads) * 4;
      *reinterpret_cast<float4*>(part + m * pp + c) =
          *reinterpret_cast<const float4*>(red + m * p.red_pitch + c);
    }
  }
  if (p.defer_sum) {
    trace_at<kTrace>(p.trace, 6);
    trace_at<kTrace>(p.trace, 7);
    return;
  }
  __shared__ int last;
  __syncthreads();  // the CTA's partial tile is stored ...
  if (tid == 0) {
    __threadfence();  // ... and visible to the GPU before the arrival counts
    last = atomicAdd(p.meta.counters + item, 1) == ks - 1;
  }
  __syncthreads();
  trace_at<kTrace>(p.trace, 6);
  if (!last) {
    trace_at<kTrace>(p.trace, 7);
    return;
  }
  __threadfence();  // the other parts, stored before their arrivals, are read after ours
  const float* base = p.meta.scratch + static_cast<int64_t>(start) * pp;
  reduce_parts<T, kRows>(p, tid, kThreads, mrows, ntiles, ks, tok, tile_slice, tile_r0, srank,
                         [&](int q, int m, int c) {
                           return __ldcg(reinterpret_cast<const float4*>(
                               base + (static_cast<int64_t>(q) * p.num_tokens + m) * pp + c));
                         });
  if (tid == 0) p.meta.counters[item] = 0;  // zero between ops
  trace_at<kTrace>(p.trace, 7);
}

// kCols: in the mma.sync form (kWg false) MMA column tiles (8 A rows) per warp at most (the 8
// warps are 4 row groups x 2 column sets, so a work item has at most 2 * kCols column tiles); in
// the wgmma form the N of each warpgroup's m64nNk16 (a work item has at most kCols / 8 column
// tiles). kStages: the cp.async ring's depth (kStages - 1 stages in flight while one is
// multiplied).
template <typename T, int kCols, int kStages, bool kTrace, bool kWg>
__global__ void __launch_bounds__(kThreads, (kWg && kCols > 64) ? 1 : 2)
    prefill_shrink_kernel(PrefillParams p) {
  constexpr int kM = kTileM<kWg>;
  constexpr int kAccTiles = kWg ? kCols / 8 : kCols;  // 8-column accumulator blocks per thread
  constexpr int kRows = kAccTiles >= 16 ? 4 : 2;      // rows per round trip of the reduction
  constexpr int kRowBytes = kWg ? kWgRowBytes : kPitch * 2;
  extern __shared__ __align__(16) unsigned char smem_dyn[];
  // The wgmma form's stages start 1024-byte aligned (the host allocates the slack).
  unsigned char* smem_raw = smem_dyn;
  if constexpr (kWg) {
    const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dyn));
    smem_raw += (kWgAlign - (at & (kWgAlign - 1))) & (kWgAlign - 1);
  }
  cg::cluster_group cluster = cg::this_cluster();
  const int ks = p.global_reduce ? p.k_split : static_cast<int>(cluster.num_blocks());
  const int crank =
      p.global_reduce ? static_cast<int>(blockIdx.x) % ks : static_cast<int>(cluster.block_rank());
  const int item = static_cast<int>(blockIdx.x) / ks;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int S = p.num_slices;

  T* stage_base = reinterpret_cast<T*>(smem_raw);
  int* prefix = reinterpret_cast<int*>(smem_raw + p.region);  // [max_loras + 2]
  int* tok = prefix + p.max_loras + 2;                        // [kM]
  int* srank = tok + kM;                                      // [kMaxSlices]
  int* tile_slice = srank + kMaxSlices;                       // [kMaxTiles]
  int* tile_r0 = tile_slice + kMaxTiles;                      // [kMaxTiles]
  int* ntiles_s = tile_r0 + kMaxTiles;                        // [1]
  int* entries = ntiles_s + 1;                                // [3 (max_loras + 1)]
  int* rank_tab = entries + 3 * (p.max_loras + 1);            // [S max_loras] when cache_ranks
  const T** row_src = reinterpret_cast<const T**>(smem_raw + p.off_rows);  // [kM + kMaxRows]
  trace_at<kTrace>(p.trace, 0);
  trace_at<kTrace>(p.trace, 1);
  // The kernel after it (the sum kernel, or the layer's pipelined expand under PDL) may
  // become resident as this grid's CTAs leave; its pdl_wait still waits for the whole grid. This
  // kernel is launched without PDL, after every earlier kernel finished.
  if (p.defer_sum || p.expand_follows) pdl_launch_dependents();
  // Tile `item` starts at sorted position item * kM when the slots before it fill whole tiles
  // (one slot; counts that are multiples of 64): its token indices are loaded on that guess
  // with the metadata, and kept only if the metadata confirms it, so a right guess takes one
  // round trip out of the chain metadata -> sorted indices -> x rows.
  const int64_t guess = int64_t{item} * kM;
  int spec = -1;
  if (tid >= kM && tid < 2 * kM && guess + (tid - kM) < p.num_tokens) {
    spec = ld_early(p.meta.sorted_token_indices + guess + (tid - kM));
  }

  // The metadata entries and the rank table come in one round trip (the other warps load the
  // ranks while warp 0 scans), so the only dependent load before the copies is the tile's
  // sorted token indices.
  if (p.cache_ranks) {
    // Not warp 0: its rank loads would be waited for before its metadata loads are issued.
    for (int i = tid - 32; i >= 0 && i < S * p.max_loras; i += kThreads - 32) {
      rank_tab[i] = p.ranks[i];
    }
  }
  const int ne = build_tile_prefix(p.meta, kM, prefix, entries);
  trace_at<kTrace>(p.trace, 2);
  if (item >= prefix[ne]) return;  // the same in every CTA of the cluster: no barrier waits
  const TileItem it = tile_item(prefix, entries, ne, item, kM);
  const int slot = it.slot;
  const int mrows = it.mrows;
  const int start = it.start;
  if (tid >= kM && tid < 2 * kM) {
    const int m = tid - kM;
    tok[m] = m >= mrows ? -1 : start == guess ? spec : p.meta.sorted_token_indices[start + m];
  }
  if (tid < S) {
    srank[tid] =
        p.cache_ranks ? rank_tab[tid * p.max_loras + slot] : p.ranks[tid * p.max_loras + slot];
  }
  __syncthreads();
  if (tid == 0) *ntiles_s = column_tiles(srank, S, tile_slice, tile_r0);
  __syncthreads();
  const int ntiles = *ntiles_s;
  if (ntiles == 0) return;  // every slice of this slot has rank 0 (same in the whole cluster)
  const T* xg = static_cast<const T*>(p.x);
  const int64_t K = p.hidden;
  // Rows staged per stage: the tile's x rows, then the A rows of the column tiles (rows past a
  // slice's rank zero-filled, never read).
  if (tid < kM)
    row_src[tid] = tok[tid] >= 0 ? xg + static_cast<int64_t>(tok[tid]) * p.x_stride : nullptr;
  if (tid < ntiles * 8) {
    const int s = tile_slice[tid >> 3];
    const int r = tile_r0[tid >> 3] + (tid & 7);
    row_src[kM + tid] = r < srank[s] ? static_cast<const T*>(p.a[s]) +
                                           (static_cast<int64_t>(slot) * p.a_slot_rows + r) * K
                                     : nullptr;
  }
  __syncthreads();
  trace_at<kTrace>(p.trace, 3);
  const int rows = kM + ntiles * 8;
  const int64_t k_lo = static_cast<int64_t>(crank) * p.k_chunk;
  const int64_t k_hi = min(K, k_lo + p.k_chunk);
  const int nk = k_hi > k_lo ? static_cast<int>(ceil_div(k_hi - k_lo, kBK)) : 0;

  // This thread's copies, the same in every stage: 16-byte column ch of rows tid / 8 + 32 i.
  // Their sources are looked up once, so a stage costs a few instructions per copy.
  constexpr int kStagedRows = kM + (kWg ? kCols : 16 * kCols);
  constexpr int kSlots = (kStagedRows * 8 + kThreads - 1) / kThreads;
  const int ch = tid & 7;
  // x rows past the item's tokens are not staged at all: row m of the product depends only on
  // x row m, and rows m >= mrows are never stored, so whatever their shared memory holds (an
  // earlier stage's bytes) stays in them; zero-filling them would cost a 128-token tile of a
  // slot with 8 tokens 120 of its 128 x copies per stage (no time difference measured at 32
  // adapters x 256 tokens). Rows past K's end and A rows past a slice's rank are still
  // zero-filled: they meet live rows.
  // Each copy's source (x itself for a zero-filled row, so that every address is valid) and
  // size, kept in registers: the compiler would otherwise recompute them from threadIdx for
  // every copy of every stage.
  const T* from[kSlots];
  int size[kSlots];
  uint32_t live = 0;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int row = (tid >> 3) + i * (kThreads / 8);
    const T* src = row < rows ? row_src[row] : nullptr;
    if (row < rows && (row < mrows || row >= kM)) live |= 1u << i;
    from[i] = opaque(src != nullptr ? src : xg);
    size[i] = static_cast<int>(opaque(src != nullptr ? 16u : 0u));
  }
  live = opaque(live);
  // Shared-memory addresses in bytes, computed once: a stage costs a few instructions per
  // copy and per fragment.
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(stage_base));
  const uint32_t stage_bytes = static_cast<uint32_t>(p.stage_bytes);
  // Row tid / 8 + 32 i keeps tid / 8 % 8, so the swizzled chunk is the same in every slot.
  const uint32_t copy_off =
      kWg ? static_cast<uint32_t>((tid >> 3) * kRowBytes + ((ch ^ ((tid >> 3) & 7)) << 4))
          : static_cast<uint32_t>(((tid >> 3) * kPitch + ch * 8) * 2);
  constexpr uint32_t kSlotBytes = (kThreads / 8) * kRowBytes;
  const uint32_t copy_at = opaque(copy_off);
  const int64_t k_at = opaque(k_lo + ch * 8);
  auto load_stage = [&](int kt, uint32_t stage) {
    const int64_t k = k_at + static_cast<int64_t>(kt) * kBK;
    const uint32_t dst = stage + copy_at;
    if (k < k_hi) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        if (live & (1u << i)) cp_async16_at(dst + i * kSlotBytes, from[i] + k, size[i]);
      }
    } else {  // past K's end (the last stage of a K range that is not a multiple of 64)
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        if (live & (1u << i)) cp_async16_at(dst + i * kSlotBytes, xg, 0);
      }
    }
  };

  const int rg = warp % (8 / kColSets);    // rows rg * 16 .. + 16 of the tile
  const int cset = warp / (8 / kColSets);  // column tiles cset, cset + kColSets, ...
  [[maybe_unused]] const uint32_t a_off =
      static_cast<uint32_t>(((rg * 16 + (lane & 15)) * kPitch + (lane >> 4) * 8) * 2);
  // Column tiles j0 = cset + 2 kColSets q (lanes 0-15) and j0 + kColSets (lanes 16-31) of pair
  // q for ldmatrix_x4.
  [[maybe_unused]] const uint32_t b_off =
      static_cast<uint32_t>(((kM + cset * 8 + (lane & 7)) * kPitch + ((lane >> 3) & 1) * 8) * 2 +
                            (lane < 16 ? 0 : kColSets * 8 * kPitch * 2));
  float acc[kAccTiles * 4];
#pragma unroll
  for (int i = 0; i < kAccTiles * 4; ++i) acc[i] = 0.0f;
  // wgmma: warpgroup wg multiplies tile rows 64 wg .. + 64 with every staged A row.
  [[maybe_unused]] const uint32_t wg_a_off = static_cast<uint32_t>((warp >> 2) * 64 * kRowBytes);
  [[maybe_unused]] const uint32_t wg_b_off = static_cast<uint32_t>(kM * kRowBytes);
  // This warp's column tiles below ntiles, in pairs.
  const int warp_tiles = ntiles > cset ? (ntiles - cset + kColSets - 1) / kColSets : 0;
  [[maybe_unused]] const int pairs = (warp_tiles + 1) / 2;

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < nk) load_stage(st, stage0 + st * stage_bytes);
    cp_async_commit();
  }
  int rd = 0;            // stage read in this iteration
  int wr = kStages - 1;  // stage written in this iteration
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();                   // stage kt has landed (this thread's copies)
    if constexpr (kWg) fence_proxy_async_shared();  // ... visible to wgmma's reads
    __syncthreads();  // ... every thread's; the stage written below is consumed
    const uint32_t buf = stage0 + rd * stage_bytes;
    const uint32_t next = stage0 + wr * stage_bytes;
    const bool more = kt + kStages - 1 < nk;
    rd = rd + 1 == kStages ? 0 : rd + 1;
    wr = wr + 1 == kStages ? 0 : wr + 1;
    if (kt == 0) trace_at<kTrace>(p.trace, 4);
    if constexpr (kWg) {
      // The tensor cores start on this stage before the threads issue the next stage's copies
      // (ten per thread at 192 A rows), so that the two overlap instead of following each other
      // (measured faster than the copies first). The stage those
      // copies overwrite was read by the previous iteration's MMAs, which each warpgroup waited
      // for before the barrier above.
      const uint64_t da = wgmma_desc(buf + wg_a_off);
      const uint64_t db = wgmma_desc(buf + wg_b_off);
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        // 16 K elements are 32 bytes further along each row: 2 in the descriptor's 16-byte units.
        Wgmma<T, kCols>::mma(acc, da + 2 * kk, db + 2 * kk);
      }
      wgmma_commit();
      if (more) load_stage(kt + kStages - 1, next);
      cp_async_commit();
      wgmma_wait<0>();  // the ring's next write goes to a stage this group reads
      wgmma_fence_operands(acc);
    } else {
      if (more) load_stage(kt + kStages - 1, next);
      cp_async_commit();
      stage_mma<T, kCols>(pairs, acc, buf + a_off, buf + b_off);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: the region holds the partial tile
  trace_at<kTrace>(p.trace, 5);

  if (p.global_reduce) {
    reduce_through_global<T, kWg, kAccTiles, kRows, kTrace>(
        p, acc, reinterpret_cast<float*>(smem_raw), item, ks, crank, start, ntiles, mrows, tok,
        tile_slice, tile_r0, srank);
    return;
  }
  float* red = reinterpret_cast<float*>(smem_raw);  // [kM][red_pitch]
  for_each_acc<kWg, kAccTiles>(acc, ntiles, [&](int row, int col, float v0, float v1) {
    *reinterpret_cast<float2*>(red + row * p.red_pitch + col) = make_float2(v0, v1);
  });
  cluster.sync();  // every CTA's partial tile is complete
  reduce_parts<T, kRows>(p, crank * kThreads + tid, ks * kThreads, mrows, ntiles, ks, tok,
                         tile_slice, tile_r0, srank, [&](int q, int m, int c) {
                           return *reinterpret_cast<const float4*>(cluster.map_shared_rank(red, q) +
                                                                   m * p.red_pitch + c);
                         });
  trace_at<kTrace>(p.trace, 6);
  // No CTA reads another's partial tile any more (the loaded values are already stored).
  cluster_arrive_relaxed();
  cluster_wait();
  trace_at<kTrace>(p.trace, 7);
}

// The deferred split-K sum (PrefillParams::defer_sum): CTA b adds the parts of rows
// kSumRows (b % blocks) .. + kSumRows of item b / blocks. Its metadata reads (the tile prefix,
// the item's token indices, the slot's ranks) come before pdl_wait: the metadata build finished
// before the shrink started, and the shrink writes none of it. The shrink's last CTA per
// 128-token tile summing 8 parts of 128 x 64 floats alone was four latency-bound round trips
// long; here each CTA reads one round trip's worth.
template <typename T, int kM, int kParts>  // kParts: p.k_split
__global__ void __launch_bounds__(kSumThreads) prefill_sum_kernel(PrefillParams p) {
  __shared__ int prefix[kMaxLorasForSum + 2];
  __shared__ int entries[3 * (kMaxLorasForSum + 1)];
  __shared__ int tok[kSumRows];
  __shared__ int srank[kMaxSlices];
  __shared__ int tile_slice[kMaxTiles];
  __shared__ int tile_r0[kMaxTiles];
  __shared__ int ntiles_s;
  constexpr int kBlocks = kM / kSumRows;
  const int item = static_cast<int>(blockIdx.x) / kBlocks;
  const int r0 = (static_cast<int>(blockIdx.x) % kBlocks) * kSumRows;
  const int tid = static_cast<int>(threadIdx.x);
  // The layer's expand (under PDL) may become resident as the shrink's and this grid's CTAs
  // leave; it reads the sums only after its own wait, which waits for this grid. Before this
  // grid's own wait, so only for a dependent that reads nothing of the shrink's before its wait.
  if (p.expand_follows) pdl_launch_dependents();
  const int ne = build_tile_prefix(p.meta, kM, prefix, entries);
  // Every CTA waits before it leaves, so that this grid's completion implies the shrink's.
  if (item >= prefix[ne]) {
    pdl_wait();
    return;
  }
  const TileItem it = tile_item(prefix, entries, ne, item, kM);
  const int slot = it.slot;
  if (r0 >= it.mrows) {
    pdl_wait();
    return;
  }
  const int rows = min(kSumRows, it.mrows - r0);
  const int start = it.start + r0;
  if (tid < rows) tok[tid] = p.meta.sorted_token_indices[start + tid];
  if (tid >= 32 && tid - 32 < p.num_slices) {
    srank[tid - 32] = p.ranks[(tid - 32) * p.max_loras + slot];
  }
  __syncthreads();
  if (tid == 0) ntiles_s = column_tiles(srank, p.num_slices, tile_slice, tile_r0);
  __syncthreads();
  const int ntiles = ntiles_s;
  pdl_wait();  // every part is stored and visible
  const int pp = p.part_pitch;
  const float* base = p.meta.scratch + static_cast<int64_t>(start) * pp;
  sum_quads<T, 2, kParts>(p, tid, kSumThreads, rows, ntiles, tok, tile_slice, tile_r0, srank,
                          [&](int q, int m, int c) {
                            return __ldcg(reinterpret_cast<const float4*>(
                                base + (static_cast<int64_t>(q) * p.num_tokens + m) * pp + c));
                          });
}

// The sum kernel for `parts` parts (1..kMaxParts).
template <typename T, int kM, int kParts = 1>
auto sum_kernel_for(int parts) -> void (*)(PrefillParams) {
  if constexpr (kParts < kMaxParts) {
    if (parts != kParts) return sum_kernel_for<T, kM, kParts + 1>(parts);
  }
  return &prefill_sum_kernel<T, kM, kParts>;
}

template <typename T, int kM>
Status launch_sum(const PrefillPlan& plan, const PrefillParams& p, StreamHandle stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(plan.sum_grid);
  cfg.blockDim = dim3(kSumThreads);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1] = {pdl_launch_attribute()};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  LORAPLEX_RETURN_IF_ERROR(cuda_status(
      cudaLaunchKernelEx(&cfg, sum_kernel_for<T, kM>(p.k_split), p), "prefill_sum_kernel launch"));
  return launch_status("prefill_sum_kernel");
}

template <typename T, int kCols, int kStages, bool kWg>
Status launch_staged(const PrefillPlan& plan, const PrefillParams& p, StreamHandle stream) {
  // The traced instantiation only for bf16 (the benchmark's dtype) while tracing.
  auto kernel = &prefill_shrink_kernel<T, kCols, kStages, false, kWg>;
  if constexpr (std::is_same_v<T, bf16>) {
    if (p.trace != nullptr) kernel = &prefill_shrink_kernel<T, kCols, kStages, true, kWg>;
  }
  LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.tiles * plan.k_split));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(plan.k_split);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = plan.global_reduce ? 0 : 1;  // split-K through global memory: no clusters
  LORAPLEX_RETURN_IF_ERROR(
      cuda_status(cudaLaunchKernelEx(&cfg, kernel, p), "prefill_shrink_kernel launch"));
  return launch_status("prefill_shrink_kernel");
}

template <typename T, int kCols, bool kWg>
Status launch_cols(const PrefillPlan& plan, const PrefillParams& p, StreamHandle stream) {
  if (plan.stages == 3) return launch_staged<T, kCols, 3, kWg>(plan, p, stream);
  return launch_staged<T, kCols, 4, kWg>(plan, p, stream);
}

template <typename T>
Status launch_form(const PrefillPlan& plan, const PrefillParams& p, StreamHandle stream) {
  if (!plan.wg) {
    return plan.cols == kSmallRows / 16 ? launch_cols<T, kSmallRows / 16, false>(plan, p, stream)
                                        : launch_cols<T, kMaxRows / 16, false>(plan, p, stream);
  }
  switch (plan.cols) {
    case 16:
      return launch_cols<T, 16, true>(plan, p, stream);
    case 32:
      return launch_cols<T, 32, true>(plan, p, stream);
    case 64:
      return launch_cols<T, 64, true>(plan, p, stream);
    case 128:
      return launch_cols<T, 128, true>(plan, p, stream);
    case 192:
      return launch_cols<T, 192, true>(plan, p, stream);
    default:
      return launch_cols<T, 256, true>(plan, p, stream);
  }
}

}  // namespace

Status launch_prefill(const PrefillPlan& plan, const ShrinkArgs& s, const LoraMetaView& meta,
                      StreamHandle stream) {
  // The reductions are instantiated for up to kMaxParts parts.
  LORAPLEX_ENSURE(plan.k_split >= 1 && plan.k_split <= kMaxParts, "prefill_shrink: K split in ",
                  plan.k_split, " parts, expected 1..", kMaxParts);
  PrefillParams p{};
  p.expand_follows = plan.expand_follows;
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
  p.out = s.out;
  p.out_f32 = s.out_dtype == DType::kF32;
  p.out_vec = (reinterpret_cast<uintptr_t>(s.out) & (p.out_f32 ? 15u : 7u)) == 0;
  p.num_tokens = s.num_tokens;
  p.stage_bytes = plan.stage_bytes;
  p.red_pitch = plan.red_pitch;
  p.cache_ranks = plan.cache_ranks;
  p.region = plan.region;
  p.off_rows = plan.off_rows;
  p.trace = kernel_trace();
  p.k_chunk = plan.k_chunk;
  p.k_split = plan.k_split;
  p.part_pitch = plan.a_rows;
  p.global_reduce = plan.global_reduce;
  p.defer_sum = plan.defer_sum;
  const bool bf = s.dtype == DType::kBF16;
  LORAPLEX_RETURN_IF_ERROR(bf ? launch_form<bf16>(plan, p, stream)
                              : launch_form<f16>(plan, p, stream));
  if (!plan.defer_sum) return Status();
  if (plan.wg) {
    return bf ? launch_sum<bf16, kTileWg>(plan, p, stream)
              : launch_sum<f16, kTileWg>(plan, p, stream);
  }
  return bf ? launch_sum<bf16, kTileMma>(plan, p, stream)
            : launch_sum<f16, kTileMma>(plan, p, stream);
}

}  // namespace loraplex::kernels::cuda
