#pragma once
// CUDA implementations of the ops in kernels/lora_ops.h. Same argument structs and semantics
// as kernels/cpu/ (the tests compare the two). Every pointer in the args is device memory of
// the current device, `stream` is a cudaStream_t. Nothing here allocates, synchronises the
// host or reads device memory on the host, so every launcher can be captured in a CUDA graph.
// In a build without CUDA every function returns an "unsupported" Status.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/status.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/kernels/planner/lora_plan.h"

namespace loraplex::kernels::cuda {

using StreamHandle = cuda_rt::StreamHandle;

// The CUDA backend runs the planner's plans (kernels/planner/) and shares its kernel shapes: its
// names are the backend's own.
using namespace planner;

/// The limits of CUDA device `index` and its architecture's tuning table (cached per device).
/// In a build without CUDA: the defaults.
LoraDevice lora_device(int index);

/// Builds the batch metadata from buffers.token_lora_mapping (device) in one single-block
/// kernel: stable counting sort by slot, distinct slots, counts and start offsets. Slots
/// outside [-1, max_loras) are treated as -1 (the host path validates before upload).
Status build_lora_meta(int32_t num_tokens, int32_t max_loras, const cpu::LoraMetaBuffers& out,
                       StreamHandle stream);

/// SGMV shrink over the metadata: the tensor-core prefill shrink where its alignment holds,
/// the generic kernel for anything else (kernels/planner/lora_plan.h decides).
Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta, const LoraDevice& device,
                   StreamHandle stream);
/// SGMV expand over the metadata, all slices in one launch (tensor cores when aligned).
Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta, const LoraDevice& device,
                   StreamHandle stream);
/// BGMV (decode gather) forms: tokens in batch order, each gathering its slot's weights.
Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping, StreamHandle stream);
Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping, StreamHandle stream);

/// Shrink then expand of one layer, on the path plan_lora_linear picks: for small batches the
/// one-kernel cluster layer or the per-token kernel pair (neither writes shrink.out), else
/// shrink into shrink.out and expand from it. expand.in must be
/// shrink.out. Fails, naming both, where the plan needs more of the metadata's scratch or
/// counters than it holds.
Status lora_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                   const LoraDevice& device, StreamHandle stream);

Status lora_expand_fp8(const ExpandFp8Args& args, const LoraMetaView& meta, StreamHandle stream);
Status lora_shrink_fp8(const ShrinkFp8Args& args, const LoraMetaView& meta, StreamHandle stream);
Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& args, StreamHandle stream);
Status lora_embedding(const EmbeddingLoraArgs& args, StreamHandle stream);
/// One block per slot: that slot's (token, k) pairs grouped by expert (stable), each expert
/// group padded to block_size; sorted_ids/expert_ids are fully written (padding, -1).
Status moe_lora_align_block_size(const MoeAlignArgs& args, StreamHandle stream);
/// Fused MoE LoRA: one CTA per routed pair (naive blocks, small batches) or per
/// (slot, aligned block) (large batches); shrink into shared memory, then expand.
Status fused_moe_lora(const FusedMoeLoraArgs& args, StreamHandle stream);

}  // namespace loraplex::kernels::cuda
