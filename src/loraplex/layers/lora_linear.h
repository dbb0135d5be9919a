#pragma once
// One LoRA-aware linear layer for every projection kind of vLLM's LoRA subsystem, described
// by data instead of one class per kind (docs/decisions.md "One linear class, described by data"):
//
//   vLLM class                                   LinearSpec factory
//   ReplicatedLinearWithLoRA                     LinearSpec::replicated
//   ColumnParallelLinearWithLoRA                 LinearSpec::column (or column_fused_lora for a
//                                                merged base with one fused LoRA)
//   MergedColumnParallelLinearWithLoRA           LinearSpec::merged_column (2 slices, gate_up)
//   MergedColumnParallelLinearVariableSlice...   LinearSpec::merged_column (>= 3 slices)
//   QKVParallelLinearWithLoRA                    LinearSpec::qkv(..., kFusedLora)
//   MergedQKVParallelLinearWithLoRA              LinearSpec::qkv(..., kPerSliceLora)
//   RowParallelLinearWithLoRA                    LinearSpec::row
//   ...WithShardedLoRA (fully_sharded_loras)     any column/row spec + LoraConfig::fully_sharded
//
// forward: y = x W^T (+ bias) on this rank's shard, plus for each token t with slot k >= 0
// y[t, slice s] += (x A_{s,k}^T) B_{s,k}^T, then the collective of the parallel style:
// row layers all-reduce (base and LoRA partial sums together), gathered column layers
// all-gather the output shards back into the full output order.
//
// Fully sharded column layers shard A by rank cyclically (rank i holds A rows i, i + tp, ...)
// and all-gather the rank intermediate interleaved, so gathered column k is x . A[k] and any
// adapter rank works (no divisibility by tp); the shards are padded with zero rows up to
// ceil(rank / tp) * tp, which the expand then reads (at most tp - 1 extra columns).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/dist/communicator.h"
#include "loraplex/kernels/model_ops.h"
#include "loraplex/layers/fp8_weight.h"
#include "loraplex/layers/lora_layer.h"
#include "loraplex/layers/weight_upload.h"
#include "loraplex/layers/workspace.h"
#include "loraplex/punica/punica_wrapper.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex {

enum class ParallelStyle { kReplicated, kColumn, kRow };

/// One output slice of the base layer (q, k, v; gate, up; or the whole output).
struct OutputSlice {
  int64_t size = 0;   // full (unsharded) width
  int64_t units = 0;  // indivisible units it is sharded by (heads); 0 = any column
};

enum class QkvLora {
  kPerSliceLora,  // q_proj, k_proj, v_proj adapters (vLLM MergedQKVParallelLinearWithLoRA)
  kFusedLora,     // one qkv adapter (vLLM QKVParallelLinearWithLoRA: chatglm, baichuan)
};

struct LinearSpec {
  std::string kind = "linear";  // for messages ("qkv_proj", "MergedQKV", ...)
  ParallelStyle style = ParallelStyle::kReplicated;
  DType dtype = DType::kBF16;  // activations and base weights
  int64_t in_features = 0;     // full (unsharded)
  std::vector<OutputSlice> outputs;
  // One LoRA spanning every output slice (A shared, B split by outputs) instead of one LoRA
  // per output slice.
  bool fused_lora = false;
  bool gather_output = false;     // column: all-gather the output shards
  bool input_is_parallel = true;  // row: x is this rank's input shard (else the full input)
  bool reduce_results = true;     // row: all-reduce (else the partial sums; bias on rank 0)
  // The base weight in float8_e4m3 with float32 scales (FP8 checkpoints): W8A8 on CUDA, the
  // dequantised weight on the CPU. LoRA A then has stacks of its own (no fused layout: the A
  // rows are not fp8 and cannot share the weight's storage and GEMM), so can_fuse() is false.
  bool fp8_weight = false;

