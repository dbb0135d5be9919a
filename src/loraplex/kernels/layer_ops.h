#pragma once
// The non-GEMM steps of the embedding and MoE layers (their tensor API: layers/embedding_moe_ops.h)
// as argument structs over raw pointers: the embedding rows of a vocab shard, token ids within a
// shard, top-k softmax routing, row gather and scatter, the sum over top-k, the expert GEMMs over
// a block table built on the device. The CPU versions
// (cpu/layer_ops_cpu.cc) define the semantics; the CUDA versions (cuda/layer_ops_cuda.cu)
// implement the same structs; kernels/dispatch/base_ops.h routes between them. Activations are f32,
// f16 or bf16, arithmetic in float; row strides in elements. Launchers return Status.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"

namespace loraplex::kernels {

/// out[t] = weight[ids[t] - vocab_start] when that is a row of the shard, else zeros (the token
/// lives in another rank's vocab shard). The CPU rejects ids outside [0, vocab); the CUDA kernel
/// writes zeros for them.
struct EmbeddingRowsArgs {
  DType dtype = DType::kF32;     // of weight and out
  const void* weight = nullptr;  // [rows, hidden] in
  int64_t rows = 0;
  int64_t hidden = 0;
  const int32_t* ids = nullptr;  // [num_tokens] in
  int64_t num_tokens = 0;
  int64_t vocab_start = 0;
  int64_t vocab = 0;
  void* out = nullptr;  // [num_tokens, out_stride] out
  int64_t out_stride = 0;
};

/// local[t] = ids[t] - vocab_start inside the shard [vocab_start, vocab_start + rows), else
/// `outside` (the index of a row of zeros).
struct ShardTokenIdsArgs {
  const int32_t* ids = nullptr;  // [num_tokens] in
  int64_t num_tokens = 0;
  int64_t vocab_start = 0;
  int64_t rows = 0;
  int32_t outside = 0;
  int32_t* local = nullptr;  // [num_tokens] out
};

/// Mixtral/transformers routing: softmax(logits) in float, the top_k largest (ties to the lower
/// expert id), renormalised to sum 1 when `renormalize`.
struct TopkSoftmaxArgs {
  DType dtype = DType::kF32;
  const void* logits = nullptr;  // [num_tokens, logits_stride] in
  int64_t logits_stride = 0;
  int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 1;
  bool renormalize = false;
  int32_t* ids = nullptr;    // [num_tokens, top_k] out
  float* weights = nullptr;  // [num_tokens, top_k] out
};

/// dst[i] = src[index[i]] (the CPU rejects an index outside [0, src_rows)).
struct GatherRowsArgs {
  DType dtype = DType::kF32;
  const void* src = nullptr;  // [src_rows, src_stride] in
  int64_t src_stride = 0;
  int64_t src_rows = 0;
  const int32_t* index = nullptr;  // [n] in
  int64_t n = 0;
  int64_t width = 0;
  void* dst = nullptr;  // [n, dst_stride] out
  int64_t dst_stride = 0;
};

/// dst[index[i]] = src[i] * row_scale[index[i]] (no scale when row_scale is null; the CPU rejects
/// an index outside [0, dst_rows)).
struct ScatterRowsArgs {
  DType dtype = DType::kF32;
  const void* src = nullptr;  // [n, src_stride] in
  int64_t src_stride = 0;
  const int32_t* index = nullptr;  // [n] in, distinct
  int64_t n = 0;
  int64_t width = 0;
  const float* row_scale = nullptr;  // [dst_rows] in, or nullptr
  void* dst = nullptr;               // [dst_rows, dst_stride] out
  int64_t dst_stride = 0;
  int64_t dst_rows = 0;
};

/// out[t] = sum over k of in[t * top_k + k], in float, rounded once.
struct SumTopkArgs {
  DType dtype = DType::kF32;
  const void* in = nullptr;  // [num_tokens * top_k, width] in (contiguous)
  int64_t num_tokens = 0;
  int top_k = 1;
  int64_t width = 0;
  void* out = nullptr;  // [num_tokens, out_stride] out
  int64_t out_stride = 0;
};

/// The routed pairs of an MoE step grouped by expert on the device, so that the expert GEMMs
/// need no host read of the routing (and a decode step can be a captured graph). Pair p =
/// t * top_k + k goes to expert ids[p]; expert e's pairs fill ceil(count_e /
/// kMoeExpertBlockRows) blocks, blocks in expert order: block_expert[b] = e for a used block and
/// -1 for the rest of the max_blocks, block_pairs[b * kMoeExpertBlockRows + i] = a pair or -1
/// (padding). Pairs with an id outside [0, num_experts) are left out. The order of the pairs
/// inside an expert's blocks is unspecified: no result depends on it.
constexpr int kMoeExpertBlockRows = 16;

/// The most blocks any routing of `num_pairs` pairs over `num_experts` experts can fill: one
/// partial block per expert that has pairs, the rest full.
inline int64_t moe_expert_max_blocks(int64_t num_pairs, int num_experts) {
  const int64_t partial = num_pairs < num_experts ? num_pairs : num_experts;
  return num_pairs / kMoeExpertBlockRows + partial;
}

struct MoeExpertBlocksArgs {
  const int32_t* topk_ids = nullptr;  // [num_pairs] in
  int64_t num_pairs = 0;
  int num_experts = 0;
  int64_t max_blocks = 0;           // >= moe_expert_max_blocks(num_pairs, num_experts)
  int32_t* block_expert = nullptr;  // [max_blocks] out
  int32_t* block_pairs = nullptr;   // [max_blocks * kMoeExpertBlockRows] out
};

/// The expert GEMMs over a block table (MoeExpertBlocksArgs): for every pair p listed in block
/// b, out[p] = row_scale[p] * (W[e] x_p) with e = block_expert[b] and x_p = x[p / top_k] (token
/// rows) or x[p] (x_rows_are_pairs); float accumulation, rounded once; no row_scale = 1. Rows of
/// out whose pairs no block lists are left as they are.
struct MoeExpertGemmArgs {
  DType dtype = DType::kF32;  // of x, w and out
  const void* x = nullptr;    // [tokens or pairs, x_stride] in
  int64_t x_stride = 0;
  bool x_rows_are_pairs = false;
  int top_k = 1;
  const void* w = nullptr;  // [num_experts, n, k] in, contiguous
  int num_experts = 0;
  int64_t n = 0;                          // output columns (rows of each expert's weight)
  int64_t k = 0;                          // input columns
  const int32_t* block_expert = nullptr;  // [max_blocks] in
  const int32_t* block_pairs = nullptr;   // [max_blocks * kMoeExpertBlockRows] in
  int64_t max_blocks = 0;
  int64_t num_pairs = 0;             // the CPU rejects a listed pair outside [0, num_pairs)
  const float* row_scale = nullptr;  // [num_pairs] in, or nullptr
  void* out = nullptr;               // [num_pairs, out_stride] out
  int64_t out_stride = 0;
};

namespace cpu {
Status embedding_rows(const EmbeddingRowsArgs& a);
Status shard_token_ids(const ShardTokenIdsArgs& a);
Status topk_softmax(const TopkSoftmaxArgs& a);
Status gather_rows(const GatherRowsArgs& a);
Status scatter_rows(const ScatterRowsArgs& a);
Status sum_topk(const SumTopkArgs& a);
Status moe_expert_blocks(const MoeExpertBlocksArgs& a);
Status moe_expert_gemm(const MoeExpertGemmArgs& a);
}  // namespace cpu

/// The same on a CUDA stream (device pointers); "unsupported" in a build without CUDA.
namespace cuda {
Status embedding_rows(const EmbeddingRowsArgs& a, cuda_rt::StreamHandle stream);
Status shard_token_ids(const ShardTokenIdsArgs& a, cuda_rt::StreamHandle stream);
Status topk_softmax(const TopkSoftmaxArgs& a, cuda_rt::StreamHandle stream);
Status gather_rows(const GatherRowsArgs& a, cuda_rt::StreamHandle stream);
Status scatter_rows(const ScatterRowsArgs& a, cuda_rt::StreamHandle stream);
Status sum_topk(const SumTopkArgs& a, cuda_rt::StreamHandle stream);
Status moe_expert_blocks(const MoeExpertBlocksArgs& a, cuda_rt::StreamHandle stream);
Status moe_expert_gemm(const MoeExpertGemmArgs& a, cuda_rt::StreamHandle stream);
}  // namespace cuda

}  // namespace loraplex::kernels
