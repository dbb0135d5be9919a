#include "loraplex/kernels/lora_ops_checks.h"

#include <algorithm>
#include <vector>

namespace loraplex::kernels {
namespace {

bool is_activation(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

Status check_common(const char* op, DType dtype, int64_t num_tokens, int num_slices, int max_loras,
                    int max_rank, const int32_t* ranks) {
  LORAPLEX_ENSURE(is_activation(dtype), op, ": dtype ", dtype,
                  " is not supported, expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(num_tokens >= 0, op, ": num_tokens ", num_tokens, " < 0");
  LORAPLEX_ENSURE(num_slices >= 1 && num_slices <= kMaxSlices, op, ": num_slices ", num_slices,
                  ", expected 1..", kMaxSlices);
  LORAPLEX_ENSURE(max_loras >= 1, op, ": max_loras ", max_loras, ", expected >= 1");
  LORAPLEX_ENSURE(max_rank >= 1, op, ": max_rank ", max_rank, ", expected >= 1");
  LORAPLEX_ENSURE(ranks != nullptr, op, ": ranks pointer is null");
  return Status();
}

bool slot_enabled(const int32_t* adapter_enabled, int32_t slot) {
  return slot >= 0 && (adapter_enabled == nullptr || adapter_enabled[slot] != 0);
}

}  // namespace

Status check_shrink_args(const ShrinkArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_common("lora_shrink", a.dtype, a.num_tokens, a.num_slices,
                                        a.max_loras, a.max_rank, a.ranks));
  LORAPLEX_ENSURE(a.out_dtype == DType::kF32 || a.out_dtype == a.dtype,
                  "lora_shrink: output dtype ", a.out_dtype, ", expected float32 or ", a.dtype);
  LORAPLEX_ENSURE(a.hidden >= 1, "lora_shrink: hidden ", a.hidden, ", expected >= 1");
  LORAPLEX_ENSURE(a.x_row_stride >= a.hidden, "lora_shrink: x row stride ", a.x_row_stride,
                  " is smaller than hidden ", a.hidden);
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(a.x != nullptr && a.out != nullptr, "lora_shrink: null x or out");
  for (int s = 0; s < a.num_slices; ++s) {
    LORAPLEX_ENSURE(a.lora_a[s] != nullptr, "lora_shrink: LoRA-A of slice ", s, " is null");
  }
  return Status();
}

Status check_expand_args(const ExpandArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_common("lora_expand", a.dtype, a.num_tokens, a.num_slices,
                                        a.max_loras, a.max_rank, a.ranks));
  LORAPLEX_ENSURE(a.in_dtype == DType::kF32 || a.in_dtype == a.dtype,
                  "lora_expand: intermediate dtype ", a.in_dtype, ", expected float32 or ",
                  a.dtype);
  LORAPLEX_ENSURE(a.offset_start >= 0, "lora_expand: offset_start ", a.offset_start, " < 0");
  int64_t end = a.offset_start;
  for (int s = 0; s < a.num_slices; ++s) {
    LORAPLEX_ENSURE(a.slice_width[s] >= 1, "lora_expand: slice ", s, " width ", a.slice_width[s],
                    ", expected >= 1");
    end += a.slice_width[s];
  }
  LORAPLEX_ENSURE(end <= a.y_row_stride, "lora_expand: slices end at column ", end,
                  " past the output row stride ", a.y_row_stride);
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(a.in != nullptr && a.y != nullptr, "lora_expand: null input or output");
  for (int s = 0; s < a.num_slices; ++s) {
    LORAPLEX_ENSURE(a.lora_b[s] != nullptr, "lora_expand: LoRA-B of slice ", s, " is null");
  }
  return Status();
}

Status check_shrink_fp8_args(const ShrinkFp8Args& a) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(a.base));
  LORAPLEX_ENSURE(a.base.out_dtype == DType::kF32, "lora_shrink_fp8: output dtype ",
                  a.base.out_dtype, ", expected float32");
  for (int s = 0; s < a.base.num_slices; ++s) {
    LORAPLEX_ENSURE(a.a_scale[s] != nullptr, "lora_shrink_fp8: scales of slice ", s, " are null");
  }
  return Status();
}

