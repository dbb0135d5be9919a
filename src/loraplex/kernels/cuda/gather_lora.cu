// One LoRA layer for decode-sized batches as TWO short kernels chained with programmatic
// dependent launch (PDL): the BGMV form, by token slot, with no work lists.
//
// Why: at decode sizes a layer moves a few MB, which takes about a microsecond at copy
// bandwidth, and what costs the time is the chain of dependent steps each warp walks through
// (~300 cycles per dependent memory access, ~17 cycles between two
// instructions of one warp when they depend on each other). So both kernels here keep that
// chain as short as it can be: a CTA reads its tokens' slots, the slot's rank, and then issues
// every load of its weights at once; no work lists, no barriers across CTAs.
//
//   gather_shrink: CTA (group of consecutive tokens of the sorted order, slice x 16- or 8-row
//     rank group, 1024-wide K chunk). Tokens of one slot are adjacent in the sorted
//     order, so a group usually shares one slot and loads its A rows once. The arithmetic is FMA
//     (each thread 8 consecutive K of every row, a butterfly reduction) or, where tokens share
//     slots, tensor cores (lane (g, t) loads 64 of its K of A rows g and g + 8 and of token
//     g's x row straight into mma fragments: the K-order trick); the four warps are summed
//     through shared memory and the K-chunk partial sums go to the metadata's scratch
//     [k_chunk][slice][token][rank].
//   gather_expand: CTA (token, 512 columns of one slice), launched with PDL so that it starts
//     while the shrink runs: its slot, rank, y values and B columns (the first 16 ranks in
//     registers, up to 64 in shared memory where the SMs allow: ExpandMode) are loaded BEFORE
//     griddepcontrol.wait; after it, the partial sums are added (fixed order), scaled and
//     rounded to the weight dtype (as the other paths and vLLM do), and each thread adds the
//     dot products of its 4 columns to y.
// Across layers (layer_pdl): the shrink may itself be launched with PDL. It then waits before
// it reads anything and only then lets the expand launch, so everything before the layer is
// complete when the expand reads y and the weights before its own wait; the expand lets the
// next layer's first kernel launch at its start. Per-CTA timelines of both kernels in the kTrace
// instantiations (`loraplex bench kernels --trace`).
// A token with slot -1, and a slice whose rank is 0 for the token's slot, leave y untouched.
// Ranks past a slot's rank are never loaded or are masked (their values may be anything).

#include <type_traits>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"

namespace loraplex::kernels::cuda {
namespace {

using namespace gather_kernel;
constexpr int kWarps = kThreads / 32;

struct GatherParams {
  const int32_t* mapping;
  const int32_t* sorted;  // tokens stably sorted by slot (the batch metadata's)
  const int32_t* ranks;   // [num_slices, max_loras]
  int max_loras;
  int max_rank;
  int a_slot_rows;  // rows of A between slots (ShrinkArgs::a_slot_rows)
  int num_slices;
  int num_tokens;
  int k_chunks;
  bool early;  // the shrink's metadata and A rows are read before its wait (see there)
  // With early: the shrink lets the expand launch at its start, the expand reads y after its
  // wait and lets the next kernel launch only then (see the expand).
  bool launch_first;
  float* partial;  // [k_chunks][num_slices][num_tokens][max_rank]
  float scale;
  // shrink
  const void* x;
  int64_t x_stride;
  int64_t hidden;
  const void* a[kMaxSlices];
  // expand
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t y_col[kMaxSlices];
  int chunk_begin[kMaxSlices + 1];  // prefix of 512-column chunks per slice
  void* y;
  int64_t y_stride;
  uint64_t* trace_shrink;  // per-CTA timelines (kernel_trace.h) in the kTrace instantiations
  uint64_t* trace_expand;
};

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const float (&x)[8]) {
  float av[8];
  unpack8<T>(a, av);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(av[i], x[i], s);
  return s;
}

// One butterfly step over 2 * W values: lanes with lane bit BIT set keep the upper W (adding
// the partner's upper W), the others the lower W.
template <int W, int BIT, int N>
__device__ __forceinline__ void butterfly_step(float (&v)[N], int lane) {
  const bool upper = (lane & BIT) != 0;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float send = upper ? v[j] : v[j + W];
    const float keep = upper ? v[j + W] : v[j];
    v[j] = keep + __shfl_xor_sync(kFullMask, send, BIT);
  }
}

