// Expand on tensor cores (bf16/f16, 16-byte aligned rows), software-pipelined over work items.
//
// A persistent grid over work items of one active slot, one 64-token tile of that slot's
// tokens (rows gathered through the sorted token indices) and one 128-column tile of one
// slice, all slices in one launch. Items are counted on the device from the metadata, so
// absent slots cost nothing and the launch configuration depends only on host-known sizes.
// Each slot costs its own rank: B columns and MMA steps past a slot's rank are never loaded or
// computed. Operands are staged with cp.async (zero-filled past the valid bytes), multiplied
// with mma.sync m16n8k16 into fp32 (the intermediate rounded to the weight dtype first, as
// vLLM does), and y is read, added and written with 16-byte accesses through shared memory.
//
// Why pipelined: at prefill sizes the expand is a read-modify-write stream over y (B and the
// intermediate are small and stay in L2). A CTA that loads an item's y tile, waits, computes
// and writes it back leaves the memory system idle while it waits; so the y tile of the NEXT
// item is loaded (double buffer) while the current one is multiplied and written back, and
// the copy engine always has a tile in flight per CTA.

#include <algorithm>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_paths.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 128;    // 4 warps, 16 token rows each
constexpr int kBM = 64;          // tokens per tile
constexpr int kBK = 64;          // rank elements per stage
constexpr int kPitch = kBK + 8;  // padded rows: fragment loads are bank-conflict free
constexpr int kBN = 128;         // output columns per item
constexpr int kYPitch = kBN + 8;
constexpr int kBlocksPerSm = 3;  // 3 x ~62 KB of shared memory
constexpr int kCacheRanks = 4096;
constexpr int kCacheSorted = 2048;

struct Params {
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
  bool cache_ranks;
  bool cache_sorted;
};

constexpr int kYTileElems = kBM * kYPitch;
constexpr int kSmemBytes = (2 * kYTileElems + kBM * kPitch + kBN * kPitch) * 2 + 2 * kBM * 4;

// Shared tables of one CTA.
struct Tables {
  const int* prefix;  // token tiles per metadata entry, prefix-summed
  int n_entries;
  const int* rank_cache;
  const int* sorted_cache;
};

// One work item, decoded.
struct Item {
  int tile;  // token tile among all active slots' tiles
  int s;     // slice
  int slot;
  int rank;
  int64_t n0;  // first column within the slice
  int ncols;
  int mrows;  // tokens of the tile
  int start;  // position of the tile's first token in the sorted order
};

__device__ __forceinline__ int rank_of(const Params& p, const Tables& t, int s, int slot) {
  return p.cache_ranks ? t.rank_cache[s * p.max_loras + slot] : p.ranks[s * p.max_loras + slot];
}

__device__ __forceinline__ Item decode_item(const Params& p, const Tables& t, int64_t item) {
  const int total_nt = p.ntile_begin[p.num_slices];
  Item it;
  it.tile = static_cast<int>(item / total_nt);
  const int u = static_cast<int>(item % total_nt);
  it.s = 0;
  while (u >= p.ntile_begin[it.s + 1]) ++it.s;
  const int e = find_tile_entry(t.prefix, t.n_entries, it.tile);
  it.slot = p.meta.active_lora_ids[e];
  it.rank = rank_of(p, t, it.s, it.slot);
  it.n0 = static_cast<int64_t>(u - p.ntile_begin[it.s]) * kBN;
  it.ncols = static_cast<int>(min(static_cast<int64_t>(kBN), p.width[it.s] - it.n0));
  const int m0 = (it.tile - t.prefix[e]) * kBM;
  it.mrows = min(kBM, p.meta.num_tokens_per_lora[e] - m0);
  it.start = p.meta.lora_token_start_loc[e] + m0;
  return it;
}

// The first item at or after `item` (before `last`) that changes y: a rank-0 slice of a slot
// adds nothing when accumulating.
__device__ __forceinline__ int64_t next_live(const Params& p, const Tables& t, int64_t item,
                                             int64_t last) {
  const int total_nt = p.ntile_begin[p.num_slices];
  for (; item < last && p.add_inputs; ++item) {
    const int tile = static_cast<int>(item / total_nt);
    const int u = static_cast<int>(item % total_nt);
    int s = 0;
    while (u >= p.ntile_begin[s + 1]) ++s;
    const int e = find_tile_entry(t.prefix, t.n_entries, tile);
    if (rank_of(p, t, s, p.meta.active_lora_ids[e]) > 0) break;
  }
  return item;
}

