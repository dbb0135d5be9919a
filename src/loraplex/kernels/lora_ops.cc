#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels {

MoeAlignSizes moe_align_sizes(int64_t num_pairs, int num_experts, int block_size) {
  // Worst case: every expert group needs block_size - 1 padding entries. With fewer pairs
  // than experts at most num_pairs groups exist, each padded to one block.
  int64_t padded = num_pairs + static_cast<int64_t>(num_experts) * (block_size - 1);
  if (num_pairs < num_experts) padded = num_pairs * block_size;
  padded = (padded + block_size - 1) / block_size * block_size;
  return {padded, padded / block_size};
}

bool moe_use_naive_blocks(int64_t num_tokens, int top_k, int num_experts, int max_loras) {
  // Measured on the CUDA kernels (align + aligned blocks against naive blocks, Qwen3-30B-A3B and
  // Mixtral-8x7B shapes): naive blocks win up to one pair per (slot, expert) and lose from two
  // on, where experts shared by a slot's pairs are read once per pair. vLLM's rule (pairs * 8)
  // aligned batches that naive blocks serve faster.
  return num_tokens * top_k <= static_cast<int64_t>(num_experts) * max_loras;
}

}  // namespace loraplex::kernels
