#pragma once
// Fused MoE with LoRA (vLLM FusedMoEWithLoRA / FusedMoE3DWithLoRA), including the base MoE:
// router softmax over experts (float), top-k, renormalisation as Mixtral/transformers do,
// SiLU-gated experts, router-weighted sum over the top-k.
//
// Per token t and routed pair (t, k) with expert e and router weight w:
//   gate_up = W13[e] x_t                + w13 LoRA delta (gate and up slices)  [before act]
//   h       = silu(gate) * up
//   down    = w * (W2[e] h)             + w * w2 LoRA delta                     [before sum]
//   y_t     = sum_k down
// which is where vLLM adds the two LoRA deltas. Experts are tensor-parallel over the
// intermediate dimension (I / tp per rank): w13 LoRA-B is sliced by intermediate rows, w2
// LoRA-A by intermediate columns, and the partial outputs are summed by one all-reduce.
// Fully sharded: w13 A is sliced by rank (cyclically, as LoraLinear) and the rank
// intermediate all-gathered; w2 B is sliced by hidden rows and the rank intermediate
// all-reduced, then expanded into this rank's hidden columns.
//
// Adapters: per-expert 2-D weights (transformers 4.x names block_sparse_moe.experts.N.w1/w3/w2)
// in MoeLoraWeights, or PEFT's 3-D expert parameters converted with peft_3d_expert_lora().
//
// Base experts: on a GPU, steps of up to kDeviceRoutedMaxPairs routed pairs (decode) group the
// pairs by expert on the device and run the expert GEMMs over that block table
// (layer_ops::moe_expert_gemm): no host read, so the decoder can capture them in CUDA graphs.
// Larger steps, and the CPU, run one GEMM per expert over the pairs routed to it, grouped on the
// host (one device-to-host copy of the top-k ids per forward on a GPU).

#include <cstdint>
#include <memory>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/dist/communicator.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/layers/lora_layer.h"
#include "loraplex/layers/weight_upload.h"
#include "loraplex/layers/workspace.h"
#include "loraplex/punica/punica_wrapper.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex {

/// How a fused gate_up projection orders its 2 * intermediate output rows.
enum class GateUpLayout {
  kConcatenated,  // [gate rows; up rows] (transformers' gate_up_proj.chunk(2))
  kInterleaved,   // gate = even rows, up = odd rows (GPT-OSS)
};

struct MoeSpec {
  int num_experts = 8;
  int top_k = 2;
  int64_t hidden = 0;
  int64_t intermediate = 0;  // full (unsharded) per expert
  DType dtype = DType::kBF16;
  bool renormalize = true;  // Mixtral: top-k probabilities renormalised to sum 1
};

/// The MoE part of one adapter, per expert. Each list is empty (the adapter does not target
/// that projection: rank 0) or has num_experts entries; an entry with undefined a and b means
/// the adapter does not target that expert (written as zeros). Ranks may differ per expert;
/// the slot runs at the largest and smaller experts are zero-padded.
struct MoeLoraWeights {
  std::vector<LoraSliceWeights> w1;  // gate: a [r, hidden], b [intermediate, r]
  std::vector<LoraSliceWeights> w3;  // up:   a [r, hidden], b [intermediate, r]
  std::vector<LoraSliceWeights> w2;  // down: a [r, intermediate], b [hidden, r]
};

/// PEFT's 3-D expert LoRA (LoraConfig.target_parameters; peft.tuners.lora.layer.ParamWrapper)
/// as per-expert 2-D slices. PEFT stores one projection of E experts as
///   A [r * E, in]   rows expert-major:   row    e * r + j  is expert e's A row j
///   B [out, r * E]  columns rank-major:  column j * E + e  is expert e's B column j
/// (ParamWrapper.get_delta_weight reshapes A to (E, r, in) and B to (out, r, E)). `in`/`out`
/// are the projection's true input/output sizes; PEFT >= 0.19 swaps its in/out features for
/// transformers-5 parameters stored [E, out, in] (_did_swap_in_out_features), and the caller
/// must pass A and B in the orientation where A's columns are the projection input.
/// Returns views (no copies). Scale must already be folded into B.
std::vector<LoraSliceWeights> peft_3d_expert_lora(const Tensor& a, const Tensor& b,
                                                  int num_experts);

