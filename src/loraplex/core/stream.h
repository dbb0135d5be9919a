#pragma once
// An ordered queue of device work. On the CPU every operation is synchronous and the stream is
// a no-op; on CUDA it wraps a cudaStream_t. Copies of a Stream share the underlying handle.

#include <memory>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/device.h"

namespace loraplex {

class Stream {
 public:
  /// The CPU, or the legacy default CUDA stream of `device`.
  Stream() = default;
  static Stream default_for(Device device) { return Stream(device, nullptr, nullptr); }
  /// A new non-blocking stream on a CUDA device, destroyed with its last copy.
  static Stream create(Device device);
  /// Wraps a stream owned elsewhere (a caller's cudaStream_t).
  static Stream wrap(Device device, cuda_rt::StreamHandle handle) {
    return Stream(device, handle, nullptr);
  }

  Device device() const { return device_; }
  cuda_rt::StreamHandle handle() const { return handle_; }
  /// Blocks until all work queued so far has finished.
  void synchronize() const;

 private:
  Stream(Device device, cuda_rt::StreamHandle handle, std::shared_ptr<void> owner)
      : device_(device), handle_(handle), owner_(std::move(owner)) {}

  Device device_ = Device::cpu();
  cuda_rt::StreamHandle handle_ = nullptr;
  std::shared_ptr<void> owner_;
};

/// A point in a stream that other streams or the host can wait for (CUDA only).
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const Stream& stream);
  void wait_on(const Stream& stream) const;  // `stream` waits for this event
  void synchronize() const;

 private:
  cuda_rt::EventHandle handle_ = nullptr;
};

}  // namespace loraplex
