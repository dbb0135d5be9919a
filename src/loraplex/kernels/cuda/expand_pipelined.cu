// Expand on tensor cores for max_rank <= 64, software-pipelined over a CTA's work items.
//
// The work items are the tensor-core expand's (shrink_expand.cu): one 64-token tile of one
// active slot (rows gathered through the sorted token indices) x one 128-column tile of one
// slice, a contiguous run of items per CTA. That kernel handles one item at a time: load y, B
// and the intermediate, wait, multiply, add, store; every item pays a full memory round trip
// plus its arithmetic, so the expand ran well above what its memory pattern alone reaches
// (docs/decisions.md, "Kernel details measured").
// Here two y tiles alternate: the next item's y rows are in flight while this item waits for
// its operands, multiplies, adds and stores, and the next item's B rows are issued as soon as
// this item's MMAs are done.
//
// The intermediate goes straight from global memory into each warp's mma A fragments (its 16
// rows x the rank) and stays there while consecutive items share the token tile and the slice
// (a run's items are consecutive column tiles of one tile: mostly the same rows). Shared
// memory then holds only the two y tiles and B, ~52 KB at rank 64, so four CTAs per SM still
// fit with the second y tile (with a staged intermediate the rank-64 kernel could not pipeline
// at four CTAs per SM). The fragments use a permuted rank order (the K-order trick: an MMA's sum
// does not depend on which k sits in which fragment slot as long as A and B agree): lane q of a
// row group holds ranks 4q..4q+3 of each 16-rank step, so it reads them with one 16-byte load
// (fp32) from global memory and B with one 8-byte shared load. Those global loads are issued
// with the item's y and B copies and converted only after the copies are waited for, so they
// add no round trip. An fp32 intermediate is rounded to the weight dtype when the fragments are
// built, as vLLM rounds it before its expand.

#include <algorithm>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/expand_items.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 128;         // 4 warps, 16 token rows each (2 x kBM: see below)
constexpr int kBM = kExpandTileRows;  // tokens per tile
constexpr int kBN = kExpandTileCols;  // output columns per item
constexpr int kYPitch = kExpandYPitch;
constexpr int kYBytes = kBM * kYPitch * 2;         // one y tile
constexpr int kTokSets = expand_kernel::kTokSets;  // token-index sets in rotation (see the loop)
static_assert(kThreads == 2 * kBM, "threads kBM.. write the first item's token indices");

// kSteps 16-deep rank steps (1: max_rank <= 16, 4: <= 64). B rows hold kSteps x 16 elements,
// padded so that a row is 8 or 24 banks after the previous one: the 8-byte fragment loads of a
// half-warp (4 rows x 4 lanes) then hit 32 distinct banks.
template <int kSteps>
struct Shape {
  static_assert(kSteps == 1 || kSteps == 4, "the launcher instantiates rank steps 1 and 4");
  static constexpr int kBPitch = kSteps == 1 ? 16 : 80;
  static_assert(kBPitch >= kSteps * 16 && (kBPitch / 2) % 16 == 8, "bank spread of B rows");
  static constexpr int kBBytes = kBN * kBPitch * 2;
  static constexpr int kFixedBytes = 2 * kYBytes + kBBytes + kTokSets * kBM * 4;
  static_assert(kBPitch == expand_kernel::pipelined_b_pitch(kSteps) &&
                    kFixedBytes == expand_kernel::pipelined_fixed_bytes(kSteps),
                "the planner's shared memory of the pipelined expand");
};

// An item of the run with its index (== the run's end: none).
struct Item : ExpandItem {
  int index;
};

// The shared-memory tables every item decode reads.
struct Tables {
  const int* prefix;
  const int* entries;     // slot, count, start per metadata entry
  const int* rank_cache;  // the rank table's shared copy (cache_ranks)
  int n;                  // metadata entries
};

