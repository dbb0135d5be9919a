// Latency probes behind the decode cost model (docs/kernels.md): dependent loads at three
// footprints (L2 / DRAM), __threadfence() after a store, and kernels in a CUDA graph (empty, one
// load, 10 and 20 dependent loads). Not built by CMake; run on the GPU machine as
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/lat bench/probes/latency_probe.cu
//   /tmp/lat
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

__global__ void chase(const unsigned* next, int steps, unsigned* out, long long* cyc) {
  unsigned i = 0;
  const long long t0 = clock64();
  for (int s = 0; s < steps; ++s) i = __ldcg(next + i);
  const long long t1 = clock64();
  *out = i;
  *cyc = t1 - t0;
}

__global__ void empty_kernel() {}

__global__ void one_load(const unsigned* p, unsigned* out) {
  out[threadIdx.x + blockIdx.x * 32] = __ldcg(p + (blockIdx.x * 7919u) % (1u << 20));
}

__global__ void fence_kernel(unsigned* p, int n) {
  const long long t0 = clock64();
  for (int i = 0; i < n; ++i) {
    p[threadIdx.x] = i;
    __threadfence();
  }
  const long long t1 = clock64();
  if (threadIdx.x == 0) p[1000] = static_cast<unsigned>(t1 - t0);
}

int main() {
  const size_t big = size_t{1} << 30;
  unsigned* buf = nullptr;
  unsigned* out = nullptr;
  long long* cyc = nullptr;
  cudaMalloc(&buf, big);
  cudaMalloc(&out, 1 << 20);
  cudaMalloc(&cyc, 8);
  for (size_t foot : {size_t{1} << 20, size_t{32} << 20, size_t{1} << 30}) {
    const size_t n = foot / 4;
    const size_t stride = 4096 / 4 + 33;  // more than a page per step
    std::vector<unsigned> h(n);
    for (size_t k = 0; k < n; ++k) h[k] = static_cast<unsigned>((k + stride) % n);
    cudaMemcpy(buf, h.data(), n * 4, cudaMemcpyHostToDevice);
    chase<<<1, 1>>>(buf, 1000, out, cyc);  // warm-up
    chase<<<1, 1>>>(buf, 2000, out, cyc);
    long long c = 0;
    cudaMemcpy(&c, cyc, 8, cudaMemcpyDeviceToHost);
    std::printf("chase footprint %zu MB: %.1f cycles per dependent load\n", foot >> 20, c / 2000.0);
  }
  fence_kernel<<<1, 32>>>(out, 100);
  unsigned fc = 0;
  cudaMemcpy(&fc, out + 1000, 4, cudaMemcpyDeviceToHost);
  std::printf("threadfence after a store: %.1f cycles each\n", fc / 100.0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto graph_time = [&](auto launch, const char* name) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (int i = 0; i < 20; ++i) launch();
    cudaStreamEndCapture(s, &g);
    cudaGraphInstantiate(&ge, g, 0);
    cudaGraphLaunch(ge, s);
    cudaStreamSynchronize(s);
    float best = 1e9f;
    for (int r = 0; r < 10; ++r) {
      cudaEventRecord(a, s);
      cudaGraphLaunch(ge, s);
      cudaEventRecord(b, s);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      best = ms < best ? ms : best;
    }
    std::printf("%s: %.2f us per kernel in a graph\n", name, best * 1000 / 20);
  };
  graph_time([&] { empty_kernel<<<1, 32, 0, s>>>(); }, "empty 1 block");
  graph_time([&] { empty_kernel<<<264, 256, 0, s>>>(); }, "empty 264x256");
  graph_time([&] { one_load<<<264, 32, 0, s>>>(buf, out); }, "one load 264 blocks");
  graph_time([&] { chase<<<1, 1, 0, s>>>(buf, 10, out, cyc); }, "10 dependent loads");
  graph_time([&] { chase<<<1, 1, 0, s>>>(buf, 20, out, cyc); }, "20 dependent loads");
  std::printf("status: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
