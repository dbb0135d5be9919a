// Fused MoE LoRA on the CPU: the per-adapter expert alignment and the shrink+expand of each
// routed (token, k) pair. Work items are runs of pairs that share (slot, expert): the aligned
// blocks, or, with naive blocks, the pairs grouped here. Each item converts its expert's A and
// B to fp32 once per thread; a pair's arithmetic does not depend on the item it sits in.

#include <algorithm>
#include <vector>

#include "loraplex/kernels/cpu/cpu_common.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

bool slot_enabled(const int32_t* adapter_enabled, int32_t slot) {
  return slot >= 0 && (adapter_enabled == nullptr || adapter_enabled[slot] != 0);
}

// Pairs ids[0, count) (entries >= num_pairs are padding) routed to `expert` under `slot`.
struct WorkItem {
  int32_t slot;
  int32_t expert;
  const int32_t* ids;
  int64_t count;
};

template <typename T>
void run_items(const FusedMoeLoraArgs& a, const std::vector<WorkItem>& items) {
  const int64_t num_pairs = a.num_tokens * a.top_k;
  const int64_t k_dim = a.hidden_in;
  const int64_t n = a.n;
  std::vector<int64_t> prefix(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) {
    int64_t rank_sum = 0;
    for (int s = 0; s < a.num_slices; ++s) rank_sum += a.ranks[s * a.max_loras + items[i].slot];
    prefix[i + 1] = prefix[i] + items[i].count * (k_dim + (rank_sum + 1) * (k_dim + n));
  }
  detail::parallel_for_balanced(prefix, detail::kMinPartCost, [&](int64_t lo, int64_t hi) {
    float* xs = detail::scratch(0, k_dim);
    float* v = detail::scratch(1, a.max_rank);
    // A as [rank, K] and B packed in panels, both fp32, keyed by slot * E + expert.
    detail::WeightCache a_cache[kMaxSlices];
    float* bt[kMaxSlices];
    for (int s = 0; s < a.num_slices; ++s) {
      a_cache[s].data = detail::scratch(2 + s, a.max_rank * k_dim);
      bt[s] = detail::scratch(2 + kMaxSlices + s, detail::panel_floats(n, a.max_rank));
    }
    for (int64_t i = lo; i < hi; ++i) {
      const WorkItem& item = items[static_cast<size_t>(i)];
      const int64_t slot_expert = static_cast<int64_t>(item.slot) * a.num_experts + item.expert;
      for (int s = 0; s < a.num_slices; ++s) {
        const int32_t rank = a.ranks[s * a.max_loras + item.slot];
        if (rank > 0 && a_cache[s].key != slot_expert) {
          const T* lora_a = static_cast<const T*>(a.lora_a[s]) + slot_expert * a.max_rank * k_dim;
          detail::load_row(lora_a, rank * k_dim, a_cache[s].data);
          const T* lora_b = static_cast<const T*>(a.lora_b[s]) + slot_expert * n * a.max_rank;
          detail::pack_panels(n, rank, bt[s], [&](int64_t j, int32_t r) {
            return detail::to_float(lora_b[j * a.max_rank + r]);
          });
          a_cache[s].key = slot_expert;
        }
      }
      for (int64_t p_i = 0; p_i < item.count; ++p_i) {
        const int64_t pair = item.ids[p_i];
        if (pair >= num_pairs) continue;  // padding
        const int64_t x_row = a.x_rows_are_pairs ? pair : pair / a.top_k;
        detail::load_row(static_cast<const T*>(a.x) + x_row * k_dim, k_dim, xs);
        const float w = a.mul_routed_weight ? a.topk_weights[pair] : 1.0f;
        T* out = static_cast<T*>(a.out) + pair * a.out_row_width + a.offset;
        for (int s = 0; s < a.num_slices; ++s) {
          const int32_t rank = a.ranks[s * a.max_loras + item.slot];
          if (rank == 0 && a.add_inputs) continue;  // exactly no effect
          // The router weight scales the rank-r intermediate: the same product as scaling
          // the output, with r multiplies instead of n.
          for (int32_t r = 0; r < rank; ++r) {
            v[r] = w * detail::dot(xs, a_cache[s].data + r * k_dim, k_dim);
          }
          detail::expand_row(v, rank, bt[s], n, a.add_inputs, out + s * n);
        }
      }
    }
  });
}

}  // namespace

