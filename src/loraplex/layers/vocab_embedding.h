#pragma once
// Vocab-parallel embedding with LoRA (vLLM VocabParallelEmbeddingWithLoRA; PEFT's
// lora_embedding_A / lora_embedding_B).
//
// The base table is split by vocabulary rows over the tensor-parallel ranks (ceil(vocab / tp)
// rows each, the last shard shorter); each rank looks up the tokens it owns, writes zeros for
// the others, and an all-reduce completes the rows. The LoRA-A table is stored transposed,
// [max_loras, vocab, max_rank], so a token's row is one contiguous read:
//   - default (as vLLM): the full-vocab A table on every rank; the LoRA is added after the
//     all-reduce, identically on every rank;
//   - fully_sharded: each rank keeps only its vocab rows of A plus one row of zeros that the
//     tokens of other shards point at, and adds its LoRA part before the all-reduce
//     (1/tp of the A table's memory per rank).

#include <cstdint>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/dist/communicator.h"
#include "loraplex/layers/lora_layer.h"
#include "loraplex/layers/weight_upload.h"
#include "loraplex/punica/punica_wrapper.h"
#include "loraplex/punica/slot_ranks.h"

namespace loraplex {

class VocabEmbeddingWithLora {
 public:
  /// comm: tensor-parallel group or nullptr (single device).
  VocabEmbeddingWithLora(int64_t vocab, int64_t hidden, DType dtype, const LoraConfig& config,
                         Communicator* comm, Device device, int max_num_tokens);

  /// weight: FULL [vocab, hidden], CPU, any float dtype (or the layer's dtype on its device).
  /// `upload`: see LoraLinear::load_base.
  void load_base(const Tensor& weight, WeightUpload* upload = nullptr);
  /// slices: exactly one {a, b}: a = lora_embedding_A [rank, vocab], b = lora_embedding_B
  /// [hidden, rank] (scale folded in), CPU, any float dtype; undefined = no embedding LoRA.
  /// Throws (slot unchanged) on a wrong shape or rank > max_lora_rank.
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices);
  /// The same, in `copy_stream` order (see LoraLinear::set_lora with a stream): B is uploaded
  /// without waiting when pinned and in lora_dtype; A is transposed on the host, so its upload
  /// is waited for.
  void set_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& copy_stream);
  void reset_lora(int slot);
  /// The same, in `copy_stream` order, without waiting.
  void reset_lora(int slot, const Stream& copy_stream);

  /// token_ids: int32 [num_tokens] on the layer's device, each in [0, vocab). Returns a view
  /// of the layer's output buffer [num_tokens, hidden] (allocated by the first call), valid
  /// until the next forward.
  Tensor forward(const Tensor& token_ids, const PunicaWrapper& punica, const Stream& stream);
  /// y: [num_tokens, hidden] out, contiguous.
  void forward(const Tensor& token_ids, Tensor& y, const PunicaWrapper& punica,
               const Stream& stream);

  int64_t vocab() const { return vocab_; }
  int64_t hidden() const { return hidden_; }
  int lora_rank(int slot) const;
  /// This rank's vocab rows: [vocab_start(), vocab_start() + local_rows()).
  int64_t vocab_start() const { return vocab_start_; }
  int64_t local_rows() const { return local_rows_; }

 private:
  Communicator& comm() { return comm_ != nullptr ? *comm_ : single_; }
  void write_lora(int slot, const std::vector<LoraSliceWeights>& slices, const Stream& stream);
  void clear_lora(int slot, const Stream& stream);

  int64_t vocab_;
  int64_t hidden_;
  DType dtype_;
  LoraConfig config_;
  Communicator* comm_;
  SingleDeviceCommunicator single_;
  Device device_;
  int max_num_tokens_;
  int tp_ = 1;
  int rank_ = 0;
  int64_t vocab_start_ = 0;
  int64_t local_rows_ = 0;
  Tensor weight_;      // [local_rows, hidden]
  Tensor lora_a_;      // [max_loras, vocab or local_rows + 1, max_rank]
  Tensor lora_b_;      // [max_loras, hidden, max_rank]
  SlotRanks ranks_;    // 1 slice
  Tensor local_ids_;   // fully sharded: int32 [max_num_tokens]
  Tensor out_buffer_;  // [max_num_tokens, hidden]
  std::vector<int32_t> host_ranks_;
};

}  // namespace loraplex
