// CUDA versions of the MoE expert block table and the expert GEMMs over it
// (kernels/layer_ops.h). Together they replace the host-routed expert GEMMs (one device-to-host
// copy of the routing, then one cuBLAS call per expert) for decode-sized steps, so that those
// steps can be captured in CUDA graphs.
//
// The GEMM is memory-bound at decode sizes: every expert that has pairs streams its whole weight
// once, while its pairs (a few to a few dozen) are the M of the product. A thread block takes
// one block of 16 pairs of one expert and a 128-column tile of the output: the weight tile goes
// through a 4-stage cp.async pipeline into shared memory, the 16 gathered input rows beside it,
// and four warps run bf16/f16 m16n8k16 MMAs (32 output columns each). Blocks of the same expert
// and column tile are neighbours in the grid (the pair block is the fastest index), so when an
// expert has several blocks they run together and share the weight tile through L2. float32, and
// inputs whose rows are not 16-byte multiples, take a plain per-element kernel.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/layer_ops.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kRows = kMoeExpertBlockRows;  // pairs per block: the MMA's M
constexpr int kTileN = 128;                 // output columns per thread block
constexpr int kTileK = 64;                  // input columns per pipeline stage
constexpr int kStages = 4;
constexpr int kWarps = 4;
constexpr int kGemmThreads = kWarps * 32;
constexpr int kPitch = kTileK + 8;  // shared row pitch in elements: conflict-free fragments
constexpr int kStageElems = (kTileN + kRows) * kPitch;
constexpr int kGemmSmemBytes = kStages * kStageElems * 2;
constexpr int kAlignThreads = 1024;
static_assert(kRows * kTileK / 8 == kGemmThreads, "one input chunk per thread and stage");
static_assert(kTileN * kTileK / 8 % kGemmThreads == 0, "whole weight chunks per thread");
static_assert(kTileN == kWarps * 32, "32 output columns per warp");

