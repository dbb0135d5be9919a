#pragma once
// Paged attention of one model step, split the way FlashInfer splits it: plan() does the host
// work of a step once (validation, FlashInfer's scheduler, the upload of the step's index
// arrays), run() does one layer's attention and only reads device memory that plan() wrote, so
// a decode step's layers can be captured in a CUDA graph and replayed after later plans.
//
// On CUDA, bf16/f16 with head dims 64 and 128 run FlashInfer's batch prefill kernel over the
// paged cache (one launch for a mixed batch of prompt chunks and decodes: causal mask, GQA);
// other dtypes and head dims run ops::cuda::paged_attention, and the CPU runs
// ops::cpu::paged_attention (decoder_ops.h). Every buffer is sized at construction.

#include <cstdint>
#include <memory>
#include <vector>

#include "loraplex/core/device.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/model/cuda/flashinfer_attention.h"
#include "loraplex/model/decoder_ops.h"

namespace loraplex::model {

/// The attention geometry of a model (and its KV cache's block size).
struct AttentionShape {
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // divides num_heads
  int64_t head_dim = 0;
  int64_t block_size = 0;      // tokens per KV-cache block
  DType dtype = DType::kBF16;  // of q, the cache and the output
};

/// One step's sequences as attention sees them (host). Sequence i's new tokens are q rows
/// [qo_indptr[i], qo_indptr[i+1]) of the step; its context after this step is kv_len[i]
/// tokens (the new ones are its last qo_len positions: causal within the step); its blocks
/// are page_indices[page_indptr[i] .. page_indptr[i+1]) (ceil(kv_len / block_size) of them).
struct AttentionStep {
  std::vector<int32_t> qo_indptr, kv_len, page_indptr, page_indices;
};

class PagedAttention {
 public:
  /// Sizes every buffer for steps of at most max_num_tokens q rows, max_num_seqs sequences
  /// and max_pages_per_step blocks in all. The softmax scale is 1 / sqrt(head_dim).
  PagedAttention(AttentionShape shape, Device device, int64_t max_num_tokens, int64_t max_num_seqs,
                 int64_t max_pages_per_step);
  ~PagedAttention();
  PagedAttention(const PagedAttention&) = delete;
  PagedAttention& operator=(const PagedAttention&) = delete;

  /// True when run() uses FlashInfer; else the fallback kernel (float32, head dims other than
  /// 64 and 128) or the CPU.
  bool uses_flashinfer() const { return flashinfer_; }
  const AttentionShape& shape() const { return shape_; }
  Device device() const { return device_; }

  /// Host work of a step: validation (throws loraplex::Error naming the sequence and value),
  /// FlashInfer's plan and the upload of every per-step array into device buffers owned
  /// here, enqueued on `stream` (pinned staging, no allocation after construction; the host
  /// waits only when it is kStagingSlots plans ahead of the GPU). graph_batch > 0: a
  /// pure-decode step padded by the caller to exactly graph_batch sequences, planned with a
  /// fixed grid so that a CUDA graph captured after a plan of the same graph_batch stays valid
  /// for every later plan of that size. run() must be enqueued on the same stream (or after
  /// it), and a graph must be replayed after the plan it should use.
  void plan(const AttentionStep& step, const Stream& stream, int64_t graph_batch = 0);

  /// One layer's attention of the planned step: q heads at column 0 of each qkv row (row
  /// stride qkv_row_stride elements), K/V from `cache` (ops::KvCacheView, layout
  /// [num_blocks, block_size, kv_heads, head_dim], K and V separate: FlashInfer's NHD);
  /// out [num_tokens, num_heads * head_dim] (contiguous). Capturable: no host sync, no
  /// allocation, reads only device memory written by plan(). Throws loraplex::Error when the
  /// cache does not match the shape or a planned block lies outside it.
  void run(const void* qkv, int64_t qkv_row_stride, const ops::KvCacheView& cache, void* out,
           const Stream& stream) const;

  /// Rows of the planned step (qo_indptr.back()).
  int64_t num_tokens() const { return num_tokens_; }

  /// Pinned staging buffers (CUDA): plan() reuses one only after the GPU has consumed it.
  static constexpr int kStagingSlots = 4;

 private:
  void validate(const AttentionStep& step, int64_t graph_batch) const;
  // Writes the fallback's arrays (layout below) for `step` into `dst`.
  void fill_fallback_arrays(const AttentionStep& step, int32_t* dst) const;
  int64_t fallback_ints(int64_t num_pages) const;
  // The next pinned staging slot, once the GPU has finished reading it.
  int32_t* acquire_staging();
  void release_staging(const Stream& stream);

  AttentionShape shape_;
  Device device_;
  int64_t max_num_tokens_;
  int64_t max_num_seqs_;
  int64_t max_pages_per_step_;
  bool flashinfer_ = false;
  float scale_ = 1.0f;

  // The planned step.
  bool planned_ = false;
  int64_t num_seqs_ = 0;
  int64_t num_tokens_ = 0;
  int64_t max_kv_len_ = 0;
  int64_t max_page_ = -1;  // largest block id of the step
  flashinfer::PlanInfo plan_info_{};
  // plan_info_ of the first plan of each graph_batch (the index), to check later plans of the
  // same size against: a graph captured after the first one replays its launch parameters.
  std::vector<flashinfer::PlanInfo> graph_plans_;
  std::vector<char> graph_planned_;
  // Blocks of the cache run() last saw: a graph_batch plan checks block ids against it,
  // because a graph replay runs the step without run() seeing it.
  mutable int64_t cache_blocks_seen_ = 0;

  // The step's int32 arrays (T = max_num_tokens, S = max_num_seqs, P = max_pages_per_step):
  //  FlashInfer: [qo_indptr S+1 | page_indptr S+1 | last_page_len S | page_indices P];
  //  fallback and CPU: [positions T | token_seq T | page_indptr S+1 | page_indices P]
  //  (model_ops.h's PagedAttentionArgs with block_table_indptr).
  // On CUDA they live on the device (step_arrays_), uploaded from a ring of pinned slots that
  // hold FlashInfer's int workspace first (int_staging_bytes_) and these arrays after it; on
  // the CPU they are host_arrays_.
  Tensor step_arrays_;
  std::vector<int32_t> host_arrays_;
  Tensor float_workspace_;  // FlashInfer's split-KV partial outputs
  Tensor int_workspace_;    // FlashInfer's work lists, written by plan()
  int64_t int_workspace_bytes_ = 0;
  int64_t int_staging_bytes_ = 0;  // int_workspace_bytes_ rounded up to 64
  std::vector<Tensor> staging_;
  std::vector<std::unique_ptr<Event>> staging_done_;
  std::vector<char> staging_used_;
  int next_slot_ = 0;
};

}  // namespace loraplex::model