  static LinearSpec replicated(int64_t in, int64_t out, DType dtype);
  static LinearSpec column(int64_t in, int64_t out, DType dtype, bool gather_output = false);
  /// Merged column layer with one LoRA per output slice: gate_up (2) or variable slices (>= 3).
  static LinearSpec merged_column(int64_t in, std::vector<int64_t> sizes, DType dtype,
                                  bool gather_output = false);
  /// Merged column base (e.g. gate_up) whose adapter is one fused LoRA.
  static LinearSpec column_fused_lora(int64_t in, std::vector<int64_t> sizes, DType dtype,
                                      bool gather_output = false);
  /// QKV with grouped-query attention: q = num_heads heads, k and v num_kv_heads heads each.
  /// With fewer KV heads than ranks each KV head is replicated on tp / num_kv_heads ranks.
  static LinearSpec qkv(int64_t in, int64_t head_size, int64_t num_heads, int64_t num_kv_heads,
                        DType dtype, QkvLora lora = QkvLora::kPerSliceLora,
                        bool gather_output = false);
  static LinearSpec row(int64_t in, int64_t out, DType dtype, bool input_is_parallel = true,
                        bool reduce_results = true);
};

class LoraLinear {
 public:
  /// comm: the tensor-parallel group (nullptr = single device; ignored by replicated layers).
  /// max_num_tokens bounds the rows of every forward; the layer reserves its scratch for it in
  /// `workspace` (shared by the model's layers; nullptr = a workspace of its own, allocated
  /// here).
  LoraLinear(LinearSpec spec, const LoraConfig& config, Communicator* comm, Device device,
             int max_num_tokens, std::shared_ptr<LayerWorkspace> workspace = nullptr);

  /// Loads the base weights: one FULL [size_s, in_features] per output slice (any float dtype on
  /// the CPU, e.g. mmap views, or spec.dtype on the layer's device), and optionally one bias
  /// [size_s] per output slice (an empty span or undefined tensors = no bias). The layer takes
  /// its shard and converts to spec.dtype. With `upload` the copies are enqueued there (the
  /// sources must live until its finish()); without, they are done on return.
  void load_base(const std::vector<Tensor>& weights, const std::vector<Tensor>& biases = {},
                 WeightUpload* upload = nullptr);
  /// The same from BaseWeights: float ones (as above), or, for a spec with fp8_weight, fp8
  /// ones with their scales (layers/fp8_weight.h), which the layer rebuilds over the rows of
  /// its shard and copies to its device before returning.
  void load_base(const std::vector<BaseWeight>& weights, const std::vector<Tensor>& biases = {},
                 WeightUpload* upload = nullptr);

