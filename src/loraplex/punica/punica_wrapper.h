#pragma once
// The Punica wrapper (vLLM's PunicaWrapperGPU/CPU): owns the step's batch metadata for tokens
// and for sampled rows, and applies LoRA to layer outputs through the ops of kernels/. Every
// method validates shapes, dtypes and devices and throws loraplex::Error naming the bad value.
// Weights are slot-stacked: A per slice [max_loras, max_rank, in], B per slice
// [max_loras, n_s, max_rank]; the scale is normally folded into B at load (scale = 1).

#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/kernels/planner/lora_plan.h"
#include "loraplex/punica/batch_meta.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex {

/// The fp8 LoRA-B of one layer for add_expand_fp8 (dequantised value = q * scale).
struct Fp8LoraB {
  std::span<const Tensor> weights;  // per slice float8_e4m3/e5m2 [max_loras, n_s, max_rank]
  // Per slice float32: [max_loras] per tensor, [max_loras, n_s] per channel, or
  // [max_loras, ceil(n_s / group_n), ceil(max_rank / group_k)] per block.
  std::span<const Tensor> scales;
  kernels::Fp8ScaleKind scale_kind = kernels::Fp8ScaleKind::kPerTensor;
  int group_n = 128;
  int group_k = 128;
};

/// One MoE step's (token, k) pairs grouped per adapter slot by expert, from
/// moe_lora_align_block_size. The block tensors are views into the wrapper's buffers, valid
/// until its next moe_lora_align_block_size call. With `naive`, alignment was skipped (vLLM's
/// naive block assignment: every pair is its own block) and the block tensors are undefined.
struct MoeLoraAlignment {
  Tensor topk_ids;         // int32 [num_tokens, top_k]: expert of each pair, -1 = not local
  Tensor adapter_enabled;  // int32 [max_loras], nonzero = slot has MoE LoRA; undefined = all
  int num_experts = 0;
  int block_size = 0;
  bool naive = false;
  Tensor sorted_ids;           // int32 [max_loras, max_num_tokens_padded]: pair ids, padded
  Tensor expert_ids;           // int32 [max_loras, max_num_m_blocks]: expert per block, -1
  Tensor num_tokens_post_pad;  // int32 [max_loras]: padded pair count per slot
};

/// Options of add_lora_fused_moe (the w13/w2 helpers set them for their projection).
struct FusedMoeLoraOptions {
  bool mul_routed_weight = false;  // multiply each pair's delta by its router weight (w2)
  int64_t offset = 0;              // first output column (fully sharded layers)
  bool add_inputs = true;          // false: overwrite the slices' columns of LoRA pairs
};

class PunicaWrapper {
 public:
  /// max_num_seqs bounds the sampled rows (logits LoRA); max_num_tokens the scheduled tokens.
  PunicaWrapper(int max_loras, int max_num_tokens, int max_num_seqs, Device device);

  /// Sets the step's mappings: one slot per scheduled token and one per sampled row
  /// (-1 = base model). Builds both metadata sets on the device.
  void update_metadata(std::span<const int32_t> token_slots, std::span<const int32_t> sampler_slots,
                       const Stream& stream);
  /// update_metadata in two halves, for CUDA graphs: the host half validates and uploads both
  /// mappings (returns {any token has LoRA, any sampled row has LoRA}); the device half builds
  /// both metadata sets from the uploaded mappings and can be captured in a graph.
  std::pair<bool, bool> upload_mappings(std::span<const int32_t> token_slots,
                                        std::span<const int32_t> sampler_slots,
                                        const Stream& stream);
  void build_metadata(int num_tokens, int num_sampled, bool token_lora, bool sampler_lora,
                      const Stream& stream);

  LoraBatchMeta& token_meta() { return token_meta_; }
  const LoraBatchMeta& token_meta() const { return token_meta_; }
  LoraBatchMeta& sampler_meta() { return sampler_meta_; }
  const LoraBatchMeta& sampler_meta() const { return sampler_meta_; }
  int max_loras() const { return max_loras_; }
  Device device() const { return device_; }
  /// What the CUDA kernels' plans are made for: the device's limits and tuning table
  /// (lora_device_of: a CUDA device's own, the defaults on the CPU).
  const kernels::planner::LoraDevice& lora_device() const { return lora_device_; }
  /// Replaces the tuning table (checked; an error names the field) for this wrapper's ops. For
  /// benchmarks and tests, between steps (captured graphs keep the old plans). The metadata's
  /// scratch grows to what the new table's plans need.
  void set_lora_tuning(const kernels::planner::LoraTuning& tuning);
  /// The same with "key=value,..." over the current table (an error names a bad key or value).
  void set_lora_tuning(const std::string& overrides);