// Threads below kBM: the tile's token rows (0 past the batch: never read or written).
__device__ __forceinline__ int token_row(const Params& p, const Tables& t, const Item& it,
                                         int row) {
  if (row >= it.mrows) return 0;
  return p.cache_sorted ? t.sorted_cache[it.start + row]
                        : p.meta.sorted_token_indices[it.start + row];
}

// cp.async of the item's y tile (rows past the batch or columns past the slice: zero bytes).
template <typename T>
__device__ __forceinline__ void load_y_tile(const Params& p, const Item& it, const int* tok, T* ys,
                                            int tid) {
  T* yg = static_cast<T*>(p.y);
  const int64_t ycol = p.y_col[it.s] + it.n0;
  for (int i = tid; i < kBM * (kBN / 8); i += kThreads) {
    const int row = i / (kBN / 8);
    const int ch = i % (kBN / 8);
    const bool ok = row < it.mrows && ch * 8 < it.ncols;
    cp_async16(ys + row * kYPitch + ch * 8, ok ? yg + tok[row] * p.y_stride + ycol + ch * 8 : yg,
               ok ? 16 : 0);
  }
}

// Rank chunk kb of the item's B columns (cp.async) and, unless still staged, of its rows of
// the intermediate (cp.async from a half-precision intermediate, converted from fp32).
template <typename T>
__device__ __forceinline__ void load_rank_chunk(const Params& p, const Item& it, const int* tok,
                                                int kb, bool stage_in, T* bs, T* ins, int tid) {
  const T* bg = static_cast<const T*>(p.b[it.s]) + (it.slot * p.width[it.s] + it.n0) * p.max_rank;
  for (int i = tid; i < kBN * 8; i += kThreads) {
    const int n = i >> 3;
    const int ch = i & 7;
    const int kvalid = it.rank - kb - ch * 8;
    const int bytes = (n < it.ncols && kvalid > 0) ? min(kvalid, 8) * 2 : 0;
    cp_async16(bs + n * kPitch + ch * 8, bytes ? bg + n * p.max_rank + kb + ch * 8 : bg, bytes);
  }
  if (!stage_in) return;
  const int64_t in_base = it.s * p.num_tokens;
  if (!p.in_f32) {
    const T* ing = static_cast<const T*>(p.in);
    for (int i = tid; i < kBM * 8; i += kThreads) {
      const int row = i >> 3;
      const int ch = i & 7;
      const int kvalid = it.rank - kb - ch * 8;
      const int bytes = (row < it.mrows && kvalid > 0) ? min(kvalid, 8) * 2 : 0;
      const T* src = ing + (in_base + tok[row]) * p.max_rank + kb + ch * 8;
      cp_async16(ins + row * kPitch + ch * 8, bytes ? src : ing, bytes);
    }
    return;
  }
  const float* ing = static_cast<const float*>(p.in);
  for (int i = tid; i < kBM * 8; i += kThreads) {
    const int row = i >> 3;
    const int ch = i & 7;
    const int kvalid = row < it.mrows ? it.rank - kb - ch * 8 : 0;
    float v[8];
    const float* src = ing + (in_base + tok[row]) * p.max_rank + kb + ch * 8;
    if (kvalid >= 8) {
      const float4 lo = *reinterpret_cast<const float4*>(src);
      const float4 hi = *reinterpret_cast<const float4*>(src + 4);
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
      v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = q < kvalid ? src[q] : 0.0f;
    }
    *reinterpret_cast<uint4*>(ins + row * kPitch + ch * 8) = pack8<T>(v);
  }
}

