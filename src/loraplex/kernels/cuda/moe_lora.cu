// Fused MoE LoRA on CUDA: the per-slot expert alignment (moe_lora_align_block_size) and the
// shrink + expand of the routed pairs. A work item is one routed pair (naive blocks, small
// batches) or one aligned block (one slot, one expert, up to block_size pairs). Two kernels
// split each item across many thread blocks, because one thread block per item (the rank-r
// intermediate kept in its shared memory) left a decode step's 40-odd items on a third of the
// SMs, each streaming its slot's expert weights alone: the shrink over (item, slice, rank group),
// the expand over (item, 256 output columns), the intermediate between them in lora_mid. Both read
// the weights in 16-byte accesses when the rows allow it.

#include <algorithm>

#include "loraplex/kernels/cuda/block_bucket.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kAlignThreads = 1024;
constexpr int kAlignMaxCounterInts = 16 * 1024;

struct AlignParams {
  int64_t num_pairs;
  int top_k;
  int num_experts;
  int block_size;
  int max_loras;
  const int32_t* topk_ids;
  const int32_t* mapping;
  const int32_t* adapter_enabled;
  int64_t max_num_tokens_padded;
  int64_t max_num_m_blocks;
  int32_t* sorted_ids;
  int32_t* expert_ids;
  int32_t* num_tokens_post_pad;
};

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(AlignParams p, int nw) {
  extern __shared__ int smem[];
  const int slot = static_cast<int>(blockIdx.x);
  const int ne = p.num_experts;
  int* wc = smem;
  int* total = wc + nw * ne;
  int* base = total + ne;
  int32_t* sorted = p.sorted_ids + slot * p.max_num_tokens_padded;
  int32_t* experts = p.expert_ids + slot * p.max_num_m_blocks;
  const int32_t pad = static_cast<int32_t>(p.num_pairs);
  for (int64_t i = threadIdx.x; i < p.max_num_tokens_padded; i += blockDim.x) sorted[i] = pad;
  for (int64_t i = threadIdx.x; i < p.max_num_m_blocks; i += blockDim.x) experts[i] = -1;
  const bool enabled = p.adapter_enabled == nullptr || p.adapter_enabled[slot] != 0;
  if (!enabled) {
    if (threadIdx.x == 0) p.num_tokens_post_pad[slot] = 0;
    return;
  }
  auto bucket = [&](int i) {
    const int32_t e = p.topk_ids[i];
    return p.mapping[i / p.top_k] == slot && e >= 0 && e < ne ? e : -1;
  };
  const int n = static_cast<int>(p.num_pairs);
  // bucket_count's first barrier also orders the fills above before the writes below.
  bucket_count(n, ne, nw, wc, bucket);
  bucket_offsets(ne, nw, wc, total);
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int run = 0;
    for (int e0 = 0; e0 < ne; e0 += 32) {
      const int e = e0 + lane;
      const int padded = e < ne ? (total[e] + p.block_size - 1) / p.block_size * p.block_size : 0;
      const int incl = warp_inclusive_sum(padded, lane);
      if (e < ne) base[e] = run + incl - padded;
      run += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) p.num_tokens_post_pad[slot] = run;
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < ne; e += blockDim.x) {
    const int blocks = (total[e] + p.block_size - 1) / p.block_size;
    for (int j = 0; j < blocks; ++j) experts[base[e] / p.block_size + j] = e;
  }
  bucket_scatter(n, ne, nw, wc, bucket, [&](int i, int e, int pos) { sorted[base[e] + pos] = i; });
}

constexpr int kMoeWarps = 8;
constexpr int kMoeThreads = 32 * kMoeWarps;
// Rows of one work item are processed this many at a time (the accumulators of a thread).
constexpr int kRowChunk = 4;
// Elements of K one shrink warp should stream at most, before the row is split over warps.
constexpr int64_t kShrinkWarpK = 2048;
// An aligned block has at most this many rows (the layer's blocks hold 16).
constexpr int kMaxItemRows = 64;
// From this many routed pairs the tensor-core shrink takes the step (prefill). Decode steps
// (at most 2,048 pairs in the MoE layer) keep the CUDA-core shrink: their items hold one or
// two pairs, which a 16-row tile would mostly waste.
constexpr int64_t kMmaMinPairs = 4096;