/// Butterfly over 16 values: afterwards every lane holds the warp sum of value lane / 2
/// (16 shuffles instead of 16 full warp reductions).
__device__ __forceinline__ float transpose_reduce16(float (&v)[16], int lane) {
  butterfly_step<8, 16>(v, lane);
  butterfly_step<4, 8>(v, lane);
  butterfly_step<2, 4>(v, lane);
  butterfly_step<1, 2>(v, lane);
  return v[0] + __shfl_xor_sync(kFullMask, v[0], 1);
}

/// The same over 8 values: afterwards lanes 4i .. 4i + 3 hold the warp sum of value i.
__device__ __forceinline__ float transpose_reduce8(float (&v)[8], int lane) {
  butterfly_step<4, 16>(v, lane);
  butterfly_step<2, 8>(v, lane);
  butterfly_step<1, 4>(v, lane);
  const float s = v[0] + __shfl_xor_sync(kFullMask, v[0], 2);
  return s + __shfl_xor_sync(kFullMask, s, 1);
}

// kGroup: consecutive tokens of the sorted order per CTA (1: token blockIdx.x itself, no
// sorted lookup). The tokens of one slot are adjacent in the sorted order, so a group usually
// shares one slot and its A rows are loaded once for all of its tokens (the A traffic through
// L2 shrinks by kGroup); a group that straddles slots is processed one slot at a time.
// The K-chunk partial sums of one slot's tokens (`mine`, a mask over the group) with FMA: each
// thread takes 8 consecutive K of the group's kRows A rows and of the tokens' x rows, and a
// butterfly leaves lane l with row l / 2 of each token (l / 4 with 8 rows); red[warp][token][row]
// gets the warp's sums.
// kPinned: the A loads in volatile asm, so that they are issued before before_x (a plain
// read-only load may be sunk past it to its use).
template <typename T, int kGroup, int kRows, bool kPinned, typename BeforeX>
__device__ __forceinline__ void shrink_fma(const GatherParams& p, const T* arow, int rows,
                                           unsigned mine, const int (&tok)[kGroup], int kc,
                                           float (*red)[kGroup][kRows], BeforeX before_x) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t k = static_cast<int64_t>(kc) * kKChunk + tid * 8;
  float acc[kGroup][kRows];
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[j][i] = 0.0f;
  }
  if (k < p.hidden) {
    uint4 av[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const T* src = arow + i * p.hidden + k;
      av[i] = i >= rows ? make_uint4(0, 0, 0, 0) : kPinned ? ldg16_now(src) : ldg16(src);
    }
    before_x();  // a thread past K waits at the kernel's end
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if ((mine >> j) & 1u) {
        const uint4 xv = ldcg16_now(static_cast<const T*>(p.x) + tok[j] * p.x_stride + k);
        float xf[8];
        unpack8<T>(xv, xf);
#pragma unroll
        for (int i = 0; i < kRows; ++i) acc[j][i] = dot8<T>(av[i], xf);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    if ((mine >> j) & 1u) {  // the same in every thread: the shuffles stay converged
      if constexpr (kRows == 16) {
        const float sum = transpose_reduce16(acc[j], lane);
        if ((lane & 1) == 0) red[warp][j][lane >> 1] = sum;
      } else {
        const float sum = transpose_reduce8(acc[j], lane);
        if ((lane & 3) == 0) red[warp][j][lane >> 2] = sum;
      }
    }
  }
}

// The same partial sums on tensor cores: each warp takes 256 of K; lane (g, t) holds A rows g
// and g + 8 and token g's x row. The K-order trick: lane t loads k = 32m + 8t .. 32m + 8t + 7
// (m = 0..7) of the warp's 256, and 4 of them at a time are, for the mma, its k = 2t, 2t + 1,
// 2t + 8, 2t + 9 of one of 16 steps; x and A use the same order, so the sum is unchanged,
// every load is a plain 16-byte load into registers, and the 4 lanes of a row read 64
// contiguous bytes per load. Fewer instructions and registers than shrink_fma, one extra
// barrier.
template <typename T, int kGroup, int kRows, typename BeforeX>
__device__ __forceinline__ void shrink_mma(const GatherParams& p, const T* arow, int rows,
                                           unsigned mine, const int (&tok)[kGroup], int kc,
                                           float (*red)[kGroup][kRows], BeforeX before_x) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2;  // mma group: A rows g and g + 8, token g of the group
  const int t = lane & 3;
  const int64_t k = static_cast<int64_t>(kc) * kKChunk + warp * 256 + t * 8;
  int my_tok = tok[0];
