#pragma once
// The decoder's LoRA-aware modules: a linear projection with output slices (q/k/v, gate/up),
// the token embedding, the lm_head (logits on sampled rows) and Mixtral's routed experts. Each
// is base computation + one Punica call per step, with slot-stacked LoRA weights sized once
// (max_loras x max_lora_rank) and an adapter's true rank per (slice, slot).
//
// They follow the layers contract (set_lora(slot, slices) with full A [rank, in] and B
// [out, rank], the scale already folded into B; reset_lora(slot)) so that the adapter loader
// programs them the same way it programs the layers library's classes.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/punica/punica_wrapper.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex::model {

/// One output slice's LoRA: a [rank, in], b [out_slice, rank] (scale folded in), any float
/// dtype, on the CPU. Undefined a/b = the adapter does not target this slice (rank 0).
struct LoraSliceWeights {
  Tensor a;
  Tensor b;
};

/// What every module of a step shares: the Punica metadata, a float32 workspace sized at
/// start-up, and the stream.
struct StepContext {
  const PunicaWrapper* punica = nullptr;
  Tensor* workspace = nullptr;  // float32, >= workspace_elements(max slices, max tokens, rank)
  Stream stream;
};

/// Sizes every module is built with.
struct LoraShape {
  int max_loras = 1;
  int max_rank = 1;
  DType dtype = DType::kF32;  // activation and LoRA weight dtype
  Device device = Device::cpu();
};

/// Anything an adapter can program.
class LoraModule {
 public:
  virtual ~LoraModule() = default;
  /// Installs `slices` (one per output slice) into `slot`; throws, leaving the slot unchanged,
  /// on a wrong shape or a rank above max_rank.
  virtual void set_lora(int slot, const std::vector<LoraSliceWeights>& slices) = 0;
  /// The slot has exactly no effect afterwards.
  virtual void reset_lora(int slot) = 0;
  virtual int num_slices() const = 0;
  virtual int64_t in_features() const = 0;
  virtual int64_t slice_out_features(int slice) const = 0;
};

/// y = x W^T (+ bias) on the device: CPU keeps W as float32 [in, out] (a vectorisable axpy
/// per input feature); CUDA keeps W [out, in] in the activation dtype and calls cuBLAS with
/// float32 compute (no TF32).
class BaseLinear {
 public:
  BaseLinear() = default;
  /// weight: [out, in] any float dtype on the CPU (read once); bias: [out] or undefined.
  BaseLinear(const Tensor& weight, const Tensor& bias, DType dtype, Device device);
  /// y: [num_tokens, out] out (written, not accumulated); x: [num_tokens, in] in.
  void forward(Tensor& y, const Tensor& x, const Stream& stream) const;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  int64_t in_ = 0;
  int64_t out_ = 0;
  DType dtype_ = DType::kF32;
  Device device_ = Device::cpu();
  Tensor weight_;  // CPU: float32 [in, out]; CUDA: dtype [out, in]
  Tensor bias_;    // [out] in dtype, or undefined
};

/// A linear projection whose output is split into slices, each with its own LoRA.
class LoraLinear : public LoraModule {
 public:
  /// weight: [sum(slice_widths), in] CPU; bias: [sum] or undefined.
  LoraLinear(const Tensor& weight, const Tensor& bias, std::vector<int64_t> slice_widths,
             const LoraShape& shape);
  /// Returns [num_tokens, out]; x: [num_tokens, in] in.
  Tensor forward(const Tensor& x, const StepContext& ctx) const;

  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices) override;
  void reset_lora(int slot) override;
  int num_slices() const override { return static_cast<int>(widths_.size()); }
  int64_t in_features() const override { return base_.in_features(); }
  int64_t slice_out_features(int slice) const override { return widths_.at(slice); }

 private:
  BaseLinear base_;
  std::vector<int64_t> widths_;
  LoraShape shape_;
  std::vector<Tensor> a_;  // per slice [max_loras, max_rank, in]
  std::vector<Tensor> b_;  // per slice [max_loras, width, max_rank]
  SlotRanks ranks_;
};

