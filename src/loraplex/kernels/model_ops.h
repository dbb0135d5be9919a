#pragma once
// The non-LoRA ops of the decoder (residual add + RMSNorm, per-head q/k RMSNorm, RoPE + paged KV
// cache write, paged attention, SiLU-and-multiply, greedy argmax, uniform fill) as framework-free
// argument structs over raw pointers. The CPU versions (cpu/model_ops_cpu.cc) define the
// semantics; the CUDA versions (cuda/model_ops_cuda.cu) implement the same structs and are tested
// against them; kernels/dispatch/base_ops.h routes between them (model/decoder_ops.h is the
// decoder's view). Launchers return Status and never throw.
//
// Activations are f32, f16 or bf16 (`dtype`); every op reads and accumulates in float32 and
// rounds once when it stores, so the float32 path follows transformers' float32 math exactly.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels {

/// The LoRA of a projection, applied by the op that consumes the projection's output (the
/// expand fused into the consumer: no launch of its own). The shrink came out of the base
/// GEMM as extra output columns: the A of every slot stored as extra rows of the base weight,
/// slot by slot, so each token's intermediate sits in its own row beside the base output.
/// For a token t of slot k = meta.token_lora_mapping[t] >= 0 and each LoRA slice s whose rank
/// r = ranks[s * max_loras + k] is > 0, the consumer's input row `in` becomes
///   in[t, offset[s] + j] = round(in[t, offset[s] + j] + sum_{i < r} S(t, k, s, i) B_s[k, j, i])
/// for j < width[s], with S(t, k, s, i) = shrink[t * shrink_row_stride + k * slot_cols +
/// s * max_rank + i] and the sum in float32. Rows of slot -1 tokens, the intermediates of other
/// slots and the columns at or past a slot's rank are never read.
struct FusedLoraExpand {
  /// The step's token grouping (the LoraBatchMeta of the same tokens): a kernel may take the
  /// tokens of one slot together so that it reads their B once. meta.token_lora_mapping ==
  /// nullptr: no LoRA (the op runs as without this struct).
  LoraMetaView meta;
  int num_slices = 0;
  int max_loras = 0;
  int max_rank = 0;                     // columns of a B row
  int num_slots = 0;                    // slots whose intermediates the rows hold
  const int32_t* ranks = nullptr;       // [num_slices, max_loras] in
  const void* shrink = nullptr;         // [num_tokens, shrink_row_stride] in (activation dtype)
  int64_t shrink_row_stride = 0;        // elements between tokens' intermediates
  int64_t slot_cols = 0;                // >= num_slices * max_rank
  const void* lora_b[kMaxSlices] = {};  // per slice [max_loras, width[s], max_rank] in
  int64_t width[kMaxSlices] = {};       // output columns of slice s
  int64_t offset[kMaxSlices] = {};      // first column of slice s in the consumer's input
  bool active() const { return meta.token_lora_mapping != nullptr; }
};

/// The fused expand's arguments as far as they can be checked without reading device memory:
/// slices that fit the consumer's `row_width` input columns and do not overlap, rows wide
/// enough for num_slots slots. (A token's slot at or past num_slots is an error on the CPU; the
/// CUDA kernels cannot report it and leave that token without LoRA.)
Status check_fused_lora_expand(const FusedLoraExpand& e, int64_t row_width, const char* op);

