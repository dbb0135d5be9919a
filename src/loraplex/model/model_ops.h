#pragma once
// The non-LoRA ops of the decoder (embedding gather, RMSNorm, RoPE, paged KV cache write and
// attention, SiLU-and-multiply, residual add, greedy argmax) as
// framework-free argument structs over raw pointers. The CPU versions (model_ops_cpu.cc) define
// the semantics; the CUDA versions (cuda/model_ops_cuda.cu) implement the same structs and are
// tested against them. Launchers return Status and never throw.
//
// Activations are f32, f16 or bf16 (`dtype`); every op reads and accumulates in float32 and
// rounds once when it stores, so the float32 path follows transformers' float32 math exactly.

#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"

namespace loraplex::model::ops {

/// out[t, :] = table[ids[t], :].
struct EmbeddingArgs {
  DType dtype = DType::kF32;  // of table and out
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
  const int32_t* ids = nullptr;  // [num_tokens] in, each in [0, vocab)
  const void* table = nullptr;   // [vocab, hidden] in
  void* out = nullptr;           // [num_tokens, hidden] out
};

/// out[t] = round(x[t] * rsqrt(mean(x[t]^2) + eps)) * weight, as transformers' RMSNorm: the
/// normalised row is rounded to `dtype` before the weight multiplies it.
struct RmsNormArgs {
  DType dtype = DType::kF32;  // of x, weight and out
  int64_t num_rows = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;
  const void* x = nullptr;  // [num_rows, x_row_stride] in
  int64_t x_row_stride = 0;
  const void* weight = nullptr;  // [hidden] in
  void* out = nullptr;           // [num_rows, hidden] out (contiguous)
};

/// Rotates the q and k heads of a packed qkv row in place (rotate_half convention, as Llama):
/// for a head h and i < d/2, angle = position * inv_freq[i],
///   x[i] = x[i] cos - x[i + d/2] sin,  x[i + d/2] = x[i + d/2] cos + x[i] sin.
struct RopeArgs {
  DType dtype = DType::kF32;  // of qkv
  int64_t num_tokens = 0;
  int64_t num_heads = 0;     // q heads, starting at column 0
  int64_t num_kv_heads = 0;  // k heads, starting at column num_heads * head_dim
  int64_t head_dim = 0;
  const int32_t* positions = nullptr;  // [num_tokens] in
  const float* inv_freq = nullptr;     // [head_dim / 2] in
  void* qkv = nullptr;                 // [num_tokens, qkv_row_stride] in/out
  int64_t qkv_row_stride = 0;
};

/// Paged KV cache geometry: each layer owns K and V of [num_blocks, block_size, kv_heads,
/// head_dim]; a sequence's token at position p lives in block block_table[p / block_size] at
/// offset p % block_size.
struct KvCacheView {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  void* k = nullptr;  // [num_blocks, block_size, kv_heads, head_dim] in/out
  void* v = nullptr;  // same
};

/// Writes the k and v heads of each token's qkv row into its cache slot
/// (slot = block * block_size + offset; -1 = skip).
struct KvWriteArgs {
  DType dtype = DType::kF32;  // of qkv and the cache
  int64_t num_tokens = 0;
  int64_t num_heads = 0;      // k starts at column num_heads * head_dim, v after k
  const void* qkv = nullptr;  // [num_tokens, qkv_row_stride] in
  int64_t qkv_row_stride = 0;
  const int32_t* slot_mapping = nullptr;  // [num_tokens] in
  KvCacheView cache;
};

/// Causal attention of each token over its own sequence's cached keys 0..positions[t]
/// (grouped-query: q head h reads kv head h / (num_heads / num_kv_heads)):
///   out[t, h] = softmax(q[t, h] . K^T * scale) V, softmax in float32.
/// Sequence s's block table is row s of a [num_seqs, max_blocks_per_seq] table, or, with
/// block_table_indptr, the blocks from block_tables[block_table_indptr[s]] on (a flat list).
struct PagedAttentionArgs {
  DType dtype = DType::kF32;  // of qkv, the cache and out
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  float scale = 1.0f;
  const void* qkv = nullptr;  // [num_tokens, qkv_row_stride] in; q heads from column 0
  int64_t qkv_row_stride = 0;
  const int32_t* positions = nullptr;           // [num_tokens] in
  const int32_t* token_seq = nullptr;           // [num_tokens] in: row of block_tables
  const int32_t* block_tables = nullptr;        // [num_seqs, max_blocks_per_seq] in, or flat
  const int32_t* block_table_indptr = nullptr;  // [num_seqs + 1] in, or nullptr (2-D table)
  int64_t num_seqs = 0;
  int64_t max_blocks_per_seq = 0;  // blocks of any one sequence (an upper bound)
  // >= every positions[t] + 1: an upper bound (the CPU sizes its scratch by it; the CUDA kernel
  // only checks positions against it, so a fixed bound keeps a captured launch valid).
  int64_t max_context = 0;
  KvCacheView cache;
  void* out = nullptr;  // [num_tokens, num_heads * head_dim] out
};

/// out[t, j] = silu(x[t, j]) * x[t, n + j] for j < n (x = [gate | up]).
struct SiluMulArgs {
  DType dtype = DType::kF32;
  int64_t num_rows = 0;
  int64_t n = 0;
  const void* x = nullptr;  // [num_rows, 2n] in
  void* out = nullptr;      // [num_rows, n] out
};

/// y[r, :] += x[r, :] (residual add, rounded once).
struct AddArgs {
  DType dtype = DType::kF32;
  int64_t num_rows = 0;
  int64_t n = 0;
  const void* x = nullptr;  // [num_rows, n] in
  void* y = nullptr;        // [num_rows, n] in/out
};

/// ids[r] = argmax_j logits[r, j]; ties go to the lowest j. NaN never wins.
struct ArgmaxArgs {
  DType dtype = DType::kF32;
  int64_t num_rows = 0;
  int64_t vocab = 0;
  const void* logits = nullptr;  // [num_rows, row_stride] in
  int64_t row_stride = 0;
  int32_t* ids = nullptr;  // [num_rows] out
};

namespace cpu {
Status embedding(const EmbeddingArgs& a);
Status rms_norm(const RmsNormArgs& a);
Status rope(const RopeArgs& a);
Status kv_write(const KvWriteArgs& a);
Status paged_attention(const PagedAttentionArgs& a);
Status silu_mul(const SiluMulArgs& a);
Status add(const AddArgs& a);
Status argmax(const ArgmaxArgs& a);
}  // namespace cpu

/// The same ops on a CUDA stream (declared always; without the CUDA backend they return
/// kUnsupported). Pointers are device pointers.
namespace cuda {
Status embedding(const EmbeddingArgs& a, const Stream& stream);
Status rms_norm(const RmsNormArgs& a, const Stream& stream);
Status rope(const RopeArgs& a, const Stream& stream);
Status kv_write(const KvWriteArgs& a, const Stream& stream);
Status paged_attention(const PagedAttentionArgs& a, const Stream& stream);
Status silu_mul(const SiluMulArgs& a, const Stream& stream);
Status add(const AddArgs& a, const Stream& stream);
Status argmax(const ArgmaxArgs& a, const Stream& stream);
}  // namespace cuda

/// Routes to cpu:: or cuda:: by the stream's device.
template <typename Args>
Status run(Status (*cpu_fn)(const Args&), Status (*cuda_fn)(const Args&, const Stream&),
           const Args& args, const Stream& stream) {
  return stream.device().is_cpu() ? cpu_fn(args) : cuda_fn(args, stream);
}

}  // namespace loraplex::model::ops
