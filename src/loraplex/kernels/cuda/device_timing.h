#pragma once
// Measurement helpers for benchmarks and graph tests: CUDA graph capture and replay, timing
// events, an L2 flush, the device-to-device copy bandwidth and on-device random fill. They
// throw loraplex::Error on failure (they are tools, not kernels). Without CUDA every one
// throws saying so.

#include <cstddef>
#include <cstdint>
#include <string>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"

namespace loraplex::kernels::cuda {

struct DeviceInfo {
  std::string name;
  int sm_count = 0;
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
  int cc_major = 0;
  int cc_minor = 0;
};
DeviceInfo device_info(int device);

/// A CUDA graph captured from one stream (relaxed capture mode), instantiated once.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void begin_capture(cuda_rt::StreamHandle stream);
  /// Ends the capture and instantiates the graph.
  void end_capture();
  void replay(cuda_rt::StreamHandle stream) const;
  bool ready() const { return exec_ != nullptr; }

 private:
  cuda_rt::StreamHandle stream_ = nullptr;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

/// A pair of timing events around work on one stream.
class Timer {
 public:
  Timer();
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  void start(cuda_rt::StreamHandle stream);
  void stop(cuda_rt::StreamHandle stream);
  /// Waits for the stop event; milliseconds between the two.
  float elapsed_ms() const;

 private:
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

/// Reads `bytes` of `buffer` with normal-priority L2 loads: evicts (and cleans) the L2 for cold
/// timings.
void read_buffer(const void* buffer, size_t bytes, float* sink, cuda_rt::StreamHandle stream);
/// Fills `count` elements of a floating dtype with values uniform in +-[scale/8, scale]
/// (never zero) from a counter-based hash of `seed`.
void fill_random(void* data, DType dtype, int64_t count, uint64_t seed, float scale,
                 cuda_rt::StreamHandle stream);
/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written over the median time
/// of `iters` copies of `bytes`).
double copy_bandwidth_gbs(size_t bytes, int iters, cuda_rt::StreamHandle stream);
/// The SM clock (MHz) during a ~10 ms single-thread spin of known cycles, timed with events.
double measured_sm_clock_mhz(cuda_rt::StreamHandle stream);

}  // namespace loraplex::kernels::cuda
