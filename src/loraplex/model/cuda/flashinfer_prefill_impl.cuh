#pragma once
// The definition of prefill_paged (flashinfer_prefill.cuh), included only by the
// instantiation files.

#include <flashinfer/attention/prefill.cuh>

#include "loraplex/model/cuda/flashinfer_prefill.cuh"

namespace loraplex::model::flashinfer {

template <typename T, uint32_t kCtaTileQ, uint32_t kHeadDim>
cudaError_t prefill_paged(PagedParams<T> params, T* tmp_v, float* tmp_s, cudaStream_t stream) {
  return ::flashinfer::BatchPrefillWithPagedKVCacheDispatched<
      /*SAME_KV_STRIDES=*/true, kCtaTileQ, kHeadDim, kHeadDim, ::flashinfer::PosEncodingMode::kNone,
      /*USE_FP16_QK_REDUCTION=*/false, ::flashinfer::MaskMode::kCausal, Variant, PagedParams<T>>(
      params, tmp_v, tmp_s, /*enable_pdl=*/false, stream);
}

}  // namespace loraplex::model::flashinfer
