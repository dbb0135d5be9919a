#pragma once
// The decoder shared by Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE: read the
// hyper-parameters, bind the weights, forward. One step runs a whole mixed batch (prefills,
// prompt chunks and decodes of different sequences, each with its own adapter slot) through the
// paged KV cache and samples on the model's device; only the sampled ids come back.
//
// Every buffer a step touches is allocated at load, so a step never allocates, and on CUDA the
// host never waits inside a step: launch() enqueues it (and the copy of its sampled ids into
// pinned memory) and returns; collect() waits for those ids. Two steps can be in flight, so
// the host stages step n + 1 while step n runs; a decode token sampled by step n is put in
// place on the device (SequenceStep::feed_row). A pure decode step (one token per sequence,
// every sequence sampled) runs as a CUDA graph captured once per batch-size bucket (and per
// "any LoRA in the batch"), padded to the bucket.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/adapters/lora_targets.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/layers/fused_moe.h"
#include "loraplex/layers/logits_processor.h"
#include "loraplex/layers/lora_linear.h"
#include "loraplex/layers/vocab_embedding.h"
#include "loraplex/layers/weight_upload.h"
#include "loraplex/layers/workspace.h"
#include "loraplex/model/checkpoint.h"
#include "loraplex/model/config.h"
#include "loraplex/model/executor.h"
#include "loraplex/model/kv_cache.h"
#include "loraplex/model/paged_attention.h"
#include "loraplex/model/step_batch.h"
#include "loraplex/model/step_logit_adjustments.h"
#include "loraplex/model/step_top_logprobs.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::model {

class WeightSource;

/// One model replica on one device: the whole model, or (options.comm set) one
/// tensor-parallel rank's shard of it, whose steps every rank of the group runs together.
class Decoder final : public ModelExecutor {
 public:
  /// Loads config.json and the weights of `dir`; throws naming the directory, file, tensor or
  /// field at fault. Each weight is read from the memory-mapped checkpoint only where this
  /// rank's shard lies.
  static std::unique_ptr<Decoder> load(const std::string& dir, const DecoderOptions& options);
  /// A model of `config`'s shapes with random weights made on options.device (see
  /// RandomWeights): the same values on the CPU and the GPU for the same seed, and every rank
  /// of a group keeps its shard of the same full weights.
  static std::unique_ptr<Decoder> create_random(const ModelConfig& config,
                                                const DecoderOptions& options, uint64_t seed);
  /// A model of `config` whose weights come from `source` (copied through `upload` when given:
  /// its stream orders device sources before their copies).
  static std::unique_ptr<Decoder> create(const ModelConfig& config, const WeightSource& source,
                                         const DecoderOptions& options,
                                         WeightUpload* upload = nullptr);

  const ModelConfig& config() const override { return config_; }
  const DecoderOptions& options() const override { return options_; }
  KvCache& kv_cache() { return *kv_; }
  void allocate_kv_cache(int64_t num_blocks) override;
  int64_t kv_block_bytes() const override;

  void launch(const StepBatch& batch) override;
  StepResult collect() override;
  const StepStats& last_step() const override { return last_step_; }
  /// launch()'s checks of `batch`, on the host alone (throws as launch does); a
  /// tensor-parallel group runs them once before any rank starts the step.
  void check(const StepBatch& batch) const;

