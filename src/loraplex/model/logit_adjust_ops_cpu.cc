#include <cmath>
#include <limits>

#include "loraplex/model/logit_adjust_ops.h"

namespace loraplex::model::ops::cpu {
namespace {

float read(DType dtype, const void* logits, int64_t i) {
  switch (dtype) {
    case DType::kF16:
      return f16_bits_to_float(static_cast<const uint16_t*>(logits)[i]);
    case DType::kBF16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(logits)[i]);
    default:
      return static_cast<const float*>(logits)[i];
  }
}

void write(DType dtype, void* logits, int64_t i, float v) {
  switch (dtype) {
    case DType::kF16:
      static_cast<uint16_t*>(logits)[i] = float_to_f16_bits(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(logits)[i] = float_to_bf16_bits(v);
      break;
    default:
      static_cast<float*>(logits)[i] = v;
  }
}

}  // namespace

Status adjust_logits(const AdjustLogitsArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_adjust_logits_args(a));
  if (a.num_rows == 0) return Status();
  LORAPLEX_ENSURE(a.row_begin[0] == 0, "adjust_logits: row_begin[0] is ", a.row_begin[0]);
  for (int64_t r = 0; r < a.num_rows; ++r) {
    LORAPLEX_ENSURE(a.row_begin[r + 1] >= a.row_begin[r], "adjust_logits: row ", r,
                    " ends before it begins");
  }
  const int32_t total = a.row_begin[a.num_rows];
  LORAPLEX_ENSURE(total == 0 || (a.entries != nullptr && a.scratch != nullptr),
                  "adjust_logits: ", total, " entries without entries or scratch");
  for (int32_t k = 0; k < total; ++k) {
    LORAPLEX_ENSURE(a.entries[k].id >= 0 && a.entries[k].id < a.vocab, "adjust_logits: entry ", k,
                    " has id ", a.entries[k].id, ", outside the vocabulary [0, ", a.vocab, ")");
  }
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const int64_t base = r * a.row_stride;
    for (int32_t k = a.row_begin[r]; k < a.row_begin[r + 1]; ++k) {
      a.scratch[k] = adjusted_logit(read(a.dtype, a.logits, base + a.entries[k].id), a.entries[k]);
    }
    if (a.only_listed[r] != 0) {
      for (int64_t j = 0; j < a.vocab; ++j) {
        write(a.dtype, a.logits, base + j, -std::numeric_limits<float>::infinity());
      }
    }
    for (int32_t k = a.row_begin[r]; k < a.row_begin[r + 1]; ++k) {
      write(a.dtype, a.logits, base + a.entries[k].id, a.scratch[k]);
    }
  }
  return Status();
}

}  // namespace loraplex::model::ops::cpu
