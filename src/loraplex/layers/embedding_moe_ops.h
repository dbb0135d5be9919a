#pragma once
// The few non-GEMM steps of the embedding and MoE layers, on the tensor's device (the ops of
// kernels/layer_ops.h and kernels/model_ops.h through kernels/dispatch/base_ops.h). Activations are
// f32, f16 or bf16; arithmetic is in float.

#include <cstdint>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"

namespace loraplex::layer_ops {

/// out[t] = weight[ids[t] - vocab_start] when ids[t] is in [vocab_start, vocab_start + rows),
/// else zeros (the token lives in another rank's vocab shard). Throws on ids outside
/// [0, vocab) (CPU only; the CUDA kernel writes zeros for them).
/// weight: [rows, hidden] in; ids: int32 [T] in; out: [T, hidden] out (rows contiguous).
void embedding_lookup(const Tensor& weight, const Tensor& ids, int64_t vocab_start, int64_t vocab,
                      Tensor& out, const Stream& stream);

/// local[t] = ids[t] - vocab_start inside the shard [vocab_start, vocab_start + rows), else
/// `outside` (the index of a row of zeros). ids, local: int32 [T].
void shard_token_ids(const Tensor& ids, int64_t vocab_start, int64_t rows, int32_t outside,
                     Tensor& local, const Stream& stream);

/// Mixtral/transformers routing: probabilities = softmax(logits) in float, the top_k largest
/// (ties go to the lower expert id), renormalised to sum 1 when `renormalize`.
/// logits: [T, E] in; ids: int32 [T, top_k] out; weights: float32 [T, top_k] out.
void topk_softmax(const Tensor& logits, int top_k, bool renormalize, Tensor& ids, Tensor& weights,
                  const Stream& stream);

/// dst[i] = src[index[i]]. src: [rows, W] in (rows contiguous); index: int32 [n] in;
/// dst: [n, W] out (rows contiguous).
void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst, const Stream& stream);

/// dst[index[i]] = src[i] * row_scale[index[i]] (no scale when row_scale is undefined).
/// src: [n, W] in; index: int32 [n] in, distinct; row_scale: float32 [rows of dst] in or
/// undefined; dst: [rows, W] out (rows contiguous).
void scatter_rows(const Tensor& src, const Tensor& index, const Tensor& row_scale, Tensor& dst,
                  const Stream& stream);

/// out[i, j] = round(silu(in[i, j])) * in[i, width + j] (silu rounded to the dtype first, as
/// transformers). in: [n, 2 * width] in, contiguous; out: [n, width] out, contiguous.
void silu_and_mul(const Tensor& in, Tensor& out, const Stream& stream);

/// out[t] = sum over k of in[t * top_k + k], in float, rounded once.
/// in: [T * top_k, W] in (contiguous); out: [T, W] out (rows contiguous).
void sum_topk(const Tensor& in, int top_k, Tensor& out, const Stream& stream);

/// The routed pairs grouped by expert on the device (kernels::MoeExpertBlocksArgs).
/// topk_ids: int32 [P] in; block_expert: int32 [max_blocks] out; block_pairs: int32
/// [max_blocks * kernels::kMoeExpertBlockRows] out, max_blocks >= moe_expert_max_blocks(P, E).
void moe_expert_blocks(const Tensor& topk_ids, int num_experts, Tensor& block_expert,
                       Tensor& block_pairs, const Stream& stream);

/// out[p] = row_scale[p] * (w[e] x_p) for the pairs of the block table (kernels::
/// MoeExpertGemmArgs): x_p = x[p / top_k], or x[p] when x_rows_are_pairs. x: [T or P, k] in
/// (rows contiguous); w: [E, n, k] in, contiguous; row_scale: float32 [P] in or undefined; out:
/// [P, n] out (rows contiguous).
void moe_expert_gemm(const Tensor& x, bool x_rows_are_pairs, int top_k, const Tensor& w,
                     const Tensor& block_expert, const Tensor& block_pairs, const Tensor& row_scale,
                     Tensor& out, const Stream& stream);

}  // namespace loraplex::layer_ops
