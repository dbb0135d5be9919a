// The per-step batch metadata built on the GPU by one thread block: no host synchronisation,
// no data-dependent launch configuration, so it can be captured in a CUDA graph and the
// mapping changed on the device between replays.

#include "loraplex/kernels/cuda/block_bucket.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kMetaThreads = 1024;
constexpr int kMetaMaxCounterInts = 16 * 1024;  // 64 KB of per-warp bucket counters
constexpr int kMetaCachedTokens = 16 * 1024;    // buckets of up to this many tokens in smem

struct MetaOut {
  const int32_t* mapping;
  int32_t* sorted;
  int32_t* active_ids;
  int32_t* counts;
  int32_t* start_loc;
  int32_t* num_active;
};

__global__ void __launch_bounds__(kMetaThreads)
    build_lora_meta_kernel(int num_tokens, int max_loras, int nw, bool cached, MetaOut out) {
  // Bucket 0 is slot -1 (and any slot outside [0, max_loras)); bucket k + 1 is slot k, so
  // ascending buckets are ascending slot ids, as in the CPU build.
  extern __shared__ int smem[];
  const int nb = max_loras + 1;
  int* wc = smem;
  int* total = wc + nw * nb;
  int* base = total + nb;
  int* cache = base + nb;  // [num_tokens] when `cached`: each token's bucket
  __shared__ int active_count;
  auto bucket_of_slot = [&](int32_t slot) { return valid_slot(slot, max_loras) ? slot + 1 : 0; };
  // One coalesced pass over the mapping; both sort passes then read shared memory only.
  if (cached) {
    for (int t = static_cast<int>(threadIdx.x); t < num_tokens; t += blockDim.x) {
      cache[t] = bucket_of_slot(out.mapping[t]);
    }
  }
  auto bucket = [&](int t) { return cached ? cache[t] : bucket_of_slot(out.mapping[t]); };
  bucket_count(num_tokens, nb, nw, wc, bucket);
  bucket_offsets(nb, nw, wc, total);
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const unsigned lower = (1u << lane) - 1u;
    int run_tokens = 0;
    int run_active = 0;
    for (int b0 = 0; b0 < nb; b0 += 32) {
      const int b = b0 + lane;
      const int c = b < nb ? total[b] : 0;
      const int incl = warp_inclusive_sum(c, lane);
      const int start = run_tokens + incl - c;
      const unsigned present = __ballot_sync(kFullMask, c > 0);
      const int index = run_active + __popc(present & lower);
      if (b < nb) base[b] = start;
      if (c > 0) {
        out.active_ids[index] = b - 1;
        out.counts[index] = c;
        out.start_loc[index] = start;
      }
      run_tokens += __shfl_sync(kFullMask, incl, 31);
      run_active += __popc(present);
    }
    if (lane == 0) {
      active_count = run_active;
      *out.num_active = run_active;
    }
  }
  __syncthreads();
  const int na = active_count;
  for (int i = na + static_cast<int>(threadIdx.x); i < max_loras + 2; i += blockDim.x) {
    if (i < max_loras + 1) {
      out.active_ids[i] = -1;
      out.counts[i] = 0;
    }
    out.start_loc[i] = num_tokens;
  }
  bucket_scatter(num_tokens, nb, nw, wc, bucket,
                 [&](int t, int b, int pos) { out.sorted[base[b] + pos] = t; });
}

}  // namespace

Status build_lora_meta(int32_t num_tokens, int32_t max_loras, const cpu::LoraMetaBuffers& buffers,
                       StreamHandle stream) {
  LORAPLEX_ENSURE(num_tokens >= 0, "build_lora_meta: num_tokens ", num_tokens, " < 0");
  LORAPLEX_ENSURE(max_loras >= 1, "build_lora_meta: max_loras ", max_loras, ", expected >= 1");
  LORAPLEX_ENSURE(
      buffers.token_lora_mapping != nullptr && buffers.sorted_token_indices != nullptr &&
          buffers.active_lora_ids != nullptr && buffers.num_tokens_per_lora != nullptr &&
          buffers.lora_token_start_loc != nullptr && buffers.num_active_loras != nullptr,
      "build_lora_meta: a metadata buffer is null");
  const int nb = max_loras + 1;
  const int nw = bucket_sort_warps(nb, kMetaMaxCounterInts, kMetaThreads / 32);
  const bool cached = num_tokens <= kMetaCachedTokens;
  const int smem = (nw * nb + 2 * nb + (cached ? num_tokens : 0)) * static_cast<int>(sizeof(int));
  LORAPLEX_RETURN_IF_ERROR(
      allow_dynamic_smem(reinterpret_cast<const void*>(&build_lora_meta_kernel), smem));
  MetaOut out{buffers.token_lora_mapping,  buffers.sorted_token_indices, buffers.active_lora_ids,
              buffers.num_tokens_per_lora, buffers.lora_token_start_loc, buffers.num_active_loras};
  build_lora_meta_kernel<<<1, kMetaThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      num_tokens, max_loras, nw, cached, out);
  return launch_status("build_lora_meta_kernel");
}

}  // namespace loraplex::kernels::cuda
