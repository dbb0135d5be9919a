// Shrink and expand on CUDA: the generic kernels (any dtype, any strides; also the BGMV
// forms) and the tensor-core expand that takes one work item at a time (expand_items.cuh: one
// 64-token tile of one active slot x one 128-column tile of one slice, all slices in one
// launch), for max_rank above the pipelined expand's 64. Each slot costs its own rank: B columns
// and MMA steps past a slot's rank are never loaded or computed. Operands are staged with
// cp.async (zero-filled past the valid bytes), multiplied with mma.sync m16n8k16 into fp32 (the
// intermediate rounded to the weight dtype first, as vLLM does), and y is read, added and written
// with 16-byte accesses through shared memory.

#include <algorithm>
#include <limits>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/expand_items.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"

namespace loraplex::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------

// Generic kernels.

struct GenericShrinkParams {
  const void* x;
  int64_t x_stride;
  int64_t hidden;
  const void* a[kMaxSlices];
  int max_loras;
  int max_rank;
  int a_slot_rows;  // rows of A between slots (ShrinkArgs::a_slot_rows)
  const int32_t* ranks;
  const int32_t* mapping;
  float scale;
  void* out;
  int64_t num_tokens;
};

// One block per (token, slice); each warp computes whole rank rows (dot over hidden).
template <typename T, typename OutT>
__global__ void __launch_bounds__(kGenericThreads) shrink_generic_kernel(GenericShrinkParams p) {
  const int64_t t = blockIdx.x;
  const int s = static_cast<int>(blockIdx.y);
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras)) return;
  const int rank = p.ranks[s * p.max_loras + slot];
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride;
  const T* a =
      static_cast<const T*>(p.a[s]) + static_cast<int64_t>(slot) * p.a_slot_rows * p.hidden;
  OutT* out = static_cast<OutT*>(p.out) + (static_cast<int64_t>(s) * p.num_tokens + t) * p.max_rank;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int r = warp; r < rank; r += kGenericThreads / 32) {
    const T* row = a + static_cast<int64_t>(r) * p.hidden;
    float acc = 0.0f;
    for (int64_t k = lane; k < p.hidden; k += 32) acc += to_float(x[k]) * to_float(row[k]);
    acc = warp_sum(acc);
    if (lane == 0) out[r] = from_float<OutT>(p.scale * acc);
  }
}

struct GenericExpandParams {
  const void* in;
  int num_slices;
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t col_begin[kMaxSlices + 1];  // prefix of widths; col_begin[num_slices] = total
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  const int32_t* mapping;
  void* y;
  int64_t y_stride;
  int64_t offset_start;
  bool add_inputs;
  int64_t num_tokens;
};

// One thread per output column of one token.
template <typename T, typename InT>
__global__ void __launch_bounds__(kGenericThreads) expand_generic_kernel(GenericExpandParams p) {
  const int64_t t = blockIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras) || col >= p.col_begin[p.num_slices]) return;
  int s = 0;
  while (col >= p.col_begin[s + 1]) ++s;
  const int64_t j = col - p.col_begin[s];
  const int rank = p.ranks[s * p.max_loras + slot];
  const InT* in = static_cast<const InT*>(p.in) + (s * p.num_tokens + t) * p.max_rank;
  const T* b = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + j) * p.max_rank;
  float acc = 0.0f;
  for (int r = 0; r < rank; ++r) acc += to_float(in[r]) * to_float(b[r]);
  T* y = static_cast<T*>(p.y) + t * p.y_stride + p.offset_start + col;
  if (p.add_inputs) acc += to_float(*y);
  *y = from_float<T>(acc);
}

GenericExpandParams generic_expand_params(const ExpandArgs& a, const int32_t* mapping) {
  GenericExpandParams p{};
  p.in = a.in;
  p.num_slices = a.num_slices;
  p.col_begin[0] = 0;
  for (int s = 0; s < a.num_slices; ++s) {
    p.b[s] = a.lora_b[s];
    p.width[s] = a.slice_width[s];
    p.col_begin[s + 1] = p.col_begin[s] + a.slice_width[s];
  }
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.ranks = a.ranks;
  p.mapping = mapping;
  p.y = a.y;
  p.y_stride = a.y_row_stride;
  p.offset_start = a.offset_start;
  p.add_inputs = a.add_inputs;
  p.num_tokens = a.num_tokens;
  return p;
}

}  // namespace

