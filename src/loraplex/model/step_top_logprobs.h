#pragma once
// The top logprobs of one step's sampled rows (StepBatch::top_logprobs) for the decoder:
// computed from the raw logits (before any adjustment) on the step's device into buffers that
// grow as needed, and brought back with the sampled ids. A step that asks for them runs
// without a CUDA graph.

#include <cstdint>

#include "loraplex/core/tensor.h"
#include "loraplex/model/step_batch.h"

namespace loraplex::model {

class StepTopLogprobs {
 public:
  /// Takes the step's k (0: none); throws loraplex::Error when it is above the limit.
  void stage(const StepBatch& batch);
  int k() const { return k_; }
  /// Computes them for `rows` rows of `logits` ([rows, vocab] of `dtype`) on `stream`.
  void compute(const void* logits, DType dtype, int64_t rows, int64_t vocab, const Stream& stream);
  /// Enqueues their copy to the host (CUDA: into page-locked buffers, so that the host does not
  /// wait here); after the stream has finished, `finish` fills `result`.
  void download(const Stream& stream);
  void finish(StepResult& result) const;

 private:
  int k_ = 0;
  int64_t rows_ = 0;
  Tensor ids_, logprobs_;            // on the step's device
  Tensor host_ids_, host_logprobs_;  // page-locked on CUDA; grown as needed
};

}  // namespace loraplex::model