// The first item at or after `index` that changes y (rank 0 with add_inputs adds nothing).
__device__ __forceinline__ Item next_item(const ExpandTileParams& p, const Tables& t, int index,
                                          int last) {
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

// B rows: the rank steps the item multiplies (ceil(rank / 16) x 16 elements per column),
// zero-filled past the rank and past the tile's columns; the steps past them are never read.
template <typename T, int kSteps>
__device__ __forceinline__ void issue_b(const ExpandTileParams& p, const Item& it, T* bs, int tid) {
  constexpr int kPitch = Shape<kSteps>::kBPitch;
  constexpr int kChunks = kSteps * 2;  // 16-byte chunks per column
  const T* bg = static_cast<const T*>(p.b[it.s]) +
                (static_cast<int64_t>(it.slot) * p.width[it.s] + it.n0) * p.max_rank;
  const int used_chunks = (it.rank + 15) / 16 * 2;
#pragma unroll
  for (int k = 0; k < kBN * kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int n = i / kChunks;
    const int ch = i % kChunks;
    if (ch < used_chunks) {
      const int kvalid = it.rank - ch * 8;
      const int bytes = (n < it.ncols && kvalid > 0) ? min(kvalid, 8) * 2 : 0;
      cp_async16(bs + n * kPitch + ch * 8, bytes ? bg + n * p.max_rank + ch * 8 : bg, bytes);
    }
  }
}

// This warp's share of the item's intermediate as loaded: rows warp * 16 + g and + 8, ranks
// ks * 16 + 4q .. + 3 of every step (16 bytes of fp32, or 8 of T in .x and .y); zero from the
// first step past the rank. Converted into A fragments by in_frags once they are needed.
template <int kSteps>
struct InRaw {
  uint4 v[kSteps][2];
};

template <int kSteps>
__device__ __forceinline__ void issue_in(const ExpandTileParams& p, const Item& it, const int* tok,
                                         int warp, int lane, InRaw<kSteps>& raw) {
  const int g = lane >> 2;
  const int q = lane & 3;
  const int64_t base = static_cast<int64_t>(it.s) * p.num_tokens;
  const int64_t off[2] = {(base + tok[warp * 16 + g]) * p.max_rank + 4 * q,
                          (base + tok[warp * 16 + g + 8]) * p.max_rank + 4 * q};
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // 4q + 3 < max_rank (a multiple of 8) wherever ks * 16 + 4q < rank: inside the row.
      if (ks * 16 + 4 * q < it.rank) {
        if (p.in_f32) {
          raw.v[ks][h] = ldg16_now(static_cast<const float*>(p.in) + off[h] + ks * 16);
        } else {
          const uint2 v = ldg8_now(static_cast<const uint16_t*>(p.in) + off[h] + ks * 16);
          raw.v[ks][h] = make_uint4(v.x, v.y, 0, 0);
        }
      } else {
        raw.v[ks][h] = make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// The A fragments (permuted order: slot pairs tq, tq + 1 and tq + 8, tq + 9 hold ranks 4q, 4q + 1
// and 4q + 2, 4q + 3), ranks at or past the item's rank zeroed: the intermediate holds anything
// there, and B is only zero-filled up to the next multiple of 16.
template <typename T, int kSteps>
__device__ __forceinline__ void in_frags(const ExpandTileParams& p, const InRaw<kSteps>& raw,
                                         int rank, int lane, uint32_t (&af)[kSteps][4]) {
  const int q = lane & 3;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const int k = ks * 16 + 4 * q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = raw.v[ks][h];
      uint32_t lo;
      uint32_t hi;
      if (p.in_f32) {
        const float f0 = k < rank ? __uint_as_float(v.x) : 0.0f;
        const float f1 = k + 1 < rank ? __uint_as_float(v.y) : 0.0f;
        const float f2 = k + 2 < rank ? __uint_as_float(v.z) : 0.0f;
        const float f3 = k + 3 < rank ? __uint_as_float(v.w) : 0.0f;
        lo = pack2<T>(f0, f1);
        hi = pack2<T>(f2, f3);
      } else {
        lo = v.x & ((k < rank ? 0xffffu : 0u) | (k + 1 < rank ? 0xffff0000u : 0u));
        hi = v.y & ((k + 2 < rank ? 0xffffu : 0u) | (k + 3 < rank ? 0xffff0000u : 0u));
      }
      af[ks][h] = lo;      // row g (h 0) or g + 8 (h 1), slots tq, tq + 1
      af[ks][h + 2] = hi;  // slots tq + 8, tq + 9
    }
  }
}

// This warp's 16 rows x 128 columns of the product, the rank steps up to the item's rank; B
// in the fragments' permuted rank order (one 8-byte load per fragment).
template <typename T, int kSteps, bool kFull>
__device__ __forceinline__ void multiply(const Item& it, const T* bs,
                                         const uint32_t (&af)[kSteps][4], float (&acc)[16][4],
                                         int lane) {
  constexpr int kPitch = Shape<kSteps>::kBPitch;
  const T* b_lane = bs + (lane >> 2) * kPitch + 4 * (lane & 3);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    if (ks * 16 >= it.rank) break;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (kFull || j * 8 < it.ncols) {
        const uint2 b = *reinterpret_cast<const uint2*>(b_lane + j * 8 * kPitch + ks * 16);
        const uint32_t bfr[2] = {b.x, b.y};
        mma_16816<T>(acc[j], af[ks], bfr);
      }
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

// Registers for five CTAs per SM up to rank 16 (93-95, no spills), four above (125-127).
template <typename T, int kSteps, bool kTrace>
__global__ void __launch_bounds__(kThreads, kSteps == 1 ? 5 : 4)
    expand_pipe_kernel(ExpandTileParams p) {
  using S = Shape<kSteps>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ybuf = reinterpret_cast<T*>(smem_raw);  // [2][kBM][kYPitch]
  T* bs = reinterpret_cast<T*>(smem_raw + 2 * kYBytes);
  int* tokbuf = reinterpret_cast<int*>(smem_raw + 2 * kYBytes + S::kBBytes);  // [kTokSets][kBM]
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
  const int guess = first_item_start_guess(p);
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
  const int items = prefix[t.n] * p.ntile_begin[p.num_slices];
  const int first = run_begin(items, static_cast<int>(blockIdx.x), p.balanced);
  const int last = run_begin(items, static_cast<int>(blockIdx.x) + 1, p.balanced);

  Item cur = next_item(p, t, first, last);
  if (cur.index >= last) {  // the same in the whole CTA
    // Under PDL every CTA waits before it leaves, so that this grid's completion implies the
    // shrink's.
    if (p.pdl) pdl_wait();
    return;
  }
  if (tid >= kBM) {
    const int m = tid - kBM;
    tokbuf[m] = m >= cur.mrows       ? 0
                : cur.start == guess ? spec
                                     : p.meta.sorted_token_indices[cur.start + m];
  }
  __syncthreads();
  trace_at<kTrace>(p.trace, 3);
  issue_y(p, cur, ybuf, tokbuf, tid);
  issue_b<T, kSteps>(p, cur, bs, tid);
  cp_async_commit();
  // Under PDL (after the prefill shrink) the first item's y and B fly while the shrink finishes: y
  // was written before the shrink started (the shrink is launched without PDL and this grid only
  // once every shrink CTA has started), B and the metadata before that. The intermediate is the
  // shrink's.
  if (p.pdl) pdl_wait();
  // The A fragments and the (tile, slice) they hold (none yet).
  uint32_t af[kSteps][4];
  int af_tile = -1;
  int af_s = -1;
  // Item k of the run uses y tile k % 2. Token sets: consecutive items of one tile (most of a
  // run: consecutive column tiles) share theirs, loaded once; a new tile takes the next of
  // kTokSets sets. The set written for item k + 1 was last read by an item at most k - 2 (the
  // sets in between belong to item k's tile and the one before), whose stores every thread
  // finished before item k - 1's first barrier.
  int yb = 0;
  int ts = 0;
  bool first_item = true;
  while (cur.index < last) {
    const Item nxt = next_item(p, t, cur.index + 1, last);
    const bool has_next = nxt.index < last;
    const bool new_rows = has_next && nxt.tile != cur.tile;
    const int ts_next = !new_rows ? ts : ts + 1 == kTokSets ? 0 : ts + 1;
    T* ys = ybuf + yb * kBM * kYPitch;
    T* ys_next = ybuf + (yb ^ 1) * kBM * kYPitch;
    const int* tok = tokbuf + ts * kBM;
    int* tok_next = tokbuf + ts_next * kBM;
    if (new_rows) load_tokens(p, nxt, tok_next, tid);
    __syncthreads();  // the next item's token indices; the other y tile's stores are done
    if (has_next) issue_y(p, nxt, ys_next, tok_next, tid);
    cp_async_commit();
    // This item's y and B (the next y may still fly). New rows or slice (uniform over the
    // CTA): the intermediate's loads fly with the copies. The wait is written in both branches
    // so that the old fragments and the new loads are never live together (they spilled).
    if (cur.tile != af_tile || cur.s != af_s) {
      InRaw<kSteps> raw;
      issue_in(p, cur, tok, warp, lane, raw);
      cp_async_wait<1>();
      __syncthreads();
      in_frags<T, kSteps>(p, raw, cur.rank, lane, af);
      af_tile = cur.tile;
      af_s = cur.s;
    } else {
      cp_async_wait<1>();
      __syncthreads();
    }
    if (first_item) trace_at<kTrace>(p.trace, 4);
    first_item = false;
    float acc[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const bool warp_has_rows = warp * 16 < cur.mrows;
    if (warp_has_rows && cur.rank > 0) {
      if (cur.ncols == kBN) {
        multiply<T, kSteps, true>(cur, bs, af, acc, lane);
      } else {
        multiply<T, kSteps, false>(cur, bs, af, acc, lane);
      }
    }
    __syncthreads();  // every warp is done with B
    if (has_next) issue_b<T, kSteps>(p, nxt, bs, tid);
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

Status launch_expand_pipelined(const ExpandPlan& plan, const ExpandArgs& a,
                               const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_items(plan));
  const ExpandTileParams p = expand_tile_params(plan, a, meta);
  auto run = [&](auto kernel) -> Status {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(plan.grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attr[1] = {pdl_launch_attribute()};
    cfg.attrs = attr;
    cfg.numAttrs = plan.pdl ? 1 : 0;
    LORAPLEX_RETURN_IF_ERROR(
        cuda_status(cudaLaunchKernelEx(&cfg, kernel, p), "expand_pipe_kernel launch"));
    return launch_status("expand_pipe_kernel");
  };
  // Two shapes: rank <= 16 (one rank step, 39 KB of shared memory) and <= 64 (four, 52 KB).
  const bool small = plan.steps == 1;
  if (a.dtype != DType::kBF16) {
    return small ? run(&expand_pipe_kernel<f16, 1, false>)
                 : run(&expand_pipe_kernel<f16, 4, false>);
  }
  // The traced instantiations only for bf16 (the benchmark's dtype) while tracing.
  if (p.trace != nullptr) {
    return small ? run(&expand_pipe_kernel<bf16, 1, true>)
                 : run(&expand_pipe_kernel<bf16, 4, true>);
  }
  return small ? run(&expand_pipe_kernel<bf16, 1, false>)
               : run(&expand_pipe_kernel<bf16, 4, false>);
}

}  // namespace loraplex::kernels::cuda
