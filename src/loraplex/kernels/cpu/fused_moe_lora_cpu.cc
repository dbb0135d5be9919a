// Fused MoE LoRA on the CPU: the per-adapter expert alignment and the shrink+expand of each
// routed (token, k) pair, visited through the aligned blocks or directly (naive blocks).

#include <algorithm>
#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

Status check_topk(const int32_t* topk_ids, int64_t num_pairs, int num_experts, const char* op) {
  for (int64_t p = 0; p < num_pairs; ++p) {
    // -1 marks an expert that is not local (expert parallelism) and is skipped.
    LORAPLEX_ENSURE(topk_ids[p] >= -1 && topk_ids[p] < num_experts, op, ": pair ", p,
                    " routes to expert ", topk_ids[p], ", expected -1 or 0..", num_experts - 1);
  }
  return Status();
}

bool slot_enabled(const int32_t* adapter_enabled, int32_t slot) {
  return slot >= 0 && (adapter_enabled == nullptr || adapter_enabled[slot] != 0);
}

template <typename T>
void apply_pair(const FusedMoeLoraArgs& a, int64_t pair, int32_t slot, int32_t expert, float* v) {
  const int64_t t = pair / a.top_k;
  const int64_t k_dim = a.hidden_in;
  const T* x = static_cast<const T*>(a.x) + (a.x_rows_are_pairs ? pair : t) * k_dim;
  T* out = static_cast<T*>(a.out) + pair * a.out_row_width + a.offset;
  const float w = a.mul_routed_weight ? a.topk_weights[pair] : 1.0f;
  const int64_t slot_expert = static_cast<int64_t>(slot) * a.num_experts + expert;
  for (int s = 0; s < a.num_slices; ++s) {
    const int32_t rank = a.ranks[s * a.max_loras + slot];
    const T* lora_a = static_cast<const T*>(a.lora_a[s]) + slot_expert * a.max_rank * k_dim;
    for (int32_t r = 0; r < rank; ++r) {
      float acc = 0.0f;
      for (int64_t i = 0; i < k_dim; ++i)
        acc += load_float(x[i]) * load_float(lora_a[r * k_dim + i]);
      v[r] = acc;
    }
    const T* lora_b = static_cast<const T*>(a.lora_b[s]) + slot_expert * a.n * a.max_rank;
    T* o = out + s * a.n;
    for (int64_t j = 0; j < a.n; ++j) {
      float acc = 0.0f;
      for (int32_t r = 0; r < rank; ++r) acc += v[r] * load_float(lora_b[j * a.max_rank + r]);
      acc *= w;
      if (a.add_inputs) acc += load_float(o[j]);
      o[j] = store_float<T>(acc);
    }
  }
}

template <typename T>
void fused_moe_typed(const FusedMoeLoraArgs& a) {
  const int64_t num_pairs = a.num_tokens * a.top_k;
  if (a.naive_blocks) {
    parallel_for(0, num_pairs, 4, [&](int64_t lo, int64_t hi) {
      std::vector<float> v(static_cast<size_t>(a.max_rank));
      for (int64_t p = lo; p < hi; ++p) {
        const int32_t slot = a.token_lora_mapping[p / a.top_k];
        const int32_t expert = a.topk_ids[p];
        if (slot_enabled(a.adapter_enabled, slot) && expert >= 0)
          apply_pair<T>(a, p, slot, expert, v.data());
      }
    });
    return;
  }
  // Work items are (slot, block); each pair sits in exactly one block, so writes are disjoint.
  const int64_t blocks = a.max_num_m_blocks;
  parallel_for(0, a.max_loras * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> v(static_cast<size_t>(a.max_rank));
    for (int64_t item = lo; item < hi; ++item) {
      const int32_t slot = static_cast<int32_t>(item / blocks);
      const int64_t block = item % blocks;
      if (!slot_enabled(a.adapter_enabled, slot)) continue;
      if (block * a.block_size >= a.num_tokens_post_pad[slot]) continue;
      const int32_t expert = a.expert_ids[item];
      if (expert < 0 || expert >= a.num_experts) continue;
      const int32_t* ids = a.sorted_ids + slot * a.max_num_tokens_padded + block * a.block_size;
      for (int i = 0; i < a.block_size; ++i) {
        if (ids[i] < num_pairs) apply_pair<T>(a, ids[i], slot, expert, v.data());
      }
    }
  });
}

}  // namespace

