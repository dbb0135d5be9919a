#include "loraplex/layers/weight_upload.h"

#include <algorithm>

#include "loraplex/core/allocator.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/core/parallel.h"

namespace loraplex {
namespace {

// [rows, cols] view of a 1-D or 2-D tensor.
Tensor as_matrix(const Tensor& t) { return t.dim() == 1 ? t.view({1, t.size(0)}) : t; }

}  // namespace

WeightUpload::WeightUpload(Device device, size_t buffer_bytes, int buffers)
    : device_(device), buffer_bytes_(buffer_bytes) {
  LORAPLEX_CHECK(buffer_bytes >= 4096 && buffers >= 1, "WeightUpload: ", buffers, " buffers of ",
                 buffer_bytes, " bytes");
  if (device_.is_cuda()) {
    stream_ = Stream::create(device_);
    buffers_.resize(static_cast<size_t>(buffers));
  }
}

WeightUpload::~WeightUpload() {
  try {
    finish();
  } catch (...) {  // a destructor must not throw; the error surfaced at the next CUDA call
  }
}

WeightUpload::Buffer& WeightUpload::next_buffer() {
  Buffer& b = buffers_[next_];
  next_ = (next_ + 1) % buffers_.size();
  if (!b.host.defined()) {
    b.host = Tensor::empty_with({static_cast<int64_t>(buffer_bytes_)}, DType::kU8, Device::cpu(),
                                pinned_host_allocator());
    b.done = std::make_unique<Event>();
  }
  if (b.pending) b.done->synchronize();
  b.pending = false;
  return b;
}

void WeightUpload::copy(Tensor dst, const Tensor& src) {
  LORAPLEX_CHECK(dst.defined() && src.defined() && dst.shape() == src.shape() &&
                     (dst.dim() == 1 || dst.dim() == 2) && is_floating(src.dtype()),
                 "WeightUpload: cannot copy ", src.defined() ? src.describe() : "undefined",
                 " into ", dst.defined() ? dst.describe() : "undefined");
  LORAPLEX_CHECK(dst.device() == device_, "WeightUpload for ", device_, " got a destination on ",
                 dst.device());
  Tensor d = as_matrix(dst);
  const Tensor s = as_matrix(src);
  const int64_t rows = d.size(0);
  const int64_t cols = d.size(1);
  bytes_ += rows * cols * static_cast<int64_t>(dtype_size(d.dtype()));
  if (device_.is_cpu() || !s.device().is_cpu()) {
    LORAPLEX_CHECK(s.device() == device_ && (device_.is_cpu() || s.dtype() == d.dtype()),
                   "WeightUpload: a device source must be on ", device_, " in ", d.dtype(),
                   ", got ", s.describe());
    if (device_.is_cuda()) {
      d.copy_from_async(s, stream_);
      return;
    }
    parallel_for(0, rows, std::max<int64_t>(1, rows / 64), [&](int64_t lo, int64_t hi) {
      Tensor part = d.narrow(0, lo, hi - lo);
      part.copy_from(s.narrow(0, lo, hi - lo));
    });
    return;
  }
  LORAPLEX_CHECK(d.stride(1) == 1 && s.stride(1) == 1, "WeightUpload: rows must be contiguous");
  const size_t es = dtype_size(d.dtype());
  const size_t row_bytes = static_cast<size_t>(cols) * es;
  LORAPLEX_CHECK(row_bytes <= buffer_bytes_, "WeightUpload: a row of ", row_bytes,
                 " bytes exceeds the ", buffer_bytes_, "-byte buffers");
  const int64_t rows_per_chunk = static_cast<int64_t>(buffer_bytes_ / row_bytes);
  for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk) {
    const int64_t n = std::min(rows_per_chunk, rows - r0);
    Buffer& b = next_buffer();
    Tensor staged = Tensor::from_blob(b.host.data_ptr(), {n, cols}, d.dtype(), Device::cpu());
    // Converting and reading the mapped file are the host's share: spread over the threads.
    parallel_for(0, n, std::max<int64_t>(1, n / (4 * num_cpu_threads())),
                 [&](int64_t lo, int64_t hi) {
                   Tensor part = staged.narrow(0, lo, hi - lo);
                   part.copy_from(s.narrow(0, r0 + lo, hi - lo));
                 });
    cuda_rt::memcpy_2d_async(d.narrow(0, r0, n).data_ptr(), static_cast<size_t>(d.stride(0)) * es,
                             staged.data_ptr(), row_bytes, row_bytes, static_cast<size_t>(n),
                             cuda_rt::CopyKind::kHostToDevice, stream_.handle());
    b.done->record(stream_);
    b.pending = true;
  }
}

void WeightUpload::finish() {
  if (device_.is_cuda()) stream_.synchronize();
  for (Buffer& b : buffers_) b.pending = false;
}

}  // namespace loraplex