  /// The stream every step runs on.
  const Stream& stream() const { return stream_; }
  std::vector<Device> devices() const override { return {options_.device}; }
  std::vector<Stream> streams() const override { return {stream_}; }
  /// Bytes of base weights this replica copied to its device at load: its shard of every
  /// tensor (whole norms and routers).
  int64_t weight_bytes() const { return weight_bytes_; }
  /// This replica's rank in its tensor-parallel group and the group's size (0 and 1 alone).
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }

  /// Every module an adapter may target (PEFT module paths without "base_model.model.":
  /// "model.layers.0.self_attn.q_proj", "lm_head", "model.layers.1.mlp.experts" (3-D),
  /// "model.layers.1.block_sparse_moe.experts.5.w1", "model.layers.1.mlp.experts.5.gate_proj"
  /// (Qwen3-MoE), ...), for the adapter manager. This
  /// replica's layers only.
  const LoraTargetRegistry& targets() const override { return targets_; }

 private:
  struct Layer {
    Tensor input_norm;
    Tensor post_norm;
    Tensor q_norm;                    // Qwen3: [head_dim], every q head; undefined without qk_norm
    Tensor k_norm;                    // Qwen3: [head_dim], every k head
    std::unique_ptr<LoraLinear> qkv;  // column, 3 LoRA slices (q, k, v)
    std::unique_ptr<LoraLinear> o;    // row
    std::unique_ptr<LoraLinear> gate_up;  // merged column, 2 LoRA slices
    std::unique_ptr<LoraLinear> down;     // row
    std::unique_ptr<FusedMoeWithLora> moe;
  };

  // Activations of one step, [max_num_tokens or max_num_seqs, ...], allocated at load.
  struct Activations {
    Tensor x;         // residual stream [T, hidden]
    Tensor h;         // normalised [T, hidden]
    Tensor qkv;       // [T, q + 2 kv]
    Tensor attn;      // [T, q]
    Tensor delta;     // o / down / MoE output, added to the residual [T, hidden]
    Tensor gate_up;   // [T, 2 inter]
    Tensor act;       // [T, inter]
    Tensor rows;      // final-normalised sampled rows [S, hidden]
    Tensor logits;    // [S, vocab]
    Tensor ids;       // sampled ids int32 [S]
    Tensor logprobs;  // float [S]
  };

  // Per-step inputs: pinned host staging buffers (one per step in flight, so that staging a
  // step never overwrites what the step before still copies from) and their device mirror
  // (the same tensor on the CPU, where a step has run when launch returns), uploaded section
  // by section (the used part of each): int32 token ids, positions, KV-cache slots and the
  // feed rows (SequenceStep::feed_row per token, -1 for the others) [max_num_tokens] and the
  // sampled token rows [max_num_seqs]; then the sampled rows' parameters: temperature, top_p
  // and min_p (float), top_k and banned ids (int32, kMaxBannedTokens per row) and the uniform
  // draws (double).
  enum Section {
    kTokenIds,
    kPositions,
    kKvSlots,
    kFeedRows,
    kSampleRows,
    kTemperature,
    kTopP,
    kMinP,
    kTopK,
    kBanned,
    kUniform,
    kSections
  };
  struct Inputs {
    Tensor host[kMaxLaunchedSteps];  // u8; on the CPU all the same buffer
    Tensor device;                   // u8
    int slot = 0;                    // the host buffer of the step being staged
    int64_t offset[kSections] = {};  // bytes
    template <typename T>
    T* host_at(Section s) const {
      return reinterpret_cast<T*>(host[slot].data<uint8_t>() + offset[s]);
    }
    template <typename T>
    T* device_at(Section s) const {
      return reinterpret_cast<T*>(device.data<uint8_t>() + offset[s]);
    }
    // Copies the first `bytes` of a section to the device.
    void upload(Section s, size_t bytes, const Stream& stream) const;
  };
  // How a step picks its tokens on the device: the sampling op (greedy rows included: its
  // argmax spreads a row over a cluster, where one block per row leaves a 128K-entry row to one
  // SM), with or without log-probabilities.
  enum class Sampling { kSample, kSampleLogprobs };

  Decoder() = default;
  // What execute() needs to know of a batch, after checking it.
  struct BatchSummary {
    int64_t tokens = 0;
    int64_t sampled = 0;
    bool pure_decode = true;  // one token per sequence, every sequence sampled
    bool fed = false;         // a token comes from the previous step's ids (feed_row)
  };
  // `feedable`: rows the previous launch sampled, which feed rows may name.
  BatchSummary summarize(const StepBatch& batch, int64_t feedable) const;
  // Builds every layer from the checkpoint's weights and registers where adapters land.
  void bind(const WeightSource& source, WeightUpload& upload);
  // bind()'s steps, over what they share (BindContext: decoder.cc).
  struct BindContext;
  void bind_embedding_and_head(const BindContext& b);
  void bind_attention(const BindContext& b, const std::string& prefix, Layer& layer);
  void bind_mlp(const BindContext& b, const std::string& prefix, Layer& layer);
  void bind_moe(const BindContext& b, const std::string& prefix, Layer& layer);
  // Registers an adapter module's place: slice `slice` of `handle`'s layer, `in` -> `out`.
  void add_target(const std::string& module, const LoraLayerHandle& handle, int slice, int64_t in,
                  int64_t out, TargetKind kind = TargetKind::kLinear, Tensor base = Tensor(),
                  bool staged_on_host = false);
  void allocate_step_buffers();
  // The host half of a step: fills the staging inputs for `batch` (padded to `padded`
  // tokens, each padding token a sequence of its own on the pad block) and enqueues their
  // upload (the feed rows' only when `fed`), the LoRA mappings' and the attention plan (for a
  // CUDA graph of `padded` sequences when `graph`).
  struct Staged {
    bool token_lora = false;    // any token has LoRA
    bool sampler_lora = false;  // any sampled row has LoRA
    int max_slot = -1;          // the highest slot of a token
  };
  Staged stage(const StepBatch& batch, int64_t padded, bool graph, bool fed);
  // The slots a step of `tokens` tokens runs its LoRA over in the fused path (slots 0 up to
  // the highest one it uses, rounded up to a bucket so that few graphs cover every step), or
  // 0 when the step takes another path.
  int fused_lora_slots(int64_t tokens, const Staged& staged) const;
  // Every device operation of a step over the uploaded inputs: capturable. fused_slots > 0:
  // the projections run forward_fused over that many slots.
  void run_device(int64_t num_tokens, int64_t num_sampled, bool token_lora, bool sampler_lora,
                  int fused_slots, Sampling sampling);
  // One projection: base product into `out`; its LoRA either added to `out` in stream order or,
  // when `delta` is given, computed into `delta` (zeroed first) on the LoRA stream beside the
  // base product, for the next elementwise op to add.
  void project(LoraLinear& layer, const Tensor& in, Tensor& out, Tensor* delta);
  void replay(int64_t bucket, bool token_lora, bool sampler_lora, int fused_slots,
              Sampling sampling);
  // Puts the previous step's sampled ids in the fed tokens' places (kFeedRows), before the
  // step's device work (a graph's eager first run and its replay then read the same tokens).
  void feed_tokens(int64_t num_tokens, int64_t feedable);
  // Enqueues the copy of the step's sampled ids (and log-probabilities, top logprobs) into the
  // host buffers of `slot`.
  void download(int slot, int64_t num_sampled, bool logprobs);

  ModelConfig config_;
  // config_ as this rank sees it: its attention heads, KV heads and MLP columns.
  ModelConfig local_;
  DecoderOptions options_;
  int tp_rank_ = 0;
  int tp_size_ = 1;
  int64_t weight_bytes_ = 0;
  Stream stream_;
  std::shared_ptr<LayerWorkspace> workspace_;
  std::unique_ptr<VocabEmbeddingWithLora> embed_;
  std::unique_ptr<LogitsProcessorWithLora> lm_head_;
  Tensor final_norm_;
  std::vector<Layer> layers_;
  Tensor inv_freq_;  // [head_dim / 2] float32 on the device
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<PunicaWrapper> punica_;
  LoraTargetRegistry targets_;
  Activations act_;
  Inputs in_;
  StepLogitAdjustments adjust_;  // this step's logits adjustments (none in most steps)
  // The top logprobs (none in most steps) of the steps in flight, by staging slot.
  StepTopLogprobs top_[kMaxLaunchedSteps];
  // Small batches with LoRA (decode) run each projection's LoRA on a second stream beside its
  // base product, which it would otherwise wait for, and the following elementwise op adds the
  // LoRA output from these buffers ([kOverlapTokens, width]) (LoraDecode::kOverlap).
  static constexpr int64_t kOverlapTokens = 512;
  // The fused path's projection outputs: [tokens, base columns + slots x intermediate columns]
  // for up to options_.fused_lora_max_tokens tokens, viewed at each step's row width.
  struct FusedOutputs {
    Tensor qkv, gate_up, delta;  // flat
  };
  FusedOutputs fused_;
  struct LoraDeltas {
    Tensor qkv, o, gate_up, down;
  };
  LoraDeltas deltas_;
  Stream lora_stream_;
  std::unique_ptr<Event> fork_;
  std::unique_ptr<Event> join_;
  // Per staging slot: pinned [2, max_num_seqs] int32 ids, then float log-probabilities, and
  // (CUDA) the event after their copy.
  Tensor host_out_[kMaxLaunchedSteps];
  std::unique_ptr<Event> downloaded_[kMaxLaunchedSteps];
  // Steps launched and not yet collected, oldest first.
  struct Launched {
    int slot = 0;
    int64_t sampled = 0;
    bool logprobs = false;
  };
  std::deque<Launched> launched_;
  int next_slot_ = 0;
  // Rows of act_.ids that the last launch sampled (0 after a launch that failed): what the
  // next step's feed rows may name.
  int64_t feedable_rows_ = 0;
  std::unique_ptr<PagedAttention> attention_;
  Tensor sample_workspace_;
  StepStats last_step_;

  struct GraphKey {
    int64_t bucket;
    bool token_lora;
    bool sampler_lora;
    int fused_slots;
    Sampling sampling;
    bool operator<(const GraphKey& o) const;
  };
  struct Graph;
  std::map<GraphKey, std::shared_ptr<Graph>> graphs_;
};

/// The CUDA-graph batch-size buckets: the smallest bucket >= n, or 0 when n is larger than
/// every bucket up to max_num_seqs.
int64_t decode_graph_bucket(int64_t n, int64_t max_num_seqs);

}  // namespace loraplex::model
