#pragma once
// The decoder shared by Llama, Mistral, Qwen2 and Mixtral: read the hyper-parameters, bind the
// weights, forward. One forward runs a whole mixed step (prefills and decodes of different
// sequences, each with its own adapter slot) through the paged KV cache and returns the logits
// of the rows that sample.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/adapters/lora_targets.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/layers/fused_moe.h"
#include "loraplex/layers/logits_processor.h"
#include "loraplex/layers/lora_linear.h"
#include "loraplex/layers/vocab_embedding.h"
#include "loraplex/model/checkpoint.h"
#include "loraplex/model/config.h"
#include "loraplex/model/kv_cache.h"
#include "loraplex/model/step_batch.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::model {

struct DecoderOptions {
  DType dtype = DType::kF32;  // activations, weights on the device, KV cache, LoRA
  Device device = Device::cpu();
  int max_loras = 1;
  int max_lora_rank = 8;
  int64_t max_num_tokens = 256;  // tokens of one step
  int64_t max_num_seqs = 16;     // sampled rows of one step
  int64_t kv_blocks = 64;
  int64_t kv_block_size = 16;
};

/// One step, described on the host. Token t belongs to row token_seq[t] of block_tables.
struct StepInput {
  std::vector<int32_t> token_ids;     // [T]
  std::vector<int32_t> positions;     // [T]
  std::vector<int32_t> token_seq;     // [T]
  std::vector<int32_t> token_slots;   // [T] LoRA slot, -1 = base model
  std::vector<int32_t> block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t num_seqs = 0;
  int64_t max_blocks_per_seq = 0;
  std::vector<int32_t> sample_tokens;  // [S] token indices whose logits are returned
  std::vector<int32_t> sample_slots;   // [S] LoRA slot of each sampled row
};

class Decoder {
 public:
  /// Loads config.json and the weights of `dir`; throws naming the directory, file, tensor or
  /// field at fault.
  static std::unique_ptr<Decoder> load(const std::string& dir, const DecoderOptions& options);

  const ModelConfig& config() const { return config_; }
  const DecoderOptions& options() const { return options_; }
  KvCache& kv_cache() { return *kv_; }
  /// Replaces the KV cache with one of `num_blocks` blocks (options().kv_block_size tokens
  /// each); every sequence's cached state is lost. The engine sizes the cache this way once the
  /// weights are on the device.
  void allocate_kv_cache(int64_t num_blocks);
  /// Device bytes of one KV block over all layers (K and V).
  int64_t kv_block_bytes() const;

  /// Runs one step and samples the next token of every sequence that asks for it; only the
  /// sampled ids (and log-probabilities) come back to the host. Throws loraplex::Error naming
  /// the sequence and value when the batch is inconsistent (blocks short of its positions,
  /// more tokens than max_num_tokens, a slot outside [-1, max_loras), bad sampling values).
  StepResult execute(const StepBatch& batch);

  /// Runs one step; returns logits [S, vocab] in the activation dtype on the device (a view
  /// of the lm_head's buffer, valid until the next forward).
  Tensor forward(const StepInput& step);
  /// The stream every forward runs on.
  const Stream& stream() const { return stream_; }

  /// Every module an adapter may target (PEFT module paths without "base_model.model.":
  /// "model.layers.0.self_attn.q_proj", "lm_head", "model.layers.1.mlp.experts" (3-D),
  /// "model.layers.1.block_sparse_moe.experts.5.w1", ...), for the adapter manager.
  const LoraTargetRegistry& targets() const { return targets_; }

 private:
  struct Layer {
    Tensor input_norm;
    Tensor post_norm;
    std::unique_ptr<LoraLinear> qkv;      // column, 3 LoRA slices (q, k, v)
    std::unique_ptr<LoraLinear> o;        // row
    std::unique_ptr<LoraLinear> gate_up;  // merged column, 2 LoRA slices
    std::unique_ptr<LoraLinear> down;     // row
    std::unique_ptr<FusedMoeWithLora> moe;
  };

  Decoder() = default;
  void bind(const Checkpoint& ckpt);
  Tensor rms_norm(const Tensor& x, const Tensor& weight) const;
  void add_inplace(Tensor& y, const Tensor& x) const;

  ModelConfig config_;
  DecoderOptions options_;
  Stream stream_;
  std::unique_ptr<VocabEmbeddingWithLora> embed_;
  std::unique_ptr<LogitsProcessorWithLora> lm_head_;
  Tensor final_norm_;
  std::vector<Layer> layers_;
  Tensor inv_freq_;  // [head_dim / 2] float32 on the device
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<PunicaWrapper> punica_;
  LoraTargetRegistry targets_;
};

}  // namespace loraplex::model
