// Expand on tensor cores for max_rank <= 16, software-pipelined over a CTA's work items.
//
// The work items are the tensor-core expand's (shrink_expand.cu): one 64-token tile of one
// active slot (rows gathered through the sorted token indices) x one 128-column tile of one
// slice, a contiguous run of items per CTA. That kernel handles one item at a time: load y, B
// and the intermediate, wait, multiply, add, store; every item pays a full memory round trip
// plus its arithmetic, and the expand ran ~6 us above what its memory pattern alone reaches.
// Here two y tiles alternate: the next item's y rows are in flight while this item waits for
// its operands, multiplies, adds and stores, and the next item's B rows and intermediate rows
// are issued as soon as this item's MMAs are done. Rank 16 keeps the B and intermediate tiles
// small enough (shared memory ~47 KB) for four CTAs per SM with the second y tile. An fp32
// intermediate is staged as fp32 and rounded to the weight dtype when the fragments are built,
// as vLLM rounds it before its expand.

#include <algorithm>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/expand_items.cuh"
#include "loraplex/kernels/cuda/kernel_tuning.h"
#include "loraplex/kernels/cuda/lora_paths.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 128;         // 4 warps, 16 token rows each (2 x kBM: see below)
constexpr int kBM = kExpandTileRows;  // tokens per tile
constexpr int kBN = kExpandTileCols;  // output columns per item
constexpr int kYPitch = kExpandYPitch;
constexpr int kRank = 16;                    // max_rank this kernel takes
constexpr int kBPitch = kRank + 8;           // 16-bit rows: fragment loads conflict-free
constexpr int kFPitch = kRank + 8;           // fp32 intermediate rows
constexpr int kYBytes = kBM * kYPitch * 2;   // one y tile
constexpr int kBBytes = kBN * kBPitch * 2;   // the B tile
constexpr int kInBytes = kBM * kFPitch * 4;  // the intermediate tile (fp32 or 16-bit)
constexpr int kTokSets = 3;                  // token-index sets in rotation (see the loop)
static_assert(kThreads == 2 * kBM, "threads kBM.. write the first item's token indices");
constexpr int kFixedBytes = 2 * kYBytes + kBBytes + kInBytes + kTokSets * kBM * 4;

// An item of the run with its index (== the run's end: none).
struct Item : ExpandItem {
  int64_t index;
};

// The shared-memory tables every item decode reads.
struct Tables {
  const int* prefix;
  const int* entries;     // slot, count, start per metadata entry
  const int* rank_cache;  // the rank table's shared copy (cache_ranks)
  int n;                  // metadata entries
};

// The first item at or after `index` that changes y (rank 0 with add_inputs adds nothing).
__device__ __forceinline__ Item next_item(const ExpandTileParams& p, const Tables& t, int64_t index,
                                          int64_t last) {
  Item it{};
  for (; index < last; ++index) {
    static_cast<ExpandItem&>(it) = expand_item(p, t.prefix, t.entries, t.n, t.rank_cache, index);
    if (!(it.rank == 0 && p.add_inputs)) break;
  }
  it.index = index;
  return it;
}

template <typename T>
__device__ __forceinline__ void issue_y(const ExpandTileParams& p, const Item& it, T* ys,
                                        const int* tok, int tid) {
  if (!p.add_inputs) return;
  const int ch = tid & 15;  // 16 threads per 256-byte row
  if (ch * 8 >= it.ncols) return;
  const T* yg = static_cast<const T*>(p.y) + p.y_col[it.s] + it.n0 + ch * 8;
  for (int row = tid >> 4; row < it.mrows; row += kThreads / 16) {
    cp_async16(ys + row * kYPitch + ch * 8, yg + static_cast<int64_t>(tok[row]) * p.y_stride, 16);
  }
}

// B rows (2 chunks of 8 per column) and intermediate rows, zero-filled past the rank and past
// the tile's rows and columns.
template <typename T>
__device__ __forceinline__ void issue_operands(const ExpandTileParams& p, const Item& it, T* bs,
                                               unsigned char* in_raw, const int* tok, int tid) {
  const T* bg = static_cast<const T*>(p.b[it.s]) +
                (static_cast<int64_t>(it.slot) * p.width[it.s] + it.n0) * p.max_rank;
#pragma unroll
  for (int k = 0; k < kBN * 2 / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int n = i >> 1;
    const int ch = i & 1;
    const int kvalid = it.rank - ch * 8;
    const int bytes = (n < it.ncols && kvalid > 0) ? min(kvalid, 8) * 2 : 0;
    cp_async16(bs + n * kBPitch + ch * 8, bytes ? bg + n * p.max_rank + ch * 8 : bg, bytes);
  }
  if (p.in_f32) {
    const float* ing = static_cast<const float*>(p.in);
    float* inf = reinterpret_cast<float*>(in_raw);
#pragma unroll
    for (int k = 0; k < kBM * 4 / kThreads; ++k) {
      const int i = tid + k * kThreads;
      const int row = i >> 2;
      const int ch = i & 3;
      const int kvalid = row < it.mrows ? it.rank - ch * 4 : 0;
      const int bytes = kvalid >= 4 ? 16 : max(kvalid, 0) * 4;
      const float* src = ing + (it.s * p.num_tokens + tok[row]) * p.max_rank + ch * 4;
      cp_async16(inf + row * kFPitch + ch * 4, bytes ? src : ing, bytes);
    }
  } else {
    const T* ing = static_cast<const T*>(p.in);
    T* ins = reinterpret_cast<T*>(in_raw);
    const int row = tid >> 1;
    const int ch = tid & 1;
    const int kvalid = row < it.mrows ? it.rank - ch * 8 : 0;
    const int bytes = kvalid > 0 ? min(kvalid, 8) * 2 : 0;
    const T* src = ing + (it.s * p.num_tokens + tok[row]) * p.max_rank + ch * 8;
    cp_async16(ins + row * kBPitch + ch * 8, bytes ? src : ing, bytes);
  }
}