#pragma unroll
  for (int j = 1; j < kGroup; ++j) my_tok = g == j ? tok[j] : my_tok;
  // The same in the whole warp (mma.sync needs every lane): this warp's K is in range.
  const bool warp_in = k - t * 8 < p.hidden;
  constexpr int kHalves = kRows / 8;
  uint4 av[kHalves][8];  // A rows g and g + 8 (zero past the rank)
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    const T* row = arow + (g + 8 * h) * p.hidden + k;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const bool in = warp_in && g + 8 * h < rows && k + 32 * m < p.hidden;
      av[h][m] = in ? ldg16_now(row + 32 * m) : make_uint4(0, 0, 0, 0);
    }
  }
  before_x();
  uint4 xv[8];  // token g of the group when it has this slot, else zero
  const bool has_x = warp_in && g < kGroup && ((mine >> g) & 1u) != 0;
  const T* xrow = static_cast<const T*>(p.x) + (has_x ? my_tok : 0) * p.x_stride + k;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    xv[m] = has_x && k + 32 * m < p.hidden ? ldcg16_now(xrow + 32 * m) : make_uint4(0, 0, 0, 0);
  }
  // A scheduling fence: every load above is issued before the first mma waits for one (left
  // alone, ptxas sinks each load next to its mma to save registers: a round trip per step).
  __syncthreads();
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  if (warp_in) {
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const uint4& x4 = xv[q >> 1];
      const uint32_t xa[4] = {(q & 1) ? x4.z : x4.x, 0u, (q & 1) ? x4.w : x4.y, 0u};
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint4& a4 = av[h][q >> 1];
        const uint32_t bf[2] = {(q & 1) ? a4.z : a4.x, (q & 1) ? a4.w : a4.y};
        mma_16816<T>(acc[h], xa, bf);
      }
    }
  }
  // acc[h][0..1]: token g, rows 8h + 2t and 8h + 2t + 1 of the group's kRows.
  if (g < kGroup && ((mine >> g) & 1u) != 0) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      red[warp][g][8 * h + 2 * t] = acc[h][0];
      red[warp][g][8 * h + 2 * t + 1] = acc[h][1];
    }
  }
}

// kGroup: consecutive tokens of the sorted order per CTA (1: token blockIdx.x itself, no
// sorted lookup). The tokens of one slot are adjacent in the sorted order, so a group usually
// shares one slot and its A rows are loaded once for all of its tokens (the A traffic through
// L2 shrinks by kGroup); a group that straddles slots is processed one slot at a time.
template <typename T, int kGroup, bool kMma, bool kTrace, bool kEarly, int kRows>
__global__ void __launch_bounds__(kThreads) gather_shrink_kernel(GatherParams p) {
  trace_at<kTrace>(p.trace_shrink, 0);
  trace_at<kTrace>(p.trace_shrink, 1);
  // Launched with PDL (layer_pdl): the kernel before it may still run until pdl_wait returns
  // (without PDL it returns at once). Nothing is read before the wait, except with p.early
  // (settled metadata: LoraMetaView::settled) the token indices and the slots, and up to rank 16
  // (kEarly) the slots' ranks and A rows: the wait then sits between the A and the x loads
  // (before_x), and the chain after it is the x rows alone. The expand may start after the
  // wait (it reads y and the weights before its own wait, which must be final by then), or with
  // launch_first at once (it then reads only the metadata and B before its wait).
  if (p.launch_first) pdl_launch_dependents();
  bool waited = false;
  auto wait_once = [&]() {
    if (!waited) {
      pdl_wait_then_launch_dependents();
      trace_at<kTrace>(p.trace_shrink, 2);
      waited = true;
    }
  };
  if (!p.early) wait_once();
  const int groups = (p.max_rank + kRows - 1) / kRows;
  const int s = static_cast<int>(blockIdx.y) / groups;
  const int r0 = (static_cast<int>(blockIdx.y) % groups) * kRows;
  const int kc = static_cast<int>(blockIdx.z);
  const int first = static_cast<int>(blockIdx.x) * kGroup;
  int tok[kGroup];
  int slot_of[kGroup];
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    const int pos = first + j;
    tok[j] = pos >= p.num_tokens ? -1 : kGroup == 1 ? pos : p.sorted[pos];
  }
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    const int slot = tok[j] >= 0 ? p.mapping[tok[j]] : -1;
    slot_of[j] = valid_slot(slot, p.max_loras) ? slot : -1;
  }
  const int tid = static_cast<int>(threadIdx.x);
  __shared__ float red[kWarps][kGroup][kRows];
  unsigned done = 0;  // tokens of the group already processed (the same in every thread)
