#pragma once
// The base model's ops (no LoRA) routed to the CPU reference or the CUDA kernels by the stream's
// device (route.h): the GEMM, table writes, the decoder's ops (kernels/model_ops.h) and the
// embedding and MoE layers' row ops (kernels/layer_ops.h). The LoRA ops route through
// punica/lora_dispatch.h.

#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/kernels/gemm.h"
#include "loraplex/kernels/layer_ops.h"
#include "loraplex/kernels/model_ops.h"
#include "loraplex/kernels/table_write.h"

namespace loraplex::kernels {

/// y = x W^T (+ bias): the blocked CPU GEMM or cuBLASLt (kernels/gemm.h).
Status dispatch_gemm_xwt(const GemmArgs& args, const Stream& stream);
/// A few int32 entries of a table, in stream order (kernels/table_write.h).
Status dispatch_write_column(const WriteColumnArgs& args, const Stream& stream);

// The decoder's ops (kernels/model_ops.h).
Status dispatch_fill_uniform(const FillUniformArgs& args, const Stream& stream);
Status dispatch_add_rms_norm(const AddRmsNormArgs& args, const Stream& stream);
Status dispatch_rope_kv_write(const RopeKvWriteArgs& args, const Stream& stream);
Status dispatch_qk_rms_norm(const QkRmsNormArgs& args, const Stream& stream);
Status dispatch_paged_attention(const PagedAttentionArgs& args, const Stream& stream);
Status dispatch_silu_mul(const SiluMulArgs& args, const Stream& stream);
Status dispatch_argmax(const ArgmaxArgs& args, const Stream& stream);
Status dispatch_feed_tokens(const FeedTokensArgs& args, const Stream& stream);

// The embedding and MoE layers' row ops (kernels/layer_ops.h).
Status dispatch_embedding_rows(const EmbeddingRowsArgs& args, const Stream& stream);
Status dispatch_shard_token_ids(const ShardTokenIdsArgs& args, const Stream& stream);
Status dispatch_topk_softmax(const TopkSoftmaxArgs& args, const Stream& stream);
Status dispatch_gather_rows(const GatherRowsArgs& args, const Stream& stream);
Status dispatch_scatter_rows(const ScatterRowsArgs& args, const Stream& stream);
Status dispatch_sum_topk(const SumTopkArgs& args, const Stream& stream);
Status dispatch_moe_expert_blocks(const MoeExpertBlocksArgs& args, const Stream& stream);
Status dispatch_moe_expert_gemm(const MoeExpertGemmArgs& args, const Stream& stream);

}  // namespace loraplex::kernels
