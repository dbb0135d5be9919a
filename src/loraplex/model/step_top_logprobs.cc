#include "loraplex/model/step_top_logprobs.h"

#include <algorithm>
#include <cstring>

#include "loraplex/core/allocator.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"
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
  const int64_t n = rows_ * k_;
  if (n == 0) return;
  if (!host_ids_.defined() || host_ids_.numel() < n) {
    Allocator& host = stream.device().is_cpu() ? cpu_allocator() : pinned_host_allocator();
    host_ids_ = Tensor::empty_with({n}, DType::kI32, Device::cpu(), host);
    host_logprobs_ = Tensor::empty_with({n}, DType::kF32, Device::cpu(), host);
  }
  const size_t bytes = static_cast<size_t>(n) * 4;
  if (stream.device().is_cpu()) {
    std::memcpy(host_ids_.data_ptr(), ids_.data_ptr(), bytes);
    std::memcpy(host_logprobs_.data_ptr(), logprobs_.data_ptr(), bytes);
    return;
  }
  const auto d2h = cuda_rt::CopyKind::kDeviceToHost;
  cuda_rt::memcpy_async(host_ids_.data_ptr(), ids_.data_ptr(), bytes, d2h, stream.handle());
  cuda_rt::memcpy_async(host_logprobs_.data_ptr(), logprobs_.data_ptr(), bytes, d2h,
                        stream.handle());
}

void StepTopLogprobs::finish(StepResult& result) const {
  if (k_ == 0) return;
  const auto n = static_cast<size_t>(rows_ * k_);
  const int32_t* ids = n > 0 ? host_ids_.data<int32_t>() : nullptr;
  const float* lps = n > 0 ? host_logprobs_.data<float>() : nullptr;
  result.top_ids.assign(ids, ids + n);
  result.top_logprobs.assign(lps, lps + n);
}

}  // namespace loraplex::model
