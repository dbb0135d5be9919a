#pragma once
// The few CUDA runtime calls that core needs (memory, copies, streams, events), behind plain
// C++ signatures so that headers above core never include cuda_runtime.h. In a build without
// CUDA every function here throws loraplex::Error saying so, and device_count() returns 0.

#include <cstddef>

namespace loraplex::cuda_rt {

/// A cudaStream_t, as an opaque pointer. nullptr is the legacy default stream.
using StreamHandle = void*;
/// A cudaEvent_t, as an opaque pointer.
using EventHandle = void*;

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };

int device_count();
void set_device(int device);
int current_device();

void* device_malloc(size_t bytes, int device);  // throws on failure, naming the size
/// Like device_malloc, but returns nullptr when the device is out of memory.
void* try_device_malloc(size_t bytes, int device);
void device_free(void* ptr, int device);
void* pinned_host_malloc(size_t bytes);
void pinned_host_free(void* ptr);

void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind, StreamHandle stream);
/// Copies `rows` rows of `row_bytes` between pitched buffers.
void memcpy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows, CopyKind kind, StreamHandle stream);
void memset_async(void* dst, int value, size_t bytes, StreamHandle stream);

StreamHandle stream_create(int device);  // non-blocking stream on `device`
void stream_destroy(StreamHandle stream);
void stream_synchronize(StreamHandle stream);
void device_synchronize();

EventHandle event_create();
void event_destroy(EventHandle event);
void event_record(EventHandle event, StreamHandle stream);
void stream_wait_event(StreamHandle stream, EventHandle event);
void event_synchronize(EventHandle event);

/// Free and total bytes of device memory (cudaMemGetInfo on `device`).
struct MemoryInfo {
  size_t free = 0;
  size_t total = 0;
};
MemoryInfo memory_info(int device);

/// A captured, instantiated CUDA graph (cudaGraphExec_t), as an opaque pointer.
using GraphHandle = void*;
/// Starts capturing the work this thread enqueues on `stream` (thread-local mode: other
/// threads may allocate and copy meanwhile).
void begin_capture(StreamHandle stream);
/// Ends the capture and instantiates it. On failure the capture is discarded and the error
/// (e.g. an operation that cannot be captured) thrown.
GraphHandle end_capture(StreamHandle stream);
void graph_launch(GraphHandle graph, StreamHandle stream);
void graph_destroy(GraphHandle graph);

/// Throws loraplex::Error naming `what` if a CUDA error is pending (clears it).
void check_last_error(const char* what);

}  // namespace loraplex::cuda_rt
