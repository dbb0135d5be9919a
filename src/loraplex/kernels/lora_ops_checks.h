#pragma once
// Argument checks shared by the CPU and CUDA launchers, so both reject the same inputs with
// the same messages. The check_*_args functions read only sizes, dtypes and pointers, never
// device memory; the check_*_host functions read index arrays and may only be given host
// memory (the CPU ops call them on their inputs; the wrapper calls them on its host copies).

#include "loraplex/core/status.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels {

Status check_shrink_args(const ShrinkArgs& args);
Status check_expand_args(const ExpandArgs& args);
Status check_expand_fp8_args(const ExpandFp8Args& args);
Status check_shrink_fp8_args(const ShrinkFp8Args& args);
Status check_quantize_args(const QuantizeIntermediateArgs& args);
Status check_embedding_args(const EmbeddingLoraArgs& args);
Status check_moe_align_args(const MoeAlignArgs& args);
Status check_fused_moe_args(const FusedMoeLoraArgs& args);
/// The metadata was built for this call: same token count and max_loras, no null pointer.
Status check_meta_view(const LoraMetaView& meta, int64_t num_tokens, int max_loras, const char* op);

/// Checks a host-resident ranks array [num_slices, max_loras]: every entry in [0, max_rank].
Status check_ranks_host(const int32_t* ranks, int num_slices, int max_loras, int max_rank);
/// Checks a host-resident token mapping: every slot in [-1, max_loras).
Status check_mapping_host(const int32_t* mapping, int64_t num_tokens, int max_loras);
/// Checks host-resident routed experts [num_pairs]: each -1 (not local) or in [0, num_experts).
Status check_topk_host(const int32_t* topk_ids, int64_t num_pairs, int num_experts, const char* op);
/// Checks host-resident aligned blocks of a fused MoE call: every slot's padded count fits
/// the buffers, every listed id is a pair or the padding value, and no pair is listed twice
/// (two blocks writing one output row would race).
Status check_moe_blocks_host(const FusedMoeLoraArgs& args);

}  // namespace loraplex::kernels
