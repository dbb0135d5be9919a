// What a decode LoRA layer can cost at the least on this GPU, whatever its arithmetic: kernels
// that move the bytes of the 1 slice / 8 adapters / 16 tokens / rank 16 case (A and B 1 MB each,
// from a rotating set of 64 weight sets = 128 MB so that they come from HBM; x 128 KB read, y
// 128 KB read and written) with the dependency structure of each layer design, and nothing else
// (a few integer adds instead of the MMAs). Timed as the bench's graph-with-rotating-weights
// figure: 64 calls in one CUDA graph, replayed, time per call.
//   empty      an empty kernel of 128 CTAs (the launch floor)
//   one_phase  one kernel reading A, B, x, y and writing y, no dependency between CTAs (what a
//              layer would cost if the shrink's result were not needed by other CTAs)
//   fused      one kernel of 128 CTAs (one per SM, all resident): A and B read first, x, a
//              16-byte partial per CTA, a GPU-wide handoff (release-add on a counter, every CTA
//              spinning until all arrived), 16 partials read, y written (the fused layer's shape)
//   pair_pdl   two kernels chained with PDL, as gather_lora.cu: the shrink reads A before its
//              griddepcontrol.wait and x after, writes its partial; the expand reads B and y
//              before its wait, triggers the next call's shrink at its start, then reads the
//              partials and writes y
//   pair       the same two kernels launched without PDL
//   pair_pdl_big        pair_pdl with the shrink as gather_lora.cu runs it at 16 tokens: 64 CTAs
//                       of 32 KB of A (two per 32 KB) instead of 128 of 8 KB
//   pair_pdl_first      pair_pdl with the expand launched at the shrink's start (its y read after
//                       its wait), as gather_lora.cu with pair_launch_first
//   pair_pdl_big_first  both
//   pair_pdl_big_first_meta  and the weights' addresses behind metadata loads as in gather_lora.cu
//                       (the shrink's A behind the token's slot, the expand's B behind the slot
//                       and its rank)
// Not built by CMake; run on the GPU machine as
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/df
//   bench/probes/decode_floor_probe.cu && /tmp/df
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kCtas = 128;
constexpr int kThreads = 256;
constexpr size_t kWeightBytes = size_t{1} << 20;  // A (and B) of one call
constexpr int kSets = 64;                         // 64 x 2 MB = 128 MB of weights
constexpr size_t kActBytes = size_t{128} << 10;   // x and y
constexpr int kCalls = 64;

struct Args {
  const uint4* a;
  const uint4* b;
  const uint4* x;
  uint4* y;
  uint4* partial;  // kCtas x 16 bytes
  unsigned* counter;
  const int* meta;  // zeros: the metadata lookups of kMeta (their values only offset addresses)
};

__device__ __forceinline__ uint4 add4(uint4 s, uint4 v) {
  return make_uint4(s.x + v.x, s.y + v.y, s.z + v.z, s.w + v.w);
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// This CTA's 8 KB of a weight matrix: two 16-byte loads per thread, issued at once.
__device__ __forceinline__ uint4 load_weights(const uint4* w) {
  const int i = blockIdx.x * (kThreads * 2) + threadIdx.x;
  return add4(__ldcg(w + i), __ldcg(w + i + kThreads));
}
// This CTA's 1 KB of an activation: 64 threads, 16 bytes each.
__device__ __forceinline__ int act_index() { return blockIdx.x * 64 + threadIdx.x; }

// CTA-wide sum of one uint4 per thread into thread 0 (the "arithmetic").
__device__ __forceinline__ uint4 cta_sum(uint4 v) {
  __shared__ uint4 s[kThreads];
  s[threadIdx.x] = v;
  __syncthreads();
  uint4 t = make_uint4(0, 0, 0, 0);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kThreads; i += 32) t = add4(t, s[i]);
  }
  __syncthreads();
  return t;
}

__global__ void empty_kernel() {}

