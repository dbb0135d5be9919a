#include <algorithm>
#include <vector>

#include "loraplex/kernels/cpu/lora_ops_cpu.h"

namespace loraplex::kernels::cpu {

Status build_lora_meta(int32_t num_tokens, int32_t max_loras, const LoraMetaBuffers& out) {
  LORAPLEX_ENSURE(num_tokens >= 0, "build_lora_meta: num_tokens ", num_tokens, " < 0");
  LORAPLEX_ENSURE(max_loras >= 1, "build_lora_meta: max_loras ", max_loras, ", expected >= 1");
  const int32_t* mapping = out.token_lora_mapping;
  // Bucket 0 holds slot -1, bucket k + 1 holds slot k, so ascending buckets are ascending ids.
  std::vector<int32_t> counts(static_cast<size_t>(max_loras) + 1, 0);
  for (int32_t t = 0; t < num_tokens; ++t) {
    const int32_t slot = mapping[t];
    LORAPLEX_ENSURE(slot >= -1 && slot < max_loras, "token ", t, " has LoRA slot ", slot,
                    ", expected -1 (no LoRA) or a slot in [0, ", max_loras, ")");
    ++counts[static_cast<size_t>(slot + 1)];
  }
  std::vector<int32_t> next(counts.size(), 0);
  int32_t active = 0;
  int32_t offset = 0;
  std::fill(out.active_lora_ids, out.active_lora_ids + max_loras + 1, -1);
  std::fill(out.num_tokens_per_lora, out.num_tokens_per_lora + max_loras + 1, 0);
  std::fill(out.lora_token_start_loc, out.lora_token_start_loc + max_loras + 2, 0);
  for (size_t b = 0; b < counts.size(); ++b) {
    next[b] = offset;
    if (counts[b] == 0) continue;
    out.active_lora_ids[active] = static_cast<int32_t>(b) - 1;
    out.num_tokens_per_lora[active] = counts[b];
    out.lora_token_start_loc[active] = offset;
    offset += counts[b];
    ++active;
    out.lora_token_start_loc[active] = offset;
  }
  // Entries past the active ones keep the running total, so every start/end pair is valid.
  for (int32_t i = active + 1; i < max_loras + 2; ++i) out.lora_token_start_loc[i] = offset;
  for (int32_t t = 0; t < num_tokens; ++t) {
    out.sorted_token_indices[next[static_cast<size_t>(mapping[t] + 1)]++] = t;
  }
  *out.num_active_loras = active;
  return Status();
}

}  // namespace loraplex::kernels::cpu
