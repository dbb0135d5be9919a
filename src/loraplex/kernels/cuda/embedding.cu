// Embedding LoRA: each LoRA token gathers its row of the slot's (transposed) LoRA-A table and
// expands it through the slot's B into its hidden row. One block per token.

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct EmbeddingParams {
  const int32_t* token_ids;
  const int32_t* mapping;
  const void* lora_a;
  int64_t vocab;
  const void* lora_b;
  int64_t hidden;
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  float scale;
  void* y;
  int64_t y_stride;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) embedding_lora_kernel(EmbeddingParams p) {
  extern __shared__ float v[];  // [max_rank]
  const int64_t t = blockIdx.x;
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras)) return;
  const int32_t id = p.token_ids[t];
  // Ids outside the vocabulary are rejected by the CPU path; here they leave the row alone.
  if (id < 0 || id >= p.vocab) return;
  const int rank = p.ranks[slot];
  if (rank == 0) return;
  const T* row = static_cast<const T*>(p.lora_a) + (slot * p.vocab + id) * p.max_rank;
  for (int r = static_cast<int>(threadIdx.x); r < rank; r += kThreads) {
    v[r] = p.scale * to_float(row[r]);
  }
  __syncthreads();
  const T* b = static_cast<const T*>(p.lora_b) + slot * p.hidden * p.max_rank;
  T* y = static_cast<T*>(p.y) + t * p.y_stride;
  for (int64_t j = threadIdx.x; j < p.hidden; j += kThreads) {
    float acc = 0.0f;
    const T* brow = b + j * p.max_rank;
    for (int r = 0; r < rank; ++r) acc += v[r] * to_float(brow[r]);
    y[j] = from_float<T>(to_float(y[j]) + acc);
  }
}

}  // namespace

Status lora_embedding(const EmbeddingLoraArgs& a, StreamHandle stream) {
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16,
                  "lora_embedding: dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.vocab >= 1 && a.hidden >= 1 && a.max_loras >= 1 &&
                      a.max_rank >= 1 && a.y_row_stride >= a.hidden,
                  "lora_embedding: bad sizes (tokens ", a.num_tokens, ", vocab ", a.vocab,
                  ", hidden ", a.hidden, ", max_loras ", a.max_loras, ", max_rank ", a.max_rank,
                  ", row stride ", a.y_row_stride, ")");
  LORAPLEX_ENSURE(a.max_rank <= 12 * 1024, "lora_embedding: max_rank ", a.max_rank,
                  " exceeds the 12288 one block holds");
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(a.token_ids != nullptr && a.token_lora_mapping != nullptr &&
                      a.lora_a != nullptr && a.lora_b != nullptr && a.ranks != nullptr &&
                      a.y != nullptr,
                  "lora_embedding: a pointer is null");
  EmbeddingParams p{a.token_ids, a.token_lora_mapping, a.lora_a, a.vocab, a.lora_b, a.hidden,
                    a.max_loras, a.max_rank,           a.ranks,  a.scale, a.y,      a.y_row_stride};
  const int smem = a.max_rank * static_cast<int>(sizeof(float));
  auto s = static_cast<cudaStream_t>(stream);
  Status status;
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // (void): nvcc flags the discarded Status& of a [[nodiscard]] class's operator=.
    (void)(status =
               allow_dynamic_smem(reinterpret_cast<const void*>(&embedding_lora_kernel<T>), smem));
    if (status.ok()) {
      embedding_lora_kernel<T><<<static_cast<unsigned>(a.num_tokens), kThreads, smem, s>>>(p);
    }
  });
  LORAPLEX_RETURN_IF_ERROR(status);
  return launch_status("embedding_lora_kernel");
}

}  // namespace loraplex::kernels::cuda
