#include "loraplex/model/step_top_logprobs.h"

#include <algorithm>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/model/model_ops.h"
#include "loraplex/model/top_logprobs_ops.h"

namespace loraplex::model {

void StepTopLogprobs::stage(const StepBatch& batch) {
  LORAPLEX_CHECK(batch.top_logprobs >= 0 && batch.top_logprobs <= ops::kMaxTopLogprobs,
                 "step batch asks for ", batch.top_logprobs, " top logprobs, at most ",
                 ops::kMaxTopLogprobs);
  k_ = batch.top_logprobs;
  rows_ = 0;
}

void StepTopLogprobs::compute(const void* logits, DType dtype, int64_t rows, int64_t vocab,
                              const Stream& stream) {
  if (k_ == 0) return;
  rows_ = rows;
  const int64_t n = std::max<int64_t>(rows * k_, 1);
  if (!ids_.defined() || ids_.numel() < n) {
    ids_ = Tensor::empty({n}, DType::kI32, stream.device());
    logprobs_ = Tensor::empty({n}, DType::kF32, stream.device());
  }
  ops::TopLogprobsArgs a;
  a.dtype = dtype;
  a.num_rows = rows;
  a.vocab = vocab;
  a.logits = logits;
  a.row_stride = vocab;
  a.k = k_;
  a.ids = ids_.data<int32_t>();
  a.logprobs = logprobs_.data<float>();
  throw_if_error(ops::run(&ops::cpu::top_logprobs, &ops::cuda::top_logprobs, a, stream));
}

void StepTopLogprobs::download(const Stream& stream) {
  const size_t n = static_cast<size_t>(rows_ * k_);
  host_ids_.resize(n);
  host_logprobs_.resize(n);
  if (n == 0) return;
  if (stream.device().is_cpu()) {
    std::copy_n(ids_.data<int32_t>(), n, host_ids_.data());
    std::copy_n(logprobs_.data<float>(), n, host_logprobs_.data());
    return;
  }
  const auto d2h = cuda_rt::CopyKind::kDeviceToHost;
  cuda_rt::memcpy_async(host_ids_.data(), ids_.data_ptr(), n * 4, d2h, stream.handle());
  cuda_rt::memcpy_async(host_logprobs_.data(), logprobs_.data_ptr(), n * 4, d2h, stream.handle());
}

void StepTopLogprobs::finish(StepResult& result) const {
  if (k_ == 0) return;
  result.top_ids = host_ids_;
  result.top_logprobs = host_logprobs_;
}

}  // namespace loraplex::model