// acc += ins[warp rows] x bs^T over one staged rank chunk.
template <typename T>
__device__ __forceinline__ void mma_chunk(const T* ins, const T* bs, int kb, const Item& it,
                                          int warp, int lane, float (&acc)[16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    if (kb + kk >= it.rank) break;
    uint32_t af[4];
    load_a_frag(af, ins + warp * 16 * kPitch + kk, kPitch, lane);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (j * 8 < it.ncols) {
        uint32_t bfr[2];
        load_b_frag(bfr, bs + j * 8 * kPitch + kk, kPitch, lane);
        mma_16816<T>(acc[j], af, bfr);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) expand_tc_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ys0 = reinterpret_cast<T*>(smem_raw);  // two y tiles: current and next item
  T* ins = ys0 + 2 * kYTileElems;
  T* bs = ins + kBM * kPitch;
  int* tok0 = reinterpret_cast<int*>(bs + kBN * kPitch);  // two token-row tables
  int* prefix = tok0 + 2 * kBM;
  int* rank_cache = prefix + p.max_loras + 2;  // when cache_ranks
  int* sorted_cache = rank_cache + (p.cache_ranks ? p.num_slices * p.max_loras : 0);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  // The layer's ranks and (small batches) the sorted token indices come with the metadata
  // in the first round trip, so a work item needs no other load before its data.
  if (p.cache_ranks) {
    for (int i = tid; i < p.num_slices * p.max_loras; i += kThreads) rank_cache[i] = p.ranks[i];
  }
  if (p.cache_sorted) {
    for (int i = tid; i < p.num_tokens; i += kThreads) {
      sorted_cache[i] = p.meta.sorted_token_indices[i];
    }
  }
  const int n_entries = build_tile_prefix(p.meta, kBM, prefix);
  const Tables tab{prefix, n_entries, rank_cache, sorted_cache};
  const int64_t items = static_cast<int64_t>(prefix[n_entries]) * p.ntile_begin[p.num_slices];

  // Each CTA takes a contiguous run of items: consecutive column tiles of one token tile
  // reuse the gathered token rows and, within a slice, the staged intermediate.
  const int64_t per_cta = ceil_div(items, static_cast<int64_t>(gridDim.x));
  const int64_t first = static_cast<int64_t>(blockIdx.x) * per_cta;
  const int64_t last = min(items, first + per_cta);
  int64_t cur = next_live(p, tab, first, last);
  if (cur >= last) return;  // the same in every thread of the CTA
  Item it = decode_item(p, tab, cur);
  if (tid < kBM) tok0[tid] = token_row(p, tab, it, tid);
  __syncthreads();
  if (p.add_inputs) load_y_tile<T>(p, it, tok0, ys0, tid);
  cp_async_commit();

  int buf = 0;
  int prev_tile = -1;
  int prev_s = -1;
  T* yg = static_cast<T*>(p.y);
  while (cur < last) {
    T* ys = ys0 + buf * kYTileElems;
    const int* tok = tok0 + buf * kBM;
    int* tok_next = tok0 + (buf ^ 1) * kBM;
    T* ys_next = ys0 + (buf ^ 1) * kYTileElems;
    const bool stage_in = !(it.tile == prev_tile && it.s == prev_s && it.rank <= kBK);
    prev_tile = it.tile;
    prev_s = it.s;

    __syncthreads();  // the previous item is done with B, the intermediate and its y tile
    if (it.rank > 0) load_rank_chunk<T>(p, it, tok, 0, stage_in, bs, ins, tid);
    cp_async_commit();
    // The next item (its metadata lookups overlap this item's loads) and its token rows.
    const int64_t nxt = next_live(p, tab, cur + 1, last);
    Item nt = it;
    if (nxt < last) {
      nt = decode_item(p, tab, nxt);
      if (tid < kBM) tok_next[tid] = nt.tile == it.tile ? tok[tid] : token_row(p, tab, nt, tid);
    }
    __syncthreads();  // the next item's token rows are visible
    if (nxt < last && p.add_inputs) load_y_tile<T>(p, nt, tok_next, ys_next, tid);
    cp_async_commit();
    cp_async_wait<1>();  // this item's y tile and first rank chunk (the next y tile may fly)
    __syncthreads();

    float acc[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const bool warp_has_rows = warp * 16 < it.mrows;
    for (int kb = 0; kb < it.rank; kb += kBK) {
      if (kb > 0) {
        // Ranks above kBK (rare): the next chunk, staged once the previous one is consumed.
        __syncthreads();
        load_rank_chunk<T>(p, it, tok, kb, true, bs, ins, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
      }
      if (warp_has_rows) mma_chunk<T>(ins, bs, kb, it, warp, lane, acc);
    }
    if (warp_has_rows) {
      const int g = lane >> 2;
      const int tq = (lane & 3) * 2;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t* cell =
              reinterpret_cast<uint32_t*>(ys + (warp * 16 + g + h * 8) * kYPitch + j * 8 + tq);
          float v0 = acc[j][h * 2];
          float v1 = acc[j][h * 2 + 1];
          if (p.add_inputs) {
            const float2 old = unpack2<T>(*cell);
            v0 += old.x;
            v1 += old.y;
          }
          *cell = pack2<T>(v0, v1);
        }
      }
    }
    __syncthreads();  // the sums are in the y tile
    const int64_t ycol = p.y_col[it.s] + it.n0;
    for (int i = tid; i < kBM * (kBN / 8); i += kThreads) {
      const int row = i / (kBN / 8);
      const int ch = i % (kBN / 8);
      if (row < it.mrows && ch * 8 < it.ncols) {
        *reinterpret_cast<uint4*>(yg + tok[row] * p.y_stride + ycol + ch * 8) =
            *reinterpret_cast<const uint4*>(ys + row * kYPitch + ch * 8);
      }
    }
    buf ^= 1;
    it = nt;
    cur = nxt;
  }
  cp_async_wait<0>();  // no copy outlives the CTA's shared memory
}

// Work tiles can exceed ceil(T / 64) by one per active slot (each slot's last partial tile).
int64_t tile_upper_bound(int64_t num_tokens, int max_loras) {
  return ceil_div(num_tokens, kBM) + std::min<int64_t>(num_tokens, max_loras);
}

bool half_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16; }

}  // namespace