#pragma unroll
  for (int j0 = 0; j0 < kGroup; ++j0) {
    const int slot = slot_of[j0];
    if (slot < 0 || ((done >> j0) & 1u) != 0) continue;
    unsigned mine = 0;  // the group's tokens of this slot
#pragma unroll
    for (int j = 0; j < kGroup; ++j) mine |= slot_of[j] == slot ? 1u << j : 0u;
    done |= mine;
    // Up to max_rank 16 the A rows are loaded before the slot's rank arrives, one round trip
    // less in the chain (a row's sums depend on that row only; rows past the rank are not
    // written): faster at rank 16, slower at rank 64, which waits (docs/decisions.md).
    // Above rank 16 the wait comes before the rank (only the metadata is read before it): an
    // empty before_x keeps the compiler's own load order there (one token per CTA: 48 registers,
    // against 163 with every A load issued before a wait).
    if constexpr (!kEarly) wait_once();
    const int rank = p.ranks[s * p.max_loras + slot];
    if (!kEarly && r0 >= rank) continue;
    const int rows_ld = min(kRows, (kEarly ? p.max_rank : rank) - r0);
    const T* arow = static_cast<const T*>(p.a[s]) +
                    (static_cast<int64_t>(slot) * p.a_slot_rows + r0) * p.hidden;
    auto before_x = [&]() {
      if constexpr (kEarly) wait_once();
    };
    if constexpr (kMma) {
      shrink_mma<T, kGroup, kRows>(p, arow, rows_ld, mine, tok, kc, red, before_x);
    } else {
      shrink_fma<T, kGroup, kRows, kEarly>(p, arow, rows_ld, mine, tok, kc, red, before_x);
    }
    __syncthreads();
    trace_at<kTrace>(p.trace_shrink, 3);
    if (kEarly && r0 >= rank) continue;  // uniform; nothing reads `red` before the next slot's sums
    trace_at<kTrace>(p.trace_shrink, 5);
    const int rows = min(kRows, rank - r0);
    if (tid < kGroup * kRows) {
      const int j = tid / kRows;
      const int r = tid % kRows;
      if (((mine >> j) & 1u) != 0 && r < rows) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += red[w][j][r];
        p.partial[((static_cast<int64_t>(kc) * p.num_slices + s) * p.num_tokens + tok[j]) *
                      p.max_rank +
                  r0 + r] = v;
      }
    }
    __syncthreads();  // `red` is free for the next slot of the group
  }
  // Every CTA waits before it exits: this grid's completion, which the expand's wait (and so
  // the next layer) relies on, must imply that the kernel before it has finished.
  wait_once();
  trace_at<kTrace>(p.trace_shrink, 4);
}

// One token per CTA: grouping tokens here measured slower (a group that straddles two slots
// serialises its second slot's B loads behind the first one's work). 4 columns per thread.
// How the expand holds B's ranks before its wait (kPreRanks in registers in every mode):
// kRegs (max_rank <= kPreRanks) unpacks them all to fp32 before the wait, so that after it
// only the sums, the FMAs and the store are left (one warp's instructions after the wait are
// on the layer's critical path, as the kernel timelines show; measured at rank 16 only,
// docs/decisions.md). kStaged (max_rank <= kStagedRanks,
// where each CTA of the pair gets an SM of its own: the planner says why) copies ranks
// kPreRanks.. into shared memory with cp.async before the wait;
// kLoop loads them after the wait, 8 ranks at a time, one dependent round trip each.
enum ExpandMode { kLoop = 0, kRegs = 1, kStaged = 2 };

