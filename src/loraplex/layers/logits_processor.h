#pragma once
// Logits with LoRA on lm_head (vLLM LogitsProcessorWithLoRA): one adapter slot per sampled
// row (the PunicaWrapper's sampler mapping), logits gathered over the vocab shards.
//
// The lm_head is split by vocabulary rows, ceil(vocab / tp) per rank (the last shard padded
// with zero rows so every rank gathers the same width). The LoRA:
//   - default (as vLLM): B holds the full vocabulary on every rank and the LoRA is applied to
//     the gathered logits;
//   - fully_sharded: B keeps this rank's vocab rows only and the LoRA is applied to the local
//     logits before the gather (1/tp of B's memory, no redundant expand work).

#include <cstdint>
#include <memory>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/dist/communicator.h"
#include "loraplex/layers/lora_layer.h"
#include "loraplex/layers/weight_upload.h"
#include "loraplex/layers/workspace.h"
#include "loraplex/punica/punica_wrapper.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex {

class LogitsProcessorWithLora {
 public:
  /// max_num_seqs bounds the sampled rows of one forward. workspace: shared scratch (see
  /// workspace.h), nullptr = its own.
  LogitsProcessorWithLora(int64_t hidden, int64_t vocab, DType dtype, const LoraConfig& config,
                          Communicator* comm, Device device, int max_num_seqs,
                          std::shared_ptr<LayerWorkspace> workspace = nullptr);

  /// lm_head: FULL [vocab, hidden], CPU, any float dtype (or the layer's dtype on its device);
  /// bias [vocab] or undefined. `upload`: see LoraLinear::load_base.
  void load_base(const Tensor& lm_head, const Tensor& bias = Tensor(),
                 WeightUpload* upload = nullptr);
  /// slices: exactly one {a [rank, hidden], b [vocab, rank]} (lm_head's lora_A / lora_B with
  /// the scale folded in), CPU, any float dtype; undefined = no lm_head LoRA.
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices);
  /// The same, in `copy_stream` order without waiting when the sources are pinned and in
  /// lora_dtype (see LoraLinear::set_lora with a stream).
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& copy_stream);
  void reset_lora(int slot);
  /// The same, in `copy_stream` order, without waiting.
  void reset_lora(int slot, const Stream& copy_stream);

  /// hidden_states: [num_seqs, hidden] in (the rows to sample, one per sequence, matching the
  /// wrapper's sampler mapping). Returns a view of the layer's buffer [num_seqs, vocab], valid
  /// until the next forward (allocated by the first call). Every rank of the group must call it.
  Tensor forward(const Tensor& hidden_states, const PunicaWrapper& punica, const Stream& stream);
  /// logits: [num_seqs, vocab] out (rows contiguous).
  void forward(const Tensor& hidden_states, Tensor& logits, const PunicaWrapper& punica,
               const Stream& stream);

  int64_t vocab() const { return vocab_; }
  int64_t hidden() const { return hidden_; }
  int lora_rank(int slot) const;

 private:
  Communicator& comm() { return comm_ != nullptr ? *comm_ : single_; }
  void write_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream);
  void clear_lora(int slot, const Stream& stream);
  struct Scratch {
    Tensor local;    // tp > 1: [seqs, shard]
    Tensor staging;  // tp > 1: [tp * seqs, shard]
    Tensor lora;     // f32 [seqs * max_rank]
  };
  Scratch carve(LayerWorkspace::Carver& carver, int64_t seqs) const;

  int64_t hidden_;
  int64_t vocab_;
  DType dtype_;
  LoraConfig config_;
  Communicator* comm_;
  SingleDeviceCommunicator single_;
  Device device_;
  int max_num_seqs_;
  int tp_ = 1;
  int rank_ = 0;
  int64_t shard_ = 0;        // vocab rows per rank (padded)
  int64_t vocab_start_ = 0;  // first vocab row of this rank
  Tensor weight_;            // [shard, hidden], rows past the vocab are zero
  Tensor bias_;              // [shard] or undefined
  Tensor lora_a_;            // [max_loras, max_rank, hidden]
  Tensor lora_b_;            // [max_loras, vocab (or shard when fully sharded), max_rank]
  SlotRanks ranks_;
  std::shared_ptr<LayerWorkspace> workspace_;
  Tensor out_buffer_;  // on first use
  std::vector<int32_t> host_ranks_;
};

}  // namespace loraplex
