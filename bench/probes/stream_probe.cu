// Memory-pattern probes behind the prefill kernels' ceilings: what the expand's and the
// shrink's access patterns reach with no arithmetic, against a plain stream. y is 4096 rows of
// 4096 bf16 (32 MB), eight copies used in turn so L2 (50 MB) never holds the next one.
//   rmw_tile_smem: the expand's pattern: 64-row x 128-column items, a contiguous run per CTA
//                  (4 CTAs per SM), each item staged with cp.async, +1, stored from shared memory
//   rmw_tile_reg:  the same items through registers (no shared memory, no barriers)
//   rmw_wide_reg:  16-row x 1024-column items through registers
//   rmw_stream:    grid-stride 16-byte read-modify-write over the whole buffer
//   read_tile:     the shrink's pattern: 64-row tiles, a cluster-free 4-way K split, 128 bytes per
//                  row per stage through cp.async (4 stages), summed
//   read_stream:   grid-stride 16-byte reads, summed (read_stream4: four loads in flight per
//                  thread)
// each with eight rotating buffers and again "cold" (512 MB read before each call, as the bench
// times), then the bench's copy-bandwidth reference (1 GB device to device) and a 1 GB read.
// Not built by CMake; run on the GPU machine as
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/sp
//   bench/probes/stream_probe.cu /tmp/sp
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kRows = 4096;
constexpr int kCols = 4096;  // bf16 elements per row
constexpr int kRowBytes = kCols * 2;
constexpr int kCopies = 8;

__device__ __forceinline__ uint4 inc(uint4 v) {
  return make_uint4(v.x + 1, v.y + 1, v.z + 1, v.w + 1);
}

__device__ __forceinline__ void cp16(void* s, const void* g) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(s));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Items of kR rows x kC bf16 columns; item i = (row tile i / col_tiles, col tile i % col_tiles).
template <int kR, int kC>
__device__ __forceinline__ void item_origin(int item, int& r0, int& c0) {
  constexpr int col_tiles = kCols / kC;
  r0 = (item / col_tiles) * kR;
  c0 = (item % col_tiles) * kC;
}

__global__ void __launch_bounds__(128) rmw_tile_smem(unsigned char* y) {
  constexpr int kR = 64, kC = 128, kPitch = kC * 2 + 16;
  __shared__ __align__(16) unsigned char tile[kR * kPitch];
  constexpr int items = (kRows / kR) * (kCols / kC);
  const int per = (items + gridDim.x - 1) / gridDim.x;
  const int tid = threadIdx.x;
  for (int item = blockIdx.x * per; item < min(items, (blockIdx.x + 1) * per); ++item) {
    int r0, c0;
    item_origin<kR, kC>(item, r0, c0);
    __syncthreads();
    for (int i = tid; i < kR * 16; i += 128) {
      const int r = i >> 4, ch = i & 15;
      cp16(tile + r * kPitch + ch * 16, y + int64_t(r0 + r) * kRowBytes + c0 * 2 + ch * 16);
    }
    cp_wait_all();
    __syncthreads();
    for (int i = tid; i < kR * 16; i += 128) {
      const int r = i >> 4, ch = i & 15;
      *reinterpret_cast<uint4*>(y + int64_t(r0 + r) * kRowBytes + c0 * 2 + ch * 16) =
          inc(*reinterpret_cast<const uint4*>(tile + r * kPitch + ch * 16));
    }
  }
}

template <int kR, int kC>
__global__ void __launch_bounds__(128) rmw_tile_reg(unsigned char* y) {
  constexpr int items = (kRows / kR) * (kCols / kC);
  constexpr int chunks = kC / 8;  // 16-byte chunks per row
  constexpr int per_thread = kR * chunks / 128;
  const int per = (items + gridDim.x - 1) / gridDim.x;
  const int tid = threadIdx.x;
  for (int item = blockIdx.x * per; item < min(items, (blockIdx.x + 1) * per); ++item) {
    int r0, c0;
    item_origin<kR, kC>(item, r0, c0);
    uint4 v[per_thread];
#pragma unroll
    for (int k = 0; k < per_thread; ++k) {
      const int i = tid + k * 128;
      const int r = i / chunks, ch = i % chunks;
      v[k] = __ldcg(
          reinterpret_cast<const uint4*>(y + int64_t(r0 + r) * kRowBytes + c0 * 2 + ch * 16));
    }
#pragma unroll
    for (int k = 0; k < per_thread; ++k) {
      const int i = tid + k * 128;
      const int r = i / chunks, ch = i % chunks;
      *reinterpret_cast<uint4*>(y + int64_t(r0 + r) * kRowBytes + c0 * 2 + ch * 16) = inc(v[k]);
    }
  }
}

__global__ void rmw_stream(uint4* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x * 4) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t j = i + int64_t(k) * gridDim.x * blockDim.x;
      if (j < n) v[k] = __ldcg(y + j);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t j = i + int64_t(k) * gridDim.x * blockDim.x;
      if (j < n) y[j] = inc(v[k]);
    }
  }
}