  /// y[s, t, :rank] = scale * x[t] @ A_s[slot(t)][:rank]^T.
  /// y: [num_slices, num_tokens, max_rank] float32 (or x's dtype) out; x: [num_tokens, in] in.
  void add_shrink(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                  const SlotRanks& ranks, float scale, const Stream& stream) const;
  /// y[t, off_s : off_s + n_s] (+)= x[s, t, :rank] @ B_s[slot(t)][:, :rank]^T.
  /// y: [num_tokens, >= offset_start + sum n_s] in/out; x: [num_slices, num_tokens, max_rank].
  void add_expand(Tensor& y, const Tensor& x, std::span<const Tensor> lora_b,
                  const SlotRanks& ranks, int64_t offset_start, bool add_inputs,
                  const Stream& stream) const;
  /// y += LoRA(x) for every slice, slices laid out from column 0 of y.
  /// workspace: float32 with at least workspace_elements(num_slices, num_tokens, max_rank)
  /// elements, owned by the caller and sized once (nothing allocates per step).
  void add_lora_linear(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                       std::span<const Tensor> lora_b, const SlotRanks& ranks, float scale,
                       Tensor& workspace, const Stream& stream) const;
  /// Which kernel path add_lora_linear takes for these arguments now: "cpu", or on CUDA
  /// "cluster" (the one-kernel decode layer), "gather" (the decode kernel pair), "split"
  /// (shrink + expand kernels) or "generic". For
  /// benchmarks and tests; launches nothing.
  std::string lora_linear_path(const Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                               std::span<const Tensor> lora_b, const SlotRanks& ranks,
                               Tensor& workspace) const;
  /// Grows the token metadata's scratch to what add_lora_linear's plan for these arguments
  /// needs (the workspace step of check, workspace, run). Setup only, as reserve_scratch.
  void reserve_lora_linear(const Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                           std::span<const Tensor> lora_b, const SlotRanks& ranks,
                           Tensor& workspace);
  /// Logits LoRA on sampled rows, with the sampler mapping. y: [num_seqs, vocab] in/out;
  /// x: [num_seqs, hidden]; A [max_loras, max_rank, hidden]; B [max_loras, vocab, max_rank].
  void add_lora_logits(Tensor& y, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b,
                       const SlotRanks& ranks, float scale, Tensor& workspace,
                       const Stream& stream) const;
  /// Embedding LoRA: y[t] += scale * A[slot][token_ids[t], :rank] @ B[slot][:, :rank]^T.
  /// y: [num_tokens, hidden] in/out; token_ids: int32 [num_tokens] on the device;
  /// lora_a: [max_loras, vocab, max_rank]; lora_b: [max_loras, hidden, max_rank].
  void add_lora_embedding(Tensor& y, const Tensor& token_ids, const Tensor& lora_a,
                          const Tensor& lora_b, const SlotRanks& ranks, float scale,
                          const Stream& stream) const;

  /// Shrink with fp8 LoRA-A (the fp8 adapter storage): y[s, t, :rank] = x[t] @
  /// deq(A_s[slot(t)][:rank])^T, deq(A)[r, :] = e4m3(A[r, :]) * a_scales_s[slot, r].
  /// y: float32 [num_slices, num_tokens, max_rank] out; lora_a per slice float8_e4m3
  /// [max_loras, max_rank, in]; a_scales per slice float32 [max_loras, max_rank].
  void add_shrink_fp8(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                      std::span<const Tensor> a_scales, const SlotRanks& ranks,
                      const Stream& stream) const;
  /// Expand with fp8 LoRA-B: y[t, off_s : off_s + n_s] (+)= x[s, t, :rank] @ deq(B_s)^T.
  /// Weight-only: x is [num_slices, num_tokens, max_rank] float32 or y's dtype, x_scale
  /// undefined. W8A8: x is fp8 (from quantize_intermediate_fp8) and x_scale float32
  /// [num_slices, num_tokens] (per token) or [num_slices] (per tensor).
  void add_expand_fp8(Tensor& y, const Tensor& x, const Fp8LoraB& lora_b, const SlotRanks& ranks,
                      int64_t offset_start, bool add_inputs, const Stream& stream,
                      const Tensor& x_scale = Tensor()) const;
  /// Quantises a float32 shrink result to fp8 for W8A8 expand: scale = max |v| over a row's
  /// first rank columns (per token) or over the slice's LoRA rows (per tensor) / fp8 max.
  /// in: float32 [num_slices, num_tokens, max_rank]; out: fp8, same shape, out;
  /// scale: float32 [num_slices, num_tokens] (per token) or [num_slices] (per tensor), out.
  /// Rows of slot -1 tokens (and their per-token scales) are left as they are.
  void quantize_intermediate_fp8(Tensor& out, Tensor& scale, const Tensor& in,
                                 const SlotRanks& ranks, const Stream& stream) const;

