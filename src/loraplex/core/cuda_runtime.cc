#include "loraplex/core/cuda_runtime.h"

#include "loraplex/core/error.h"

#if LORAPLEX_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace loraplex::cuda_rt {

#if LORAPLEX_WITH_CUDA

namespace {

cudaMemcpyKind to_cuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
    case CopyKind::kHostToHost:
      return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    LORAPLEX_FAIL("CUDA call ", what, " failed: ", cudaGetErrorString(err), " (error ",
                  static_cast<int>(err), ")");
  }
}

cudaStream_t as_stream(StreamHandle s) { return static_cast<cudaStream_t>(s); }

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for a CPU run
    return 0;
  }
  return count;
}

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

void* try_device_malloc(size_t bytes, int device) {
  set_device(device);
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;
  }
  check(err, "cudaMalloc");
  return ptr;
}

void* device_malloc(size_t bytes, int device) {
  void* ptr = try_device_malloc(bytes, device);
  LORAPLEX_CHECK(ptr != nullptr || bytes == 0, "out of GPU memory on cuda:", device, " allocating ",
                 bytes, " bytes");
  return ptr;
}

void device_free(void* ptr, int device) {
  if (ptr == nullptr) return;
  set_device(device);
  check(cudaFree(ptr), "cudaFree");
}

void* pinned_host_malloc(size_t bytes) {
  void* ptr = nullptr;
  check(cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault), "cudaHostAlloc");
  return ptr;
}

void pinned_host_free(void* ptr) {
  if (ptr != nullptr) check(cudaFreeHost(ptr), "cudaFreeHost");
}

void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind, StreamHandle stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), as_stream(stream)), "cudaMemcpyAsync");
}

void memcpy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows, CopyKind kind, StreamHandle stream) {
  if (row_bytes == 0 || rows == 0) return;
  check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, to_cuda(kind),
                          as_stream(stream)),
        "cudaMemcpy2DAsync");
}

void memset_async(void* dst, int value, size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(dst, value, bytes, as_stream(stream)), "cudaMemsetAsync");
}

StreamHandle stream_create(int device) {
  set_device(device);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return stream;
}

void stream_destroy(StreamHandle stream) {
  if (stream != nullptr) cudaStreamDestroy(as_stream(stream));
}

void stream_synchronize(StreamHandle stream) {
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void device_synchronize() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

EventHandle event_create() {
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  return event;
}

void event_destroy(EventHandle event) {
  if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(EventHandle event, StreamHandle stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)), "cudaEventRecord");
}

void stream_wait_event(StreamHandle stream, EventHandle event) {
  check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

void event_synchronize(EventHandle event) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void check_last_error(const char* what) { check(cudaGetLastError(), what); }

MemoryInfo memory_info(int device) {
  set_device(device);
  MemoryInfo info;
  check(cudaMemGetInfo(&info.free, &info.total), "cudaMemGetInfo");
  return info;
}

void begin_capture(StreamHandle stream) {
  check(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture");
}

GraphHandle end_capture(StreamHandle stream) {
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(as_stream(stream), &graph);
  if (err != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
    check(err, "cudaStreamEndCapture");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(inst, "cudaGraphInstantiate");
  return exec;
}

void graph_launch(GraphHandle graph, StreamHandle stream) {
  check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), as_stream(stream)), "cudaGraphLaunch");
}

void graph_destroy(GraphHandle graph) {
  if (graph != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

#else  // !LORAPLEX_WITH_CUDA

namespace {
[[noreturn]] void no_cuda(const char* what) {
  LORAPLEX_FAIL(what, " needs CUDA, but this loraplex was built without the CUDA backend");
}
}  // namespace

int device_count() { return 0; }
void set_device(int) { no_cuda("set_device"); }
int current_device() { no_cuda("current_device"); }
void* try_device_malloc(size_t, int) { no_cuda("device memory"); }
void* device_malloc(size_t, int) { no_cuda("device memory"); }
void device_free(void*, int) { no_cuda("device memory"); }
void* pinned_host_malloc(size_t) { no_cuda("pinned host memory"); }
void pinned_host_free(void*) { no_cuda("pinned host memory"); }
void memcpy_async(void*, const void*, size_t, CopyKind, StreamHandle) { no_cuda("memcpy"); }
void memcpy_2d_async(void*, size_t, const void*, size_t, size_t, size_t, CopyKind, StreamHandle) {
  no_cuda("memcpy");
}
void memset_async(void*, int, size_t, StreamHandle) { no_cuda("memset"); }
StreamHandle stream_create(int) { no_cuda("a stream"); }
void stream_destroy(StreamHandle) {}
void stream_synchronize(StreamHandle stream) {
  if (stream != nullptr) no_cuda("stream_synchronize");
}
void device_synchronize() {}
EventHandle event_create() { no_cuda("an event"); }
void event_destroy(EventHandle) {}
void event_record(EventHandle, StreamHandle) { no_cuda("an event"); }
void stream_wait_event(StreamHandle, EventHandle) { no_cuda("an event"); }
void event_synchronize(EventHandle) { no_cuda("an event"); }
void check_last_error(const char*) {}
MemoryInfo memory_info(int) { no_cuda("device memory"); }
void begin_capture(StreamHandle) { no_cuda("a CUDA graph"); }
GraphHandle end_capture(StreamHandle) { no_cuda("a CUDA graph"); }
void graph_launch(GraphHandle, StreamHandle) { no_cuda("a CUDA graph"); }
void graph_destroy(GraphHandle) {}

#endif

}  // namespace loraplex::cuda_rt