Status moe_lora_align_block_size(const MoeAlignArgs& a) {
  const char* op = "moe_lora_align_block_size";
  LORAPLEX_RETURN_IF_ERROR(check_moe_align_args(a));
  const int64_t num_pairs = a.num_tokens * a.top_k;
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  LORAPLEX_RETURN_IF_ERROR(check_topk_host(a.topk_ids, num_pairs, a.num_experts, op));
  const int64_t experts = a.num_experts;
  // Counting sort of the pairs by (slot, expert), ascending pair index within a group.
  std::vector<int64_t> next(static_cast<size_t>(a.max_loras * experts), 0);
  auto group_of = [&](int64_t p) -> int64_t {
    const int32_t slot = a.token_lora_mapping[p / a.top_k];
    if (!slot_enabled(a.adapter_enabled, slot) || a.topk_ids[p] < 0) return -1;
    return slot * experts + a.topk_ids[p];
  };
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t g = group_of(p);
    if (g >= 0) ++next[static_cast<size_t>(g)];
  }
  const int32_t pad = static_cast<int32_t>(num_pairs);
  for (int32_t slot = 0; slot < a.max_loras; ++slot) {
    int32_t* sorted = a.sorted_ids + slot * a.max_num_tokens_padded;
    int32_t* expert_ids = a.expert_ids + slot * a.max_num_m_blocks;
    std::fill(sorted, sorted + a.max_num_tokens_padded, pad);
    std::fill(expert_ids, expert_ids + a.max_num_m_blocks, -1);
    int64_t pos = 0;
    for (int64_t e = 0; e < experts; ++e) {
      int64_t& group = next[static_cast<size_t>(slot * experts + e)];
      const int64_t count = group;
      group = slot * a.max_num_tokens_padded + pos;  // now the next write position
      if (count == 0) continue;
      const int64_t padded = (count + a.block_size - 1) / a.block_size * a.block_size;
      std::fill(expert_ids + pos / a.block_size, expert_ids + (pos + padded) / a.block_size,
                static_cast<int32_t>(e));
      pos += padded;
    }
    a.num_tokens_post_pad[slot] = static_cast<int32_t>(pos);
  }
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t g = group_of(p);
    if (g >= 0) a.sorted_ids[next[static_cast<size_t>(g)]++] = static_cast<int32_t>(p);
  }
  return Status();
}

Status fused_moe_lora(const FusedMoeLoraArgs& a) {
  const char* op = "fused_moe_lora";
  LORAPLEX_RETURN_IF_ERROR(check_fused_moe_args(a));
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  const int64_t num_pairs = a.num_tokens * a.top_k;
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  LORAPLEX_RETURN_IF_ERROR(check_topk_host(a.topk_ids, num_pairs, a.num_experts, op));
  std::vector<WorkItem> items;
  std::vector<int32_t> pairs;
  if (a.naive_blocks) {
    // vLLM's naive assignment: every pair is its own block, slot from its token. Grouping the
    // pairs by (slot, expert) here only lets the items share converted weights.
    for (int64_t p = 0; p < num_pairs; ++p) {
      if (slot_enabled(a.adapter_enabled, a.token_lora_mapping[p / a.top_k]) &&
          a.topk_ids[p] >= 0) {
        pairs.push_back(static_cast<int32_t>(p));
      }
    }
    auto key = [&](int32_t p) {
      return static_cast<int64_t>(a.token_lora_mapping[p / a.top_k]) * a.num_experts +
             a.topk_ids[p];
    };
    std::stable_sort(pairs.begin(), pairs.end(),
                     [&](int32_t x, int32_t y) { return key(x) < key(y); });
    for (size_t i = 0; i < pairs.size(); ++i) {
      const int32_t p = pairs[i];
      const int32_t slot = a.token_lora_mapping[p / a.top_k];
      if (!items.empty() && items.back().slot == slot && items.back().expert == a.topk_ids[p]) {
        ++items.back().count;
      } else {
        items.push_back({slot, a.topk_ids[p], pairs.data() + i, 1});
      }
    }
  } else {
    LORAPLEX_RETURN_IF_ERROR(check_moe_blocks_host(a));
    for (int32_t slot = 0; slot < a.max_loras; ++slot) {
      if (!slot_enabled(a.adapter_enabled, slot)) continue;
      const int64_t blocks = (a.num_tokens_post_pad[slot] + a.block_size - 1) / a.block_size;
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t expert = a.expert_ids[slot * a.max_num_m_blocks + b];
        if (expert < 0 || expert >= a.num_experts) continue;
        items.push_back({slot, expert,
                         a.sorted_ids + slot * a.max_num_tokens_padded + b * a.block_size,
                         a.block_size});
      }
    }
  }
  dispatch_activation_dtype(a.dtype,
                            [&](auto tag) { run_items<typename decltype(tag)::type>(a, items); });
  return Status();
}

}  // namespace loraplex::kernels::cpu