  /// Allocates the MoE alignment buffers once, for max_num_tokens tokens with up to
  /// `max_top_k` experts each, `num_experts` experts and blocks of up to `max_block_size`.
  void reserve_moe_lora(int num_experts, int max_top_k, int max_block_size);
  /// vLLM's moe_lora_align_block_size: for each enabled slot, its (token, k) pairs grouped
  /// by expert, each group padded to a multiple of block_size with the id num_tokens * top_k.
  /// When allow_naive and tokens * top_k <= num_experts * max_loras, alignment is
  /// skipped (naive blocks). topk_ids: int32 [num_tokens, top_k]; adapter_enabled: int32
  /// [max_loras] or undefined (every slot enabled). Needs reserve_moe_lora first.
  MoeLoraAlignment moe_lora_align_block_size(const Tensor& topk_ids, int num_experts,
                                             int block_size, const Tensor& adapter_enabled,
                                             const Stream& stream, bool allow_naive = true);
  /// Fused MoE LoRA (shrink and expand per routed pair, vLLM's add_lora_fused_moe):
  ///   y[t, k, offset + s*n + j] (+)= w * sum_r (x_row . A_s[slot, e, r]) * B_s[slot, e, j, r]
  /// with e = topk_ids[t, k], w the router weight when mul_routed_weight (else 1), and x_row
  /// = x[t] when x has num_tokens rows (w13) or x[t * top_k + k] when it has one row per
  /// pair (w2). y: [num_tokens, top_k, width] contiguous, in/out; x: [num_tokens or
  /// num_tokens * top_k, K]; lora_a per slice [max_loras, num_experts, max_rank, K];
  /// lora_b per slice [max_loras, num_experts, n, max_rank]; topk_weights float32
  /// [num_tokens, top_k] (may be undefined without mul_routed_weight).
  void add_lora_fused_moe(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                          std::span<const Tensor> lora_b, const SlotRanks& ranks,
                          const Tensor& topk_weights, const MoeLoraAlignment& alignment,
                          const FusedMoeLoraOptions& options, const Stream& stream) const;
  /// w13 (gate and up, two slices of width n side by side): x [num_tokens, hidden],
  /// y [num_tokens, top_k, >= offset + 2n], no router weight.
  void add_lora_moe_w13(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                        std::span<const Tensor> lora_b, const SlotRanks& ranks,
                        const MoeLoraAlignment& alignment, const Stream& stream,
                        int64_t offset = 0) const;
  /// w2 (down): x [num_tokens * top_k, intermediate] (one row per pair), y [num_tokens,
  /// top_k, >= offset + hidden], each pair's delta multiplied by its router weight.
  void add_lora_moe_w2(Tensor& y, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b,
                       const SlotRanks& ranks, const Tensor& topk_weights,
                       const MoeLoraAlignment& alignment, const Stream& stream,
                       int64_t offset = 0) const;

  static int64_t workspace_elements(int num_slices, int64_t num_tokens, int max_rank) {
    return static_cast<int64_t>(num_slices) * num_tokens * max_rank;
  }

 private:
  void lora_linear_with_meta(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                             std::span<const Tensor> lora_b, const SlotRanks& ranks, float scale,
                             Tensor& workspace, const LoraBatchMeta& meta,
                             const Stream& stream) const;
  /// The checked shrink and expand arguments of one layer (the shrink writes the workspace).
  std::pair<kernels::ShrinkArgs, kernels::ExpandArgs> linear_args(const Tensor& y, const Tensor& x,
                                                                  std::span<const Tensor> lora_a,
                                                                  std::span<const Tensor> lora_b,
                                                                  const SlotRanks& ranks,
                                                                  float scale, Tensor& workspace,
                                                                  const LoraBatchMeta& meta) const;

  int max_loras_;
  int max_num_tokens_;
  Device device_;
  kernels::planner::LoraDevice lora_device_;
  LoraBatchMeta token_meta_;
  LoraBatchMeta sampler_meta_;
  // MoE alignment buffers, sized by reserve_moe_lora.
  int moe_num_experts_ = 0;
  int moe_max_top_k_ = 0;
  int moe_max_block_size_ = 0;
  Tensor moe_sorted_ids_;           // int32 [max_loras, padded ids of the largest call]
  Tensor moe_expert_ids_;           // int32 [max_loras, blocks of the largest call]
  Tensor moe_num_tokens_post_pad_;  // int32 [max_loras]
  // fused_moe_lora's rank-r intermediate (kernels::FusedMoeLoraArgs::lora_mid), grown to the
  // largest call; the layers carve their own, so this serves the op-level API only.
  mutable Tensor moe_lora_mid_;
};

}  // namespace loraplex
