// FlashInfer's paged prefill kernel for float16, head dim 128, at each CTA_TILE_Q its planner
// picks (one file per dtype and head dim: they compile in parallel).

#include "loraplex/model/cuda/flashinfer_prefill_impl.cuh"

namespace loraplex::model::flashinfer {

template cudaError_t prefill_paged<half, 16, 128>(PagedParams<half>, half*, float*, cudaStream_t);
template cudaError_t prefill_paged<half, 64, 128>(PagedParams<half>, half*, float*, cudaStream_t);
template cudaError_t prefill_paged<half, 128, 128>(PagedParams<half>, half*, float*, cudaStream_t);

}  // namespace loraplex::model::flashinfer