Status check_expand_fp8_args(const ExpandFp8Args& a) {
  ExpandArgs plain = a.base;
  // A W8A8 intermediate is fp8 and checked below, not as an activation dtype.
  if (a.w8a8) plain.in_dtype = DType::kF32;
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(plain));
  LORAPLEX_ENSURE(is_fp8(a.weight_dtype), "lora_expand_fp8: weight dtype ", a.weight_dtype,
                  ", expected float8_e4m3 or float8_e5m2");
  if (a.scale_kind == Fp8ScaleKind::kPerBlock) {
    LORAPLEX_ENSURE(a.group_n >= 1 && a.group_k >= 1, "lora_expand_fp8: block scale groups ",
                    a.group_n, "x", a.group_k, ", expected >= 1");
  }
  for (int s = 0; s < a.base.num_slices; ++s) {
    LORAPLEX_ENSURE(a.b_scale[s] != nullptr, "lora_expand_fp8: scale of slice ", s, " is null");
  }
  if (a.w8a8) {
    LORAPLEX_ENSURE(is_fp8(a.in_fp8_dtype), "lora_expand_fp8: W8A8 intermediate dtype ",
                    a.in_fp8_dtype, ", expected float8_e4m3 or float8_e5m2");
    LORAPLEX_ENSURE(a.in_scale != nullptr, "lora_expand_fp8: W8A8 needs the intermediate scale");
  }
  return Status();
}

Status check_quantize_args(const QuantizeIntermediateArgs& a) {
  const char* op = "quantize_intermediate_fp8";
  LORAPLEX_ENSURE(is_fp8(a.out_dtype), op, ": output dtype ", a.out_dtype,
                  ", expected float8_e4m3 or float8_e5m2");
  LORAPLEX_ENSURE(a.num_slices >= 1 && a.num_slices <= kMaxSlices && a.max_loras >= 1 &&
                      a.max_rank >= 1 && a.num_tokens >= 0,
                  op, ": bad sizes (slices ", a.num_slices, ", max_loras ", a.max_loras,
                  ", max_rank ", a.max_rank, ", tokens ", a.num_tokens, "), expected slices 1..",
                  kMaxSlices, ", max_loras >= 1, max_rank >= 1, tokens >= 0");
  LORAPLEX_ENSURE(a.ranks != nullptr, op, ": ranks pointer is null");
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(
      a.in != nullptr && a.out != nullptr && a.scale != nullptr && a.token_lora_mapping != nullptr,
      op, ": null input, output, scale or token mapping");
  return Status();
}

Status check_embedding_args(const EmbeddingLoraArgs& a) {
  const char* op = "lora_embedding";
  LORAPLEX_ENSURE(is_activation(a.dtype), op, ": dtype ", a.dtype,
                  ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.vocab >= 1 && a.hidden >= 1 && a.max_loras >= 1 &&
                      a.max_rank >= 1 && a.y_row_stride >= a.hidden,
                  op, ": bad sizes (tokens ", a.num_tokens, ", vocab ", a.vocab, ", hidden ",
                  a.hidden, ", max_loras ", a.max_loras, ", max_rank ", a.max_rank, ", row stride ",
                  a.y_row_stride, "), expected all >= 1 and stride >= hidden");
  LORAPLEX_ENSURE(a.ranks != nullptr, op, ": ranks pointer is null");
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(a.token_ids != nullptr && a.token_lora_mapping != nullptr &&
                      a.lora_a != nullptr && a.lora_b != nullptr && a.y != nullptr,
                  op, ": null token ids, mapping, weights or output");
  return Status();
}

