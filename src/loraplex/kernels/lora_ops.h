#pragma once
// The multi-LoRA ops of the Punica path, as framework-free argument structs over raw pointers.
// One struct per op; the CPU reference (kernels/cpu/) and the CUDA kernels (kernels/cuda/)
// implement the same struct with the same semantics. All pointers live on the device the op
// runs on. Launchers return Status and never throw.
//
// Ranks: every op takes ranks [num_slices, max_loras] (slot k of slice s uses only the first
// ranks[s * max_loras + k] rows of A and columns of B). Columns of an intermediate at or past
// a slot's rank are neither read nor written and nothing relies on zero padding, which is what
// lets each adapter cost its own rank. A rank of 0 means "this slot has no LoRA here".
//
// Slot -1 means "base model only": such tokens are neither read nor written by any op.

#include <cstdint>

#include "loraplex/core/dtype.h"

namespace loraplex::kernels {

/// Most output slices one call can carry (q/k/v is 3; gate/up is 2; variable-slice layers more).
inline constexpr int kMaxSlices = 8;

/// Per-step batch metadata (vLLM's LoRAKernelMeta) on the op's device. Built once per step by
/// LoraBatchMeta and shared by every layer.
struct LoraMetaView {
  int32_t num_tokens = 0;
  int32_t max_loras = 0;
  const int32_t* token_lora_mapping = nullptr;    // [num_tokens] slot of each token, -1 none
  const int32_t* sorted_token_indices = nullptr;  // [num_tokens] tokens stably sorted by slot
  // Distinct slot ids present, ascending (-1 first when present); entries past
  // *num_active_loras are -1. [max_loras + 1]
  const int32_t* active_lora_ids = nullptr;
  const int32_t* num_tokens_per_lora = nullptr;   // [max_loras + 1] tokens of each active entry
  const int32_t* lora_token_start_loc = nullptr;  // [max_loras + 2] exclusive prefix sum
  const int32_t* num_active_loras = nullptr;      // [1] valid entries of active_lora_ids
  // Device scratch that a GPU op may use for its partial sums (the decode kernels' split-K
  // shrink), with arrival counters that are zero between ops: each op that uses them resets
  // them before it ends. One op at a time per metadata (ops of a step run on one stream).
  // Null / 0 on the CPU; an op that finds too little scratch takes a path without it.
  float* scratch = nullptr;  // [scratch_floats] in/out
  int64_t scratch_floats = 0;
  int32_t* counters = nullptr;  // [num_counters] in/out, zero between ops
  int64_t num_counters = 0;
  // True when the metadata above was complete before the kernel that precedes this op on its
  // stream was launched: the op is not the first since the build on the build's stream (every
  // LoRA op's first kernel lets later kernels launch only after its own griddepcontrol.wait,
  // and other kernels are launched without PDL). A kernel launched with PDL may then read the
  // metadata, and the ranks and A / B rows of the slots it names, before its wait: the rank and
  // weights of a slot that a batch uses are written before the batch's metadata is built and
  // stay until its last op. False is always safe.
  bool settled = false;
};

/// Shrink: out[s, t, :rank] = scale * x[t, :] @ A_s[slot(t)][:rank, :]^T.
struct ShrinkArgs {
  DType dtype = DType::kBF16;  // of x and A: f32, f16 or bf16
  int64_t num_tokens = 0;
  int64_t hidden = 0;        // K
  const void* x = nullptr;   // [num_tokens, x_row_stride] in
  int64_t x_row_stride = 0;  // elements between rows of x (>= hidden)
  int num_slices = 1;
  // Per slice: slot k's rows start at row k * a_slot_rows (0 = max_rank: [max_loras, max_rank,
  // hidden]); a larger stride lets A live slot by slot inside a bigger matrix (the extra rows
  // of a base weight, LoraLinear's fused layout).
  const void* lora_a[kMaxSlices] = {};  // per slice [max_loras, a_slot_rows, hidden] in
  int a_slot_rows = 0;
  int max_loras = 0;
  int max_rank = 0;
  const int32_t* ranks = nullptr;  // [num_slices, max_loras] in
  float scale = 1.0f;
  DType out_dtype = DType::kF32;  // f32, or `dtype`
  void* out = nullptr;            // [num_slices, num_tokens, max_rank] out
};

/// Rows of A between one slot and the next.
inline int a_slot_rows(const ShrinkArgs& a) {
  return a.a_slot_rows > 0 ? a.a_slot_rows : a.max_rank;
}

/// Expand: y[t, off_s : off_s + n_s] (+)= in[s, t, :rank] @ B_s[slot(t)][:, :rank]^T, with
/// off_0 = offset_start and off_{s+1} = off_s + n_s. With add_inputs the sum is rounded once.
struct ExpandArgs {
  DType dtype = DType::kBF16;  // of B and y: f32, f16 or bf16
  int64_t num_tokens = 0;
  DType in_dtype = DType::kF32;  // of the intermediate: f32, or `dtype`
  const void* in = nullptr;      // [num_slices, num_tokens, max_rank] in
  int num_slices = 1;
  const void* lora_b[kMaxSlices] = {};   // per slice [max_loras, slice_width[s], max_rank] in
  int64_t slice_width[kMaxSlices] = {};  // n_s
  int max_loras = 0;
  int max_rank = 0;
  const int32_t* ranks = nullptr;  // [num_slices, max_loras] in
  void* y = nullptr;               // [num_tokens, y_row_stride] in/out
  int64_t y_row_stride = 0;
  int64_t offset_start = 0;
  bool add_inputs = true;  // false: overwrite the slice columns of LoRA tokens
};

/// Shrink with A stored as float8_e4m3 and one float32 scale per A row (per channel), the fp8
/// adapter storage: out[s, t, r] = scale * a_scale_s[slot(t) * a_slot_rows + r] *
/// sum_k x[t, k] * e4m3(A_s[slot(t)][r, k]). The intermediate is float32.
struct ShrinkFp8Args {
  ShrinkArgs base;  // base.dtype is x's; base.lora_a point at e4m3 codes; base.out_dtype f32
  const float* a_scale[kMaxSlices] = {};  // per slice [max_loras, a_slot_rows] in
};

/// How the fp8 LoRA-B scales are laid out (dequantised value = q * scale).
enum class Fp8ScaleKind {
  kPerTensor,   // [max_loras] per slice
  kPerChannel,  // [max_loras, n_s] per slice
  kPerBlock,    // [max_loras, ceil(n_s / group_n), ceil(max_rank / group_k)] per slice
};

/// Expand with B stored as fp8. Weight-only: the intermediate is f32/f16/bf16 (base.in_dtype).
/// W8A8: the intermediate is fp8 (in_fp8_dtype) with scales per (slice, token) or per slice.
struct ExpandFp8Args {
  ExpandArgs base;  // base.dtype is the dtype of y; base.lora_b point at fp8 data
  DType weight_dtype = DType::kF8E4M3;  // kF8E4M3 or kF8E5M2
  Fp8ScaleKind scale_kind = Fp8ScaleKind::kPerTensor;
  const float* b_scale[kMaxSlices] = {};  // per slice, layout per scale_kind
  int group_n = 128;
  int group_k = 128;
  bool w8a8 = false;
  DType in_fp8_dtype = DType::kF8E4M3;  // when w8a8: the dtype of base.in
  bool in_scale_per_token = true;
  const float* in_scale = nullptr;  // when w8a8: [num_slices, num_tokens] or [num_slices]
};

/// Quantises an f32 shrink result to fp8 for W8A8 expand: per (slice, token) or per slice,
/// scale = max |v| over the slot's first `rank` columns / fp8 max (1 when all are zero).
struct QuantizeIntermediateArgs {
  int64_t num_tokens = 0;
  int num_slices = 1;
  int max_loras = 0;
  int max_rank = 0;
  const int32_t* ranks = nullptr;               // [num_slices, max_loras] in
  const int32_t* token_lora_mapping = nullptr;  // [num_tokens] in
  const float* in = nullptr;                    // [num_slices, num_tokens, max_rank] in
  DType out_dtype = DType::kF8E4M3;
  void* out = nullptr;  // [num_slices, num_tokens, max_rank] out
  bool per_token = true;
  float* scale = nullptr;  // [num_slices, num_tokens] or [num_slices] out
};

/// Embedding LoRA: y[t, :] += scale * A[slot][token_ids[t], :rank] @ B[slot][:, :rank]^T.
/// A is PEFT's lora_embedding_A transposed so that a token's row is one contiguous read.
struct EmbeddingLoraArgs {
  DType dtype = DType::kBF16;  // of A, B and y
  int64_t num_tokens = 0;
  const int32_t* token_ids = nullptr;           // [num_tokens] in, each in [0, vocab)
  const int32_t* token_lora_mapping = nullptr;  // [num_tokens] in
  const void* lora_a = nullptr;                 // [max_loras, vocab, max_rank] in
  int64_t vocab = 0;
  const void* lora_b = nullptr;  // [max_loras, hidden, max_rank] in
  int64_t hidden = 0;
  int max_loras = 0;
  int max_rank = 0;
  const int32_t* ranks = nullptr;  // [max_loras] in
  float scale = 1.0f;
  void* y = nullptr;  // [num_tokens, y_row_stride] in/out
  int64_t y_row_stride = 0;
};

/// Groups each slot's (token, k) pairs by expert, each expert group padded to block_size
/// (vLLM's moe_lora_align_block_size). Slots that are inactive or not adapter_enabled get
/// num_tokens_post_pad 0.
struct MoeAlignArgs {
  int64_t num_tokens = 0;
  int top_k = 1;
  int num_experts = 0;
  int block_size = 16;
  int max_loras = 0;
  const int32_t* topk_ids = nullptr;            // [num_tokens, top_k] in
  const int32_t* token_lora_mapping = nullptr;  // [num_tokens] in
  const int32_t* adapter_enabled = nullptr;     // [max_loras] in, nonzero = slot has MoE LoRA
  int64_t max_num_tokens_padded = 0;            // from moe_align_sizes()
  int64_t max_num_m_blocks = 0;
  // Flat pair index t * top_k + k; padding entries hold num_tokens * top_k.
  int32_t* sorted_ids = nullptr;           // [max_loras, max_num_tokens_padded] out
  int32_t* expert_ids = nullptr;           // [max_loras, max_num_m_blocks] out, -1 unused
  int32_t* num_tokens_post_pad = nullptr;  // [max_loras] out
};

struct MoeAlignSizes {
  int64_t max_num_tokens_padded = 0;
  int64_t max_num_m_blocks = 0;
};
/// Buffer sizes for moe_lora_align_block_size: vLLM's worst case (every expert group padded),
/// rounded up to whole blocks.
MoeAlignSizes moe_align_sizes(int64_t num_pairs, int num_experts, int block_size);
/// True when alignment is skipped (naive blocks): num_tokens * top_k <= num_experts * max_loras,
/// at most one routed pair per (slot, expert) on average (vLLM skips it from 8 times fewer).
bool moe_use_naive_blocks(int64_t num_tokens, int top_k, int num_experts, int max_loras);

/// Fused MoE LoRA, shrink and expand for one projection of the routed experts:
///   for each pair (t, k) with slot = mapping[t] enabled and expert e = topk_ids[t, k]:
///   out[t, k, offset + s*n + j] (+)= w * sum_r (x_row . A_s[slot, e, r, :]) * B_s[slot, e, j, r]
/// where x_row is x[t] (w13: rows are tokens) or x[t * top_k + k] (w2: rows are pairs) and w
/// is topk_weights[t, k] when mul_routed_weight, else 1.
/// Pairs are visited either through the aligned blocks (sorted_ids/expert_ids) or, when
/// `naive_blocks`, directly through topk_ids.
struct FusedMoeLoraArgs {
  DType dtype = DType::kBF16;  // of x, A, B and out
  int64_t num_tokens = 0;
  int top_k = 1;
  int num_experts = 0;
  int64_t hidden_in = 0;    // K
  const void* x = nullptr;  // [num_tokens, K] or [num_tokens * top_k, K] in
  bool x_rows_are_pairs = false;
  int num_slices = 1;                   // 2 for w13 (gate, up), 1 for w2 (down)
  const void* lora_a[kMaxSlices] = {};  // per slice [max_loras, num_experts, max_rank, K] in
  const void* lora_b[kMaxSlices] = {};  // per slice [max_loras, num_experts, n, max_rank] in
  int64_t n = 0;                        // output width of each slice
  int max_loras = 0;
  int max_rank = 0;
  const int32_t* ranks = nullptr;               // [num_slices, max_loras] in
  const int32_t* token_lora_mapping = nullptr;  // [num_tokens] in
  const int32_t* adapter_enabled = nullptr;     // [max_loras] in
  const int32_t* topk_ids = nullptr;            // [num_tokens, top_k] in
  const float* topk_weights = nullptr;          // [num_tokens, top_k] in
  bool mul_routed_weight = false;
  bool naive_blocks = false;
  int block_size = 16;
  int64_t max_num_tokens_padded = 0;
  int64_t max_num_m_blocks = 0;
  const int32_t* sorted_ids = nullptr;  // from MoeAlignArgs (unless naive_blocks)
  const int32_t* expert_ids = nullptr;
  const int32_t* num_tokens_post_pad = nullptr;
  // The rank-r intermediate between the CUDA shrink and expand kernels: scratch of
  // fused_moe_lora_mid_floats() floats; the CPU op does not use it.
  float* lora_mid = nullptr;
  void* out = nullptr;  // [num_tokens, top_k, out_row_width] in/out
  int64_t out_row_width = 0;
  int64_t offset = 0;  // first output column (fully sharded layers)
  bool add_inputs = true;
  // True when the kernel just before this op on its stream wrote none of x, the routing, the
  // mapping, the ranks or the LoRA weights, and naive_blocks holds: the CUDA shrink may then run
  // beside that kernel's last thread blocks (programmatic dependent launch; it ends only after
  // that kernel has). The CPU ignores it.
  bool overlap_preceding_kernel = false;
};

/// Floats of FusedMoeLoraArgs::lora_mid for a call: [num_tokens * top_k, num_slices, max_rank].
inline int64_t fused_moe_lora_mid_floats(int64_t num_pairs, int num_slices, int max_rank) {
  return num_pairs * num_slices * max_rank;
}

}  // namespace loraplex::kernels