struct MoeParams {
  const void* x;
  bool x_rows_are_pairs;
  int64_t k_dim;
  int num_slices;
  const void* a[kMaxSlices];
  const void* b[kMaxSlices];
  int64_t n;
  int max_loras;
  int max_rank;
  int k_split;      // warps sharing one LoRA-A row: 1, 2, 4 or 8
  int rank_groups;  // ceil(max_rank / (kMoeWarps / k_split))
  int num_experts;
  int top_k;
  int64_t num_pairs;
  const int32_t* ranks;
  const int32_t* mapping;
  const int32_t* adapter_enabled;
  const int32_t* topk_ids;
  const float* topk_weights;
  bool mul_routed_weight;
  bool naive;
  int block_size;
  int64_t max_num_tokens_padded;
  int64_t max_num_m_blocks;
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* num_tokens_post_pad;
  float* mid;  // [num_pairs, num_slices, max_rank]
  void* out;
  int64_t out_row_width;
  int64_t offset;
  bool add_inputs;
};

// V consecutive elements: one 16-byte access when V * sizeof(T) is 16, else V scalar loads.
template <typename T, int V>
struct alignas(V * sizeof(T) == 16 ? 16 : alignof(T)) Pack {
  T e[V];
};
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  Pack<T, V> r;
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) r.e[i] = p[i];
  }
  return r;
}

// The routed pairs of one work item, compacted into `pairs`; 0 when the item has nothing to
// do. A naive item is one pair. Otherwise the item-th aligned block that holds pairs, counting
// slot by slot: every block below a slot's num_tokens_post_pad holds at least one pair, so a
// launch of min(pairs, all blocks) items covers them, where one item per (slot, block) would
// spend most of a decode step's thread blocks on empty ones. Warp 0 decides; the barrier
// publishes its answer to the whole thread block.
__device__ int item_rows(const MoeParams& p, int64_t item, int* pairs, int& slot, int& expert) {
  __shared__ int count;
  __shared__ int item_slot;
  __shared__ int item_expert;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int s = -1;
    int e = -1;
    int64_t block = 0;
    if (p.naive) {
      s = p.mapping[item / p.top_k];
      e = p.topk_ids[item];
    } else {
      int64_t start = 0;
      for (int s0 = 0; s0 < p.max_loras && s < 0; s0 += 32) {
        const int sl = s0 + lane;
        const int blocks = sl < p.max_loras ? p.num_tokens_post_pad[sl] / p.block_size : 0;
        const int incl = warp_inclusive_sum(blocks, lane);
        const unsigned past = __ballot_sync(kFullMask, item < start + incl);
        if (past != 0) {
          const int l = __ffs(past) - 1;
          s = s0 + l;
          block = item - start - __shfl_sync(kFullMask, incl - blocks, l);
        }
        start += __shfl_sync(kFullMask, incl, 31);
      }
      if (s >= 0) e = p.expert_ids[s * p.max_num_m_blocks + block];
    }
    int n = 0;
    const bool usable = valid_slot(s, p.max_loras) &&
                        (p.adapter_enabled == nullptr || p.adapter_enabled[s] != 0) && e >= 0 &&
                        e < p.num_experts;
    if (usable) {
      const int32_t* ids =
          p.naive ? nullptr : p.sorted_ids + s * p.max_num_tokens_padded + block * p.block_size;
      const int width = p.naive ? 1 : p.block_size;
      for (int base = 0; base < width; base += 32) {
        const int i = base + lane;
        const int64_t id = i >= width ? -1 : p.naive ? item : ids[i];
        const bool ok = id >= 0 && id < p.num_pairs;
        const unsigned mask = __ballot_sync(kFullMask, ok);
        if (ok) pairs[n + __popc(mask & ((1u << lane) - 1u))] = static_cast<int>(id);
        n += __popc(mask);
      }
    }
    if (lane == 0) {
      count = n;
      item_slot = s;
      item_expert = e;
    }
  }
  __syncthreads();
  slot = item_slot;
  expert = item_expert;
  return count;
}

