// FlashInfer's paged prefill kernel for bfloat16, head dim 128, at each CTA_TILE_Q its planner
// picks (one file per dtype and head dim: they compile in parallel).

#include "loraplex/model/cuda/flashinfer_prefill_impl.cuh"

namespace loraplex::model::flashinfer {

template cudaError_t prefill_paged<__nv_bfloat16, 16, 128>(PagedParams<__nv_bfloat16>,
                                                           __nv_bfloat16*, float*, cudaStream_t);
template cudaError_t prefill_paged<__nv_bfloat16, 64, 128>(PagedParams<__nv_bfloat16>,
                                                           __nv_bfloat16*, float*, cudaStream_t);
template cudaError_t prefill_paged<__nv_bfloat16, 128, 128>(PagedParams<__nv_bfloat16>,
                                                            __nv_bfloat16*, float*, cudaStream_t);

}  // namespace loraplex::model::flashinfer
