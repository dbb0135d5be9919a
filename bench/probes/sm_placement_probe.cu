// Where the CTAs of a one-wave grid land: the wgmma prefill shrink's 132 one-per-SM CTAs (227 KB
// of shared memory each) were placed on only 120 SMs, 8 of them taking two (that launch had
// in fact fallen back to clusters of 4). Here an otherwise empty kernel records each CTA's SM
// (%smid) and start time and then spins for 20 us, so that every CTA that can be resident at
// once is; for several shared-memory sizes and grids, alone and right after a 512 MB read (as
// the bench's cold timing runs it), with the default shared-memory carveout and with the largest.
// Prints the SMs used, the most CTAs on one SM and how many CTAs started 10 us or more after
// the first (a second wave). Not built by CMake; run on the GPU machine as
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/sp
//   bench/probes/sm_placement_probe.cu && /tmp/sp
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace cg = cooperative_groups;

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void place(int* sm, uint64_t* start, uint64_t spin_ns, int touch) {
  extern __shared__ int smem[];
  const uint64_t t0 = global_ns();
  if (threadIdx.x == 0) {
    int id;
    asm volatile("mov.u32 %0, %smid;" : "=r"(id));
    sm[blockIdx.x] = id;
    start[blockIdx.x] = t0;
    if (touch) smem[0] = id;  // the dynamic shared memory is used (none with 0 KB)
  }
  while (global_ns() - t0 < spin_ns) {
  }
}

// The same with the cluster calls the prefill shrink makes (it is launched without cluster
// dimensions when its split-K parts meet in global memory).
__global__ void place_cluster_api(int* sm, uint64_t* start, uint64_t spin_ns, int touch) {
  extern __shared__ int smem[];
  const uint64_t t0 = global_ns();
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) {
    int id;
    asm volatile("mov.u32 %0, %smid;" : "=r"(id));
    sm[blockIdx.x] = id + 1000 * static_cast<int>(cluster.num_blocks() - 1);
    start[blockIdx.x] = t0;
    if (touch) smem[0] = id;
  }
  while (global_ns() - t0 < spin_ns) {
  }
  if (touch > 1) cluster.sync();
}

__global__ void read_all(const float4* p, size_t n, float* out) {
  float s = 0.0f;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float4 v = p[i];
    s += v.x + v.y + v.z + v.w;
  }
  if (s == 12345.0f) *out = s;
}

int main() {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs, %zu KB shared memory per SM, %zu per block opt-in\n", prop.name,
              prop.multiProcessorCount, prop.sharedMemPerMultiprocessor / 1024,
              prop.sharedMemPerBlockOptin / 1024);
  const size_t flush_bytes = size_t{512} << 20;
  float4* flush = nullptr;
  float* sink = nullptr;
  int* sm = nullptr;
  uint64_t* start = nullptr;
  cudaMalloc(&flush, flush_bytes);
  cudaMemset(flush, 0, flush_bytes);
  cudaMalloc(&sink, 4);
  cudaMalloc(&sm, 4096 * sizeof(int));
  cudaMalloc(&start, 4096 * sizeof(uint64_t));
  const int max_smem = static_cast<int>(prop.sharedMemPerBlockOptin);
  cudaFuncSetAttribute(reinterpret_cast<const void*>(place),
                       cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  const int sms = prop.multiProcessorCount;
  cudaFuncSetAttribute(reinterpret_cast<const void*>(place_cluster_api),
                       cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  for (int kind = 0; kind < 2; ++kind) {
    auto* kernel = kind == 0 ? place : place_cluster_api;
    for (int carveout : {-1, 100}) {
      if (carveout >= 0) {
        cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
      }
      for (int kb : {0, 100, 200, max_smem / 1024}) {
        for (int grid : {sms - 4, sms, 2 * sms}) {
          for (int flushed = 0; flushed < 2; ++flushed) {
            if (flushed) read_all<<<4 * sms, 512>>>(flush, flush_bytes / 16, sink);
            kernel<<<grid, 256, static_cast<size_t>(kb) * 1024>>>(sm, start, 20000, kb > 0);
            const cudaError_t e = cudaDeviceSynchronize();
            if (e != cudaSuccess) {
              std::printf("smem %3d KB grid %3d: %s\n", kb, grid, cudaGetErrorString(e));
              continue;
            }
            std::vector<int> h(grid);
            std::vector<uint64_t> t(grid);
            cudaMemcpy(h.data(), sm, grid * sizeof(int), cudaMemcpyDeviceToHost);
            cudaMemcpy(t.data(), start, grid * sizeof(uint64_t), cudaMemcpyDeviceToHost);
            std::vector<int> per(1024, 0);
            for (int id : h) ++per[id % 1000];
            const int used = static_cast<int>(
                std::count_if(per.begin(), per.end(), [](int c) { return c > 0; }));
            const int most = *std::max_element(per.begin(), per.end());
            const uint64_t first = *std::min_element(t.begin(), t.end());
            const int late = static_cast<int>(
                std::count_if(t.begin(), t.end(), [&](uint64_t x) { return x - first >= 10000; }));
            int blocks = 0;
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 256,
                                                          static_cast<size_t>(kb) * 1024);
            std::printf(
                "%s carveout %4s smem %3d KB (occupancy %d/SM) grid %3d %s: %3d SMs used, at most "
                "%d "
                "CTAs on one, %3d CTAs started >= 10 us late\n",
                kind == 0 ? "plain  " : "cluster", carveout < 0 ? "auto" : "max", kb, blocks, grid,
                flushed ? "after a 512 MB read" : "alone", used, most, late);
          }
        }
      }
    }
  }
  return 0;
}
