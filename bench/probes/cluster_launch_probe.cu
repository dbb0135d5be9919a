// Launch cost of thread-block clusters (docs/kernels.md): an almost
// empty kernel, and one with a single barrier.cluster (release/acquire), launched with clusters
// of 1..16 CTAs, 20 launches per CUDA graph, median of 50 replays per launch. Not built by
// CMake; run on the GPU machine as
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/clp bench/probes/cluster_launch_probe.cu
//   /tmp/clp
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>
__global__ void empty_k(int* p) {
  if (p && threadIdx.x == 9999) p[0] = 1;
}
__global__ void bar_k(int* p) {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  if (p && threadIdx.x == 9999) p[0] = 1;
}
float run(void (*k)(int*), int cs, int clusters, int smem, bool use_cluster) {
  cudaStream_t s;
  cudaStreamCreate(&s);
  cudaFuncSetAttribute((const void*)k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute((const void*)k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cs, clusters);
  cfg.blockDim = dim3(256);
  cfg.stream = s;
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cs;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = use_cluster ? 1 : 0;
  int* p = nullptr;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < 20; ++i) cudaLaunchKernelEx(&cfg, k, p);
  cudaStreamEndCapture(s, &g);
  if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) {
    printf("inst fail %s\n", cudaGetErrorString(cudaGetLastError()));
    return -1;
  }
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < 60; ++r) {
    cudaEventRecord(a, s);
    cudaGraphLaunch(ge, s);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (r >= 10) t.push_back(ms * 1000 / 20);
  }
  std::sort(t.begin(), t.end());
  cudaError_t e = cudaGetLastError();
  if (e) printf("err %s\n", cudaGetErrorString(e));
  return t[t.size() / 2];
}
int main() {
  for (int smem : {0, 60 * 1024}) {
    printf("smem %d: no cluster, 16x9 CTAs: empty %.2f us\n", smem,
           run(empty_k, 16, 9, smem, false));
    for (int cs : {1, 2, 4, 8, 16}) {
      int clusters = 144 / cs;
      printf("smem %d: cluster %2d x %3d: empty %.2f us, with cluster barrier %.2f us\n", smem, cs,
             clusters, run(empty_k, cs, clusters, smem, true),
             run(bar_k, cs, clusters, smem, true));
    }
    printf("smem %d: cluster 16 x 32: empty %.2f  barrier %.2f\n", smem,
           run(empty_k, 16, 32, smem, true), run(bar_k, 16, 32, smem, true));
    printf("smem %d: cluster 8 x 64: empty %.2f  barrier %.2f\n", smem,
           run(empty_k, 8, 64, smem, true), run(bar_k, 8, 64, smem, true));
  }
}
