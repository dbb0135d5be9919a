#pragma once
// CPU implementations of the ops in kernels/lora_ops.h: fp32 accumulation, f32/f16/bf16
// activations, split over the thread pool by cost. They define the semantics that the CUDA
// kernels are tested against, and they are the backend that runs everywhere.
//
// Each slot's weights are converted to fp32 once per thread and reused while consecutive
// tokens share the slot (tokens are visited grouped by slot: from the metadata for the SGMV
// forms, by a counting sort for the BGMV forms). Every output element is computed by the same
// fp32 operations whatever the rest of the batch is, so results are bit-identical across
// permutations of the batch, across batch sizes, across thread counts, and between the SGMV
// and BGMV forms.
//
// Conventions shared by the ops: tokens (pairs) of slot -1, or of an adapter that is not
// enabled, are neither read nor written; a slot of rank 0 adds nothing, and without add_inputs
// its output columns are overwritten with its zero delta; index arrays (mappings, ranks,
// routed experts, aligned blocks) are validated before any output is written, and a bad one
// returns an invalid-argument Status naming the value.

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
Status lora_shrink_fp8(const ShrinkFp8Args& args, const LoraMetaView& meta);
Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& args);
Status lora_embedding(const EmbeddingLoraArgs& args);
/// Pairs within an expert group are in ascending pair order (vLLM's CUDA kernel leaves that
/// order free). The buffers may be larger than moe_align_sizes(); every entry is written.
Status moe_lora_align_block_size(const MoeAlignArgs& args);
/// The aligned blocks must match the call's mapping and routing (checked); the router weight
/// multiplies the rank-r intermediate, which is the same product as scaling the output.
Status fused_moe_lora(const FusedMoeLoraArgs& args);

}  // namespace loraplex::kernels::cpu