Status moe_lora_align_block_size(const MoeAlignArgs& a) {
  const char* op = "moe_lora_align_block_size";
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.block_size >= 1 &&
                      a.max_loras >= 1,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", block ", a.block_size, ", max_loras ", a.max_loras, ")");
  const int64_t num_pairs = a.num_tokens * a.top_k;
  const MoeAlignSizes need = moe_align_sizes(num_pairs, a.num_experts, a.block_size);
  LORAPLEX_ENSURE(a.max_num_tokens_padded >= need.max_num_tokens_padded &&
                      a.max_num_m_blocks >= need.max_num_m_blocks,
                  op, ": buffers hold ", a.max_num_tokens_padded, " ids and ", a.max_num_m_blocks,
                  " blocks, need ", need.max_num_tokens_padded, " and ", need.max_num_m_blocks);
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  LORAPLEX_RETURN_IF_ERROR(check_topk(a.topk_ids, num_pairs, a.num_experts, op));
  const int32_t pad = static_cast<int32_t>(num_pairs);
  std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(a.num_experts));
  for (int32_t slot = 0; slot < a.max_loras; ++slot) {
    int32_t* sorted = a.sorted_ids + slot * a.max_num_tokens_padded;
    int32_t* experts = a.expert_ids + slot * a.max_num_m_blocks;
    std::fill(sorted, sorted + a.max_num_tokens_padded, pad);
    std::fill(experts, experts + a.max_num_m_blocks, -1);
    a.num_tokens_post_pad[slot] = 0;
    if (!slot_enabled(a.adapter_enabled, slot)) continue;
    for (auto& list : by_expert) list.clear();
    for (int64_t p = 0; p < num_pairs; ++p) {
      if (a.token_lora_mapping[p / a.top_k] == slot && a.topk_ids[p] >= 0) {
        by_expert[static_cast<size_t>(a.topk_ids[p])].push_back(static_cast<int32_t>(p));
      }
    }
    int64_t pos = 0;
    for (int32_t e = 0; e < a.num_experts; ++e) {
      const auto& list = by_expert[static_cast<size_t>(e)];
      if (list.empty()) continue;
      std::copy(list.begin(), list.end(), sorted + pos);
      const int64_t padded =
          (static_cast<int64_t>(list.size()) + a.block_size - 1) / a.block_size * a.block_size;
      for (int64_t b = pos / a.block_size; b < (pos + padded) / a.block_size; ++b) experts[b] = e;
      pos += padded;
    }
    a.num_tokens_post_pad[slot] = static_cast<int32_t>(pos);
  }
  return Status();
}

Status fused_moe_lora(const FusedMoeLoraArgs& a) {
  const char* op = "fused_moe_lora";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.hidden_in >= 1 &&
                      a.n >= 1 && a.max_loras >= 1 && a.max_rank >= 1 && a.num_slices >= 1 &&
                      a.num_slices <= kMaxSlices,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", K ", a.hidden_in, ", N ", a.n, ", slices ", a.num_slices, ")");
  LORAPLEX_ENSURE(a.offset >= 0 && a.offset + a.num_slices * a.n <= a.out_row_width, op,
                  ": slices cover columns [", a.offset, ", ", a.offset + a.num_slices * a.n,
                  ") of rows ", a.out_row_width, " wide");
  LORAPLEX_ENSURE(!a.mul_routed_weight || a.topk_weights != nullptr, op,
                  ": mul_routed_weight needs topk_weights");
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  if (a.naive_blocks) {
    LORAPLEX_RETURN_IF_ERROR(check_topk(a.topk_ids, a.num_tokens * a.top_k, a.num_experts, op));
  } else {
    LORAPLEX_ENSURE(
        a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr, op,
        ": aligned blocks need sorted_ids, expert_ids and num_tokens_post_pad");
  }
  dispatch_activation_dtype(a.dtype,
                            [&](auto tag) { fused_moe_typed<typename decltype(tag)::type>(a); });
  return Status();
}

}  // namespace loraplex::kernels::cpu
