#pragma once
// The one FlashInfer kernel configuration PagedAttention launches: batch prefill over a paged
// NHD cache with K and V of equal strides, causal mask, no positional encoding in the kernel
// (RoPE is applied before the cache write), FlashInfer's default softmax attention. Declared
// here, defined in flashinfer_prefill_impl.cuh and instantiated per dtype and head dim in
// flashinfer_prefill_*.cu, so those large instantiations compile in parallel and the glue
// (flashinfer_attention.cu) does not compile them again.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>

namespace loraplex::model::flashinfer {

template <typename T>
using PagedParams = ::flashinfer::BatchPrefillPagedParams<T, T, T, int32_t>;

/// No custom mask, no sliding window, no logits soft cap, no ALiBi.
using Variant = ::flashinfer::DefaultAttention<false, false, false, false>;

/// BatchPrefillWithPagedKVCacheDispatched for element type T (half or __nv_bfloat16). The
/// CTA_TILE_Q values are those FlashInfer's planner (FA2DetermineCtaTileQ) picks for head dims
/// below 256 on sm_80 and newer: 16, 64 and 128.
template <typename T, uint32_t kCtaTileQ, uint32_t kHeadDim>
cudaError_t prefill_paged(PagedParams<T> params, T* tmp_v, float* tmp_s, cudaStream_t stream);

}  // namespace loraplex::model::flashinfer