  /// Installs an adapter in `slot`: one LoraSliceWeights per LoRA slice (num_lora_slices():
  /// 1 for fused or single-output layers, else one per output slice), FULL weights (see
  /// lora_layer.h). Throws loraplex::Error and leaves the slot unchanged on a wrong shape, a
  /// rank above max_lora_rank, or a slot outside [0, max_loras).
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices);
  /// The same, enqueued on `copy_stream` (on the layer's device) without waiting for it when
  /// the sources are pinned and already in lora_dtype with contiguous rows (the adapter
  /// manager's packed adapters): the slot's weights and then its ranks are written in stream
  /// order. The caller keeps the sources alive and unchanged, and makes the compute stream
  /// wait for `copy_stream` (an Event) before a forward uses the slot. Other sources (and
  /// fully sharded column layers, whose A is re-ordered) are staged on the host and waited for.
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& copy_stream);
  /// The slot has exactly no effect afterwards (every slice at rank 0).
  void reset_lora(int slot);
  /// The same, in `copy_stream` order, without waiting.
  void reset_lora(int slot, const Stream& copy_stream);

  /// y = base(x) + LoRA(x) for the tokens of `punica`'s current step.
  /// x: [num_tokens, input_width()] in (rows contiguous); row layers with
  /// input_is_parallel == false take the full [num_tokens, in_features] and use their shard.
  /// Returns a view of the layer's output buffer [num_tokens, output_width()], valid until the
  /// next forward of this layer. The buffer ([max_num_tokens, output_width()]) is allocated by
  /// the first call; models that own their activations use the overload below instead.
  /// Every rank of the group must call it (collectives).
  Tensor forward(const Tensor& x, const PunicaWrapper& punica, const Stream& stream);
  /// As above, writing into `y` ([num_tokens, output_width()], rows contiguous; contiguous
  /// for row layers, which all-reduce it).
  void forward(const Tensor& x, Tensor& y, const PunicaWrapper& punica, const Stream& stream);

  /// forward's two halves, for a single-device caller that runs the LoRA part beside the base
  /// product on another stream: y = x W^T (+ bias), and d += LoRA(x) for the tokens with an
  /// adapter (rows of slot -1 and slices an adapter leaves at rank 0 are not written: the
  /// caller zeroes d). Throws for layers with collectives (tensor parallelism).
  void forward_base(const Tensor& x, Tensor& y, const Stream& stream);
  void add_lora_to(const Tensor& x, Tensor& d, const PunicaWrapper& punica, const Stream& stream);

  /// The fused path (decode steps): ONE GEMM over the base weight and the A rows of slots
  /// 0..num_slots-1 writes each token's base output (columns [0, output_width()), bias added)
  /// and its shrink for every one of those slots after it; row-parallel layers all-reduce the
  /// whole rows. Returns the expand that the op consuming y applies (FusedLoraExpand: nothing
  /// when the step has no LoRA or num_slots is 0), so the layer launches nothing for its LoRA.
  /// Every token whose slot is >= 0 must have a slot below num_slots.
  /// x: [tokens, input_width()] in; y: [tokens, fused_row_width(num_slots)] out, contiguous.
  kernels::FusedLoraExpand forward_fused(const Tensor& x, Tensor& y, const PunicaWrapper& punica,
                                         int num_slots, const Stream& stream);
  /// Columns of forward_fused's output over `num_slots` slots.
  int64_t fused_row_width(int num_slots) const;
  /// Whether forward_fused can run: the fused weight layout (not fully sharded LoRA), an output
  /// that is not gathered, an input that is this rank's shard.
  bool can_fuse() const;

  const LinearSpec& spec() const { return spec_; }
  const LoraConfig& config() const { return config_; }
  Device device() const { return device_; }
  int tp_size() const { return tp_; }
  int tp_rank() const { return rank_; }
  /// Columns of x that forward expects.
  int64_t input_width() const;
  /// Columns of the output: the local shard (column layers without gather) or the full width.
  int64_t output_width() const;
  int num_lora_slices() const { return static_cast<int>(lora_a_.size()); }
  /// The adapter rank installed in (slot, LoRA slice); 0 when empty or reset.
  int lora_rank(int slot, int slice) const;
  /// This rank's base weight [local out, local in] and bias (undefined when none); with the
  /// fused layout, views of the first rows of the layer's weight storage.
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  /// An fp8 weight's scales over this rank's rows (undefined tensors for other layers).
  const Fp8Scales& fp8_scales() const { return fp8_; }
  /// Device stacks of LoRA slice s: A [max_loras, rank rows, in] (with the fused layout a view
  /// whose slots lie slot_cols apart in the weight storage), B [max_loras, n, rank cols], in
  /// lora_dtype.
  const Tensor& lora_a(int s) const { return lora_a_[static_cast<size_t>(s)]; }
  const Tensor& lora_b(int s) const { return lora_b_[static_cast<size_t>(s)]; }
  /// fp8 adapter storage (lora_dtype float8_e4m3): the float32 scale of each A row
  /// [max_loras, rank rows] and of each B row [max_loras, n] of slice s (dequantised A[r, :] =
  /// e4m3(A[r, :]) * a_scale[r]); undefined otherwise.
  Tensor lora_a_scales(int s) const {
    return fp8_lora() ? a_scales_[static_cast<size_t>(s)] : Tensor();
  }
  Tensor lora_b_scales(int s) const {
    return fp8_lora() ? b_scales_[static_cast<size_t>(s)] : Tensor();
  }

 private:
  struct LocalSlice {
    int64_t full_offset = 0;  // first column of the slice in the full output
    int64_t full_size = 0;
    int64_t local_offset = 0;  // first column in this rank's output
    int64_t local_size = 0;
    int64_t shard_start = 0;  // first column of this rank's shard, within the slice
    int groups = 1;           // distinct shards (fewer than tp when KV heads are replicated)
  };

  // set_lora's work, enqueued on `stream`; waits only for pageable sources.
  void write_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream);
  void clear_lora(int slot, const Stream& stream);
  bool fully_sharded_column() const;
  // LoRA A and B stored in float8_e4m3 with per-row scales (their own stacks, no fused layout).
  bool fp8_lora() const { return config_.lora_dtype == DType::kF8E4M3; }
  bool fully_sharded_row() const;
  Communicator& comm() { return comm_ != nullptr ? *comm_ : single_; }
  // Views of one forward's scratch, carved from the workspace.
  struct Scratch {
    Tensor lora;       // f32 shrink intermediate [num_lora * tokens * A rows]
    Tensor gathered;   // fully sharded column layers: f32 [num_lora * tokens * B cols]
    Tensor local_out;  // gathered column layers: [tokens, out_local]
    Tensor staging;    // gathered column layers: [tp * tokens, out_local]
    Tensor fp8;        // fp8 weights on CUDA: x quantised for the GEMM (u8)
  };
  Scratch carve(LayerWorkspace::Carver& carver, int64_t tokens) const;
  void add_lora(Tensor& y, const Tensor& x, const PunicaWrapper& punica, Scratch& scratch,
                const Stream& stream);
  void gather_output(const Tensor& local, Tensor& staging, Tensor& y, const Stream& stream);
  // y = x W^T (+ bias) over the base weight, in its dtype (fp8 through linear_base_fp8).
  void base_gemm(const Tensor& x, const Tensor& bias, Tensor& y, const Scratch& scratch,
                 const Stream& stream) const;

  LinearSpec spec_;
  LoraConfig config_;
  Communicator* comm_;
  SingleDeviceCommunicator single_;
  Device device_;
  int max_num_tokens_;
  int tp_ = 1;
  int rank_ = 0;
  int64_t in_local_ = 0;  // columns of the base weight
  int64_t in_offset_ = 0;
  int64_t out_local_ = 0;
  int64_t out_full_ = 0;
  std::vector<LocalSlice> slices_;

  Tensor storage_;       // [local out (+ max_loras * slot_cols_ A rows), local in]
  Tensor weight_;        // storage_'s first local out rows
  Tensor bias_storage_;  // [storage_ rows]: the bias, then zeros (undefined when none)
  Tensor bias_;          // its first local out entries
  bool loaded_ = false;  // load_base has run (the storage exists from construction)
  Fp8Scales fp8_;        // fp8_weight: the scales of weight_'s rows, on the device
  bool fused_layout_ = false;
  int64_t slot_cols_ = 0;  // A rows per slot in storage_ (num_lora_slices * max_lora_rank)
  std::vector<Tensor> lora_a_;
  std::vector<Tensor> lora_b_;
  std::vector<Tensor> a_scales_;     // fp8_lora(): float32 per slice [max_loras, A rows]
  std::vector<Tensor> b_scales_;     // fp8_lora(): float32 per slice [max_loras, B rows]
  std::vector<int64_t> lora_width_;  // local output columns of each LoRA slice
  SlotRanks ranks_;                  // shrink ranks (and expand ranks unless fully sharded)
  SlotRanks expand_ranks_;           // fully sharded column layers: ceil(r / tp) * tp
  std::vector<int32_t> host_ranks_;  // [slice * max_loras + slot] adapter ranks

  std::shared_ptr<LayerWorkspace> workspace_;
  Tensor out_buffer_;  // [max_num_tokens, output_width()], on first use
};

}  // namespace loraplex