// Shrink: mid[pair, s, r] = x_row . A_s[slot, expert, r, :] for the ranks of one rank group
// of one slice (blockIdx.y) and the item's rows (blockIdx.x). p.k_split warps share a rank,
// each taking every k_split-th run of 32 x V elements of K, so a thread holds a few
// accumulators (with one thread block resident per SM most decode items would wait for one)
// while a long K still has its loads spread over several warps instead of one warp's serial
// chain.
template <typename T, int V>
__device__ void shrink_blocks(const MoeParams& p) {
  __shared__ int pairs[kMaxItemRows];
  __shared__ float partial[kMoeWarps][kRowChunk];
  int slot = 0;
  int expert = 0;
  const int rows = item_rows(p, blockIdx.x, pairs, slot, expert);
  if (rows == 0) return;
  const int split = p.k_split;
  const int s = static_cast<int>(blockIdx.y) / p.rank_groups;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int r0 = static_cast<int>(blockIdx.y) % p.rank_groups * (kMoeWarps / split);
  const int rank = p.ranks[s * p.max_loras + slot];
  if (r0 >= rank) return;  // the same for the whole thread block, before any barrier below
  const int r = r0 + warp / split;
  const bool live_rank = r < rank;
  const int64_t K = p.k_dim;
  const T* a =
      static_cast<const T*>(p.a[s]) +
      ((static_cast<int64_t>(slot) * p.num_experts + expert) * p.max_rank + (live_rank ? r : r0)) *
          K;
  const T* x = static_cast<const T*>(p.x);
  for (int c0 = 0; c0 < rows; c0 += kRowChunk) {
    const int live = min(kRowChunk, rows - c0);
    const T* xr[kRowChunk];
#pragma unroll
    for (int c = 0; c < kRowChunk; ++c) {
      const int pair = pairs[c0 + min(c, live - 1)];
      xr[c] = x + (p.x_rows_are_pairs ? pair : pair / p.top_k) * K;
    }
    float acc[kRowChunk] = {};
    if (live_rank) {
#pragma unroll 4
      for (int64_t k = (static_cast<int64_t>(warp % split) * 32 + lane) * V; k < K;
           k += int64_t{32} * V * split) {
        const Pack<T, V> av = load_pack<T, V>(a + k);
#pragma unroll
        for (int c = 0; c < kRowChunk; ++c) {
          if (c >= live) break;
          const Pack<T, V> xv = load_pack<T, V>(xr[c] + k);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[c] += to_float(xv.e[i]) * to_float(av.e[i]);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kRowChunk; ++c) acc[c] = warp_sum(acc[c]);
    if (split == 1) {
      if (lane == 0 && live_rank) {
#pragma unroll
        for (int c = 0; c < kRowChunk; ++c) {
          if (c >= live) break;
          p.mid[(static_cast<int64_t>(pairs[c0 + c]) * p.num_slices + s) * p.max_rank + r] = acc[c];
        }
      }
      continue;
    }
    if (lane == 0) {
#pragma unroll
      for (int c = 0; c < kRowChunk; ++c) partial[warp][c] = acc[c];
    }
    __syncthreads();
    const int t = static_cast<int>(threadIdx.x);
    const int rr = t / kRowChunk;
    const int c = t % kRowChunk;
    if (rr < kMoeWarps / split && r0 + rr < rank && c < live) {
      float sum = 0.0f;
      for (int w = 0; w < split; ++w) sum += partial[rr * split + w][c];
      p.mid[(static_cast<int64_t>(pairs[c0 + c]) * p.num_slices + s) * p.max_rank + r0 + rr] = sum;
    }
    __syncthreads();
  }
}

// Launched with PDL (overlap_preceding_kernel) it may start before the kernel ahead of it ends;
// the wait at the end keeps the stream's order for whatever follows it.
template <typename T, int V>
__global__ void __launch_bounds__(kMoeThreads) moe_lora_shrink_kernel(MoeParams p) {
  shrink_blocks<T, V>(p);
  pdl_wait();
}

// The tensor-core shrink for prefill-sized steps (bf16/f16, aligned blocks of at most 16 pairs,
// K a multiple of 16 and max_rank of 8, rows on 16 bytes): a block's pairs are the 16 rows of
// an m16n8k16 tile, so a step of tens of thousands of pairs is not multiplied out on CUDA
// cores. Fragments are read straight from global memory (rows past the item's repeat its last
// pair; their results are dropped).
__device__ __forceinline__ uint32_t ld_pair(const void* p) {
  return *static_cast<const uint32_t*>(p);
}

// Shrink: the item's 16 x 8 tile of mid for 8 ranks of one slice (blockIdx.y), the 8 warps
// splitting K in steps of 16, their partial tiles summed in shared memory in warp order.
template <typename T>
__global__ void __launch_bounds__(kMoeThreads) moe_lora_shrink_mma_kernel(MoeParams p) {
  __shared__ int pairs[kMaxItemRows];
  __shared__ float partial[kMoeWarps][16 * 8];
  int slot = 0;
  int expert = 0;
  const int rows = item_rows(p, blockIdx.x, pairs, slot, expert);
  if (rows == 0) return;
  const int s = static_cast<int>(blockIdx.y) / p.rank_groups;
  const int r0 = static_cast<int>(blockIdx.y) % p.rank_groups * 8;
  const int rank = p.ranks[s * p.max_loras + slot];
  if (r0 >= rank) return;  // the same for the whole thread block, before its barrier
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int64_t K = p.k_dim;
  const T* x = static_cast<const T*>(p.x);
  auto x_row = [&](int r) {
    const int pair = pairs[min(r, rows - 1)];
    return x + (p.x_rows_are_pairs ? pair : pair / p.top_k) * K;
  };
  const T* x0 = x_row(g);
  const T* x1 = x_row(g + 8);
  const T* a = static_cast<const T*>(p.a[s]) +
               ((static_cast<int64_t>(slot) * p.num_experts + expert) * p.max_rank + r0 + g) * K;
  float c[4] = {};
#pragma unroll 4
  for (int64_t k = static_cast<int64_t>(warp) * 16 + 2 * t; k < K; k += 16 * kMoeWarps) {
    const uint32_t af[4] = {ld_pair(x0 + k), ld_pair(x1 + k), ld_pair(x0 + k + 8),
                            ld_pair(x1 + k + 8)};
    const uint32_t bf[2] = {ld_pair(a + k), ld_pair(a + k + 8)};
    mma_16816<T>(c, af, bf);
  }
  partial[warp][g * 8 + 2 * t] = c[0];
  partial[warp][g * 8 + 2 * t + 1] = c[1];
  partial[warp][(g + 8) * 8 + 2 * t] = c[2];
  partial[warp][(g + 8) * 8 + 2 * t + 1] = c[3];
  __syncthreads();
  const int i = static_cast<int>(threadIdx.x);
  const int row = i / 8;
  const int col = i % 8;
  if (i < 16 * 8 && row < rows && r0 + col < rank) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMoeWarps; ++w) sum += partial[w][i];
    p.mid[(static_cast<int64_t>(pairs[row]) * p.num_slices + s) * p.max_rank + r0 + col] = sum;
  }
}

