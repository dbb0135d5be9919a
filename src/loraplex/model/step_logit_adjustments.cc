#include "loraplex/model/step_logit_adjustments.h"

#include <algorithm>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"
#include "loraplex/model/logit_adjust_ops.h"

namespace loraplex::model {

bool StepLogitAdjustments::stage(const StepBatch& batch, int64_t vocab) {
  row_begin_.assign(1, 0);
  entries_.clear();
  only_listed_.clear();
  active_ = false;
  std::vector<int32_t> ids;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SequenceStep& q = batch.seqs[i];
    if (!q.sample) continue;
    active_ = active_ || q.only_listed || !q.adjust.empty();
    ids.clear();
    for (const LogitAdjustment& e : q.adjust) {
      LORAPLEX_CHECK(e.id >= 0 && e.id < vocab, "step batch: sequence ", i,
                     " adjusts the logit of id ", e.id, ", outside the vocabulary [0, ", vocab,
                     ")");
      ids.push_back(e.id);
    }
    std::sort(ids.begin(), ids.end());
    LORAPLEX_CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end(), "step batch: sequence ",
                   i, " adjusts one id twice");
    entries_.insert(entries_.end(), q.adjust.begin(), q.adjust.end());
    row_begin_.push_back(static_cast<int32_t>(entries_.size()));
    only_listed_.push_back(q.only_listed ? 1 : 0);
  }
  return active_;
}

const void* StepLogitAdjustments::upload(const void* host, size_t bytes, Tensor& buffer,
                                         const Stream& stream) {
  if (bytes == 0) return nullptr;
  if (!buffer.defined() || buffer.nbytes() < bytes) {
    buffer = Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 4096))}, DType::kU8,
                           stream.device());
  }
  cuda_rt::memcpy_async(buffer.data_ptr(), host, bytes, cuda_rt::CopyKind::kHostToDevice,
                        stream.handle());
  return buffer.data_ptr();
}

void StepLogitAdjustments::apply(void* logits, DType dtype, int64_t vocab, const Stream& stream) {
  if (!active_) return;
  ops::AdjustLogitsArgs a;
  a.dtype = dtype;
  a.num_rows = static_cast<int64_t>(only_listed_.size());
  a.vocab = vocab;
  a.logits = logits;
  a.row_stride = vocab;
  if (stream.device().is_cpu()) {
    host_scratch_.resize(entries_.size());
    a.row_begin = row_begin_.data();
    a.entries = entries_.data();
    a.only_listed = only_listed_.data();
    a.scratch = host_scratch_.data();
  } else {
    a.row_begin = static_cast<const int32_t*>(
        upload(row_begin_.data(), row_begin_.size() * sizeof(int32_t), row_begin_dev_, stream));
    a.entries = static_cast<const LogitAdjustment*>(
        upload(entries_.data(), entries_.size() * sizeof(LogitAdjustment), entries_dev_, stream));
    a.only_listed = static_cast<const uint8_t*>(
        upload(only_listed_.data(), only_listed_.size(), only_listed_dev_, stream));
    const size_t scratch_bytes = std::max<size_t>(entries_.size(), 1) * sizeof(float);
    if (!scratch_dev_.defined() || scratch_dev_.nbytes() < scratch_bytes) {
      scratch_dev_ =
          Tensor::empty({static_cast<int64_t>(scratch_bytes)}, DType::kU8, stream.device());
    }
    a.scratch = static_cast<float*>(scratch_dev_.data_ptr());
    if (a.entries == nullptr) {
      // A row list of only only_listed rows: the kernel reads no entry, but takes a pointer.
      a.entries = reinterpret_cast<const LogitAdjustment*>(scratch_dev_.data_ptr());
    }
  }
  throw_if_error(ops::run(&ops::cpu::adjust_logits, &ops::cuda::adjust_logits, a, stream));
}

}  // namespace loraplex::model