/// The token embedding with PEFT's embedding LoRA (lora_embedding_A [rank, vocab] as `a`,
/// lora_embedding_B [hidden, rank] as `b`).
class LoraEmbedding : public LoraModule {
 public:
  /// table: [vocab, hidden] CPU.
  LoraEmbedding(const Tensor& table, const LoraShape& shape);
  /// Returns [num_tokens, hidden]; ids: int32 [num_tokens] on the device.
  Tensor forward(const Tensor& ids, const StepContext& ctx) const;
  const Tensor& table() const { return table_; }

  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices) override;
  void reset_lora(int slot) override;
  int num_slices() const override { return 1; }
  int64_t in_features() const override { return table_.size(0); }
  int64_t slice_out_features(int) const override { return table_.size(1); }

 private:
  Tensor table_;  // [vocab, hidden] dtype, device
  LoraShape shape_;
  Tensor a_;  // [max_loras, vocab, max_rank]
  Tensor b_;  // [max_loras, hidden, max_rank]
  SlotRanks ranks_;
};

/// lm_head on the sampled rows, with its LoRA applied through the sampler mapping.
class LoraLogits : public LoraModule {
 public:
  /// weight: [vocab, hidden] CPU.
  LoraLogits(const Tensor& weight, const LoraShape& shape);
  /// Returns [num_rows, vocab]; h: [num_rows, hidden] in (rows = sampled sequences).
  Tensor forward(const Tensor& h, const StepContext& ctx) const;

  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices) override;
  void reset_lora(int slot) override;
  int num_slices() const override { return 1; }
  int64_t in_features() const override { return base_.in_features(); }
  int64_t slice_out_features(int) const override { return base_.out_features(); }

 private:
  BaseLinear base_;
  LoraShape shape_;
  Tensor a_;  // [max_loras, max_rank, hidden]
  Tensor b_;  // [max_loras, vocab, max_rank]
  SlotRanks ranks_;
};

/// Mixtral's routed experts with LoRA on w13 (gate and up, two slices) and w2 (down).
/// Adapters arrive either as PEFT's 3-D form (set_lora_3d) or per expert (set_lora_expert).
class LoraMoe {
 public:
  /// w1/w3: per expert [inter, hidden]; w2: per expert [hidden, inter]; all CPU.
  LoraMoe(const std::vector<Tensor>& w1, const std::vector<Tensor>& w3,
          const std::vector<Tensor>& w2, int top_k, const LoraShape& shape);
  /// Returns [num_tokens, hidden]; h: [num_tokens, hidden] in; router_logits [num_tokens, E].
  Tensor forward(const Tensor& h, const Tensor& router_logits, const StepContext& ctx) const;

  /// PEFT target_parameters: `param` is 0 for gate_up_proj (a [r*E, hidden], b [2*inter, r*E])
  /// or 1 for down_proj (a [r*E, inter], b [hidden, r*E]); rows of a are expert-major, columns
  /// of b rank-major (column j*E + e), as PEFT's ParamWrapper lays them out. Scale folded in b.
  void set_lora_3d(int slot, int param, const Tensor& a, const Tensor& b);
  /// One expert's 2-D LoRA for w1 (which = 0), w3 (1) or w2 (2): a [r, in], b [out, r].
  void set_lora_expert(int slot, int expert, int which, const Tensor& a, const Tensor& b);
  void reset_lora(int slot);
  int num_experts() const { return num_experts_; }
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return inter_; }

 private:
  void write_expert(int slot, int which, int expert, const Tensor& a, const Tensor& b);
  void upload(int slot, int which);

  int num_experts_;
  int top_k_;
  int64_t hidden_;
  int64_t inter_;
  LoraShape shape_;
  Tensor w13_;  // [E, 2*inter, hidden] dtype, device (gate rows, then up rows)
  Tensor w2_;   // [E, hidden, inter]
  // LoRA stacks, index 0/1 = gate/up of w13, 2 = w2; host mirrors keep partial (per-expert)
  // updates simple and are uploaded one slot at a time.
  Tensor a_host_[3];  // [max_loras, E, max_rank, in] CPU
  Tensor b_host_[3];  // [max_loras, E, out, max_rank] CPU
  Tensor a_[3];       // the same on the device
  Tensor b_[3];
  SlotRanks ranks13_;
  SlotRanks ranks2_;
  std::vector<int32_t> enabled_host_;  // [max_loras]
  Tensor enabled_;                     // [max_loras] int32 on the device
};

}  // namespace loraplex::model