template <typename T, bool kTrace, int kMode>
__global__ void __launch_bounds__(kThreads) gather_expand_kernel(GatherParams p) {
  constexpr bool kSmall = kMode == kRegs;
  // kStaged: [chunk][column of the thread][thread], 16 bytes each (conflict-free reads).
  extern __shared__ __align__(16) uint4 staged[];
  trace_at<kTrace>(p.trace_expand, 0);
  trace_at<kTrace>(p.trace_expand, 5);
  constexpr int kColsPerCta = kThreads * kColsPerThread;
  __shared__ __align__(16) float inter[kMaxRank];
  // The next layer's first kernel (layer_pdl) may launch now: it waits for this grid before
  // it reads anything. With launch_first this grid may have started before the kernel ahead
  // of the layer finished: then it reads only the metadata and B before its wait, lets the next
  // kernel launch after it, and waits before it exits in any case (a grid that completed
  // without waiting would let the next kernel's wait return too early).
  if (!p.launch_first) pdl_launch_dependents();
  auto leave = [&]() {
    if (p.launch_first) pdl_wait();
  };
  const int t = static_cast<int>(blockIdx.x);
  const int u = static_cast<int>(blockIdx.y);
  const int slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras)) return leave();
  int s = 0;
  while (u >= p.chunk_begin[s + 1]) ++s;
  const int rank = p.ranks[s * p.max_loras + slot];
  if (rank == 0) return leave();
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t c = static_cast<int64_t>(u - p.chunk_begin[s]) * kColsPerCta + tid * kColsPerThread;
  const bool active = c < p.width[s];  // widths are multiples of kColsPerThread
  T* yp = static_cast<T*>(p.y) + t * p.y_stride + p.y_col[s] + c;
  const T* bp = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + c) * p.max_rank;
  // Loads that do not depend on the shrink: y and the first ranks of the 4 B columns.
  uint2 yv = make_uint2(0, 0);
  uint4 bv[kColsPerThread][kPreRanks / 8];
  const int pre = min(rank, kPreRanks);
  if (active) {
    if (!p.launch_first) yv = *reinterpret_cast<const uint2*>(yp);
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
#pragma unroll
      for (int q = 0; q < kPreRanks / 8; ++q) {
        bv[j][q] = q * 8 < pre ? ldg16(bp + j * p.max_rank + q * 8) : make_uint4(0, 0, 0, 0);
      }
    }
  }
  if constexpr (kMode == kStaged) {
    if (active) {
#pragma unroll
      for (int q = 0; q < kStagedChunks; ++q) {
        const int r0 = kPreRanks + 8 * q;
#pragma unroll
        for (int j = 0; j < kColsPerThread; ++j) {
          const int bytes = 2 * max(0, min(8, rank - r0));  // zero-filled past the rank
          cp_async16(&staged[(q * kColsPerThread + j) * kThreads + tid],
                     bp + j * p.max_rank + (bytes > 0 ? r0 : 0), bytes);
        }
      }
    }
    cp_async_commit();
  }
  // kSmall: B as fp32 [rank][column], ranks past the slot's rank zeroed (B may hold anything
  // there, NaN included), and y, unpacked here before the wait; empty asm that takes the values
  // keeps them here (left alone, the compiler moves the unpacking next to the FMAs).
  float bf[kSmall ? kPreRanks : 1][kColsPerThread];
  float yf[kColsPerThread];
  auto unpack_y = [&]() {
    const float2 y01 = unpack2<T>(yv.x);
    const float2 y23 = unpack2<T>(yv.y);
    yf[0] = y01.x;
    yf[1] = y01.y;
    yf[2] = y23.x;
    yf[3] = y23.y;
  };
  if constexpr (kSmall) {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
#pragma unroll
      for (int q = 0; q < kPreRanks / 8; ++q) {
        float v[8];
        unpack8<T>(bv[j][q], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) bf[q * 8 + i][j] = q * 8 + i < pre ? v[i] : 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < kPreRanks; ++r) {
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) asm volatile("" : "+f"(bf[r][j]));
    }
    unpack_y();
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) asm volatile("" : "+f"(yf[j]));
  }
  pdl_wait();  // the shrink grid has finished and its partial sums are visible
  trace_at<kTrace>(p.trace_expand, 6);
  if (p.launch_first) {
    pdl_launch_dependents();
    if (active) yv = *reinterpret_cast<const uint2*>(yp);
    if constexpr (kSmall) unpack_y();
  }
  const int64_t kstride = static_cast<int64_t>(p.num_slices) * p.num_tokens * p.max_rank;
  const float* part = p.partial + (static_cast<int64_t>(s) * p.num_tokens + t) * p.max_rank;
  for (int r = tid; r < rank; r += kThreads) {
    float v = 0.0f;
#pragma unroll 4
    for (int kc = 0; kc < p.k_chunks; ++kc) v += __ldcg(part + kc * kstride + r);
    inter[r] = to_float(from_float<T>(p.scale * v));  // rounded as the other paths round it
  }
  if (kSmall && tid >= rank && tid < kPreRanks) inter[tid] = 0.0f;  // times the zeroed B ranks
  __syncthreads();
  if (!active) return;
  float acc[kColsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (kSmall) {
    // Every rank from the registers, four at a time from shared memory.
#pragma unroll
    for (int q = 0; q < kPreRanks / 4; ++q) {
      const float4 iv = reinterpret_cast<const float4*>(inter)[q];
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        acc[j] = fmaf(iv.x, bf[4 * q][j], acc[j]);
        acc[j] = fmaf(iv.y, bf[4 * q + 1][j], acc[j]);
        acc[j] = fmaf(iv.z, bf[4 * q + 2][j], acc[j]);
        acc[j] = fmaf(iv.w, bf[4 * q + 3][j], acc[j]);
      }
    }
  } else {
    // Ranks 0..15 from the registers loaded before the wait, masked past the slot's rank; then
    // the higher ranks, 8 at a time for all four columns.
#pragma unroll
    for (int q = 0; q < kPreRanks / 8; ++q) {
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        float v[8];
        unpack8<T>(bv[j][q], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (q * 8 + i < pre) acc[j] = fmaf(inter[q * 8 + i], v[i], acc[j]);
        }
      }
    }
    if constexpr (kMode == kStaged) cp_async_wait<0>();  // this thread's own copies
    for (int r0 = kPreRanks; r0 < rank; r0 += 8) {
      uint4 hv[kColsPerThread];
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        hv[j] = kMode == kStaged
                    ? staged[((r0 - kPreRanks) / 8 * kColsPerThread + j) * kThreads + tid]
                    : ldg16(bp + j * p.max_rank + r0);
      }
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        float v[8];
        unpack8<T>(hv[j], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (r0 + i < rank) acc[j] = fmaf(inter[r0 + i], v[i], acc[j]);
        }
      }
    }
  }
  if constexpr (!kSmall) unpack_y();
  *reinterpret_cast<uint2*>(yp) = make_uint2(pack2<T>(yf[0] + acc[0], yf[1] + acc[1]),
                                             pack2<T>(yf[2] + acc[2], yf[3] + acc[3]));
  trace_at<kTrace>(p.trace_expand, 7);
}