// One thread block: counts per expert in shared memory, a warp scan of the blocks per expert,
// then each pair takes a place in its expert's blocks.
__global__ void __launch_bounds__(kAlignThreads)
    moe_expert_blocks_kernel(const int32_t* __restrict__ ids, int64_t num_pairs, int num_experts,
                             int64_t max_blocks, int32_t* __restrict__ block_expert,
                             int32_t* __restrict__ block_pairs) {
  extern __shared__ int smem_i[];
  int* count = smem_i;                       // [E]
  int* first = smem_i + num_experts;         // [E + 1] first block of each expert
  int* fill = smem_i + 2 * num_experts + 1;  // [E] places taken
  const int tid = static_cast<int>(threadIdx.x);
  for (int e = tid; e < num_experts; e += kAlignThreads) {
    count[e] = 0;
    fill[e] = 0;
  }
  for (int64_t b = tid; b < max_blocks; b += kAlignThreads) block_expert[b] = -1;
  for (int64_t i = tid; i < max_blocks * kRows; i += kAlignThreads) block_pairs[i] = -1;
  __syncthreads();
  for (int64_t p = tid; p < num_pairs; p += kAlignThreads) {
    const int e = ids[p];
    if (e >= 0 && e < num_experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (tid < 32) {
    int running = 0;
    for (int base = 0; base < num_experts; base += 32) {
      const int e = base + tid;
      const int blocks = e < num_experts ? (count[e] + kRows - 1) / kRows : 0;
      const int inclusive = warp_inclusive_sum(blocks, tid);
      if (e < num_experts) first[e] = running + inclusive - blocks;
      running += __shfl_sync(kFullMask, inclusive, 31);
    }
    if (tid == 0) first[num_experts] = running;
  }
  __syncthreads();
  for (int e = tid; e < num_experts; e += kAlignThreads) {
    for (int b = first[e]; b < first[e + 1]; ++b) block_expert[b] = e;
  }
  for (int64_t p = tid; p < num_pairs; p += kAlignThreads) {
    const int e = ids[p];
    if (e < 0 || e >= num_experts) continue;
    const int place = atomicAdd(&fill[e], 1);
    block_pairs[static_cast<int64_t>(first[e]) * kRows + place] = static_cast<int32_t>(p);
  }
}

struct GemmParams {
  const void* x;
  int64_t x_stride;
  int x_row_div;  // x row of pair p = p / x_row_div (top_k, or 1 when the rows are pairs)
  const void* w;
  int64_t n;
  int64_t k;
  const int32_t* block_expert;
  const int32_t* block_pairs;
  const float* row_scale;
  void* out;
  int64_t out_stride;
};

template <typename T>
__global__ void __launch_bounds__(kGemmThreads) moe_expert_gemm_mma_kernel(const GemmParams p) {
  // The expert LoRA shrink that follows reads none of this kernel's output (PDL; it waits for
  // this kernel before it ends), so it may fill the SMs this kernel's last blocks leave.
  pdl_launch_dependents();
  const int64_t block = blockIdx.x;
  const int expert = p.block_expert[block];
  if (expert < 0) return;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  __shared__ int pairs[kRows];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid < kRows) pairs[tid] = p.block_pairs[block * kRows + tid];
  __syncthreads();

  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  const T* w = static_cast<const T*>(p.w) + static_cast<int64_t>(expert) * p.n * p.k;
  const T* x = static_cast<const T*>(p.x);
  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK);
  constexpr int kChunks = kTileK / 8;  // 16-byte chunks per row of a stage

  // Each thread copies 8 weight chunks and one input chunk per stage. Rows past n and chunks
  // past k are zero-filled (src_bytes 0) from a clamped, valid address.
  auto load_stage = [&](int stage, int kt) {
    T* sw = smem + stage * kStageElems;
    T* sx = sw + kTileN * kPitch;
    const int64_t k0 = static_cast<int64_t>(kt) * kTileK;
#pragma unroll
    for (int i = 0; i < kTileN * kChunks / kGemmThreads; ++i) {
      const int c = tid + i * kGemmThreads;
      const int row = c / kChunks;
      const int col = (c % kChunks) * 8;
      const int64_t n = n0 + row;
      const bool ok = n < p.n && k0 + col < p.k;
      const T* src = ok ? w + n * p.k + k0 + col : w;
      cp_async16(sw + row * kPitch + col, src, ok ? 16 : 0);
    }
    {
      const int row = tid / kChunks;
      const int col = (tid % kChunks) * 8;
      const int pair = pairs[row];
      const bool ok = pair >= 0 && k0 + col < p.k;
      const T* src = ok ? x + (pair / p.x_row_div) * p.x_stride + k0 + col : x;
      cp_async16(sx + row * kPitch + col, src, ok ? 16 : 0);
    }
  };

  float acc[4][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();
    const T* sw = smem + (kt % kStages) * kStageElems;
    const T* sx = sw + kTileN * kPitch;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      uint32_t a[4];
      load_a_frag(a, sx + kk, kPitch, lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[2];
        load_b_frag(b, sw + (warp * 32 + j * 8) * kPitch + kk, kPitch, lane);
        mma_16816<T>(acc[j], a, b);
      }
    }
  }
  cp_async_wait<0>();

  // acc[j][0..1]: row g, columns 2t and 2t + 1 of n-tile j; acc[j][2..3]: row g + 8.
  const int g = lane >> 2;
  const int t = (lane & 3) * 2;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int pair = pairs[g + half * 8];
    if (pair < 0) continue;
    const float scale = p.row_scale != nullptr ? p.row_scale[pair] : 1.0f;
    T* row = out + static_cast<int64_t>(pair) * p.out_stride;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + warp * 32 + j * 8 + t;
      if (n < p.n) row[n] = from_float<T>(acc[j][half * 2] * scale);
      if (n + 1 < p.n) row[n + 1] = from_float<T>(acc[j][half * 2 + 1] * scale);
    }
  }
}