// The item's rows of the intermediate in shared memory, [ceil(rows, kRowChunk)][num_slices]
// [max_rank], zero past each slice's rank and past the item's rows; ends with a barrier.
__device__ void stage_mid(const MoeParams& p, int rows, const int* pairs, int slot, float* v) {
  const int S = p.num_slices;
  const int MR = p.max_rank;
  const int padded_rows = (rows + kRowChunk - 1) / kRowChunk * kRowChunk;
  for (int i = static_cast<int>(threadIdx.x); i < padded_rows * S * MR; i += kMoeThreads) {
    const int row = i / (S * MR);
    const int sr = i % (S * MR);
    const bool live = row < rows && sr % MR < p.ranks[sr / MR * p.max_loras + slot];
    v[i] = live ? p.mid[static_cast<int64_t>(pairs[row]) * S * MR + sr] : 0.0f;
  }
  __syncthreads();
}

// Expand: one output column per thread (blockIdx.y picks 256 of the slices' columns), for the
// item's rows: out[pair, offset + col] (+)= w * sum_r mid[pair, s, r] * B_s[slot, expert, j, r].
// A warp reads 32 consecutive B rows, contiguous memory.
template <typename T, int V>
__global__ void __launch_bounds__(kMoeThreads) moe_lora_expand_kernel(MoeParams p) {
  extern __shared__ float v[];  // stage_mid's
  __shared__ int pairs[kMaxItemRows];
  int slot = 0;
  int expert = 0;
  const int rows = item_rows(p, blockIdx.x, pairs, slot, expert);
  if (rows == 0) return;
  const int S = p.num_slices;
  const int MR = p.max_rank;
  stage_mid(p, rows, pairs, slot, v);
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kMoeThreads + threadIdx.x;
  if (col >= S * p.n) return;
  const int s = static_cast<int>(col / p.n);
  const int64_t j = col % p.n;
  const int rank = p.ranks[s * p.max_loras + slot];
  const T* b = static_cast<const T*>(p.b[s]) +
               ((static_cast<int64_t>(slot) * p.num_experts + expert) * p.n + j) * MR;
  for (int c0 = 0; c0 < rows; c0 += kRowChunk) {
    float acc[kRowChunk] = {};
    for (int r = 0; r < rank; r += V) {
      const Pack<T, V> bp = load_pack<T, V>(b + r);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float bv = r + i < rank ? to_float(bp.e[i]) : 0.0f;
#pragma unroll
        for (int c = 0; c < kRowChunk; ++c) acc[c] += v[((c0 + c) * S + s) * MR + r + i] * bv;
      }
    }
#pragma unroll
    for (int c = 0; c < kRowChunk; ++c) {
      if (c0 + c >= rows) break;
      const int64_t pair = pairs[c0 + c];
      float o = acc[c];
      if (p.mul_routed_weight) o *= p.topk_weights[pair];
      T* dst = static_cast<T*>(p.out) + pair * p.out_row_width + p.offset + col;
      if (p.add_inputs) o += to_float(*dst);
      *dst = from_float<T>(o);
    }
  }
}

