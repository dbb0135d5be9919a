// How many thread-block clusters of 16, 8 and 4 CTAs (256 threads) can be resident at once
// (cudaOccupancyMaxActiveClusters) for a range of dynamic shared memory sizes: the one-wave
// capacity of the cluster layer. A trivial kernel: registers do not limit it
// here (the cluster layer's 64 registers per thread cap it at 4 CTAs per SM). Not built by
// CMake; run on the GPU machine as
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/occ
//   bench/probes/cluster_occupancy_probe.cu /tmp/occ
#include <cuda_runtime.h>
#include <cstdio>
__global__ void __launch_bounds__(256) k(int* p) {
  if (p && threadIdx.x == 9999) p[0] = 1;
}
int main() {
  cudaFuncSetAttribute((const void*)k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute((const void*)k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  for (int kb : {20, 33, 39, 45, 52, 56, 59, 75, 100}) {
    for (int cs : {16, 8, 4}) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(cs, 64);
      cfg.blockDim = dim3(256);
      cfg.dynamicSmemBytes = kb * 1024;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = cs;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = -1;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&n, (void*)k, &cfg);
      int b = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, 256, kb * 1024);
      printf("smem %3d KB: blocks/SM %d, cluster %2d: max active clusters %d (%d CTAs) %s\n", kb, b,
             cs, n, n * cs, e ? cudaGetErrorString(e) : "");
    }
  }
}
