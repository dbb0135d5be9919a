// CUDA versions of kernels/layer_ops.h: row copies and routing. Memory-bound and simple on
// purpose; one thread block per row (or per token), a grid-stride inner loop.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/layer_ops.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// The most experts routing takes (Qwen3-MoE has 128, DeepSeek-V3 256).
constexpr int kMaxExperts = 512;

__device__ inline float to_f(float v) { return v; }
__device__ inline float to_f(__half v) { return __half2float(v); }
__device__ inline float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_f(float v);
template <>
__device__ inline float from_f<float>(float v) {
  return v;
}
template <>
__device__ inline __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename Fn>
bool dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(float{});
      return true;
    case DType::kF16:
      fn(__half{});
      return true;
    case DType::kBF16:
      fn(__nv_bfloat16{});
      return true;
    default:
      return false;
  }
}

Status bad_dtype(const char* op, DType dtype) {
  return invalid_argument(op, ": dtype ", dtype, ", expected float32, float16 or bfloat16");
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(n > 0 ? n : 1); }

template <typename T>
__global__ void embedding_kernel(const T* w, int64_t rows, int64_t hidden, const int32_t* ids,
                                 int64_t vocab_start, T* out, int64_t out_stride) {
  const int64_t t = blockIdx.x;
  const int64_t local = static_cast<int64_t>(ids[t]) - vocab_start;
  T* dst = out + t * out_stride;
  if (local >= 0 && local < rows) {
    const T* src = w + local * hidden;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = src[j];
  } else {
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = from_f<T>(0.0f);
  }
}

__global__ void shard_ids_kernel(const int32_t* ids, int64_t n, int64_t vocab_start, int64_t rows,
                                 int32_t outside, int32_t* local) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const int64_t l = static_cast<int64_t>(ids[t]) - vocab_start;
  local[t] = (l >= 0 && l < rows) ? static_cast<int32_t>(l) : outside;
}

// One warp per token: each lane owns the experts e == lane (mod 32) and recomputes their
// probabilities where needed, so nothing per expert is stored. A thread per token walked
// top_k x E probabilities serially and left the GPU all but idle.
constexpr int kTopkWarps = 4;

template <typename T>
__global__ void topk_softmax_kernel(const T* logits, int64_t stride, int64_t n, int num_experts,
                                    int top_k, bool renormalize, int32_t* ids, float* weights) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTopkWarps + threadIdx.x / 32;
  if (t >= n) return;  // the whole warp: the shuffles below see every lane
  const T* row = logits + t * stride;
  float mx = -FLT_MAX;
  for (int e = lane; e < num_experts; e += 32) mx = fmaxf(mx, to_f(row[e]));
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int e = lane; e < num_experts; e += 32) sum += expf(to_f(row[e]) - mx);
  sum = warp_sum(sum);
  float picked = 0.0f;
  float prev = FLT_MAX;
  int prev_id = -1;
  for (int k = 0; k < top_k; ++k) {
    // The next pick is the largest probability below the previous pick (ties: lower id
    // first), so nothing per expert needs to be remembered.
    int best = -1;
    float best_p = -1.0f;
    for (int e = lane; e < num_experts; e += 32) {
      const float p = expf(to_f(row[e]) - mx) / sum;
      const bool after_prev = p < prev || (p == prev && e > prev_id);
      if (after_prev && (best < 0 || p > best_p)) {
        best = e;
        best_p = p;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other_p = __shfl_xor_sync(kFullMask, best_p, o);
      const int other = __shfl_xor_sync(kFullMask, best, o);
      const bool wins =
          other >= 0 && (best < 0 || other_p > best_p || (other_p == best_p && other < best));
      if (wins) {
        best = other;
        best_p = other_p;
      }
    }
    if (lane == 0) {
      ids[t * top_k + k] = best;
      weights[t * top_k + k] = best_p;
    }
    picked += best_p;
    prev = best_p;
    prev_id = best;
  }
  if (renormalize && lane == 0) {
    for (int k = 0; k < top_k; ++k) weights[t * top_k + k] /= picked;
  }
}

template <typename T>
__global__ void gather_kernel(const T* src, int64_t src_stride, const int32_t* index, int64_t width,
                              T* dst, int64_t dst_stride) {
  const int64_t i = blockIdx.x;
  const T* from = src + static_cast<int64_t>(index[i]) * src_stride;
  T* to = dst + i * dst_stride;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) to[j] = from[j];
}

