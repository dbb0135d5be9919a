#pragma once
// The logits adjustments of one step's sampled rows (SequenceStep::adjust, only_listed), staged
// for the decoder's device: gathered from the StepBatch in sampling order, checked, copied to
// device buffers that grow as needed, and applied to the logits before sampling
// (logit_adjust_ops.h). Sizes vary from step to step, so a step with adjustments runs without
// a CUDA graph.

#include <cstdint>
#include <vector>

#include "loraplex/core/tensor.h"
#include "loraplex/model/step_batch.h"

namespace loraplex::model {

class StepLogitAdjustments {
 public:
  /// Gathers `batch`'s adjustments (sampled rows, in order). Returns whether there are any;
  /// throws loraplex::Error naming a sequence whose ids are outside [0, vocab) or repeated.
  bool stage(const StepBatch& batch, int64_t vocab);
  bool active() const { return active_; }
  /// Adjusts `logits` ([rows, vocab] of `dtype`, on `stream`'s device) as staged, copying the
  /// adjustments to the device first.
  void apply(void* logits, DType dtype, int64_t vocab, const Stream& stream);

 private:
  // `host`'s bytes on the device, in `buffer` (grown when too small).
  const void* upload(const void* host, size_t bytes, Tensor& buffer, const Stream& stream);

  bool active_ = false;
  std::vector<int32_t> row_begin_;
  std::vector<LogitAdjustment> entries_;
  std::vector<uint8_t> only_listed_;
  std::vector<float> host_scratch_;
  Tensor row_begin_dev_, entries_dev_, only_listed_dev_, scratch_dev_;
};

}  // namespace loraplex::model