__global__ void one_phase(Args p) {
  uint4 v = add4(load_weights(p.a), load_weights(p.b));
  if (threadIdx.x < 64) v = add4(v, add4(__ldcg(p.x + act_index()), __ldcg(p.y + act_index())));
  const uint4 s = cta_sum(v);
  if (threadIdx.x < 64) p.y[act_index()] = add4(s, v);
}

__global__ void fused(Args p) {
  const uint4 wa = load_weights(p.a);
  const uint4 wb = load_weights(p.b);
  uint4 yv = make_uint4(0, 0, 0, 0);
  uint4 v = wa;
  if (threadIdx.x < 64) {
    yv = __ldcg(p.y + act_index());
    v = add4(v, __ldcg(p.x + act_index()));
  }
  const uint4 s = cta_sum(v);
  if (threadIdx.x == 0) {
    p.partial[blockIdx.x] = s;
    unsigned one = 1;
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p.counter), "r"(one) : "memory");
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(p.counter) : "memory");
    } while (seen < kCtas);
  }
  __syncthreads();
  uint4 q = wb;
  if (threadIdx.x < 16) q = add4(q, __ldcg(p.partial + ((blockIdx.x & ~15) + threadIdx.x)));
  const uint4 t = cta_sum(q);
  if (threadIdx.x < 64) p.y[act_index()] = add4(yv, t);
  // The last CTA out resets the counter for the next call (stream-ordered after this kernel).
  if (threadIdx.x == 0) {
    if (atomicAdd(p.counter + 1, 1) == kCtas - 1) {
      p.counter[0] = 0;
      p.counter[1] = 0;
    }
  }
}

// kBig: 64 CTAs of 32 KB of A each, two CTAs per 32 KB (gather_lora.cu at 16 tokens over 8
// adapters: one token per CTA, 16 A rows x 1024 K, two tokens per adapter) instead of 128 x 8 KB.
// kFirst: the expand may launch at the shrink's start (pair_launch_first), so it reads y only
// after its own wait.
// kMeta: the A rows' address depends on one metadata load (the token's slot), the B columns' on
// two (the slot, then the slot's rank), as in gather_lora.cu.
template <bool kBig, bool kFirst, bool kMeta = false>
__global__ void pair_shrink(Args p) {
  if (kFirst) pdl_trigger();
  const int slot = kMeta ? __ldcg(p.meta + blockIdx.x) : 0;
  uint4 wa;
  if constexpr (kBig) {
    const uint4* w = p.a + slot + (blockIdx.x / 2) * (kThreads * 8);
    wa = make_uint4(0, 0, 0, 0);
    uint4 r[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = __ldcg(w + threadIdx.x + i * kThreads);
#pragma unroll
    for (int i = 0; i < 8; ++i) wa = add4(wa, r[i]);
  } else {
    wa = load_weights(p.a);  // weights: not written by the kernel before
  }
  pdl_wait();                  // x is (in a model: written by the kernel before)
  if (!kFirst) pdl_trigger();  // the expand may launch and read its weights and y
  uint4 v = wa;
  if (threadIdx.x < 64) v = add4(v, __ldcg(p.x + act_index()));
  const uint4 s = cta_sum(v);
  if (threadIdx.x == 0) p.partial[blockIdx.x] = s;
}

template <bool kFirst, bool kMeta = false>
__global__ void pair_expand(Args p) {
  int off = 0;
  if constexpr (kMeta) off = __ldcg(p.meta + 1024 + __ldcg(p.meta + blockIdx.x));
  const uint4 wb = load_weights(p.b + off);
  // y: in a model the base GEMM wrote it before the shrink started, which the shrink's wait
  // covered; read before this kernel's wait as gather_lora.cu does (not with kFirst).
  uint4 yv = make_uint4(0, 0, 0, 0);
  if (!kFirst && threadIdx.x < 64) yv = __ldcg(p.y + act_index());
  if (!kFirst) pdl_trigger();  // the next call's shrink may launch and read its weights
  pdl_wait();                  // the partials are written
  if (kFirst) pdl_trigger();
  if (kFirst && threadIdx.x < 64) yv = __ldcg(p.y + act_index());
  uint4 q = wb;
  if (threadIdx.x < 16) q = add4(q, __ldcg(p.partial + ((blockIdx.x & ~15) + threadIdx.x)));
  const uint4 t = cta_sum(q);
  if (threadIdx.x < 64) p.y[act_index()] = add4(yv, t);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename... A>
void launch_n(void (*k)(A...), int ctas, bool pdl, cudaStream_t s, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, k, args...), "launch");
}

