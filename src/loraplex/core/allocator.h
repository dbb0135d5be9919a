#pragma once
// Memory sources for tensors. GPU memory comes from a caching allocator (cudaMalloc is slow
// and synchronises the device), so steady-state steps never reach the driver.

#include <cstddef>
#include <cstdint>

#include "loraplex/core/device.h"

namespace loraplex {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  /// True for page-locked host memory, which a GPU can copy from without the host waiting.
  virtual bool page_locked() const { return false; }
};

/// 64-byte aligned host memory.
Allocator& cpu_allocator();
/// Page-locked host memory, for asynchronous host-to-device copies.
Allocator& pinned_host_allocator();
/// The caching allocator of CUDA device `device`.
Allocator& cuda_allocator(int device);
/// The allocator for tensors on `device`.
Allocator& allocator_for(Device device);

struct CachingAllocatorStats {
  int64_t allocated_bytes = 0;     // handed out and not yet returned
  int64_t cached_bytes = 0;        // returned and kept for reuse
  int64_t driver_allocations = 0;  // cudaMalloc calls so far
};
CachingAllocatorStats cuda_allocator_stats(int device);
/// Returns every cached (free) block of `device` to the driver.
void cuda_allocator_empty_cache(int device);

}  // namespace loraplex