// The shrink with PDL where the plan says so, the expand always (it waits for the shrink's sums).
// While a trace buffer is set (bf16 only, the benchmark's dtype), the kTrace instantiations:
// the shrink's CTAs first, then the expand's.
template <typename T, int kGroup, bool kMma, int kRows>
Status launch_pair(const GatherPlan& plan, GatherParams p, StreamHandle stream) {
  cudaLaunchAttribute attr[1] = {pdl_launch_attribute()};
  cudaLaunchConfig_t shrink_cfg = {};
  shrink_cfg.gridDim = dim3(plan.shrink_grid[0], plan.shrink_grid[1], plan.shrink_grid[2]);
  shrink_cfg.blockDim = dim3(kThreads);
  shrink_cfg.stream = static_cast<cudaStream_t>(stream);
  shrink_cfg.attrs = attr;
  shrink_cfg.numAttrs = plan.shrink_pdl ? 1 : 0;
  cudaLaunchConfig_t expand_cfg = shrink_cfg;
  expand_cfg.gridDim = dim3(plan.expand_grid[0], plan.expand_grid[1]);
  expand_cfg.dynamicSmemBytes = static_cast<size_t>(plan.expand_smem);
  expand_cfg.numAttrs = 1;
  auto run = [&](auto shrink, auto expand) -> Status {
    if (plan.expand_smem > 0) {  // the static `inter` counts toward the opt-in above 48 KB
      LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(expand),
                                                  plan.expand_smem + kMaxRank * 4));
    }
    LORAPLEX_RETURN_IF_ERROR(
        cuda_status(cudaLaunchKernelEx(&shrink_cfg, shrink, p), "gather_shrink"));
    LORAPLEX_RETURN_IF_ERROR(launch_status("gather_shrink_kernel"));
    LORAPLEX_RETURN_IF_ERROR(
        cuda_status(cudaLaunchKernelEx(&expand_cfg, expand, p), "gather_expand"));
    return launch_status("gather_expand_kernel");
  };
  // kRegs (up to rank 16) goes with the shrink that loads its A rows before the rank.
  auto pick = [&](auto trace) -> Status {
    constexpr bool kT = decltype(trace)::value;
    switch (plan.mode) {
      case GatherExpandMode::kRegs:
        return run(gather_shrink_kernel<T, kGroup, kMma, kT, true, kRows>,
                   gather_expand_kernel<T, kT, kRegs>);
      case GatherExpandMode::kStaged:
        return run(gather_shrink_kernel<T, kGroup, kMma, kT, false, kRows>,
                   gather_expand_kernel<T, kT, kStaged>);
      default:
        return run(gather_shrink_kernel<T, kGroup, kMma, kT, false, kRows>,
                   gather_expand_kernel<T, kT, kLoop>);
    }
  };
  p.trace_shrink = kernel_trace();
  if constexpr (std::is_same_v<T, bf16>) {
    if (p.trace_shrink != nullptr) {
      const int64_t shrink_ctas =
          int64_t{plan.shrink_grid[0]} * plan.shrink_grid[1] * int64_t{plan.shrink_grid[2]};
      p.trace_expand = p.trace_shrink + shrink_ctas * kTraceSlots;
      return pick(std::true_type{});
    }
  }
  return pick(std::false_type{});
}

