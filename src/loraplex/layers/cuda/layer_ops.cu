// CUDA kernels of layer_ops.h: row copies, routing and the gated activation. Memory-bound
// and simple on purpose; one thread block per row (or per token), a grid-stride inner loop.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>

#include "loraplex/layers/layer_ops_cuda.h"

namespace loraplex::layer_ops_cuda {
namespace {

constexpr int kThreads = 256;
// Routing keeps per-token probabilities in registers of one thread.
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

Status launch_status(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status();
  return Status(StatusCode::kCudaError, detail::concat(op, ": ", cudaGetErrorString(err)));
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

// One thread per token: E is small (8..512) and the selection is sequential anyway.
template <typename T>
__global__ void topk_softmax_kernel(const T* logits, int64_t stride, int64_t n, int num_experts,
                                    int top_k, bool renormalize, int32_t* ids, float* weights) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const T* row = logits + t * stride;
  float mx = -FLT_MAX;
  for (int e = 0; e < num_experts; ++e) mx = fmaxf(mx, to_f(row[e]));
  float sum = 0.0f;
  for (int e = 0; e < num_experts; ++e) sum += expf(to_f(row[e]) - mx);
  float picked = 0.0f;
  float prev = FLT_MAX;
  int prev_id = -1;
  for (int k = 0; k < top_k; ++k) {
    // The next pick is the largest probability below the previous pick (ties: lower id
    // first), so nothing per expert needs to be remembered.
    int best = -1;
    float best_p = -1.0f;
    for (int e = 0; e < num_experts; ++e) {
      const float p = expf(to_f(row[e]) - mx) / sum;
      const bool after_prev = p < prev || (p == prev && e > prev_id);
      if (after_prev && (best < 0 || p > best_p)) {
        best = e;
        best_p = p;
      }
    }
    ids[t * top_k + k] = best;
    weights[t * top_k + k] = best_p;
    picked += best_p;
    prev = best_p;
    prev_id = best;
  }
  if (renormalize) {
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
__global__ void silu_mul_kernel(const T* in, int64_t in_stride, int64_t width, T* out,
                                int64_t out_stride) {
  const int64_t i = blockIdx.x;
  const T* row = in + i * in_stride;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    const float g = to_f(row[j]);
    out[i * out_stride + j] = from_f<T>(g / (1.0f + expf(-g)) * to_f(row[width + j]));
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

Status embedding_lookup(DType dtype, const void* weight, int64_t rows, int64_t hidden,
                        const int32_t* ids, int64_t num_tokens, int64_t vocab_start, void* out,
                        int64_t out_stride, void* stream) {
  if (num_tokens == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    embedding_kernel<T><<<grid_for(num_tokens), kThreads, 0, s>>>(static_cast<const T*>(weight),
                                                                  rows, hidden, ids, vocab_start,
                                                                  static_cast<T*>(out), out_stride);
  });
  if (!ok) return bad_dtype("embedding_lookup", dtype);
  return launch_status("embedding_lookup");
}

Status shard_token_ids(const int32_t* ids, int64_t num_tokens, int64_t vocab_start, int64_t rows,
                       int32_t outside, int32_t* local, void* stream) {
  if (num_tokens == 0) return Status();
  const unsigned blocks = static_cast<unsigned>((num_tokens + kThreads - 1) / kThreads);
  shard_ids_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      ids, num_tokens, vocab_start, rows, outside, local);
  return launch_status("shard_token_ids");
}

Status topk_softmax(DType dtype, const void* logits, int64_t logits_stride, int64_t num_tokens,
                    int num_experts, int top_k, bool renormalize, int32_t* ids, float* weights,
                    void* stream) {
  LORAPLEX_ENSURE(
      num_experts >= 1 && num_experts <= kMaxExperts && top_k >= 1 && top_k <= num_experts,
      "topk_softmax: ", num_experts, " experts and top_k ", top_k, " (CUDA supports up to ",
      kMaxExperts, " experts)");
  if (num_tokens == 0) return Status();
  const unsigned blocks = static_cast<unsigned>((num_tokens + 127) / 128);
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    topk_softmax_kernel<T><<<blocks, 128, 0, s>>>(static_cast<const T*>(logits), logits_stride,
                                                  num_tokens, num_experts, top_k, renormalize, ids,
                                                  weights);
  });
  if (!ok) return bad_dtype("topk_softmax", dtype);
  return launch_status("topk_softmax");
}

Status gather_rows(DType dtype, const void* src, int64_t src_stride, const int32_t* index,
                   int64_t n, int64_t width, void* dst, int64_t dst_stride, void* stream) {
  if (n == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    gather_kernel<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(src), src_stride, index,
                                                      width, static_cast<T*>(dst), dst_stride);
  });
  if (!ok) return bad_dtype("gather_rows", dtype);
  return launch_status("gather_rows");
}

Status scatter_rows(DType dtype, const void* src, int64_t src_stride, const int32_t* index,
                    int64_t n, int64_t width, const float* row_scale, void* dst, int64_t dst_stride,
                    void* stream) {
  if (n == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    scatter_kernel<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(src), src_stride,
                                                       index, width, row_scale,
                                                       static_cast<T*>(dst), dst_stride);
  });
  if (!ok) return bad_dtype("scatter_rows", dtype);
  return launch_status("scatter_rows");
}

Status silu_and_mul(DType dtype, const void* in, int64_t in_stride, int64_t n, int64_t width,
                    void* out, int64_t out_stride, void* stream) {
  if (n == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_kernel<T><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(in), in_stride, width,
                                                        static_cast<T*>(out), out_stride);
  });
  if (!ok) return bad_dtype("silu_and_mul", dtype);
  return launch_status("silu_and_mul");
}

Status sum_topk(DType dtype, const void* in, int64_t num_tokens, int top_k, int64_t width,
                void* out, int64_t out_stride, void* stream) {
  if (num_tokens == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const bool ok = dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    sum_topk_kernel<T><<<grid_for(num_tokens), kThreads, 0, s>>>(
        static_cast<const T*>(in), top_k, width, static_cast<T*>(out), out_stride);
  });
  if (!ok) return bad_dtype("sum_topk", dtype);
  return launch_status("sum_topk");
}

}  // namespace loraplex::layer_ops_cuda