/// Splits per-expert gate_up adapters (B [2 * intermediate, r]) into gate (w1) and up (w3)
/// adapters sharing A, per the base layer's gate_up row layout. Views, no copies.
void split_gate_up_lora(const std::vector<LoraSliceWeights>& gate_up, int64_t intermediate,
                        GateUpLayout layout, std::vector<LoraSliceWeights>& w1,
                        std::vector<LoraSliceWeights>& w3);

class FusedMoeWithLora {
 public:
  /// comm: tensor-parallel group or nullptr. intermediate must be divisible by the group size.
  /// workspace: shared scratch for the routed pairs' intermediates (see workspace.h; the MoE
  /// layer needs the most of all layers), nullptr = its own.
  FusedMoeWithLora(const MoeSpec& spec, const LoraConfig& config, Communicator* comm, Device device,
                   int max_num_tokens, std::shared_ptr<LayerWorkspace> workspace = nullptr);

  /// FULL base weights, CPU, any float dtype (or spec.dtype on the layer's device): router
  /// [E, hidden]; per expert w1 (gate) and w3 (up) [intermediate, hidden], w2 (down) [hidden,
  /// intermediate]. `upload`: see LoraLinear::load_base.
  void load_base(const Tensor& router, const std::vector<Tensor>& w1, const std::vector<Tensor>& w3,
                 const std::vector<Tensor>& w2, WeightUpload* upload = nullptr);
  /// transformers-5 style 3-D experts (CPU): gate_up [E, 2 * intermediate, hidden] (row layout
  /// `layout`), down [E, hidden, intermediate].
  void load_base_3d(const Tensor& router, const Tensor& gate_up, const Tensor& down,
                    GateUpLayout layout = GateUpLayout::kConcatenated,
                    WeightUpload* upload = nullptr);

  /// Throws loraplex::Error (slot unchanged) on a wrong shape, list length or rank.
  void set_lora(int slot, const MoeLoraWeights& weights);
  /// The same, in `copy_stream` order (see LoraLinear::set_lora with a stream): a projection
  /// whose experts are all pinned and in lora_dtype is uploaded without waiting (the slot's
  /// stacks are zeroed on the device, then each expert copied); others (and fully sharded
  /// layers) are staged on the host and waited for.
  void set_lora(int slot, const MoeLoraWeights& weights, const Stream& copy_stream);
  void reset_lora(int slot);
  /// The same, in `copy_stream` order, without waiting.
  void reset_lora(int slot, const Stream& copy_stream);

  /// x: [num_tokens, hidden] in, contiguous. Returns a view of the layer's output buffer
  /// [num_tokens, hidden] (allocated by the first call), valid until the next forward. Every
  /// rank must call it.
  Tensor forward(const Tensor& x, const PunicaWrapper& punica, const Stream& stream);
  /// y: [num_tokens, hidden] out, contiguous.
  void forward(const Tensor& x, Tensor& y, const PunicaWrapper& punica, const Stream& stream);

  const MoeSpec& spec() const { return spec_; }
  /// Whether a forward of `tokens` tokens routes on the device (no host synchronisation: it can
  /// be captured in a CUDA graph).
  bool routes_on_device(int64_t tokens) const;
  /// The most routed pairs (tokens x top_k) a GPU step groups on the device. Decode steps of
  /// up to 256 sequences of a top-8 model fit; beyond that (prefill) one GEMM per expert with
  /// its whole M is the better kernel.
  static constexpr int64_t kDeviceRoutedMaxPairs = 2048;
  /// kAuto: the device ops for steps of up to kDeviceRoutedMaxPairs pairs on a GPU, the host
  /// otherwise; kHost: always the host (to measure the per-expert cuBLASLt GEMMs against the
  /// device-routed kernel); kDevice: the device ops up to the limit on any device (tests: the
  /// path a GPU takes, run with the ops' CPU versions where there is no GPU).
  enum class Routing { kAuto, kHost, kDevice };
  void set_routing(Routing routing) { routing_ = routing; }
  /// Adapter rank of (slot, projection): projection 0 = w1, 1 = w3, 2 = w2.
  int lora_rank(int slot, int projection) const;