bool tc_expand_applies(const ExpandArgs& a) {
  if (!half_dtype(a.dtype) || a.max_rank % 8 != 0 || a.y_row_stride % 8 != 0 ||
      a.offset_start % 8 != 0 || !aligned16(a.y) || !aligned16(a.in))
    return false;
  for (int s = 0; s < a.num_slices; ++s) {
    if (a.slice_width[s] % 8 != 0 || !aligned16(a.lora_b[s])) return false;
  }
  return true;
}

Status tc_expand(const ExpandArgs& a, const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_ENSURE(tc_expand_applies(a), "tc_expand: arguments not supported");
  Params p{};
  p.in = a.in;
  p.in_f32 = a.in_dtype == DType::kF32;
  p.num_slices = a.num_slices;
  int64_t col = a.offset_start;
  p.ntile_begin[0] = 0;
  for (int s = 0; s < a.num_slices; ++s) {
    p.b[s] = a.lora_b[s];
    p.width[s] = a.slice_width[s];
    p.y_col[s] = col;
    col += a.slice_width[s];
    p.ntile_begin[s + 1] = p.ntile_begin[s] + static_cast<int>(ceil_div(a.slice_width[s], kBN));
  }
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.ranks = a.ranks;
  p.y = a.y;
  p.y_stride = a.y_row_stride;
  p.add_inputs = a.add_inputs;
  p.num_tokens = a.num_tokens;
  p.meta = meta;
  p.cache_ranks = a.num_slices * a.max_loras <= kCacheRanks;
  p.cache_sorted = a.num_tokens <= kCacheSorted;
  const int smem = kSmemBytes + (a.max_loras + 2) * 4 +
                   (p.cache_ranks ? a.num_slices * a.max_loras * 4 : 0) +
                   (p.cache_sorted ? static_cast<int>(a.num_tokens) * 4 : 0);
  const int64_t items = tile_upper_bound(a.num_tokens, a.max_loras) * p.ntile_begin[a.num_slices];
  const int grid = static_cast<int>(std::min<int64_t>(items, kBlocksPerSm * sm_count()));
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](auto kernel) -> Status {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem));
    kernel<<<grid, kThreads, smem, s>>>(p);
    return launch_status("expand_tc_kernel");
  };
  if (a.dtype == DType::kBF16) return run(&expand_tc_kernel<bf16>);
  return run(&expand_tc_kernel<f16>);
}

}  // namespace loraplex::kernels::cuda
