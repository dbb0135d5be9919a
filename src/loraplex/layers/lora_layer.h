#pragma once
// What every LoRA-aware layer shares: its LoRA pool configuration and the adapter weights
// handed to set_lora.
//
// The adapter contract (docs: contracts.md "Layers"): set_lora(slot, slices) takes FULL
// (unsharded) adapter weights on the CPU in any float dtype, with the scale already folded
// into B. The layer validates everything first (so a failed set_lora leaves the slot as it
// was), slices A and B for its tensor-parallel rank, converts to lora_dtype and writes its
// device stacks. A rank-r adapter runs at rank r (SlotRanks), never at max_lora_rank.
// set_lora(slot, slices, copy_stream) and reset_lora(slot, copy_stream) do the same in
// copy_stream order: sources already pinned, in lora_dtype and with contiguous rows are copied
// without a host wait (the slot's ranks follow its weights on that stream); the caller keeps
// them alive and makes the compute stream wait for copy_stream before using the slot.
//
// Thread safety: set_lora / reset_lora must not run concurrently with forward (or with each
// other) on the same layer; the adapter manager serialises them. forward itself is not
// re-entrant either: a layer owns its workspaces and its output buffer.

#include <cstdint>
#include <vector>

#include "loraplex/core/dtype.h"
#include "loraplex/core/tensor.h"

namespace loraplex {

/// The LoRA pool of a layer (vLLM's LoRAConfig, the parts a layer needs).
struct LoraConfig {
  int max_loras = 1;       // slots
  int max_lora_rank = 16;  // largest adapter rank a slot accepts
  // dtype of the stacked weights; the Punica ops need it equal to the activation dtype.
  DType lora_dtype = DType::kBF16;
  // vLLM's fully_sharded_loras (S-LoRA): column layers also shard A by rank and all-gather the
  // rank-r intermediate; row layers all-reduce the intermediate and expand into their own
  // output shard.
  bool fully_sharded = false;
};

/// One output slice of an adapter (q, k, v; gate, up; ...). Undefined a and b (default
/// tensors) mean "the adapter does not target this slice": rank 0, exactly no effect.
struct LoraSliceWeights {
  Tensor a;  // [rank, in_features] FULL LoRA-A, CPU, any float dtype
  Tensor b;  // [out_features_of_slice, rank] FULL LoRA-B, CPU, scale folded in
};

/// Splits one fused adapter (A [rank, in], B [sum(sizes), rank]) into per-slice weights for a
/// layer with one LoRA slice per output (A shared by every slice, B split by `sizes`). Views,
/// no copies. This is how vLLM's variable-slice layer accepts a single fused LoRA.
std::vector<LoraSliceWeights> split_fused_lora(const Tensor& a, const Tensor& b,
                                               const std::vector<int64_t>& sizes);

}  // namespace loraplex