// Expand with eight output columns per thread (bf16/f16): B's eight rows are read as 16-byte
// packs and each pair's output is read and written 16 bytes at a time. One thread block covers
// up to 2,048 columns of an item, so the item lookup and the intermediate's staging are paid
// once per 2,048 columns instead of once per 256.
template <typename T>
__global__ void __launch_bounds__(kMoeThreads) moe_lora_expand_vec_kernel(MoeParams p) {
  constexpr int kCols = 16 / static_cast<int>(sizeof(T));
  extern __shared__ float v[];  // stage_mid's
  __shared__ int pairs[kMaxItemRows];
  int slot = 0;
  int expert = 0;
  const int rows = item_rows(p, blockIdx.x, pairs, slot, expert);
  if (rows == 0) return;
  const int S = p.num_slices;
  const int MR = p.max_rank;
  stage_mid(p, rows, pairs, slot, v);
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * kMoeThreads + threadIdx.x) * kCols;
  if (col >= S * p.n) return;
  const int s = static_cast<int>(col / p.n);
  const int64_t j = col % p.n;
  const int rank = p.ranks[s * p.max_loras + slot];
  const T* b = static_cast<const T*>(p.b[s]) +
               ((static_cast<int64_t>(slot) * p.num_experts + expert) * p.n + j) * MR;
  for (int c0 = 0; c0 < rows; c0 += kRowChunk) {
    float acc[kRowChunk][kCols] = {};
    for (int r = 0; r < rank; r += kCols) {
      Pack<T, kCols> bp[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) bp[c] = load_pack<T, kCols>(b + c * MR + r);
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        if (r + i >= rank) break;  // B past the slot's rank need not be zero
#pragma unroll
        for (int row = 0; row < kRowChunk; ++row) {
          const float m = v[((c0 + row) * S + s) * MR + r + i];
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[row][c] += m * to_float(bp[c].e[i]);
        }
      }
    }
