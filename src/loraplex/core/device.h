#pragma once
// Where a tensor lives. CUDA presence is a run-time question: the same binary runs on machines
// with and without a GPU, so tests and the CLI ask cuda_device_count() instead of #ifdefs.

#include <iosfwd>
#include <string>
#include <string_view>

namespace loraplex {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device cpu() { return Device{DeviceKind::kCpu, 0}; }
  static Device cuda(int index = 0) { return Device{DeviceKind::kCuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  bool operator==(const Device& other) const = default;
  /// "cpu" or "cuda:N".
  std::string str() const;
  /// Parses "cpu", "cuda" (device 0) or "cuda:N"; throws loraplex::Error otherwise.
  static Device parse(std::string_view text);
};

std::ostream& operator<<(std::ostream& os, const Device& device);

/// True when this binary was built with the CUDA backend.
bool built_with_cuda();
/// Number of usable CUDA devices; 0 without a GPU, without a driver, or without CUDA support.
int cuda_device_count();

}  // namespace loraplex
