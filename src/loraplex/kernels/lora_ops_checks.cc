#include "loraplex/kernels/lora_ops_checks.h"

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

}  // namespace loraplex::kernels