#pragma unroll
    for (int row = 0; row < kRowChunk; ++row) {
      if (c0 + row >= rows) break;
      const int64_t pair = pairs[c0 + row];
      const float w = p.mul_routed_weight ? p.topk_weights[pair] : 1.0f;
      T* dst = static_cast<T*>(p.out) + pair * p.out_row_width + p.offset + col;
      Pack<T, kCols> o;
      if (p.add_inputs) o = load_pack<T, kCols>(dst);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const float val = acc[row][c] * w;
        o.e[c] = from_float<T>(p.add_inputs ? val + to_float(o.e[c]) : val);
      }
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&o);
    }
  }
}

// Warps per LoRA-A row: enough that none streams more than kShrinkWarpK elements of K.
int shrink_k_split(int64_t k) {
  int split = 1;
  while (split < kMoeWarps && k > kShrinkWarpK * split) split *= 2;
  return split;
}

}  // namespace

Status moe_lora_align_block_size(const MoeAlignArgs& a, StreamHandle stream) {
  const char* op = "moe_lora_align_block_size";
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.block_size >= 1 &&
                      a.max_loras >= 1,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", block ", a.block_size, ", max_loras ", a.max_loras, ")");
  const int64_t num_pairs = a.num_tokens * a.top_k;
  LORAPLEX_ENSURE(num_pairs < (int64_t{1} << 31), op, ": ", num_pairs, " pairs exceed int32");
  const MoeAlignSizes need = moe_align_sizes(num_pairs, a.num_experts, a.block_size);
  LORAPLEX_ENSURE(a.max_num_tokens_padded >= need.max_num_tokens_padded &&
                      a.max_num_m_blocks >= need.max_num_m_blocks,
                  op, ": buffers hold ", a.max_num_tokens_padded, " ids and ", a.max_num_m_blocks,
                  " blocks, need ", need.max_num_tokens_padded, " and ", need.max_num_m_blocks);
  LORAPLEX_ENSURE(
      a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr &&
          (num_pairs == 0 || (a.topk_ids != nullptr && a.token_lora_mapping != nullptr)),
      op, ": a pointer is null");
  AlignParams p{num_pairs,
                a.top_k,
                a.num_experts,
                a.block_size,
                a.max_loras,
                a.topk_ids,
                a.token_lora_mapping,
                a.adapter_enabled,
                a.max_num_tokens_padded,
                a.max_num_m_blocks,
                a.sorted_ids,
                a.expert_ids,
                a.num_tokens_post_pad};
  const int nw = bucket_sort_warps(a.num_experts, kAlignMaxCounterInts, kAlignThreads / 32);
  const int smem = (nw * a.num_experts + 2 * a.num_experts) * static_cast<int>(sizeof(int));
  LORAPLEX_RETURN_IF_ERROR(
      allow_dynamic_smem(reinterpret_cast<const void*>(&moe_align_kernel), smem));
  moe_align_kernel<<<a.max_loras, kAlignThreads, smem, static_cast<cudaStream_t>(stream)>>>(p, nw);
  return launch_status("moe_align_kernel");
}

