#pragma once
// A stable counting sort run by one thread block, for the batch metadata (tokens by slot) and
// the MoE alignment (pairs by expert). Each of `nw` warps owns one contiguous segment of the
// items, so positions follow item order: per-warp bucket counts in shared memory
// (wc[nw][nb]), turned into per-warp offsets within each bucket, then a second pass over the
// segments places each item. Within a warp, __match_any_sync groups lanes of one bucket.

#include "loraplex/kernels/cuda/cuda_common.cuh"

namespace loraplex::kernels::cuda {

/// Warps the sort may use for `nb` buckets within `max_ints` of shared counters.
__host__ __device__ inline int bucket_sort_warps(int nb, int max_ints, int block_warps) {
  int nw = nb > 0 ? max_ints / nb : block_warps;
  if (nw > block_warps) nw = block_warps;
  return nw < 1 ? 1 : nw;
}

__device__ __forceinline__ void segment_of(int n, int nw, int w, int& lo, int& hi) {
  const int seg = (n + nw - 1) / nw;
  lo = min(n, w * seg);
  hi = min(n, lo + seg);
}

/// Pass 1: wc[w][b] = number of items of bucket b in warp w's segment. bucket(i) returns
/// -1 to drop an item. Counting needs no order, so plain shared-memory atomics do it. Ends
/// with a block barrier.
template <typename BucketFn>
__device__ void bucket_count(int n, int nb, int nw, int* wc, BucketFn bucket) {
  for (int i = static_cast<int>(threadIdx.x); i < nw * nb; i += blockDim.x) wc[i] = 0;
  __syncthreads();
  const int w = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (w < nw) {
    int lo = 0;
    int hi = 0;
    segment_of(n, nw, w, lo, hi);
    int* mine = wc + w * nb;
    for (int i = lo + lane; i < hi; i += 32) {
      const int b = bucket(i);
      if (b >= 0) atomicAdd(mine + b, 1);
    }
  }
  __syncthreads();
}

/// Pass 2: wc[w][b] becomes the number of bucket-b items in segments before w; total[b] the
/// bucket size. One warp per bucket scans over the (up to 32) segments. Ends with a block
/// barrier.
__device__ inline void bucket_offsets(int nb, int nw, int* wc, int* total) {
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  for (int b = warp; b < nb; b += warps) {
    int run = 0;
    for (int w0 = 0; w0 < nw; w0 += 32) {
      const int w = w0 + lane;
      const int c = w < nw ? wc[w * nb + b] : 0;
      const int incl = warp_inclusive_sum(c, lane);
      if (w < nw) wc[w * nb + b] = run + incl - c;
      run += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) total[b] = run;
  }
  __syncthreads();
}

/// Pass 3: emit(i, b, position of item i within bucket b), stable in item order.
template <typename BucketFn, typename EmitFn>
__device__ void bucket_scatter(int n, int nb, int nw, int* wc, BucketFn bucket, EmitFn emit) {
  const int w = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (w >= nw) return;
  int lo = 0;
  int hi = 0;
  segment_of(n, nw, w, lo, hi);
  int* mine = wc + w * nb;
  const unsigned lower = (1u << lane) - 1u;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const int b = i < hi ? bucket(i) : -1;
    const unsigned same = __match_any_sync(kFullMask, b);
    if (b >= 0) emit(i, b, mine[b] + __popc(same & lower));
    __syncwarp();
    if (b >= 0 && lane == __ffs(same) - 1) mine[b] += __popc(same);
    __syncwarp();
  }
}

}  // namespace loraplex::kernels::cuda
