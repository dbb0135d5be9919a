// Without the CUDA backend cuda::adjust_logits and cuda::top_logprobs report kUnsupported (as
// sampling_ops_no_cuda.cc).

#include "loraplex/model/logit_adjust_ops.h"
#include "loraplex/model/top_logprobs_ops.h"

namespace loraplex::model::ops::cuda {

Status adjust_logits(const AdjustLogitsArgs&, const Stream&) {
  return unsupported("adjust_logits: this build of loraplex has no CUDA backend");
}

Status top_logprobs(const TopLogprobsArgs&, const Stream&) {
  return unsupported("top_logprobs: this build of loraplex has no CUDA backend");
}

}  // namespace loraplex::model::ops::cuda