/// Residual add and RMSNorm in one pass, in transformers' order: the sum is rounded to `dtype`,
/// kept as the new residual and normalised; the normalised row is rounded before the weight
/// multiplies it. For output row r and its source row s = rows ? rows[r] : r:
///   sum = round(residual[s] + delta[s] + delta2[s])   (absent deltas count as zero)
///   residual_out[r] = sum                        (residual_out == nullptr: not stored)
///   out[r] = round(round(sum * rsqrt(mean(sum^2) + eps)) * weight)
/// residual_out may alias residual when rows == nullptr (each row is read before it is written).
/// With `lora`, delta's row of each LoRA token first takes that token's expand (rounded), as
/// FusedLoraExpand describes (its token is the source row s).
struct AddRmsNormArgs {
  DType dtype = DType::kF32;  // of every tensor
  int64_t num_rows = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;
  const int32_t* rows = nullptr;   // [num_rows] in: source rows, or nullptr = row r
  const void* residual = nullptr;  // [*, hidden] in (contiguous rows)
  const void* delta = nullptr;     // [*, hidden] in, or nullptr
  void* residual_out = nullptr;    // [num_rows, hidden] out, or nullptr
  const void* weight = nullptr;    // [hidden] in
  void* out = nullptr;             // [num_rows, hidden] out
  /// A second addend (a LoRA output computed apart from its base output), or nullptr.
  void* delta2 = nullptr;  // [*, hidden] in (zeroed after reading with clear_delta2)
  /// Zero delta2 after reading it (rows == nullptr only), so that the caller's buffer is ready
  /// to accumulate the next LoRA output without a memset.
  bool clear_delta2 = false;
  int64_t delta_row_stride = 0;  // elements between rows of delta; 0 = hidden
  FusedLoraExpand lora = {};     // applied to delta (which must then be given)
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

/// RoPE and the KV-cache write of each token's packed qkv row [q heads | k heads | v heads]:
/// rotates its q and k heads in place (rotate_half convention, as Llama: for a head and
/// i < d/2, angle = position * inv_freq[i], x[i] = x[i] cos - x[i + d/2] sin,
/// x[i + d/2] = x[i + d/2] cos + x[i] sin), then stores the rotated k heads and the v heads in
/// cache slot slot_mapping[t] (= block * block_size + offset; -1 = not stored). With `delta`
/// (a LoRA output computed apart from the base qkv), each q, k and v value is first
/// round(qkv + delta) (stored back to qkv for q and k, to the cache for v). With `lora`, each
/// token's qkv row first takes its expand (FusedLoraExpand), stored back likewise.
struct RopeKvWriteArgs {
  DType dtype = DType::kF32;  // of qkv and the cache
  int64_t num_tokens = 0;
  int64_t num_heads = 0;  // q heads; k heads start at column num_heads * head_dim, v after k
  const int32_t* positions = nullptr;  // [num_tokens] in
  const float* inv_freq = nullptr;     // [head_dim / 2] in
  void* qkv = nullptr;                 // [num_tokens, qkv_row_stride] in/out
  int64_t qkv_row_stride = 0;
  const int32_t* slot_mapping = nullptr;  // [num_tokens] in
  KvCacheView cache;                      // num_kv_heads and head_dim come from here
  void* delta = nullptr;      // [num_tokens, (heads + 2 kv_heads) * head_dim] in, or nullptr
  bool clear_delta = false;   // zero delta after reading it (see AddRmsNormArgs::clear_delta2)
  FusedLoraExpand lora = {};  // applied to the qkv rows
};

/// Qwen3's per-head RMSNorm of q and k (q_norm / k_norm), in place on each token's packed qkv
/// row [q heads | k heads | v heads], between the qkv projection and RoPE. For every q head and
/// every k head x of head_dim values, with w = q_weight for q heads and k_weight for k heads:
///   x = round(round(x * rsqrt(mean(x^2) + eps)) * w)
/// (transformers' Qwen3RMSNorm: float32 statistics, the normalised value rounded to the
/// activation dtype before the weight multiplies it). v heads are not touched. With `delta` (a
/// LoRA output computed apart from the base qkv), each q and k value is first round(x + delta)
/// and, with clear_delta, those q and k delta entries are zeroed; v's delta entries are left for
/// rope_kv_write to add.
struct QkRmsNormArgs {
  DType dtype = DType::kF32;  // of qkv, the weights and delta
  int64_t num_tokens = 0;
  int64_t num_heads = 0;     // q heads; k heads start at column num_heads * head_dim
  int64_t num_kv_heads = 0;  // k heads
  int64_t head_dim = 0;
  float eps = 1e-6f;
  void* qkv = nullptr;  // [num_tokens, qkv_row_stride] in/out
  int64_t qkv_row_stride = 0;
  const void* q_weight = nullptr;  // [head_dim] in
  const void* k_weight = nullptr;  // [head_dim] in
  void* delta = nullptr;           // [num_tokens, (heads + 2 kv_heads) * head_dim] in, or nullptr
  bool clear_delta = false;        // zero delta's q and k entries after reading them
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

/// out[t, j] = silu(x[t, j]) * x[t, n + j] for j < n (x = [gate | up]). With `lora`, the gate
/// and up values are first x plus the token's expand (FusedLoraExpand, rounded); x is not
/// written.
struct SiluMulArgs {
  DType dtype = DType::kF32;
  int64_t num_rows = 0;
  int64_t n = 0;
  const void* x = nullptr;  // [num_rows, x_row_stride] in
  void* out = nullptr;      // [num_rows, n] out
  /// x + delta (rounded) is what the gate and up halves are, when given (a LoRA output
  /// computed apart from the base gate_up).
  void* delta = nullptr;      // [num_rows, 2n] in, or nullptr
  bool clear_delta = false;   // zero delta after reading it (see AddRmsNormArgs::clear_delta2)
  int64_t x_row_stride = 0;   // elements between rows of x; 0 = 2n
  FusedLoraExpand lora = {};  // applied to x's rows
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

/// The tokens of a step that the host does not know yet, taken from the ids the previous step
/// sampled (asynchronous scheduling plans a step before the one before it has returned):
/// tokens[t] = sampled[rows[t]] where rows[t] >= 0; rows[t] = -1 keeps tokens[t]. A row outside
/// [0, num_sampled) keeps the token too (never read past the buffer).
struct FeedTokensArgs {
  int64_t num_tokens = 0;
  int64_t num_sampled = 0;
  const int32_t* rows = nullptr;     // [num_tokens] in
  const int32_t* sampled = nullptr;  // [num_sampled] in: the previous step's ids
  int32_t* tokens = nullptr;         // [num_tokens] in/out
};

/// out[i] = lo + (hi - lo) * u(seed, i), u in [0, 1) from 24 bits of splitmix64(seed + i), so
/// the CPU and the GPU make the same values (random weights at real shapes).
struct FillUniformArgs {
  DType dtype = DType::kF32;  // f32, f16, bf16, or float8_e4m3 (random FP8 weights)
  int64_t n = 0;
  uint64_t seed = 0;
  float lo = 0.0f;
  float hi = 1.0f;
  void* out = nullptr;  // [n] out
};

/// Argument checks shared by both versions (sizes and pointers only, never device memory), so
/// both reject the same inputs with the same messages.
Status check_rope_kv_write_args(const RopeKvWriteArgs& a);
Status check_paged_attention_args(const PagedAttentionArgs& a);
Status check_qk_rms_norm_args(const QkRmsNormArgs& a);
Status check_feed_tokens_args(const FeedTokensArgs& a);

namespace cpu {
Status fill_uniform(const FillUniformArgs& a);
Status add_rms_norm(const AddRmsNormArgs& a);
Status rope_kv_write(const RopeKvWriteArgs& a);
Status qk_rms_norm(const QkRmsNormArgs& a);
Status paged_attention(const PagedAttentionArgs& a);
Status silu_mul(const SiluMulArgs& a);
Status argmax(const ArgmaxArgs& a);
Status feed_tokens(const FeedTokensArgs& a);
}  // namespace cpu

/// The same ops on a CUDA stream (declared always; without the CUDA backend they return
/// kUnsupported). Pointers are device pointers.
namespace cuda {
Status fill_uniform(const FillUniformArgs& a, cuda_rt::StreamHandle stream);
Status add_rms_norm(const AddRmsNormArgs& a, cuda_rt::StreamHandle stream);
Status rope_kv_write(const RopeKvWriteArgs& a, cuda_rt::StreamHandle stream);
Status qk_rms_norm(const QkRmsNormArgs& a, cuda_rt::StreamHandle stream);
Status paged_attention(const PagedAttentionArgs& a, cuda_rt::StreamHandle stream);
Status silu_mul(const SiluMulArgs& a, cuda_rt::StreamHandle stream);
Status argmax(const ArgmaxArgs& a, cuda_rt::StreamHandle stream);
Status feed_tokens(const FeedTokensArgs& a, cuda_rt::StreamHandle stream);
}  // namespace cuda

/// The value fill_uniform stores at index i (before rounding to the dtype).
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline float
    uniform_at(const FillUniformArgs& a, int64_t i) {
  uint64_t z = a.seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
  return a.lo + (a.hi - a.lo) * u;
}

}  // namespace loraplex::kernels
