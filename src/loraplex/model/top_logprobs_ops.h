#pragma once
// The k most probable ids of each logit row and their log-probabilities (OpenAI's top
// logprobs), as a framework-free argument struct over raw pointers (as sampling_ops.h). Order:
// largest logit first, ties to the lower id; NaN logits never count. Log-probabilities are
// log_softmax of the row as token_logprob (sampler.h) defines it; the CPU sums in double, the
// GPU too (in another order), so the two agree to about 1e-6, and on the ids exactly.

#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"

namespace loraplex::model::ops {

/// vLLM's default max_logprobs.
inline constexpr int kMaxTopLogprobs = 20;

struct TopLogprobsArgs {
  DType dtype = DType::kF32;  // of logits: f32, f16 or bf16
  int64_t num_rows = 0;
  int64_t vocab = 0;             // >= k
  const void* logits = nullptr;  // [num_rows, row_stride] in
  int64_t row_stride = 0;        // elements, >= vocab
  int k = 0;                     // 1 .. kMaxTopLogprobs
  int32_t* ids = nullptr;        // [num_rows, k] out
  float* logprobs = nullptr;     // [num_rows, k] out
};

inline Status check_top_logprobs_args(const TopLogprobsArgs& a) {
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16,
                  "top_logprobs: logits dtype ", a.dtype,
                  ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.k >= 1 && a.k <= kMaxTopLogprobs && a.vocab >= a.k && a.num_rows >= 0 &&
                      a.row_stride >= a.vocab,
                  "top_logprobs: k ", a.k, " (1 .. ", kMaxTopLogprobs, "), vocab ", a.vocab,
                  ", num_rows ", a.num_rows, ", row_stride ", a.row_stride);
  LORAPLEX_ENSURE(
      a.num_rows == 0 || (a.logits != nullptr && a.ids != nullptr && a.logprobs != nullptr),
      "top_logprobs: a required pointer is null");
  return Status();
}

namespace cpu {
Status top_logprobs(const TopLogprobsArgs& a);
}  // namespace cpu

/// Pointers are device pointers. Without the CUDA backend: kUnsupported.
namespace cuda {
Status top_logprobs(const TopLogprobsArgs& a, const Stream& stream);
}  // namespace cuda

}  // namespace loraplex::model::ops
