#pragma once
// CUDA launchers behind layer_ops.h (built with the CUDA backend only). Raw device pointers,
// an explicit cudaStream_t (as void*), Status instead of exceptions. Row strides in elements.

#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::layer_ops_cuda {

Status embedding_lookup(DType dtype, const void* weight, int64_t rows, int64_t hidden,
                        const int32_t* ids, int64_t num_tokens, int64_t vocab_start, void* out,
                        int64_t out_stride, void* stream);
Status shard_token_ids(const int32_t* ids, int64_t num_tokens, int64_t vocab_start, int64_t rows,
                       int32_t outside, int32_t* local, void* stream);
Status topk_softmax(DType dtype, const void* logits, int64_t logits_stride, int64_t num_tokens,
                    int num_experts, int top_k, bool renormalize, int32_t* ids, float* weights,
                    void* stream);
Status gather_rows(DType dtype, const void* src, int64_t src_stride, const int32_t* index,
                   int64_t n, int64_t width, void* dst, int64_t dst_stride, void* stream);
Status scatter_rows(DType dtype, const void* src, int64_t src_stride, const int32_t* index,
                    int64_t n, int64_t width, const float* row_scale, void* dst, int64_t dst_stride,
                    void* stream);
Status silu_and_mul(DType dtype, const void* in, int64_t in_stride, int64_t n, int64_t width,
                    void* out, int64_t out_stride, void* stream);
Status sum_topk(DType dtype, const void* in, int64_t num_tokens, int top_k, int64_t width,
                void* out, int64_t out_stride, void* stream);

}  // namespace loraplex::layer_ops_cuda
