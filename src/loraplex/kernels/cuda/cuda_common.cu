#include <map>
#include <mutex>
#include <utility>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"

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

LoraDevice lora_device(int index) {
  static std::mutex mutex;
  static std::map<int, LoraDevice> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(index);
  if (it != cache.end()) return it->second;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();
    return LoraDevice{};
  }
  LoraDevice d;
  d.limits.cc_major = prop.major;
  d.limits.cc_minor = prop.minor;
  d.limits.sm_count = prop.multiProcessorCount;
  d.limits.smem_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
  d.limits.smem_per_sm = static_cast<int>(prop.sharedMemPerMultiprocessor);
  d.limits.reserved_smem_per_block = static_cast<int>(prop.reservedSharedMemPerBlock);
  d.tuning = lora_tuning_for(prop.major, prop.minor);
  cache[index] = d;
  return d;
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