// This warp's 16 rows x 128 columns of the product (one 16-deep K step: rank <= 16).
template <typename T, bool kFull>
__device__ __forceinline__ void multiply(const ExpandTileParams& p, const Item& it, const T* bs,
                                         const unsigned char* in_raw, float (&acc)[16][4], int warp,
                                         int lane) {
  uint32_t af[4];
  if (p.in_f32) {
    const float* f = reinterpret_cast<const float*>(in_raw) + (warp * 16 + (lane >> 2)) * kFPitch +
                     (lane & 3) * 2;
    const float2 v0 = *reinterpret_cast<const float2*>(f);
    const float2 v1 = *reinterpret_cast<const float2*>(f + 8 * kFPitch);
    const float2 v2 = *reinterpret_cast<const float2*>(f + 8);
    const float2 v3 = *reinterpret_cast<const float2*>(f + 8 * kFPitch + 8);
    af[0] = pack2<T>(v0.x, v0.y);
    af[1] = pack2<T>(v1.x, v1.y);
    af[2] = pack2<T>(v2.x, v2.y);
    af[3] = pack2<T>(v3.x, v3.y);
  } else {
    load_a_frag(af, reinterpret_cast<const T*>(in_raw) + warp * 16 * kBPitch, kBPitch, lane);
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (kFull || j * 8 < it.ncols) {
      uint32_t bfr[2];
      load_b_frag(bfr, bs + j * 8 * kBPitch, kBPitch, lane);
      mma_16816<T>(acc[j], af, bfr);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_tile(const ExpandTileParams& p, const Item& it, const T* ys,
                                           const int* tok, int tid) {
  const int ch = tid & 15;
  if (ch * 8 >= it.ncols) return;
  T* yg = static_cast<T*>(p.y) + p.y_col[it.s] + it.n0 + ch * 8;
  for (int row = tid >> 4; row < it.mrows; row += kThreads / 16) {
    *reinterpret_cast<uint4*>(yg + static_cast<int64_t>(tok[row]) * p.y_stride) =
        *reinterpret_cast<const uint4*>(ys + row * kYPitch + ch * 8);
  }
}

__device__ __forceinline__ void load_tokens(const ExpandTileParams& p, const Item& it, int* tok,
                                            int tid) {
  if (tid < kBM) tok[tid] = tid < it.mrows ? p.meta.sorted_token_indices[it.start + tid] : 0;
}

template <typename T, bool kTrace>
__global__ void __launch_bounds__(kThreads, 4) expand_pipe_kernel(ExpandTileParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ybuf = reinterpret_cast<T*>(smem_raw);  // [2][kBM][kYPitch]
  T* bs = reinterpret_cast<T*>(smem_raw + 2 * kYBytes);
  unsigned char* in_raw = smem_raw + 2 * kYBytes + kBBytes;
  int* tokbuf = reinterpret_cast<int*>(in_raw + kInBytes);  // [kTokSets][kBM]
  int* prefix = tokbuf + kTokSets * kBM;
  int* entries = prefix + p.max_loras + 2;
  int* rank_cache = entries + 3 * (p.max_loras + 1);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  trace_at<kTrace>(p.trace, 0);
  trace_at<kTrace>(p.trace, 1);
  // The first item's token indices on a guess (expand_items.cuh), by the threads that write
  // them below (warp 0 scans the metadata).
  const int64_t guess = first_item_start_guess(p);
  int spec = 0;
  if (tid >= kBM && guess + (tid - kBM) < p.num_tokens) {
    spec = ld_early(p.meta.sorted_token_indices + guess + (tid - kBM));
  }
  if (p.cache_ranks) {
    // Not warp 0: its rank loads would be waited for before its metadata loads are issued.
    for (int i = tid - 32; i >= 0 && i < p.num_slices * p.max_loras; i += kThreads - 32) {
      rank_cache[i] = p.ranks[i];
    }
  }
  Tables t;
  t.n = build_tile_prefix(p.meta, kBM, prefix, entries);  // its barrier covers the ranks too
  trace_at<kTrace>(p.trace, 2);
  t.prefix = prefix;
  t.entries = entries;
  t.rank_cache = rank_cache;
  const int64_t items = static_cast<int64_t>(prefix[t.n]) * p.ntile_begin[p.num_slices];
  const int64_t first = run_begin(items, blockIdx.x, p.balanced);
  const int64_t last = run_begin(items, blockIdx.x + 1, p.balanced);

  Item cur = next_item(p, t, first, last);
  if (cur.index >= last) return;  // the same in the whole CTA
  if (tid >= kBM) {
    const int m = tid - kBM;
    tokbuf[m] = m >= cur.mrows       ? 0
                : cur.start == guess ? spec
                                     : p.meta.sorted_token_indices[cur.start + m];
  }
  __syncthreads();
  trace_at<kTrace>(p.trace, 3);
  issue_y(p, cur, ybuf, tokbuf, tid);
  issue_operands(p, cur, bs, in_raw, tokbuf, tid);
  cp_async_commit();
  // Item k of the run uses y tile k % 2 and token set k % 3: the set written for item k + 1 was
  // last read by item k - 2's stores, which every thread finished before item k - 1's first
  // barrier.
  int yb = 0;
  int ts = 0;
  bool first_item = true;
  while (cur.index < last) {
    const Item nxt = next_item(p, t, cur.index + 1, last);
    const bool has_next = nxt.index < last;
    const int ts_next = ts + 1 == kTokSets ? 0 : ts + 1;
    T* ys = ybuf + yb * kBM * kYPitch;
    T* ys_next = ybuf + (yb ^ 1) * kBM * kYPitch;
    const int* tok = tokbuf + ts * kBM;
    int* tok_next = tokbuf + ts_next * kBM;
    if (has_next) load_tokens(p, nxt, tok_next, tid);
    __syncthreads();  // the next item's token indices; the other y tile's stores are done
    if (has_next) issue_y(p, nxt, ys_next, tok_next, tid);
    cp_async_commit();
    cp_async_wait<1>();  // this item's y, B and intermediate (the next y may still fly)
    __syncthreads();
    if (first_item) trace_at<kTrace>(p.trace, 4);
    first_item = false;
    float acc[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const bool warp_has_rows = warp * 16 < cur.mrows;
    if (warp_has_rows && cur.rank > 0) {
      if (cur.ncols == kBN) {
        multiply<T, true>(p, cur, bs, in_raw, acc, warp, lane);
      } else {
        multiply<T, false>(p, cur, bs, in_raw, acc, warp, lane);
      }
    }
    __syncthreads();  // every warp is done with B and the intermediate
    if (has_next) issue_operands(p, nxt, bs, in_raw, tok_next, tid);
    cp_async_commit();
    if (warp_has_rows) add_into_y_tile(ys, acc, warp, lane, cur.ncols, p.add_inputs);
    __syncthreads();  // the tile's sums are complete
    store_tile(p, cur, ys, tok, tid);
    cur = nxt;
    yb ^= 1;
    ts = ts_next;
  }
  trace_at<kTrace>(p.trace, 6);
  cp_async_wait<0>();
  trace_at<kTrace>(p.trace, 7);
}

}  // namespace

bool expand_pipelined_applies(const ExpandArgs& a) {
  if (!half_dtype(a.dtype) || a.max_rank % 8 != 0 || a.max_rank > kRank) return false;
  if (kernel_tuning().expand_pipelined == 1) return false;
  if (a.y_row_stride % 8 != 0 || a.offset_start % 8 != 0 || !aligned16(a.y) || !aligned16(a.in))
    return false;
  for (int s = 0; s < a.num_slices; ++s) {
    if (a.slice_width[s] % 8 != 0 || !aligned16(a.lora_b[s])) return false;
  }
  return true;
}

Status expand_pipelined(const ExpandArgs& a, const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_ENSURE(expand_pipelined_applies(a), "expand_pipelined: arguments not supported");
  ExpandTileParams p = expand_tile_params(a, meta);
  p.cache_sorted = false;  // the token indices are loaded an item ahead
  p.balanced = true;
  const int smem = kFixedBytes + expand_table_bytes(p);
  const int grid = static_cast<int>(std::min<int64_t>(
      expand_tile_items(p), int64_t{kernel_tuning().expand_ctas_per_sm} * sm_count()));
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](auto kernel) -> Status {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem));
    kernel<<<grid, kThreads, smem, s>>>(p);
    return launch_status("expand_pipe_kernel");
  };
  if (a.dtype != DType::kBF16) return run(&expand_pipe_kernel<f16, false>);
  // The traced instantiation only for bf16 (the benchmark's dtype) while tracing.
  return p.trace != nullptr ? run(&expand_pipe_kernel<bf16, true>)
                            : run(&expand_pipe_kernel<bf16, false>);
}

}  // namespace loraplex::kernels::cuda