// Any dtype and row alignment: one thread per (listed pair, output column), float accumulation.
constexpr int kPlainCols = 16;
template <typename T>
__global__ void __launch_bounds__(kRows* kPlainCols)
    moe_expert_gemm_plain_kernel(const GemmParams p) {
  const int64_t block = blockIdx.x;
  const int expert = p.block_expert[block];
  if (expert < 0) return;
  const int pair = p.block_pairs[block * kRows + threadIdx.y];
  const int64_t n = static_cast<int64_t>(blockIdx.y) * kPlainCols + threadIdx.x;
  if (pair < 0 || n >= p.n) return;
  const T* w = static_cast<const T*>(p.w) + (static_cast<int64_t>(expert) * p.n + n) * p.k;
  const T* x = static_cast<const T*>(p.x) + (pair / p.x_row_div) * p.x_stride;
  float acc = 0.0f;
  for (int64_t c = 0; c < p.k; ++c) acc += to_float(x[c]) * to_float(w[c]);
  const float scale = p.row_scale != nullptr ? p.row_scale[pair] : 1.0f;
  static_cast<T*>(p.out)[static_cast<int64_t>(pair) * p.out_stride + n] =
      from_float<T>(acc * scale);
}

}  // namespace

Status moe_expert_blocks(const MoeExpertBlocksArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.num_experts >= 1 && a.num_experts <= 4096, "moe_expert_blocks: ", a.num_experts,
                  " experts (CUDA supports 1 to 4096)");
  LORAPLEX_ENSURE(a.max_blocks >= moe_expert_max_blocks(a.num_pairs, a.num_experts),
                  "moe_expert_blocks: max_blocks ", a.max_blocks, " below ",
                  moe_expert_max_blocks(a.num_pairs, a.num_experts));
  if (a.max_blocks == 0) return Status();
  const int smem = static_cast<int>((3 * a.num_experts + 1) * sizeof(int));
  moe_expert_blocks_kernel<<<1, kAlignThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      a.topk_ids, a.num_pairs, a.num_experts, a.max_blocks, a.block_expert, a.block_pairs);
  return launch_status("moe_expert_blocks");
}

Status moe_expert_gemm(const MoeExpertGemmArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.n >= 1 && a.k >= 1 && a.top_k >= 1 && a.max_blocks >= 0, "moe_expert_gemm: n ",
                  a.n, ", k ", a.k, ", top_k ", a.top_k, ", max_blocks ", a.max_blocks);
  if (a.max_blocks == 0) return Status();
  GemmParams p{a.x,
               a.x_stride,
               a.x_rows_are_pairs ? 1 : a.top_k,
               a.w,
               a.n,
               a.k,
               a.block_expert,
               a.block_pairs,
               a.row_scale,
               a.out,
               a.out_stride};
  const auto s = static_cast<cudaStream_t>(stream);
  // The MMA kernel copies 16-byte chunks of weight and input rows.
  const bool mma = half_dtype(a.dtype) && a.k % 8 == 0 && a.x_stride % 8 == 0 && aligned16(a.x) &&
                   aligned16(a.w);
  if (mma) {
    const void* kernel = a.dtype == DType::kBF16
                             ? reinterpret_cast<const void*>(&moe_expert_gemm_mma_kernel<bf16>)
                             : reinterpret_cast<const void*>(&moe_expert_gemm_mma_kernel<f16>);
    const Status smem = allow_dynamic_smem(kernel, kGemmSmemBytes);
    if (!smem.ok()) return smem;
  }
  const bool ok = dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, float>) {
      if (mma) {
        const dim3 grid(static_cast<unsigned>(a.max_blocks),
                        static_cast<unsigned>(ceil_div(a.n, kTileN)));
        moe_expert_gemm_mma_kernel<T><<<grid, kGemmThreads, kGemmSmemBytes, s>>>(p);
        return;
      }
    }
    const dim3 grid(static_cast<unsigned>(a.max_blocks),
                    static_cast<unsigned>(ceil_div(a.n, kPlainCols)));
    moe_expert_gemm_plain_kernel<T><<<grid, dim3(kPlainCols, kRows), 0, s>>>(p);
  });
  LORAPLEX_ENSURE(ok, "moe_expert_gemm: dtype ", a.dtype,
                  ", expected float32, float16 or bfloat16");
  return launch_status("moe_expert_gemm");
}

}  // namespace loraplex::kernels::cuda