Status check_moe_align_args(const MoeAlignArgs& a) {
  const char* op = "moe_lora_align_block_size";
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.block_size >= 1 &&
                      a.max_loras >= 1,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", block ", a.block_size, ", max_loras ", a.max_loras,
                  "), expected tokens >= 0 and the others >= 1");
  const MoeAlignSizes need = moe_align_sizes(a.num_tokens * a.top_k, a.num_experts, a.block_size);
  LORAPLEX_ENSURE(a.max_num_tokens_padded >= need.max_num_tokens_padded &&
                      a.max_num_m_blocks >= need.max_num_m_blocks,
                  op, ": buffers hold ", a.max_num_tokens_padded, " ids and ", a.max_num_m_blocks,
                  " blocks, need ", need.max_num_tokens_padded, " and ", need.max_num_m_blocks);
  LORAPLEX_ENSURE(
      a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr, op,
      ": null sorted_ids, expert_ids or num_tokens_post_pad");
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(a.topk_ids != nullptr && a.token_lora_mapping != nullptr, op,
                  ": null topk_ids or token mapping");
  return Status();
}

Status check_fused_moe_args(const FusedMoeLoraArgs& a) {
  const char* op = "fused_moe_lora";
  LORAPLEX_ENSURE(is_activation(a.dtype), op, ": dtype ", a.dtype,
                  ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.hidden_in >= 1 &&
                      a.n >= 1 && a.max_loras >= 1 && a.max_rank >= 1 && a.num_slices >= 1 &&
                      a.num_slices <= kMaxSlices,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", K ", a.hidden_in, ", N ", a.n, ", max_loras ", a.max_loras,
                  ", max_rank ", a.max_rank, ", slices ", a.num_slices,
                  "), expected tokens >= 0, slices 1..", kMaxSlices, ", the others >= 1");
  LORAPLEX_ENSURE(a.offset >= 0 && a.offset + a.num_slices * a.n <= a.out_row_width, op,
                  ": slices cover columns [", a.offset, ", ", a.offset + a.num_slices * a.n,
                  ") of rows ", a.out_row_width, " wide");
  LORAPLEX_ENSURE(a.ranks != nullptr, op, ": ranks pointer is null");
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(!a.mul_routed_weight || a.topk_weights != nullptr, op,
                  ": mul_routed_weight needs topk_weights");
  LORAPLEX_ENSURE(a.x != nullptr && a.out != nullptr && a.token_lora_mapping != nullptr &&
                      a.topk_ids != nullptr,
                  op, ": null x, output, token mapping or topk_ids");
  for (int s = 0; s < a.num_slices; ++s) {
    LORAPLEX_ENSURE(a.lora_a[s] != nullptr && a.lora_b[s] != nullptr, op, ": LoRA-A or B of slice ",
                    s, " is null");
  }
  if (!a.naive_blocks) {
    LORAPLEX_ENSURE(
        a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr, op,
        ": aligned blocks need sorted_ids, expert_ids and num_tokens_post_pad");
    LORAPLEX_ENSURE(a.block_size >= 1 && a.max_num_m_blocks >= 0 && a.max_num_tokens_padded >= 0,
                    op, ": block size ", a.block_size, ", buffer rows of ", a.max_num_tokens_padded,
                    " ids and ", a.max_num_m_blocks,
                    " blocks; expected block size >= 1 and rows >= 0");
  }
  return Status();
}

Status check_meta_view(const LoraMetaView& meta, int64_t num_tokens, int max_loras,
                       const char* op) {
  LORAPLEX_ENSURE(meta.num_tokens == num_tokens, op, ": metadata built for ", meta.num_tokens,
                  " tokens, the call has ", num_tokens);
  LORAPLEX_ENSURE(meta.max_loras == max_loras, op, ": metadata built for max_loras ",
                  meta.max_loras, ", the weights have ", max_loras);
  LORAPLEX_ENSURE(meta.token_lora_mapping != nullptr && meta.sorted_token_indices != nullptr &&
                      meta.active_lora_ids != nullptr && meta.num_tokens_per_lora != nullptr &&
                      meta.lora_token_start_loc != nullptr && meta.num_active_loras != nullptr,
                  op, ": metadata has a null pointer");
  return Status();
}