template <typename... A>
void launch(void (*k)(A...), bool pdl, cudaStream_t s, A... args) {
  launch_n(k, kCtas, pdl, s, args...);
}

int main() {
  uint4* weights = nullptr;
  uint4* x = nullptr;
  uint4* y = nullptr;
  uint4* partial = nullptr;
  unsigned* counter = nullptr;
  int* meta = nullptr;
  check(cudaMalloc(&meta, 4096 * sizeof(int)), "malloc");
  cudaMemset(meta, 0, 4096 * sizeof(int));
  check(cudaMalloc(&weights, 2 * kWeightBytes * kSets), "malloc");
  check(cudaMalloc(&x, kActBytes), "malloc");
  check(cudaMalloc(&y, kActBytes), "malloc");
  check(cudaMalloc(&partial, kCtas * 16), "malloc");
  check(cudaMalloc(&counter, 8), "malloc");
  cudaMemset(weights, 1, 2 * kWeightBytes * kSets);
  cudaMemset(x, 2, kActBytes);
  cudaMemset(y, 3, kActBytes);
  cudaMemset(counter, 0, 8);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto args_of = [&](int call) {
    const size_t set = static_cast<size_t>(call % kSets);
    const uint4* a = weights + set * 2 * (kWeightBytes / 16);
    return Args{a, a + kWeightBytes / 16, x, y, partial, counter, meta};
  };
  const char* names[] = {"empty",
                         "one_phase",
                         "fused",
                         "pair_pdl",
                         "pair",
                         "pair_pdl_big",
                         "pair_pdl_first",
                         "pair_pdl_big_first",
                         "pair_pdl_big_first_meta"};
  int device = 0;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  std::printf("%s, %d SMs; 64 calls per graph, 64 weight sets of 2 MB rotating\n", prop.name,
              prop.multiProcessorCount);
  for (int v = 0; v < 9; ++v) {
    cudaGraph_t graph;
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
    for (int c = 0; c < kCalls; ++c) {
      const Args p = args_of(c);
      switch (v) {
        case 0:
          launch(empty_kernel, false, s);
          break;
        case 1:
          launch(one_phase, false, s, p);
          break;
        case 2:
          launch(fused, false, s, p);
          break;
        case 3:
        case 4:
          launch(pair_shrink<false, false>, v == 3, s, p);
          launch(pair_expand<false>, v == 3, s, p);
          break;
        case 5:
          launch_n(pair_shrink<true, false>, kCtas / 2, true, s, p);
          launch(pair_expand<false>, true, s, p);
          break;
        case 6:
          launch(pair_shrink<false, true>, true, s, p);
          launch(pair_expand<true>, true, s, p);
          break;
        case 7:
          launch_n(pair_shrink<true, true>, kCtas / 2, true, s, p);
          launch(pair_expand<true>, true, s, p);
          break;
        default:
          launch_n(pair_shrink<true, true, true>, kCtas / 2, true, s, p);
          launch(pair_expand<true, true>, true, s, p);
      }
    }
    check(cudaStreamEndCapture(s, &graph), "end capture");
    cudaGraphExec_t exec;
    check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> us;
    for (int r = 0; r < 12; ++r) {
      cudaEventRecord(e0, s);
      check(cudaGraphLaunch(exec, s), "graph launch");
      cudaEventRecord(e1, s);
      check(cudaEventSynchronize(e1), "sync");
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (r >= 2) us.push_back(ms * 1e3f / kCalls);
    }
    std::sort(us.begin(), us.end());
    std::printf("%-10s %.2f us per call (median of 10 replays; min %.2f)\n", names[v],
                us[us.size() / 2], us.front());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  return 0;
}
