#include "loraplex/kernels/cpu/cpu_common.h"

#include <algorithm>
#include <cassert>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu::detail {

float* scratch(int index, int64_t n) {
  thread_local std::vector<float> buffers[kScratchBuffers];
  assert(index >= 0 && index < kScratchBuffers);
  std::vector<float>& b = buffers[index];
  if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
  return b.data();
}

void lora_tokens_by_slot(const int32_t* mapping, int64_t num_tokens, int max_loras,
                         std::vector<int32_t>& order) {
  std::vector<int64_t> start(static_cast<size_t>(max_loras) + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (mapping[t] >= 0) ++start[static_cast<size_t>(mapping[t]) + 1];
  }
  for (int k = 0; k < max_loras; ++k) start[k + 1] += start[k];
  order.resize(static_cast<size_t>(start[static_cast<size_t>(max_loras)]));
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (mapping[t] >= 0) order[start[static_cast<size_t>(mapping[t])]++] = static_cast<int32_t>(t);
  }
}

Status tokens_from_meta(const LoraMetaView& meta, int64_t num_tokens, int max_loras, const char* op,
                        LoraTokens& out) {
  LORAPLEX_RETURN_IF_ERROR(check_meta_view(meta, num_tokens, max_loras, op));
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(meta.token_lora_mapping, num_tokens, max_loras));
  const int32_t active = *meta.num_active_loras;
  LORAPLEX_ENSURE(active >= 0 && active <= max_loras + 1, op, ": metadata has ", active,
                  " active slots, expected 0..", max_loras + 1);
  // The slot -1 group, when present, comes first in the sorted order.
  const int64_t skip =
      active > 0 && meta.active_lora_ids[0] == -1 ? meta.num_tokens_per_lora[0] : 0;
  LORAPLEX_ENSURE(skip >= 0 && skip <= num_tokens, op, ": metadata has ", skip,
                  " base-only tokens, the call has ", num_tokens, " tokens");
  for (int64_t p = skip; p < num_tokens; ++p) {
    const int32_t t = meta.sorted_token_indices[p];
    LORAPLEX_ENSURE(t >= 0 && t < num_tokens && meta.token_lora_mapping[t] >= 0, op,
                    ": metadata lists token ", t, " at sorted position ", p,
                    ", expected a LoRA token in [0, ", num_tokens, "); rebuild the metadata");
  }
  out.tokens = meta.sorted_token_indices + skip;
  out.count = num_tokens - skip;
  return Status();
}

void tokens_from_mapping(const int32_t* mapping, int64_t num_tokens, int max_loras,
                         LoraTokens& out) {
  lora_tokens_by_slot(mapping, num_tokens, max_loras, out.storage);
  out.tokens = out.storage.data();
  out.count = static_cast<int64_t>(out.storage.size());
}

void parallel_for_balanced(const std::vector<int64_t>& prefix, int64_t min_part_cost,
                           const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = static_cast<int64_t>(prefix.size()) - 1;
  if (n <= 0) return;
  const int64_t total = prefix.back();
  const int64_t parts = std::clamp<int64_t>(total / std::max<int64_t>(min_part_cost, 1), 1,
                                            std::min<int64_t>(num_cpu_threads(), n));
  if (parts == 1) {
    fn(0, n);
    return;
  }
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, n);
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t target = total * p / parts;
    bounds[p] = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
  }
  parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      if (bounds[p] < bounds[p + 1]) fn(bounds[p], bounds[p + 1]);
    }
  });
}

}  // namespace loraplex::kernels::cpu::detail