Status launch_shrink_generic(const ShrinkArgs& a, const int32_t* mapping, StreamHandle stream) {
  GenericShrinkParams p{};
  p.x = a.x;
  p.x_stride = a.x_row_stride;
  p.hidden = a.hidden;
  for (int s = 0; s < a.num_slices; ++s) p.a[s] = a.lora_a[s];
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.a_slot_rows = a_slot_rows(a);
  p.ranks = a.ranks;
  p.mapping = mapping;
  p.scale = a.scale;
  p.out = a.out;
  p.num_tokens = a.num_tokens;
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_slices));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.out_dtype == DType::kF32) {
      shrink_generic_kernel<T, float><<<grid, kGenericThreads, 0, s>>>(p);
    } else {
      shrink_generic_kernel<T, T><<<grid, kGenericThreads, 0, s>>>(p);
    }
  });
  return launch_status("shrink_generic_kernel");
}

Status launch_expand_generic(const ExpandArgs& a, const int32_t* mapping, StreamHandle stream) {
  const GenericExpandParams p = generic_expand_params(a, mapping);
  const int64_t total = p.col_begin[a.num_slices];
  const int64_t col_blocks = ceil_div(total, kGenericThreads);
  LORAPLEX_ENSURE(col_blocks <= 65535, "lora_expand: ", total, " output columns exceed the ",
                  65535 * kGenericThreads, " the generic kernel covers");
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(col_blocks));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.in_dtype == DType::kF32) {
      expand_generic_kernel<T, float><<<grid, kGenericThreads, 0, s>>>(p);
    } else {
      expand_generic_kernel<T, T><<<grid, kGenericThreads, 0, s>>>(p);
    }
  });
  return launch_status("expand_generic_kernel");
}

namespace {

// ---------------------------------------------------------------------------------------------
// Tensor-core kernels.

constexpr int kTcThreads = 128;         // 4 warps, 16 token rows each
constexpr int kTcBM = kExpandTileRows;  // tokens per tile
static_assert(kTcThreads == 2 * kTcBM, "threads kTcBM.. write an item's token indices");
constexpr int kTcBK = 64;                   // rank elements per staged chunk
constexpr int kExpandBN = kExpandTileCols;  // output columns per expand item
constexpr int kYPitch = kExpandYPitch;

// One rank chunk (kBK) of a warp's 16 x 128 block. kFull (all 128 columns): straight-line
// code; testing the column count per MMA put a warp-synchronising barrier and a compare before
// every .aligned instruction (the same cost the prefill shrink's pair loop had).
template <typename T, int kBK, bool kFull>
__device__ __forceinline__ void expand_mma(float (&acc)[16][4], const T* a_rows, const T* bs,
                                           int rank_left, int ncols, int lane) {
  constexpr int kPitch = kBK + 8;
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    if (kk >= rank_left) break;
    uint32_t af[4];
    load_a_frag(af, a_rows + kk, kPitch, lane);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (kFull || j * 8 < ncols) {
        uint32_t bfr[2];
        load_b_frag(bfr, bs + j * 8 * kPitch + kk, kPitch, lane);
        mma_16816<T>(acc[j], af, bfr);
      }
    }
  }
}

// The y tile, the intermediate tile, the B tile and the token indices of one item.
constexpr int expand_smem_bytes(int bk) {
  return (kTcBM * kYPitch + kTcBM * (bk + 8) + kExpandBN * (bk + 8)) * 2 + kTcBM * 4;
}
static_assert(expand_smem_bytes(kTcBK) == expand_kernel::tc_fixed_bytes(),
              "the planner's shared memory of the tensor-core expand");