template <typename T>
__global__ void scatter_kernel(const T* src, int64_t src_stride, const int32_t* index,
                               int64_t width, const float* scale, T* dst, int64_t dst_stride) {
  const int64_t i = blockIdx.x;
  const int64_t row = index[i];
  const T* from = src + i * src_stride;
  T* to = dst + row * dst_stride;
  if (scale == nullptr) {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) to[j] = from[j];
  } else {
    const float f = scale[row];
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) to[j] = from_f<T>(to_f(from[j]) * f);
  }
}

template <typename T>
__global__ void sum_topk_kernel(const T* in, int top_k, int64_t width, T* out, int64_t out_stride) {
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < top_k; ++k) acc += to_f(in[(t * top_k + k) * width + j]);
    out[t * out_stride + j] = from_f<T>(acc);
  }
}

}  // namespace

Status embedding_rows(const EmbeddingRowsArgs& a, cuda_rt::StreamHandle stream) {
  if (a.num_tokens == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    embedding_kernel<T><<<grid_for(a.num_tokens), kThreads, 0, s>>>(
        static_cast<const T*>(a.weight), a.rows, a.hidden, a.ids, a.vocab_start,
        static_cast<T*>(a.out), a.out_stride);
  });
  if (!ok) return bad_dtype("embedding_lookup", a.dtype);
  return launch_status("embedding_lookup");
}

Status shard_token_ids(const ShardTokenIdsArgs& a, cuda_rt::StreamHandle stream) {
  if (a.num_tokens == 0) return Status();
  const unsigned blocks = static_cast<unsigned>((a.num_tokens + kThreads - 1) / kThreads);
  shard_ids_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      a.ids, a.num_tokens, a.vocab_start, a.rows, a.outside, a.local);
  return launch_status("shard_token_ids");
}

Status topk_softmax(const TopkSoftmaxArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.num_experts >= 1 && a.num_experts <= kMaxExperts && a.top_k >= 1 &&
                      a.top_k <= a.num_experts,
                  "topk_softmax: ", a.num_experts, " experts and top_k ", a.top_k,
                  " (CUDA supports up to ", kMaxExperts, " experts)");
  if (a.num_tokens == 0) return Status();
  const unsigned blocks = static_cast<unsigned>((a.num_tokens + kTopkWarps - 1) / kTopkWarps);
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    topk_softmax_kernel<T><<<blocks, 32 * kTopkWarps, 0, s>>>(
        static_cast<const T*>(a.logits), a.logits_stride, a.num_tokens, a.num_experts, a.top_k,
        a.renormalize, a.ids, a.weights);
  });
  if (!ok) return bad_dtype("topk_softmax", a.dtype);
  return launch_status("topk_softmax");
}

Status gather_rows(const GatherRowsArgs& a, cuda_rt::StreamHandle stream) {
  if (a.n == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    gather_kernel<T><<<grid_for(a.n), kThreads, 0, s>>>(static_cast<const T*>(a.src), a.src_stride,
                                                        a.index, a.width, static_cast<T*>(a.dst),
                                                        a.dst_stride);
  });
  if (!ok) return bad_dtype("gather_rows", a.dtype);
  return launch_status("gather_rows");
}

Status scatter_rows(const ScatterRowsArgs& a, cuda_rt::StreamHandle stream) {
  if (a.n == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    scatter_kernel<T><<<grid_for(a.n), kThreads, 0, s>>>(static_cast<const T*>(a.src), a.src_stride,
                                                         a.index, a.width, a.row_scale,
                                                         static_cast<T*>(a.dst), a.dst_stride);
  });
  if (!ok) return bad_dtype("scatter_rows", a.dtype);
  return launch_status("scatter_rows");
}

Status sum_topk(const SumTopkArgs& a, cuda_rt::StreamHandle stream) {
  if (a.num_tokens == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    sum_topk_kernel<T><<<grid_for(a.num_tokens), kThreads, 0, s>>>(
        static_cast<const T*>(a.in), a.top_k, a.width, static_cast<T*>(a.out), a.out_stride);
  });
  if (!ok) return bad_dtype("sum_topk", a.dtype);
  return launch_status("sum_topk");
}

}  // namespace loraplex::kernels::cuda