Status check_ranks_host(const int32_t* ranks, int num_slices, int max_loras, int max_rank) {
  for (int s = 0; s < num_slices; ++s) {
    for (int k = 0; k < max_loras; ++k) {
      const int32_t r = ranks[s * max_loras + k];
      LORAPLEX_ENSURE(r >= 0 && r <= max_rank, "slice ", s, " slot ", k, " has rank ", r,
                      ", expected 0..", max_rank, " (the stacked weights' rank)");
    }
  }
  return Status();
}

Status check_mapping_host(const int32_t* mapping, int64_t num_tokens, int max_loras) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    LORAPLEX_ENSURE(mapping[t] >= -1 && mapping[t] < max_loras, "token ", t, " has LoRA slot ",
                    mapping[t], ", expected -1 (no LoRA) or a slot in [0, ", max_loras, ")");
  }
  return Status();
}

Status check_topk_host(const int32_t* topk_ids, int64_t num_pairs, int num_experts,
                       const char* op) {
  for (int64_t p = 0; p < num_pairs; ++p) {
    // -1 marks an expert that is not local (expert parallelism) and is skipped.
    LORAPLEX_ENSURE(topk_ids[p] >= -1 && topk_ids[p] < num_experts, op, ": pair ", p,
                    " routes to expert ", topk_ids[p], ", expected -1 or 0..", num_experts - 1);
  }
  return Status();
}

Status check_moe_blocks_host(const FusedMoeLoraArgs& a) {
  const char* op = "fused_moe_lora";
  const int64_t num_pairs = a.num_tokens * a.top_k;
  const int64_t capacity = a.max_num_m_blocks * a.block_size;
  std::vector<bool> seen(static_cast<size_t>(num_pairs), false);
  for (int32_t slot = 0; slot < a.max_loras; ++slot) {
    if (!slot_enabled(a.adapter_enabled, slot)) continue;
    const int64_t padded = a.num_tokens_post_pad[slot];
    LORAPLEX_ENSURE(padded >= 0 && padded <= a.max_num_tokens_padded && padded <= capacity &&
                        padded % a.block_size == 0,
                    op, ": slot ", slot, " has ", padded,
                    " padded pairs, expected a multiple of the block size ", a.block_size,
                    " in 0..", std::min(capacity, a.max_num_tokens_padded),
                    " (the aligned buffers)");
    const int64_t blocks = (padded + a.block_size - 1) / a.block_size;
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t expert = a.expert_ids[slot * a.max_num_m_blocks + b];
      if (expert < 0 || expert >= a.num_experts) continue;  // skipped, as vLLM does
      const int32_t* ids = a.sorted_ids + slot * a.max_num_tokens_padded + b * a.block_size;
      for (int i = 0; i < a.block_size; ++i) {
        const int64_t p = ids[i];
        if (p == num_pairs) continue;  // padding
        LORAPLEX_ENSURE(p >= 0 && p < num_pairs, op, ": slot ", slot, " block ", b, " lists pair ",
                        p, ", expected 0..", num_pairs - 1, " or the padding ", num_pairs);
        LORAPLEX_ENSURE(a.token_lora_mapping[p / a.top_k] == slot && a.topk_ids[p] == expert, op,
                        ": slot ", slot, " block ", b, " (expert ", expert, ") lists pair ", p,
                        " of slot ", a.token_lora_mapping[p / a.top_k], " routed to expert ",
                        a.topk_ids[p], "; the alignment does not match this batch");
        LORAPLEX_ENSURE(!seen[static_cast<size_t>(p)], op, ": pair ", p,
                        " is listed twice in the aligned blocks");
        seen[static_cast<size_t>(p)] = true;
      }
    }
  }
  return Status();
}

}  // namespace loraplex::kernels
