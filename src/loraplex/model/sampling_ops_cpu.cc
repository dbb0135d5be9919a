// The batched CPU sampler: each row converted to float32 in the workspace and handed to
// sample_row (the rule's definition) with the rest of the workspace as its scratch.

#include <cmath>
#include <span>

#include "loraplex/model/sampler.h"
#include "loraplex/model/sampling_ops.h"

namespace loraplex::model::ops {

size_t sample_workspace_bytes(int64_t /*max_rows*/, int64_t vocab) {
  // One converted row and sample_row's scratch of two rows.
  return 3 * static_cast<size_t>(vocab < 0 ? 0 : vocab) * sizeof(float);
}

namespace cpu {
namespace {

Status check_params(const SampleArgs& a, int64_t r) {
  const float t = a.temperature[r];
  LORAPLEX_ENSURE(t >= 0.0f && std::isfinite(t), "sample: row ", r,
                  " temperature must be a finite number >= 0, got ", t);
  LORAPLEX_ENSURE(a.top_k[r] >= 0, "sample: row ", r, " top_k must be >= 0 (0 = off), got ",
                  a.top_k[r]);
  LORAPLEX_ENSURE(a.top_p[r] > 0.0f && a.top_p[r] <= 1.0f, "sample: row ", r,
                  " top_p must be in (0, 1], got ", a.top_p[r]);
  LORAPLEX_ENSURE(a.min_p == nullptr || (a.min_p[r] >= 0.0f && a.min_p[r] <= 1.0f), "sample: row ",
                  r, " min_p must be in [0, 1], got ", a.min_p == nullptr ? 0.0f : a.min_p[r]);
  const bool greedy = t == 0.0f || a.top_k[r] == 1;
  LORAPLEX_ENSURE(greedy || (a.uniform[r] >= 0.0 && a.uniform[r] < 1.0), "sample: row ", r,
                  " uniform must be in [0, 1), got ", a.uniform[r]);
  return Status();
}

}  // namespace

Status sample(const SampleArgs& a) {
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16,
                  "sample: logits dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.vocab >= 1 && a.row_stride >= a.vocab, "sample: num_rows ",
                  a.num_rows, ", vocab ", a.vocab, ", row_stride ", a.row_stride,
                  " (need num_rows >= 0, vocab >= 1, row_stride >= vocab)");
  if (a.num_rows == 0) return Status();
  LORAPLEX_ENSURE(a.logits != nullptr && a.temperature != nullptr && a.top_k != nullptr &&
                      a.top_p != nullptr && a.uniform != nullptr && a.banned != nullptr &&
                      a.ids != nullptr,
                  "sample: a required pointer is null");
  const size_t need = sample_workspace_bytes(a.num_rows, a.vocab);
  LORAPLEX_ENSURE(a.workspace != nullptr && a.workspace_bytes >= need, "sample: workspace of ",
                  a.workspace_bytes, " bytes, need ", need);
  for (int64_t r = 0; r < a.num_rows; ++r) LORAPLEX_RETURN_IF_ERROR(check_params(a, r));

  const auto n = static_cast<size_t>(a.vocab);
  float* const row_f32 = static_cast<float*>(a.workspace);
  const std::span<float> scratch(row_f32 + n, 2 * n);
  try {
    for (int64_t r = 0; r < a.num_rows; ++r) {
      const int64_t offset = r * a.row_stride;
      const float* row = row_f32;
      if (a.dtype == DType::kF32) {
        row = static_cast<const float*>(a.logits) + offset;
      } else {
        const auto* bits = static_cast<const uint16_t*>(a.logits) + offset;
        for (size_t j = 0; j < n; ++j) {
          row_f32[j] =
              a.dtype == DType::kF16 ? f16_bits_to_float(bits[j]) : bf16_bits_to_float(bits[j]);
        }
      }
      const std::span<const float> logits(row, n);
      const SamplingParams params{a.temperature[r], a.top_k[r], a.top_p[r],
                                  a.min_p == nullptr ? 0.0f : a.min_p[r]};
      const std::span<const int32_t> banned(a.banned + r * kMaxBannedTokens, kMaxBannedTokens);
      const int32_t id = sample_row(logits, params, a.uniform[r], banned, scratch);
      a.ids[r] = id;
      if (a.logprobs != nullptr) a.logprobs[r] = token_logprob(logits, id);
    }
  } catch (const Error& e) {
    return Status(StatusCode::kInternal, e.what());
  }
  return Status();
}

}  // namespace cpu
}  // namespace loraplex::model::ops