template <typename T, bool kMma, int kRows>
Status launch_group(const GatherPlan& plan, const GatherParams& p, StreamHandle stream) {
  if (plan.group == 1) return launch_pair<T, 1, kMma, kRows>(plan, p, stream);
  return launch_pair<T, 2, kMma, kRows>(plan, p, stream);
}

template <typename T>
Status launch_kind(const GatherPlan& plan, const GatherParams& p, StreamHandle stream) {
  if (plan.rows == 8) {
    return plan.mma ? launch_group<T, true, 8>(plan, p, stream)
                    : launch_group<T, false, 8>(plan, p, stream);
  }
  return plan.mma ? launch_group<T, true, 16>(plan, p, stream)
                  : launch_group<T, false, 16>(plan, p, stream);
}

}  // namespace

Status launch_gather(const GatherPlan& plan, const ShrinkArgs& s, const ExpandArgs& e,
                     const LoraMetaView& meta, StreamHandle stream) {
  GatherParams p{};
  p.mapping = meta.token_lora_mapping;
  p.sorted = meta.sorted_token_indices;
  p.ranks = s.ranks;
  p.max_loras = s.max_loras;
  p.max_rank = s.max_rank;
  p.a_slot_rows = a_slot_rows(s);
  p.num_slices = s.num_slices;
  p.num_tokens = static_cast<int>(s.num_tokens);
  p.k_chunks = plan.k_chunks;
  p.early = plan.early;
  p.launch_first = plan.launch_first;
  p.partial = meta.scratch;
  p.scale = s.scale;
  p.x = s.x;
  p.x_stride = s.x_row_stride;
  p.hidden = s.hidden;
  int64_t col = e.offset_start;
  for (int i = 0; i < s.num_slices; ++i) {
    p.a[i] = s.lora_a[i];
    p.b[i] = e.lora_b[i];
    p.width[i] = e.slice_width[i];
    p.y_col[i] = col;
    col += e.slice_width[i];
  }
  for (int i = 0; i <= s.num_slices; ++i) p.chunk_begin[i] = plan.chunk_begin[i];
  p.y = e.y;
  p.y_stride = e.y_row_stride;
  if (s.dtype == DType::kBF16) return launch_kind<bf16>(plan, p, stream);
  return launch_kind<f16>(plan, p, stream);
}

}  // namespace loraplex::kernels::cuda