// Four CTAs per SM, the default grid (expand_ctas_per_sm 0): 45 KB of shared memory and ~125
// registers. kBK ranks per staged chunk (64: any rank, in chunks); the launcher instantiates 64,
// for the ranks above the pipelined expand's.
template <typename T, int kBK, bool kTrace>
__global__ void __launch_bounds__(kTcThreads, 4) expand_tc_kernel(ExpandTileParams p) {
  constexpr int kTcPitch = kBK + 8;  // padded rows: fragment loads are bank-conflict free
  constexpr int kChunks = kBK / 8;   // 16-byte chunks per staged row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ys = reinterpret_cast<T*>(smem_raw);
  T* ins = ys + kTcBM * kYPitch;
  T* bs = ins + kTcBM * kTcPitch;
  int* tok = reinterpret_cast<int*>(bs + kExpandBN * kTcPitch);
  int* prefix = tok + kTcBM;
  int* entries = prefix + p.max_loras + 2;            // [3 (max_loras + 1)]: slot, count, start
  int* rank_cache = entries + 3 * (p.max_loras + 1);  // when cache_ranks
  // 16-byte aligned for the int4 copy below (expand_table_bytes leaves room for that).
  int* sorted_cache = reinterpret_cast<int*>(
      (reinterpret_cast<uintptr_t>(rank_cache + (p.cache_ranks ? p.num_slices * p.max_loras : 0)) +
       15) &
      ~uintptr_t{15});
  // The layer's ranks and (small batches) the sorted token indices come with the metadata
  // in the first round trip, so a work item needs no other load before its data.
  // The first item's token indices on a guess (expand_items.cuh), by the threads that write
  // them below (warp 0 scans the metadata); small batches have them all cached instead.
  trace_at<kTrace>(p.trace, 0);
  trace_at<kTrace>(p.trace, 1);
  const int guess = first_item_start_guess(p);
  int spec = 0;
  if (!p.cache_sorted && threadIdx.x >= kTcBM && guess + (threadIdx.x - kTcBM) < p.num_tokens) {
    spec = ld_early(p.meta.sorted_token_indices + guess + (threadIdx.x - kTcBM));
  }
  // Not warp 0: its loads here would be waited for before its metadata loads are issued.
  const int helper = static_cast<int>(threadIdx.x) - 32;
  if (p.cache_ranks) {
    for (int i = helper; i >= 0 && i < p.num_slices * p.max_loras; i += kTcThreads - 32) {
      rank_cache[i] = p.ranks[i];
    }
  }
  if (p.cache_sorted) {
    // Four indices per load (int4), all of a thread's loads before its stores: scalar
    // load-store pairs made the expand slower than with warp 0 helping.
    const int n4 = static_cast<int>(p.num_tokens / 4);
    const int4* src4 = reinterpret_cast<const int4*>(p.meta.sorted_token_indices);
    int4* dst4 = reinterpret_cast<int4*>(sorted_cache);
    constexpr int kHelpers = kTcThreads - 32;
    for (int i0 = helper; i0 >= 0 && i0 < n4; i0 += 4 * kHelpers) {
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (i0 + u * kHelpers < n4) v[u] = __ldg(src4 + i0 + u * kHelpers);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (i0 + u * kHelpers < n4) dst4[i0 + u * kHelpers] = v[u];
      }
    }
    for (int i = 4 * n4 + helper; helper >= 0 && i < p.num_tokens; i += kHelpers) {
      sorted_cache[i] = p.meta.sorted_token_indices[i];
    }
  }
  const int n_entries = build_tile_prefix(p.meta, kTcBM, prefix, entries);
  trace_at<kTrace>(p.trace, 2);
  const int total_nt = p.ntile_begin[p.num_slices];
  const int items = prefix[n_entries] * total_nt;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  T* yg = static_cast<T*>(p.y);

  // Each CTA takes a contiguous run of items: consecutive column tiles of one token tile
  // reuse the gathered token rows and, within a slice, the staged intermediate.
  const int first = run_begin(items, static_cast<int>(blockIdx.x), p.balanced);
  const int last = run_begin(items, static_cast<int>(blockIdx.x) + 1, p.balanced);
  int prev_tile = -1;
  int prev_s = -1;
  for (int item = first; item < last; ++item) {
    const ExpandItem it = expand_item(p, prefix, entries, n_entries, rank_cache, item);
    const int tile = it.tile;
    const int s = it.s;
    const int slot = it.slot;
    const int rank = it.rank;
    if (rank == 0 && p.add_inputs) continue;
    const int64_t n0 = it.n0;
    const int ncols = it.ncols;
    const int mrows = it.mrows;
    const int start = it.start;
    const bool same_rows = tile == prev_tile;
    const bool same_in = same_rows && s == prev_s && rank <= kBK;
    prev_tile = tile;
    prev_s = s;
    __syncthreads();  // the previous item is done with the tiles
    if (!same_rows) {
      if (tid >= kTcBM) {
        const int m = tid - kTcBM;
        tok[m] = m >= mrows       ? 0
                 : p.cache_sorted ? sorted_cache[start + m]
                 : start == guess ? spec
                                  : p.meta.sorted_token_indices[start + m];
      }
      __syncthreads();
      if (item == first) trace_at<kTrace>(p.trace, 3);
    }
    const int64_t ycol = p.y_col[s] + n0;
    if (p.add_inputs) {
      for (int i = tid; i < kTcBM * (kExpandBN / 8); i += kTcThreads) {
        const int row = i / (kExpandBN / 8);
        const int ch = i % (kExpandBN / 8);
        const bool ok = row < mrows && ch * 8 < ncols;
        cp_async16(ys + row * kYPitch + ch * 8,
                   ok ? yg + tok[row] * p.y_stride + ycol + ch * 8 : yg, ok ? 16 : 0);
      }
    }
    float acc[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const T* bg = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + n0) * p.max_rank;
    const bool warp_has_rows = warp * 16 < mrows;
    for (int kb = 0; kb < rank; kb += kBK) {
      if (kb > 0) __syncthreads();  // the previous rank chunk's fragments are consumed
      for (int i = tid; i < kExpandBN * kChunks; i += kTcThreads) {
        const int n = i / kChunks;
        const int ch = i % kChunks;
        const int kvalid = rank - kb - ch * 8;
        const int bytes = (n < ncols && kvalid > 0) ? min(kvalid, 8) * 2 : 0;
        cp_async16(bs + n * kTcPitch + ch * 8, bytes ? bg + n * p.max_rank + kb + ch * 8 : bg,
                   bytes);
      }
      if (same_in) {
        // The intermediate of these rows and this slice is still staged.
      } else if (!p.in_f32) {
        const T* ing = static_cast<const T*>(p.in);
        for (int i = tid; i < kTcBM * kChunks; i += kTcThreads) {
          const int row = i / kChunks;
          const int ch = i % kChunks;
          const int kvalid = rank - kb - ch * 8;
          const int bytes = (row < mrows && kvalid > 0) ? min(kvalid, 8) * 2 : 0;
          const T* src = ing + (s * p.num_tokens + tok[row]) * p.max_rank + kb + ch * 8;
          cp_async16(ins + row * kTcPitch + ch * 8, bytes ? src : ing, bytes);
        }
      } else {
        const float* ing = static_cast<const float*>(p.in);
        for (int i = tid; i < kTcBM * kChunks; i += kTcThreads) {
          const int row = i / kChunks;
          const int ch = i % kChunks;
          const int kvalid = row < mrows ? rank - kb - ch * 8 : 0;
          float v[8];
          const float* src = ing + (s * p.num_tokens + tok[row]) * p.max_rank + kb + ch * 8;
          if (kvalid >= 8) {
            const float4 lo = *reinterpret_cast<const float4*>(src);
            const float4 hi = *reinterpret_cast<const float4*>(src + 4);
            v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
            v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
          } else {
#pragma unroll
            for (int q = 0; q < 8; ++q) v[q] = q < kvalid ? src[q] : 0.0f;
          }
          *reinterpret_cast<uint4*>(ins + row * kTcPitch + ch * 8) = pack8<T>(v);
        }
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      if (item == first && kb == 0) trace_at<kTrace>(p.trace, 4);
      if (warp_has_rows) {
        const T* a_rows = ins + warp * 16 * kTcPitch;
        if (ncols == kExpandBN) {
          expand_mma<T, kBK, true>(acc, a_rows, bs, rank - kb, ncols, lane);
        } else {
          expand_mma<T, kBK, false>(acc, a_rows, bs, rank - kb, ncols, lane);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the y tile has landed for every thread
    // Every column (those past ncols are never stored): no per-column test, as before.
    if (warp_has_rows) add_into_y_tile(ys, acc, warp, lane, kExpandBN, p.add_inputs);
    __syncthreads();
    for (int i = tid; i < kTcBM * (kExpandBN / 8); i += kTcThreads) {
      const int row = i / (kExpandBN / 8);
      const int ch = i % (kExpandBN / 8);
      if (row < mrows && ch * 8 < ncols) {
        *reinterpret_cast<uint4*>(yg + tok[row] * p.y_stride + ycol + ch * 8) =
            *reinterpret_cast<const uint4*>(ys + row * kYPitch + ch * 8);
      }
    }
  }
  trace_at<kTrace>(p.trace, 6);
  trace_at<kTrace>(p.trace, 7);
}

}  // namespace

ExpandTileParams expand_tile_params(const ExpandPlan& plan, const ExpandArgs& a,
                                    const LoraMetaView& meta) {
  ExpandTileParams p{};
  p.in = a.in;
  p.in_f32 = a.in_dtype == DType::kF32;
  p.num_slices = a.num_slices;
  int64_t col = a.offset_start;
  for (int s = 0; s < a.num_slices; ++s) {
    p.b[s] = a.lora_b[s];
    p.width[s] = a.slice_width[s];
    p.y_col[s] = col;
    col += a.slice_width[s];
  }
  for (int s = 0; s <= a.num_slices; ++s) p.ntile_begin[s] = plan.ntile_begin[s];
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.ranks = a.ranks;
  p.y = a.y;
  p.y_stride = a.y_row_stride;
  p.add_inputs = a.add_inputs;
  p.num_tokens = a.num_tokens;
  p.meta = meta;
  p.cache_ranks = plan.cache_ranks;
  p.cache_sorted = plan.cache_sorted;
  p.trace = kernel_trace();
  p.balanced = plan.balanced;
  p.pdl = plan.pdl;
  return p;
}

Status check_expand_items(const ExpandPlan& plan) {
  LORAPLEX_ENSURE(plan.items <= std::numeric_limits<int>::max(), "lora_expand: ", plan.items,
                  " work items (64-token tiles x 128-column tiles) exceed the kernels' 32-bit "
                  "item index (at most ",
                  std::numeric_limits<int>::max(), ")");
  return Status();
}

Status launch_expand_tc(const ExpandPlan& plan, const ExpandArgs& a, const LoraMetaView& meta,
                        StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_items(plan));
  const ExpandTileParams p = expand_tile_params(plan, a, meta);
  auto s = static_cast<cudaStream_t>(stream);
  auto run = [&](auto kernel) -> Status {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem));
    kernel<<<plan.grid, kTcThreads, plan.smem, s>>>(p);
    return Status();
  };
  // The traced instantiations only for bf16 (the benchmark's dtype) while tracing.
  if (a.dtype == DType::kBF16 && p.trace != nullptr) {
    LORAPLEX_RETURN_IF_ERROR(run(&expand_tc_kernel<bf16, kTcBK, true>));
  } else if (a.dtype == DType::kBF16) {
    LORAPLEX_RETURN_IF_ERROR(run(&expand_tc_kernel<bf16, kTcBK, false>));
  } else {
    LORAPLEX_RETURN_IF_ERROR(run(&expand_tc_kernel<f16, kTcBK, false>));
  }
  return launch_status("expand_tc_kernel");
}

}  // namespace loraplex::kernels::cuda
