#pragma once
// Kernel durations of a stretch of device work, from CUPTI's activity records (graph replays
// included), grouped into the components of a model step: where the time of a step goes.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loraplex::cli {

struct KernelRecord {
  std::string name;  // demangled
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  uint32_t stream = 0;
};

/// Records every kernel that runs between start() and stop() (one at a time per process).
/// Without CUPTI (a build without CUDA) available() is false and stop() returns nothing.
class KernelProfile {
 public:
  static bool available();
  void start();
  /// Waits for the device, flushes the records and stops recording.
  std::vector<KernelRecord> stop();
};

/// The component of a step a kernel belongs to: "base_gemm", "attention", "lora",
/// "norm_rope_act", "sampling" or "other".
std::string kernel_component(const std::string& name);

/// Per component: milliseconds of kernel time; plus "kernels" (all of them), "busy" (the union
/// of the kernels' intervals) and, given the wall time of the stretch, "host_gaps" (wall time
/// with no kernel running).
std::map<std::string, double> component_ms(const std::vector<KernelRecord>& records,
                                           double wall_ms);

/// One kernel name's share of a stretch: its total milliseconds and launches.
struct KernelTotal {
  std::string name;  // demangled, template arguments and parameters cut to keep it readable
  double ms = 0.0;
  int64_t launches = 0;
};

/// The records from the last launch of a kernel whose name contains `first_kernel` (the kernel
/// that opens a step) to the end, in start order: the last step's timeline. All of them, in
/// start order, when no such kernel ran.
std::vector<KernelRecord> last_step(std::vector<KernelRecord> records,
                                    const std::string& first_kernel);

/// The `n` kernels (by name) that took the most time, longest first.
std::vector<KernelTotal> top_kernels(const std::vector<KernelRecord>& records, size_t n);

}  // namespace loraplex::cli
