#pragma once
// The Punica wrapper (vLLM's PunicaWrapperGPU/CPU): owns the step's batch metadata for tokens
// and for sampled rows, and applies LoRA to layer outputs through the ops of kernels/. Every
// method validates shapes, dtypes and devices and throws loraplex::Error naming the bad value.
// Weights are slot-stacked: A per slice [max_loras, max_rank, in], B per slice
// [max_loras, n_s, max_rank]; the scale is normally folded into B at load (scale = 1).

#include <cstdint>
#include <span>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/punica/batch_meta.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex {

class PunicaWrapper {
 public:
  /// max_num_seqs bounds the sampled rows (logits LoRA); max_num_tokens the scheduled tokens.
  PunicaWrapper(int max_loras, int max_num_tokens, int max_num_seqs, Device device);

  /// Sets the step's mappings: one slot per scheduled token and one per sampled row
  /// (-1 = base model). Builds both metadata sets on the device.
  void update_metadata(std::span<const int32_t> token_slots, std::span<const int32_t> sampler_slots,
                       const Stream& stream);

  LoraBatchMeta& token_meta() { return token_meta_; }
  const LoraBatchMeta& token_meta() const { return token_meta_; }
  LoraBatchMeta& sampler_meta() { return sampler_meta_; }
  const LoraBatchMeta& sampler_meta() const { return sampler_meta_; }
  int max_loras() const { return max_loras_; }
  Device device() const { return device_; }

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

  static int64_t workspace_elements(int num_slices, int64_t num_tokens, int max_rank) {
    return static_cast<int64_t>(num_slices) * num_tokens * max_rank;
  }

 private:
  void lora_linear_with_meta(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                             std::span<const Tensor> lora_b, const SlotRanks& ranks, float scale,
                             Tensor& workspace, const LoraBatchMeta& meta,
                             const Stream& stream) const;

  int max_loras_;
  Device device_;
  LoraBatchMeta token_meta_;
  LoraBatchMeta sampler_meta_;
};

}  // namespace loraplex
