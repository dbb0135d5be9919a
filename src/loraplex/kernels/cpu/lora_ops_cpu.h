#pragma once
// CPU reference implementations of the ops in kernels/lora_ops.h: threaded over tokens,
// fp32 accumulation, f32/f16/bf16 activations. They define the semantics that the CUDA
// kernels are tested against, and they are the backend that runs everywhere.

#include <cstdint>

#include "loraplex/core/status.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels::cpu {

/// Output buffers of build_lora_meta; token_lora_mapping must already hold the mapping.
struct LoraMetaBuffers {
  int32_t* token_lora_mapping = nullptr;    // [num_tokens] in
  int32_t* sorted_token_indices = nullptr;  // [max_num_tokens] out
  int32_t* active_lora_ids = nullptr;       // [max_loras + 1] out
  int32_t* num_tokens_per_lora = nullptr;   // [max_loras + 1] out
  int32_t* lora_token_start_loc = nullptr;  // [max_loras + 2] out
  int32_t* num_active_loras = nullptr;      // [1] out
};

/// Counting sort of the tokens by slot (stable), distinct slots, counts and start offsets.
/// Rejects slots outside [-1, max_loras).
Status build_lora_meta(int32_t num_tokens, int32_t max_loras, const LoraMetaBuffers& out);

/// SGMV-style shrink: tokens visited grouped by slot through the metadata.
Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta);
/// BGMV-style shrink: tokens visited in order, each gathering its slot's A.
Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping);
/// SGMV-style expand over all slices.
Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta);
/// BGMV-style expand; with one slice and offset_start this is vLLM's bgmv_expand_slice.
Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping);

Status lora_expand_fp8(const ExpandFp8Args& args, const LoraMetaView& meta);
Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& args);
Status lora_embedding(const EmbeddingLoraArgs& args);
Status moe_lora_align_block_size(const MoeAlignArgs& args);
Status fused_moe_lora(const FusedMoeLoraArgs& args);

}  // namespace loraplex::kernels::cpu
