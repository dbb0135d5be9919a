#pragma once
// CUDA implementations of the ops in kernels/lora_ops.h. Same argument structs and semantics
// as kernels/cpu/ (the tests compare the two). Every pointer in the args is device memory of
// the current device, `stream` is a cudaStream_t. Nothing here allocates, synchronises the
// host or reads device memory on the host, so every launcher can be captured in a CUDA graph.
// In a build without CUDA every function returns an "unsupported" Status.

#include <cstdint>
#include <string>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/status.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels::cuda {

using StreamHandle = cuda_rt::StreamHandle;

/// Builds the batch metadata from buffers.token_lora_mapping (device) in one single-block
/// kernel: stable counting sort by slot, distinct slots, counts and start offsets. Slots
/// outside [-1, max_loras) are treated as -1 (the host path validates before upload).
Status build_lora_meta(int32_t num_tokens, int32_t max_loras, const cpu::LoraMetaBuffers& out,
                       StreamHandle stream);

/// SGMV shrink over the metadata. bf16/f16 with 16-byte aligned rows: small batches run the
/// decode kernel (split-K partial sums in the metadata's scratch), larger ones a tensor-core
/// kernel over (slot, 64-token tile) items against every slice's A rows at once (x read
/// once), K split over a cluster. Anything else runs a generic kernel.
Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta, StreamHandle stream);
/// SGMV expand over the metadata, all slices in one launch (tensor cores when aligned).
Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta, StreamHandle stream);
/// BGMV (decode gather) forms: tokens in batch order, each gathering its slot's weights.
Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping, StreamHandle stream);
Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping, StreamHandle stream);

/// Shrink then expand of one layer. Small batches (up to 64 tokens by default) run a decode
/// path that does not write shrink.out: ONE kernel of thread-block clusters that reduces the
/// split-K shrink over distributed shared memory (cluster_lora.cu) wherever its staged weights
/// fit; else split-K partial sums in the metadata's scratch, through the per-token kernel pair
/// chained with PDL (gather_lora.cu) while tokens x max_rank is small, or ONE persistent kernel
/// with per-(slot, slice) arrival counters (decode_lora.cu); see kernel_tuning.h. Larger
/// batches run lora_shrink into shrink.out and lora_expand from it. expand.in must be
/// shrink.out.
Status lora_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                   StreamHandle stream);
/// Which path lora_linear takes for these arguments: "cluster", "gather", "fused", "split" or
/// "generic".
std::string lora_linear_path(const ShrinkArgs& shrink, const ExpandArgs& expand,
                             const LoraMetaView& meta);
/// Largest batch (tokens) that runs a decode path (lora_linear's gather / fused, and the decode
/// kernel's lora_shrink); a negative value restores the default. For benchmarks and tests that
/// compare the paths; not thread-safe against launches.
void set_fused_linear_max_tokens(int max_tokens);

Status lora_expand_fp8(const ExpandFp8Args& args, const LoraMetaView& meta, StreamHandle stream);
Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& args, StreamHandle stream);
Status lora_embedding(const EmbeddingLoraArgs& args, StreamHandle stream);
/// One block per slot: that slot's (token, k) pairs grouped by expert (stable), each expert
/// group padded to block_size; sorted_ids/expert_ids are fully written (padding, -1).
Status moe_lora_align_block_size(const MoeAlignArgs& args, StreamHandle stream);
/// Fused MoE LoRA: one CTA per routed pair (naive blocks, small batches) or per
/// (slot, aligned block) (large batches); shrink into shared memory, then expand.
Status fused_moe_lora(const FusedMoeLoraArgs& args, StreamHandle stream);

}  // namespace loraplex::kernels::cuda
