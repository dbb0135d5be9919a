#pragma once
// The work items of the tensor-core expands (shrink_expand.cu one item at a time,
// expand_pipelined.cu pipelined): one 64-token tile of one active slot (rows gathered through
// the sorted token indices) x one 128-column tile of one slice, all slices in one launch,
// counted on the device from the metadata (absent slots cost nothing, the launch shape depends
// only on host-known sizes). Their parameters, the host side that fills them and the decode of
// an item index. Internal to the CUDA backend.

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels::cuda {

inline constexpr int kExpandTileRows = expand_kernel::kTileRows;  // tokens per item
inline constexpr int kExpandTileCols = expand_kernel::kTileCols;  // output columns per item
inline constexpr int kExpandYPitch = expand_kernel::kYPitch;      // staged y rows

struct ExpandTileParams {
  const void* in;
  bool in_f32;
  int num_slices;
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t y_col[kMaxSlices];        // first y column of each slice
  int ntile_begin[kMaxSlices + 1];  // prefix of 128-column tiles per slice
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  void* y;
  int64_t y_stride;
  bool add_inputs;
  int64_t num_tokens;
  LoraMetaView meta;
  bool cache_ranks;   // the rank table goes to shared memory (num_slices x max_loras small)
  bool cache_sorted;  // the sorted token indices go to shared memory (small batches)
  uint64_t* trace;    // per-CTA timeline (kernel_trace.h) or nullptr
  bool balanced;      // run_begin's split of the items over the CTAs
  // Launched with PDL right after this layer's prefill shrink (pipelined expand only): y, B and
  // the metadata are read before griddepcontrol.wait, the intermediate after it.
  bool pdl;
};

/// The plan's values and the arguments' pointers.
ExpandTileParams expand_tile_params(const ExpandPlan& plan, const ExpandArgs& a,
                                    const LoraMetaView& meta);

/// An error naming the count when the plan's items do not fit the kernels' 32-bit item index.
Status check_expand_items(const ExpandPlan& plan);

struct ExpandItem {
  int tile;
  int s;  // slice
  int slot;
  int rank;
  int n0;     // first column within the slice
  int ncols;  // columns (a multiple of 8 where the tensor-core paths apply)
  int mrows;  // tokens
  int start;  // first sorted position
};

/// Item `index` from the tile prefix and the metadata entries (build_tile_prefix over `n`
/// entries) and the rank table (`rank_cache`: its shared copy where cache_ranks, else the
/// global one; kept as two loads so the shared one stays a shared-memory load).
__device__ __forceinline__ ExpandItem expand_item(const ExpandTileParams& p, const int* prefix,
                                                  const int* entries, int n, const int* rank_cache,
                                                  int index) {
  const int total_nt = p.ntile_begin[p.num_slices];
  ExpandItem it;
  it.tile = index / total_nt;
  const int u = index - it.tile * total_nt;
  int s = 0;
  while (u >= p.ntile_begin[s + 1]) ++s;
  const int e = find_tile_entry(prefix, n, it.tile);
  it.s = s;
  it.slot = entries[e];
  const int r = s * p.max_loras + it.slot;
  it.rank = p.cache_ranks ? rank_cache[r] : p.ranks[r];
  it.n0 = (u - p.ntile_begin[s]) * kExpandTileCols;
  it.ncols = static_cast<int>(min(static_cast<int64_t>(kExpandTileCols), p.width[s] - it.n0));
  const int m0 = (it.tile - prefix[e]) * kExpandTileRows;
  it.mrows = min(kExpandTileRows, entries[n + e] - m0);
  it.start = entries[2 * n + e] + m0;
  return it;
}

/// The first of CTA `cta`'s contiguous run of `items` work items (its run ends where CTA cta + 1's
/// begins). Balanced: runs differ by at most one item (the first items % grid CTAs take one
/// more); else ceil(items / grid) each, which leaves the last CTAs idle (2048 items on 528 CTAs:
/// 512 CTAs with 4, 16 with none). The pipelined expand is faster balanced; the one-item-at-a-
/// time expand, which reuses the token rows and intermediate of consecutive items, slower, so
/// it keeps ceil-sized runs (docs/decisions.md). 32-bit (the
/// launchers check that the items fit): a 64-bit division is a call to
/// a subroutine at the end of the kernel's code, one more instruction-cache miss in the cold
/// chain before the first load.
__device__ __forceinline__ int run_begin(int items, int cta, bool balanced) {
  const int grid = static_cast<int>(gridDim.x);
  if (!balanced) return min(items, cta * ((items + grid - 1) / grid));
  const int q = items / grid;
  return cta * q + min(cta, items - q * grid);
}

/// The sorted position of the first token of this CTA's first item if every active slot filled
/// whole tiles (then the run is ceil(num_tokens / 64) tiles x the column tiles, split evenly
/// over the grid). The expands load that item's token indices on this guess together with the
/// metadata and keep them when the item's real start equals it (one round trip less in the
/// first item's chain metadata -> token indices -> y rows).
__device__ __forceinline__ int first_item_start_guess(const ExpandTileParams& p) {
  const int total_nt = p.ntile_begin[p.num_slices];
  const int items =
      static_cast<int>((p.num_tokens + kExpandTileRows - 1) / kExpandTileRows) * total_nt;
  return run_begin(items, static_cast<int>(blockIdx.x), p.balanced) / total_nt * kExpandTileRows;
}

/// A warp's 16 x 128 sums (mma accumulator layout) plus the old y (add_inputs), rounded to T,
/// into its rows of the staged y tile (pitch kExpandYPitch); columns past ncols skipped.
template <typename T>
__device__ __forceinline__ void add_into_y_tile(T* ys, const float (&acc)[16][4], int warp,
                                                int lane, int ncols, bool add_inputs) {
  const int g = lane >> 2;
  const int tq = (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (j * 8 < ncols) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t* cell =
            reinterpret_cast<uint32_t*>(ys + (warp * 16 + g + h * 8) * kExpandYPitch + j * 8 + tq);
        float v0 = acc[j][h * 2];
        float v1 = acc[j][h * 2 + 1];
        if (add_inputs) {
          const float2 old = unpack2<T>(*cell);
          v0 += old.x;
          v1 += old.y;
        }
        *cell = pack2<T>(v0, v1);
      }
    }
  }
}

}  // namespace loraplex::kernels::cuda