 private:
  Communicator& comm() { return comm_ != nullptr ? *comm_ : single_; }
  void write_lora(int slot, const MoeLoraWeights& weights, const Stream& stream);
  void clear_lora(int slot, const Stream& stream);
  void load_experts(const Tensor& router, const std::vector<Tensor>& gate,
                    const std::vector<Tensor>& up, const std::vector<Tensor>& down,
                    WeightUpload* upload);
  void route_on_host(int64_t tokens, const Stream& stream);
  void experts_on_host(const Tensor& sorted_in, const Tensor& w, Tensor& sorted_out,
                       const Stream& stream);
  void gate_up_on_host(const Tensor& x, const Stream& stream);
  void down_on_host(const Stream& stream);
  void add_w13_lora(const Tensor& x, Tensor& gate_up, const PunicaWrapper& punica,
                    const Stream& stream);
  void add_w2_lora(const Tensor& act, Tensor& down, const PunicaWrapper& punica,
                   const Stream& stream);
  kernels::FusedMoeLoraArgs lora_args(const PunicaWrapper& punica, int64_t tokens) const;
  bool lora_follows_expert_gemm(int64_t tokens) const;

  MoeSpec spec_;
  LoraConfig config_;
  Communicator* comm_;
  SingleDeviceCommunicator single_;
  Device device_;
  int max_num_tokens_;
  int tp_ = 1;
  int rank_ = 0;
  int64_t inter_local_ = 0;
  int64_t rank_shard_ = 0;  // fully sharded: ceil(max_rank / tp)
  int64_t rank_pad_ = 0;    // fully sharded: rank_shard_ * tp

  Tensor router_;  // [E, hidden]
  Tensor w13_;     // [E, 2 * inter_local, hidden] gate rows then up rows
  Tensor w2_;      // [E, hidden, inter_local]

  Tensor w13_a_[2];  // [L, E, max_rank (or rank_shard), hidden]
  Tensor w13_b_[2];  // [L, E, inter_local, max_rank (or rank_pad)]
  Tensor w2_a_;      // [L, E, max_rank, inter_local]
  Tensor w2_b_;      // [L, E, hidden (or hidden / tp), max_rank]
  // Fully sharded: the split shrink / expand run as fused_moe_lora calls whose other factor
  // is a 0/1 selector (identity) matrix.
  Tensor select_shard_;   // [L, E, rank_shard, rank_shard] identity
  Tensor select_pad_[2];  // [L, E, rank_pad, 2 * rank_pad]: picks slice s of the gathered rows
  Tensor select_rank_;    // [L, E, max_rank, max_rank] identity
  SlotRanks ranks13_;     // [2 slices]
  SlotRanks ranks13_expand_;
  SlotRanks ranks2_;                 // [1 slice]
  Tensor adapter_enabled_;           // int32 [L] on the device
  std::vector<int32_t> host_ranks_;  // [projection * L + slot]

  // Views of one forward's scratch (P = tokens * top_k routed pairs).
  struct Scratch {
    Tensor logits;          // [T, E]
    Tensor topk_ids;        // int32 [P]
    Tensor topk_weights;    // f32 [P]
    Tensor pair_index;      // int32 [2, P]: pairs sorted by expert, and their tokens
    Tensor rows_h;          // [P, hidden]: gathered x rows, later the sorted down outputs
    Tensor gate_up_sorted;  // [P, 2 * inter_local]
    Tensor act_sorted;      // [P, inter_local], aliases gate_up_sorted (dead by then)
    Tensor gate_up;         // [P, 2 * inter_local] pair-major
    Tensor act;             // [P, inter_local] pair-major
    Tensor down;            // [P, hidden] pair-major
    Tensor sorted_ids;      // int32 [L, align_padded]
    Tensor expert_ids;      // int32 [L, align_blocks]
    Tensor num_post_pad;    // int32 [L]
    Tensor lora_mid;        // f32: fused_moe_lora's rank-r intermediate
    Tensor block_expert;    // int32 [expert blocks]: device routing (moe_expert_blocks)
    Tensor block_pairs;     // int32 [expert blocks * 16]
    int64_t align_padded = 0;
    int64_t align_blocks = 0;
    Tensor fs13;           // fully sharded: [P * 2 * rank_shard]
    Tensor fs13_gathered;  // [P * 2 * rank_pad]
    Tensor fs2;            // [P * max_rank]
  };
  Scratch carve(LayerWorkspace::Carver& carver, int64_t tokens) const;

  std::shared_ptr<LayerWorkspace> workspace_;
  Scratch s_;          // the current forward's views
  Tensor host_ids_;    // CUDA: pinned int32 [max pairs]
  Tensor host_order_;  // CUDA: pinned int32 [2, max pairs]
  std::vector<int64_t> expert_offsets_;
  Tensor out_buffer_;          // [max_num_tokens, hidden], on first use
  bool naive_blocks_ = false;  // this step's choice (kernels::moe_use_naive_blocks)
  Routing routing_ = Routing::kAuto;
};

}  // namespace loraplex
