#pragma once
// Base weights into device memory at page-cache speed. A checkpoint's tensors are views of
// memory-mapped files in any float dtype; a layer needs its shard in the model dtype on the
// device. Copying each through a fresh pageable buffer, one at a time, left the GPU idle while
// the host converted and the host idle while the GPU copied. Here several threads convert each
// source into one of a ring of pinned buffers while the device copies the previous ones in, so
// reading, converting and copying overlap (BENCHMARKS.md gives each run's load time).
//
// One WeightUpload serves a whole model load; layers take it as an optional argument of
// load_base. Not thread-safe: one loading thread calls copy().

#include <cstddef>
#include <cstdint>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"

namespace loraplex {

class WeightUpload {
 public:
  /// `device`: where the destinations live (on the CPU copies are plain conversions).
  explicit WeightUpload(Device device, size_t buffer_bytes = size_t{64} << 20, int buffers = 4);
  ~WeightUpload();
  WeightUpload(const WeightUpload&) = delete;
  WeightUpload& operator=(const WeightUpload&) = delete;

  /// dst = src converted to dst's dtype, enqueued. dst: [rows, cols] on the device, rows
  /// contiguous (row stride may exceed cols). src: the same shape, any float dtype, on the CPU
  /// (rows contiguous, any row stride; kept alive and unchanged until finish()) or on dst's
  /// device in dst's dtype (copied on the device). 1-D tensors count as one row.
  void copy(Tensor dst, const Tensor& src);
  /// Waits until every copy so far is on the device.
  void finish();
  /// The stream the device copies run on: work that makes a device source there is ordered
  /// before its copy, and its memory may be reused after it.
  const Stream& stream() const { return stream_; }
  /// Bytes copied so far (destination bytes).
  int64_t bytes() const { return bytes_; }

 private:
  struct Buffer {
    Tensor host;  // pinned u8 [buffer_bytes]
    std::unique_ptr<Event> done;
    bool pending = false;
  };
  // The next ring buffer, once the device has finished reading it.
  Buffer& next_buffer();

  Device device_;
  size_t buffer_bytes_;
  Stream stream_;
  std::vector<Buffer> buffers_;
  size_t next_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace loraplex
