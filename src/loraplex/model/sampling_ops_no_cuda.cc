// Without the CUDA backend cuda::sample reports kUnsupported (as model_ops_no_cuda.cc).

#include "loraplex/model/sampling_ops.h"

namespace loraplex::model::ops::cuda {

Status sample(const SampleArgs&, const Stream&) {
  return unsupported("sample: this build of loraplex has no CUDA backend");
}

}  // namespace loraplex::model::ops::cuda