Status fused_moe_lora(const FusedMoeLoraArgs& a, StreamHandle stream) {
  const char* op = "fused_moe_lora";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.hidden_in >= 1 &&
                      a.n >= 1 && a.max_loras >= 1 && a.max_rank >= 1 && a.num_slices >= 1 &&
                      a.num_slices <= kMaxSlices,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", K ", a.hidden_in, ", N ", a.n, ", slices ", a.num_slices, ")");
  LORAPLEX_ENSURE(a.offset >= 0 && a.offset + a.num_slices * a.n <= a.out_row_width, op,
                  ": slices cover columns [", a.offset, ", ", a.offset + a.num_slices * a.n,
                  ") of rows ", a.out_row_width, " wide");
  LORAPLEX_ENSURE(!a.mul_routed_weight || a.topk_weights != nullptr, op,
                  ": mul_routed_weight needs topk_weights");
  if (a.num_tokens == 0) return Status();
  if (!a.naive_blocks) {
    LORAPLEX_ENSURE(
        a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr, op,
        ": aligned blocks need sorted_ids, expert_ids and num_tokens_post_pad");
    LORAPLEX_ENSURE(a.block_size >= 1 && a.max_num_m_blocks >= 1, op, ": block size ", a.block_size,
                    " and ", a.max_num_m_blocks, " blocks, expected >= 1");
  }
  LORAPLEX_ENSURE(a.naive_blocks || a.block_size <= kMaxItemRows, op, ": block size ", a.block_size,
                  ", at most ", kMaxItemRows);
  LORAPLEX_ENSURE(a.lora_mid != nullptr, op,
                  ": lora_mid is null (the rank-r intermediate, [pairs, slices, max_rank] floats)");
  MoeParams p{};
  p.x = a.x;
  p.x_rows_are_pairs = a.x_rows_are_pairs;
  p.k_dim = a.hidden_in;
  p.num_slices = a.num_slices;
  bool aligned_a = aligned16(a.x);
  bool aligned_b = true;
  for (int s = 0; s < a.num_slices; ++s) {
    p.a[s] = a.lora_a[s];
    p.b[s] = a.lora_b[s];
    aligned_a = aligned_a && aligned16(a.lora_a[s]);
    aligned_b = aligned_b && aligned16(a.lora_b[s]);
  }
  p.n = a.n;
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.k_split = shrink_k_split(a.hidden_in);
  p.rank_groups = static_cast<int>(ceil_div(a.max_rank, kMoeWarps / p.k_split));
  p.num_experts = a.num_experts;
  p.top_k = a.top_k;
  p.num_pairs = a.num_tokens * a.top_k;
  p.ranks = a.ranks;
  p.mapping = a.token_lora_mapping;
  p.adapter_enabled = a.adapter_enabled;
  p.topk_ids = a.topk_ids;
  p.topk_weights = a.topk_weights;
  p.mul_routed_weight = a.mul_routed_weight;
  p.naive = a.naive_blocks;
  p.block_size = a.block_size;
  p.max_num_tokens_padded = a.max_num_tokens_padded;
  p.max_num_m_blocks = a.max_num_m_blocks;
  p.sorted_ids = a.sorted_ids;
  p.expert_ids = a.expert_ids;
  p.num_tokens_post_pad = a.num_tokens_post_pad;
  p.mid = a.lora_mid;
  p.out = a.out;
  p.out_row_width = a.out_row_width;
  p.offset = a.offset;
  p.add_inputs = a.add_inputs;
  const int rows = a.naive_blocks ? 1 : a.block_size;
  const int64_t smem64 =
      ceil_div(rows, kRowChunk) * kRowChunk * a.num_slices * int64_t{a.max_rank} * 4;
  LORAPLEX_ENSURE(smem64 <= 200 * 1024, op, ": block of ", rows, " rows x ", a.num_slices,
                  " slices x rank ", a.max_rank, " needs ", smem64, " bytes of shared memory");
  const int smem = static_cast<int>(smem64);
  const int64_t items = a.naive_blocks
                            ? p.num_pairs
                            : std::min(p.num_pairs, int64_t{a.max_loras} * a.max_num_m_blocks);
  const int64_t column_blocks = ceil_div(a.num_slices * a.n, kMoeThreads);
  LORAPLEX_ENSURE(items < (int64_t{1} << 31) && column_blocks < 65536, op, ": ", items,
                  " work items of ", column_blocks, " column blocks exceed one launch");
  if (items == 0) return Status();
  auto s = static_cast<cudaStream_t>(stream);
  // The tensor-core shrink for prefill-sized steps; the expand stays on CUDA cores, whose
  // thread per column stores each pair's output row coalesced (the tensor-core expand's 8-column
  // tiles stored a row 16 bytes at a time and took longer than this one).
  const bool mma = (a.dtype == DType::kBF16 || a.dtype == DType::kF16) && !a.naive_blocks &&
                   a.block_size <= 16 && p.num_pairs >= kMmaMinPairs && a.hidden_in % 16 == 0 &&
                   a.max_rank % 8 == 0 && aligned_a;
  const dim3 expand_grid(static_cast<unsigned>(items), static_cast<unsigned>(column_blocks));
  Status status;
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kV = 16 / static_cast<int>(sizeof(T));
    if constexpr (!std::is_same_v<T, float>) {
      if (mma) {
        MoeParams q = p;
        q.rank_groups = a.max_rank / 8;
        const dim3 grid(static_cast<unsigned>(items),
                        static_cast<unsigned>(a.num_slices * q.rank_groups));
        moe_lora_shrink_mma_kernel<T><<<grid, kMoeThreads, 0, s>>>(q);
      }
    }
    if (!mma) {
      const dim3 shrink_grid(static_cast<unsigned>(items),
                             static_cast<unsigned>(a.num_slices * p.rank_groups));
      // 16-byte accesses when every row starts on 16 bytes; scalar ones otherwise.
      const bool vector_a = aligned_a && a.hidden_in % kV == 0;
      auto shrink = vector_a ? &moe_lora_shrink_kernel<T, kV> : &moe_lora_shrink_kernel<T, 1>;
      if (a.overlap_preceding_kernel && a.naive_blocks) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = shrink_grid;
        cfg.blockDim = dim3(kMoeThreads);
        cfg.stream = s;
        cudaLaunchAttribute attr[1] = {pdl_launch_attribute()};
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        (void)(status = cuda_status(cudaLaunchKernelEx(&cfg, shrink, p), "moe_lora_shrink_kernel"));
        if (!status.ok()) return;
      } else {
        shrink<<<shrink_grid, kMoeThreads, 0, s>>>(p);
      }
    }
    (void)(status = launch_status("moe_lora_shrink_kernel"));
    if (!status.ok()) return;
    const bool vector_b = aligned_b && a.max_rank % kV == 0;
    // The 16-byte expand for prefill-sized steps only: with a decode step's one or two pairs an
    // item, a thread per column keeps more loads in flight than a thread per eight columns.
    const bool vector_out = sizeof(T) == 2 && vector_b && p.num_pairs >= kMmaMinPairs &&
                            a.n % kV == 0 && a.offset % kV == 0 && a.out_row_width % kV == 0 &&
                            aligned16(a.out);
    const void* expand = vector_b ? reinterpret_cast<const void*>(&moe_lora_expand_kernel<T, kV>)
                                  : reinterpret_cast<const void*>(&moe_lora_expand_kernel<T, 1>);
    if constexpr (!std::is_same_v<T, float>) {
      if (vector_out) expand = reinterpret_cast<const void*>(&moe_lora_expand_vec_kernel<T>);
    }
    // (void): nvcc flags the discarded Status& of a [[nodiscard]] class's operator=.
    (void)(status = allow_dynamic_smem(expand, smem));
    if (!status.ok()) return;
    if constexpr (!std::is_same_v<T, float>) {
      if (vector_out) {
        const dim3 grid(static_cast<unsigned>(items),
                        static_cast<unsigned>(ceil_div(a.num_slices * a.n, kMoeThreads * kV)));
        moe_lora_expand_vec_kernel<T><<<grid, kMoeThreads, smem, s>>>(p);
        return;
      }
    }
    if (vector_b) {
      moe_lora_expand_kernel<T, kV><<<expand_grid, kMoeThreads, smem, s>>>(p);
    } else {
      moe_lora_expand_kernel<T, 1><<<expand_grid, kMoeThreads, smem, s>>>(p);
    }
  });
  LORAPLEX_RETURN_IF_ERROR(status);
  return launch_status("moe_lora_expand_kernel");
}

}  // namespace loraplex::kernels::cuda
