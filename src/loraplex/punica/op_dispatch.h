#pragma once
// Routes each op to the CPU reference or the CUDA kernels by the stream's device. The one
// place above kernels/ that knows both backends exist. The LoRA ops' CUDA plans are made for
// `lora_device` (the device's limits and the tuning table in force); nullptr: the stream
// device's own (kernels::cuda::lora_device).

#include <string>

#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/cuda/lora_plan.h"
#include "loraplex/kernels/gemm.h"
#include "loraplex/kernels/layer_ops.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/kernels/model_ops.h"
#include "loraplex/kernels/table_write.h"

namespace loraplex {

Status dispatch_build_lora_meta(int32_t num_tokens, int32_t max_loras,
                                const kernels::cpu::LoraMetaBuffers& buffers, const Stream& stream);
Status dispatch_lora_shrink(const kernels::ShrinkArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream,
                            const kernels::cuda::LoraDevice* lora_device = nullptr);
Status dispatch_lora_expand(const kernels::ExpandArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream,
                            const kernels::cuda::LoraDevice* lora_device = nullptr);
/// Per-token gather forms (vLLM's bgmv_shrink / bgmv_expand / bgmv_expand_slice): the same
/// math driven by the mapping alone, for callers without batch metadata.
Status dispatch_bgmv_shrink(const kernels::ShrinkArgs& args, const int32_t* token_lora_mapping,
                            const Stream& stream);
Status dispatch_bgmv_expand(const kernels::ExpandArgs& args, const int32_t* token_lora_mapping,
                            const Stream& stream);
/// Shrink and expand of one layer in one call: on CUDA small batches run the decode kernel
/// pair (split-K shrink partial sums in the metadata's scratch, `shrink.out` not written) or
/// the cluster layer; otherwise shrink into `shrink.out`, then expand from it.
Status dispatch_lora_linear(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                            const kernels::LoraMetaView& meta, const Stream& stream,
                            const kernels::cuda::LoraDevice* lora_device = nullptr);
/// The path dispatch_lora_linear takes on `device`: "cpu", or the CUDA plan's
/// (kernels::cuda::path_name).
std::string lora_linear_path_of(const kernels::ShrinkArgs& shrink,
                                const kernels::ExpandArgs& expand,
                                const kernels::LoraMetaView& meta, Device device,
                                const kernels::cuda::LoraDevice& lora_device);
/// The metadata scratch (floats) that dispatch_lora_linear needs on `device` (0 on the CPU).
int64_t lora_linear_scratch_of(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                               const kernels::LoraMetaView& meta, Device device,
                               const kernels::cuda::LoraDevice& lora_device);
Status dispatch_lora_expand_fp8(const kernels::ExpandFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream);
Status dispatch_lora_shrink_fp8(const kernels::ShrinkFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream);
Status dispatch_quantize_intermediate_fp8(const kernels::QuantizeIntermediateArgs& args,
                                          const Stream& stream);
Status dispatch_lora_embedding(const kernels::EmbeddingLoraArgs& args, const Stream& stream);
Status dispatch_moe_lora_align(const kernels::MoeAlignArgs& args, const Stream& stream);
Status dispatch_fused_moe_lora(const kernels::FusedMoeLoraArgs& args, const Stream& stream);

/// y = x W^T (+ bias): the blocked CPU GEMM or cuBLASLt (kernels/gemm.h).
Status dispatch_gemm_xwt(const kernels::GemmArgs& args, const Stream& stream);
/// A few int32 entries of a table, in stream order (kernels/table_write.h).
Status dispatch_write_column(const kernels::WriteColumnArgs& args, const Stream& stream);

// The decoder's non-LoRA ops (kernels/model_ops.h).
Status dispatch_fill_uniform(const kernels::FillUniformArgs& args, const Stream& stream);
Status dispatch_add_rms_norm(const kernels::AddRmsNormArgs& args, const Stream& stream);
Status dispatch_rope_kv_write(const kernels::RopeKvWriteArgs& args, const Stream& stream);
Status dispatch_qk_rms_norm(const kernels::QkRmsNormArgs& args, const Stream& stream);
Status dispatch_paged_attention(const kernels::PagedAttentionArgs& args, const Stream& stream);
Status dispatch_silu_mul(const kernels::SiluMulArgs& args, const Stream& stream);
Status dispatch_argmax(const kernels::ArgmaxArgs& args, const Stream& stream);
Status dispatch_feed_tokens(const kernels::FeedTokensArgs& args, const Stream& stream);

// The embedding and MoE layers' row ops (kernels/layer_ops.h).
Status dispatch_embedding_rows(const kernels::EmbeddingRowsArgs& args, const Stream& stream);
Status dispatch_shard_token_ids(const kernels::ShardTokenIdsArgs& args, const Stream& stream);
Status dispatch_topk_softmax(const kernels::TopkSoftmaxArgs& args, const Stream& stream);
Status dispatch_gather_rows(const kernels::GatherRowsArgs& args, const Stream& stream);
Status dispatch_scatter_rows(const kernels::ScatterRowsArgs& args, const Stream& stream);
Status dispatch_sum_topk(const kernels::SumTopkArgs& args, const Stream& stream);

}  // namespace loraplex
