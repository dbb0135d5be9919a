#include <map>
#include <mutex>
#include <utility>

#include "loraplex/kernels/cuda/cuda_common.cuh"

namespace loraplex::kernels::cuda {

int sm_count() {
  static std::mutex mutex;
  static std::map<int, int> counts;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = counts.find(device);
  if (it != counts.end()) return it->second;
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) {
    cudaGetLastError();
    n = 1;
  }
  counts[device] = n;
  return n;
}

int max_smem_optin() {
  static std::mutex mutex;
  static std::map<int, int> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 48 * 1024;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      v < 48 * 1024) {
    cudaGetLastError();
    v = 48 * 1024;
  }
  cache[device] = v;
  return v;
}

Status allow_dynamic_smem(const void* kernel, int bytes) {
  // Raising the limit is a function attribute, not stream work: done once (outside any
  // capture in practice, since the first call of every op is a warm-up) and cached.
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> done;
  int device = 0;
  LORAPLEX_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  std::lock_guard<std::mutex> lock(mutex);
  int& current = done[{kernel, device}];
  if (bytes <= current || bytes <= 48 * 1024) return Status();
  LORAPLEX_RETURN_IF_ERROR(
      cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                  "cudaFuncSetAttribute(max dynamic shared memory)"));
  current = bytes;
  return Status();
}

namespace {
uint64_t* g_kernel_trace = nullptr;
}  // namespace

void set_kernel_trace(uint64_t* device_buffer) { g_kernel_trace = device_buffer; }
uint64_t* kernel_trace() { return g_kernel_trace; }

}  // namespace loraplex::kernels::cuda
