#pragma once
// LoraBatchMeta (vLLM's LoRAKernelMeta): per-step token grouping by adapter slot, built once
// per step on the op device and shared by every layer. Buffers are sized once from max_loras
// and max_num_tokens, so nothing allocates per step, and the device build reads only device
// memory, so it can be captured in a CUDA graph.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex {

class LoraBatchMeta {
 public:
  /// On CUDA the metadata also owns the scratch the ops of a step use for split-K partial
  /// sums (LoraMetaView::scratch): `scratch_floats` floats, by default what every plan of the
  /// default tuning table needs for up to max_num_tokens tokens
  /// (kernels::planner::lora_scratch_floats), and arrival counters for every plan
  /// (kernels::planner::lora_counters). An op whose plan needs more fails, naming both.
  LoraBatchMeta(int max_loras, int max_num_tokens, Device device, int64_t scratch_floats = -1);

  /// Grows the scratch to at least `floats` (CUDA; waits for the device first, so that no
  /// kernel still uses the old buffer). Setup only: not while a graph is being captured.
  void reserve_scratch(int64_t floats);

  /// Builds the metadata from a host mapping (one slot per token, -1 = no LoRA). Throws when
  /// a slot is outside [-1, max_loras) or there are more tokens than max_num_tokens.
  void prepare(std::span<const int32_t> token_slots, const Stream& stream);
  /// prepare()'s host half: validates the mapping and enqueues its upload into
  /// mapping_buffer(); returns true when every slot is -1. A CUDA graph that captured
  /// prepare_from_buffer() then builds the metadata from it when replayed.
  bool upload(std::span<const int32_t> token_slots, const Stream& stream);
  /// Builds the metadata from a mapping already written to mapping_buffer() on the device;
  /// `no_lora` is the caller's host-side knowledge that every slot is -1. Capturable.
  void prepare_from_buffer(int num_tokens, bool no_lora, const Stream& stream);

  /// [max_num_tokens] int32 on the device: the per-token slots read by prepare_from_buffer.
  const Tensor& mapping_buffer() const { return mapping_; }
  /// True when every token of the step has slot -1: ops may skip all LoRA work.
  bool no_lora() const { return no_lora_; }
  int num_tokens() const { return num_tokens_; }
  int max_loras() const { return max_loras_; }
  int max_num_tokens() const { return max_num_tokens_; }
  Device device() const { return device_; }
  kernels::LoraMetaView view() const;
  /// Records that an op using this metadata has been enqueued on `stream`: from then on the
  /// views say the metadata is settled (LoraMetaView::settled) if `stream` is the one it was
  /// built on, until the next build. A host-side record of launch order, hence const.
  void note_op_enqueued(const Stream& stream) const;

  /// The metadata copied to the host (synchronises the stream), for tests and debugging.
  struct HostCopy {
    std::vector<int32_t> mapping;
    std::vector<int32_t> sorted_token_indices;
    std::vector<int32_t> active_lora_ids;
    std::vector<int32_t> num_tokens_per_lora;
    std::vector<int32_t> lora_token_start_loc;
    int32_t num_active_loras = 0;
  };
  HostCopy to_host(const Stream& stream) const;

 private:
  int max_loras_;
  int max_num_tokens_;
  Device device_;
  int num_tokens_ = 0;
  bool no_lora_ = true;
  cuda_rt::StreamHandle build_stream_ = nullptr;  // the stream of the last build
  mutable bool settled_ = false;  // an op has been enqueued on build_stream_ since the build
  Tensor mapping_;                // [max_num_tokens]
  Tensor sorted_;                 // [max_num_tokens]
  Tensor active_ids_;             // [max_loras + 1]
  Tensor counts_;                 // [max_loras + 1]
  Tensor start_loc_;              // [max_loras + 2]
  Tensor num_active_;             // [1]
  Tensor scratch_;                // float32, CUDA only (see the constructor)
  Tensor counters_;               // int32, zero between ops (see above), CUDA only
  // Pinned host memory for the mapping upload, two steps' worth: the engine stages a step
  // while the one before runs, whose copy may not have run yet.
  static constexpr int kStagingSlots = 2;
  Tensor host_staging_[kStagingSlots];            // [max_num_tokens] each
  std::unique_ptr<Event> staged_[kStagingSlots];  // after the copy from each slot
  int next_staging_ = 0;
};

}  // namespace loraplex
