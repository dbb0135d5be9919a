#include "loraplex/core/allocator.h"

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"

namespace loraplex {
namespace {

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* ptr = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    LORAPLEX_CHECK(ptr != nullptr, "out of host memory allocating ", bytes, " bytes");
    return ptr;
  }
  void deallocate(void* ptr, size_t) override { std::free(ptr); }
};

class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override { return cuda_rt::pinned_host_malloc(bytes); }
  void deallocate(void* ptr, size_t) override { cuda_rt::pinned_host_free(ptr); }
  bool page_locked() const override { return true; }
};

// Best-fit reuse of freed blocks, rounded to 512 bytes (small) or 2 MiB (large) so that
// similar requests share blocks. Blocks are reused on the assumption that device work is
// ordered on one compute stream per device; code that frees memory still in use by another
// stream must synchronise first (the adapter loader copies into preallocated slots instead).
class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}
  ~CudaCachingAllocator() override = default;  // the driver reclaims memory at exit

  void* allocate(size_t bytes) override {
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.lower_bound(size);
    // Do not hand a huge block to a small request: that would pin the big block.
    if (it != free_.end() && it->first <= 2 * size + (2u << 20)) {
      void* ptr = it->second;
      const size_t block = it->first;
      free_.erase(it);
      stats_.cached_bytes -= static_cast<int64_t>(block);
      stats_.allocated_bytes += static_cast<int64_t>(block);
      sizes_[ptr] = block;
      return ptr;
    }
    void* ptr = cuda_rt::try_device_malloc(size, device_);
    if (ptr == nullptr) {
      release_cached_locked();
      ptr = cuda_rt::device_malloc(size, device_);
    }
    ++stats_.driver_allocations;
    stats_.allocated_bytes += static_cast<int64_t>(size);
    sizes_[ptr] = size;
    return ptr;
  }

  void deallocate(void* ptr, size_t) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) return;
    const size_t block = it->second;
    sizes_.erase(it);
    free_.emplace(block, ptr);
    stats_.allocated_bytes -= static_cast<int64_t>(block);
    stats_.cached_bytes += static_cast<int64_t>(block);
  }

  CachingAllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached_locked();
  }

 private:
  static size_t round_size(size_t bytes) {
    constexpr size_t kSmall = 512;
    constexpr size_t kLarge = 2u << 20;
    if (bytes <= (1u << 20)) return bytes == 0 ? kSmall : (bytes + kSmall - 1) / kSmall * kSmall;
    return (bytes + kLarge - 1) / kLarge * kLarge;
  }

  void release_cached_locked() {
    for (auto& [size, ptr] : free_) cuda_rt::device_free(ptr, device_);
    free_.clear();
    stats_.cached_bytes = 0;
  }

  const int device_;
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> sizes_;
  CachingAllocatorStats stats_;
};

CudaCachingAllocator& caching_allocator(int device) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<CudaCachingAllocator>> allocators;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = allocators[device];
  if (!slot) slot = std::make_unique<CudaCachingAllocator>(device);
  return *slot;
}

}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator allocator;
  return allocator;
}

Allocator& pinned_host_allocator() {
  static PinnedHostAllocator allocator;
  return allocator;
}

Allocator& cuda_allocator(int device) {
  LORAPLEX_CHECK(device >= 0 && device < cuda_device_count(), "device cuda:", device,
                 " is not available (", cuda_device_count(), " CUDA devices found)");
  return caching_allocator(device);
}

Allocator& allocator_for(Device device) {
  return device.is_cpu() ? cpu_allocator() : cuda_allocator(device.index);
}

CachingAllocatorStats cuda_allocator_stats(int device) { return caching_allocator(device).stats(); }

void cuda_allocator_empty_cache(int device) { caching_allocator(device).empty_cache(); }

}  // namespace loraplex
