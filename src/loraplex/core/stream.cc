#include "loraplex/core/stream.h"

#include "loraplex/core/error.h"

namespace loraplex {

Stream Stream::create(Device device) {
  LORAPLEX_CHECK(device.is_cuda(), "Stream::create needs a CUDA device, got ", device);
  LORAPLEX_CHECK(device.index < cuda_device_count(), "device ", device, " is not available (",
                 cuda_device_count(), " CUDA devices found)");
  cuda_rt::StreamHandle handle = cuda_rt::stream_create(device.index);
  std::shared_ptr<void> owner(handle, [](void* h) { cuda_rt::stream_destroy(h); });
  return Stream(device, handle, std::move(owner));
}

void Stream::synchronize() const {
  if (device_.is_cuda()) cuda_rt::stream_synchronize(handle_);
}

Event::Event() : handle_(cuda_rt::event_create()) {}
Event::~Event() { cuda_rt::event_destroy(handle_); }
void Event::record(const Stream& stream) { cuda_rt::event_record(handle_, stream.handle()); }
void Event::wait_on(const Stream& stream) const {
  cuda_rt::stream_wait_event(stream.handle(), handle_);
}
void Event::synchronize() const { cuda_rt::event_synchronize(handle_); }

}  // namespace loraplex
