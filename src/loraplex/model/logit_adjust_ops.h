#pragma once
// The logits-adjustment step before sampling (vLLM's logit_bias, allowed_token_ids, bad_words
// and repetition, frequency and presence penalties) over a batch of logit rows, as a
// framework-free argument struct over raw pointers (as sampling_ops.h). Each row has a sparse
// list of adjustments (step_batch.h, LogitAdjustment: one id each, at most once per row) and a
// flag that first sets every id without one to -inf. The CPU version defines the semantics;
// the CUDA version computes the same float values (the same operations, in the same order, each
// rounded once), one block per row.

#include <cstddef>
#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/model/step_batch.h"

namespace loraplex::model::ops {

struct AdjustLogitsArgs {
  DType dtype = DType::kF32;  // of logits: f32, f16 or bf16
  int64_t num_rows = 0;
  int64_t vocab = 0;
  void* logits = nullptr;  // [num_rows, row_stride] in/out
  int64_t row_stride = 0;  // elements, >= vocab
  /// Row r's adjustments are entries[row_begin[r] .. row_begin[r + 1]).
  const int32_t* row_begin = nullptr;        // [num_rows + 1] in
  const LogitAdjustment* entries = nullptr;  // [row_begin[num_rows]] in
  const uint8_t* only_listed = nullptr;      // [num_rows] in: 1 = unlisted ids become -inf
  float* scratch = nullptr;                  // [row_begin[num_rows]] scratch
};

/// The adjusted value of one logit (the rule both versions compute).
inline float adjusted_logit(float logit, const LogitAdjustment& e) {
  float l = logit + e.bias;
  l = l > 0.0f ? l / e.repetition : l * e.repetition;
  return l - e.subtract;
}

/// The checks both versions make on the host: dtype, sizes and the pointers they need (an empty
/// batch needs none).
inline Status check_adjust_logits_args(const AdjustLogitsArgs& a) {
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16,
                  "adjust_logits: logits dtype ", a.dtype,
                  ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.vocab >= 1 && a.row_stride >= a.vocab,
                  "adjust_logits: num_rows ", a.num_rows, ", vocab ", a.vocab, ", row_stride ",
                  a.row_stride);
  LORAPLEX_ENSURE(a.num_rows == 0 ||
                      (a.logits != nullptr && a.row_begin != nullptr && a.only_listed != nullptr),
                  "adjust_logits: a required pointer is null");
  return Status();
}

namespace cpu {
/// Checks the ids (in the vocabulary) and the row offsets too (they are on the host here).
Status adjust_logits(const AdjustLogitsArgs& a);
}  // namespace cpu

/// Pointers are device pointers (row_begin included); nothing is read on the host. Without the
/// CUDA backend: kUnsupported.
namespace cuda {
Status adjust_logits(const AdjustLogitsArgs& a, const Stream& stream);
}  // namespace cuda

}  // namespace loraplex::model::ops