// 64-row tiles x 4 K quarters (1024 columns each) = 256 CTAs; 4-stage cp.async ring of 64 rows x
// 128 bytes, one barrier per stage, like the prefill shrink.
__global__ void __launch_bounds__(256) read_tile(const unsigned char* x, unsigned* out) {
  constexpr int kStages = 4, kStageBytes = 64 * 144;
  __shared__ __align__(16) unsigned char ring[kStages * kStageBytes];
  const int tile = blockIdx.x >> 2, quarter = blockIdx.x & 3;
  const int tid = threadIdx.x;
  const int r = tid >> 3, ch = tid & 7;  // rows r and r + 32, 16-byte chunk ch
  const unsigned char* base = x + int64_t(tile * 64) * kRowBytes + quarter * (kRowBytes / 4);
  constexpr int nk = (kRowBytes / 4) / 128;  // 16 stages of 128 bytes
  auto load = [&](int kt) {
    unsigned char* s = ring + (kt % kStages) * kStageBytes;
    for (int h = 0; h < 2; ++h) {
      cp16(s + (r + 32 * h) * 144 + ch * 16,
           base + int64_t(r + 32 * h) * kRowBytes + kt * 128 + ch * 16);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  for (int kt = 0; kt < kStages - 1; ++kt) load(kt);
  unsigned acc = 0;
  for (int kt = 0; kt < nk; ++kt) {
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    __syncthreads();
    if (kt + kStages - 1 < nk) {
      load(kt + kStages - 1);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    const unsigned char* s = ring + (kt % kStages) * kStageBytes;
    acc += reinterpret_cast<const unsigned*>(s + r * 144 + ch * 16)[0];
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

template <int kUnroll>
__global__ void read_stream(const uint4* x, int64_t n, unsigned* out) {
  unsigned acc = 0;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += step * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = i + k * step < n ? __ldcg(x + i + k * step) : uint4{};
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) acc += v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

int main() {
  const size_t bytes = size_t(kRows) * kRowBytes;
  std::vector<unsigned char*> buf(kCopies);
  for (auto& b : buf) {
    cudaMalloc(&b, bytes);
    cudaMemset(b, 1, bytes);
  }
  unsigned* out;
  cudaMalloc(&out, 4096 * sizeof(unsigned));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  // "cold" as the bench times it: 512 MB read before each call (clean L2, nothing dirty).
  unsigned char* flush;
  const size_t flush_bytes = size_t(512) << 20;
  cudaMalloc(&flush, flush_bytes);
  cudaMemset(flush, 0, flush_bytes);
  bool cold = false;
  auto time = [&](const char* name, double moved, auto launch) {
    std::vector<float> t;
    for (int rep = 0; rep < 24; ++rep) {
      unsigned char* b = buf[rep % kCopies];
      if (cold) {
        read_stream<4><<<8 * sms, 256>>>(reinterpret_cast<const uint4*>(flush),
                                         int64_t(flush_bytes / 16), out);
      }
      cudaEventRecord(e0);
      launch(b);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (rep >= kCopies) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    const double us = t[t.size() / 2] * 1e3;
    std::printf("%-16s %8.2f us  %7.0f GB/s\n", name, us, moved / us * 1e-3);
  };
  const double rw = 2.0 * bytes;
  const int64_t n16 = int64_t(bytes / 16);
  for (int pass = 0; pass < 2; ++pass) {
    cold = pass == 1;
    std::printf("%s\n",
                cold ? "cold (512 MB read before each call)" : "rotating buffers, no flush");
    time("rmw_tile_smem", rw, [&](unsigned char* b) { rmw_tile_smem<<<4 * sms, 128>>>(b); });
    time("rmw_tile_reg", rw, [&](unsigned char* b) { rmw_tile_reg<64, 128><<<4 * sms, 128>>>(b); });
    time("rmw_tile_reg8", rw,
         [&](unsigned char* b) { rmw_tile_reg<64, 128><<<8 * sms, 128>>>(b); });
    time("rmw_wide_reg", rw,
         [&](unsigned char* b) { rmw_tile_reg<16, 1024><<<4 * sms, 128>>>(b); });
    time("rmw_stream", rw,
         [&](unsigned char* b) { rmw_stream<<<4 * sms, 256>>>(reinterpret_cast<uint4*>(b), n16); });
    time("read_tile", bytes, [&](unsigned char* b) { read_tile<<<256, 256>>>(b, out); });
    time("read_stream", bytes, [&](unsigned char* b) {
      read_stream<1><<<8 * sms, 256>>>(reinterpret_cast<const uint4*>(b), n16, out);
    });
    time("read_stream4", bytes, [&](unsigned char* b) {
      read_stream<4><<<8 * sms, 256>>>(reinterpret_cast<const uint4*>(b), n16, out);
    });
    // Copy bandwidth as the bench measures it: a device-to-device copy, read + write.
    time("memcpy", rw, [&](unsigned char* b) {
      cudaMemcpyAsync(buf[(b == buf[0]) ? 1 : 0], b, bytes, cudaMemcpyDeviceToDevice);
    });
  }
  // The bench's copy-bandwidth reference: 1 GB device to device.
  unsigned char* big;
  const size_t big_bytes = size_t(1) << 30;
  cudaMalloc(&big, 2 * big_bytes);
  cold = false;
  time("memcpy_1GB", 2.0 * big_bytes, [&](unsigned char*) {
    cudaMemcpyAsync(big, big + big_bytes, big_bytes, cudaMemcpyDeviceToDevice);
  });
  time("read_1GB", double(big_bytes), [&](unsigned char*) {
    read_stream<4>
        <<<8 * sms, 256>>>(reinterpret_cast<const uint4*>(big), int64_t(big_bytes / 16), out);
  });
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
