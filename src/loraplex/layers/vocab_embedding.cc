#include "loraplex/layers/vocab_embedding.h"

#include <algorithm>
#include <optional>

#include "loraplex/core/error.h"
#include "loraplex/layers/embedding_moe_ops.h"
#include "loraplex/layers/layer_util.h"

namespace loraplex {

using layers_detail::host_block;

VocabEmbeddingWithLora::VocabEmbeddingWithLora(int64_t vocab, int64_t hidden, DType dtype,
                                               const LoraConfig& config, Communicator* comm,
                                               Device device, int max_num_tokens)
    : vocab_(vocab),
      hidden_(hidden),
      dtype_(dtype),
      config_(config),
      comm_(comm),
      device_(device),
      max_num_tokens_(max_num_tokens) {
  const char* k = "VocabEmbeddingWithLora";
  LORAPLEX_CHECK(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16, k,
                 ": dtype ", dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_CHECK(config.lora_dtype == dtype, k, ": lora_dtype ", config.lora_dtype,
                 " must equal the activation dtype ", dtype);
  LORAPLEX_CHECK(config.max_loras >= 1 && config.max_lora_rank >= 1 && max_num_tokens >= 1, k,
                 ": max_loras ", config.max_loras, ", max_lora_rank ", config.max_lora_rank,
                 " and max_num_tokens ", max_num_tokens, " must be >= 1");
  tp_ = layers_detail::comm_size(comm);
  rank_ = layers_detail::comm_rank(comm);
  const int64_t shard = layers_detail::ceil_div(vocab, tp_);
  LORAPLEX_CHECK(vocab >= 1 && hidden >= 1 && (tp_ - 1) * shard < vocab, k, ": vocab ", vocab,
                 " and hidden ", hidden, " cannot be split over ", tp_,
                 " ranks with at least one row each");
  vocab_start_ = rank_ * shard;
  local_rows_ = std::min(shard, vocab - vocab_start_);
  const int64_t a_rows = config.fully_sharded ? local_rows_ + 1 : vocab;
  lora_a_ = Tensor::zeros({config.max_loras, a_rows, config.max_lora_rank}, dtype, device);
  lora_b_ = Tensor::zeros({config.max_loras, hidden, config.max_lora_rank}, dtype, device);
  ranks_ = SlotRanks(1, config.max_loras, config.max_lora_rank, device);
  if (config.fully_sharded) local_ids_ = Tensor::empty({max_num_tokens}, DType::kI32, device);
  host_ranks_.assign(static_cast<size_t>(config.max_loras), 0);
}

int VocabEmbeddingWithLora::lora_rank(int slot) const {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, "VocabEmbeddingWithLora: slot ", slot,
                 " outside [0, ", config_.max_loras, ")");
  return host_ranks_[static_cast<size_t>(slot)];
}

void VocabEmbeddingWithLora::load_base(const Tensor& weight, WeightUpload* upload) {
  LORAPLEX_CHECK(layers_detail::is_weight_source(weight, device_, dtype_) && weight.dim() == 2 &&
                     weight.size(0) == vocab_ && weight.size(1) == hidden_,
                 "VocabEmbeddingWithLora: base weight must be a CPU float [", vocab_, ", ", hidden_,
                 "], got ", weight.defined() ? weight.describe() : "undefined");
  std::optional<WeightUpload> own;
  if (upload == nullptr) upload = &own.emplace(device_);
  weight_ = Tensor::empty({local_rows_, hidden_}, dtype_, device_);
  upload->copy(weight_, weight.narrow(0, vocab_start_, local_rows_));
  if (own) own->finish();
}

void VocabEmbeddingWithLora::set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
  const Stream stream = Stream::default_for(device_);
  write_lora(slot, slices, stream);
  stream.synchronize();
}

void VocabEmbeddingWithLora::set_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                                      const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, "VocabEmbeddingWithLora");
  write_lora(slot, slices, copy_stream);
}

void VocabEmbeddingWithLora::write_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                                        const Stream& stream) {
  const std::string where = "VocabEmbeddingWithLora set_lora slot " + std::to_string(slot);
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, where, ": slot outside [0, max_loras ",
                 config_.max_loras, ")");
  LORAPLEX_CHECK(slices.size() == 1, where, ": got ", slices.size(),
                 " slices, expected one {lora_embedding_A, lora_embedding_B}");
  const int r =
      layers_detail::check_lora_pair(slices[0], vocab_, hidden_, config_.max_lora_rank, where);
  if (r == 0) {
    clear_lora(slot, stream);
    return;
  }
  // PEFT's A is [rank, vocab]; the table holds its transpose, rows = token ids.
  const Tensor a_t = slices[0].a.transpose(0, 1);
  const int64_t first = config_.fully_sharded ? vocab_start_ : 0;
  const int64_t rows = config_.fully_sharded ? local_rows_ : vocab_;
  const std::vector<layers_detail::PendingWrite> writes = {
      {lora_a_.select(0, slot).narrow(0, 0, rows).narrow(1, 0, r),
       host_block(a_t, first, rows, 0, r, dtype_)},
      {lora_b_.select(0, slot).narrow(1, 0, r),
       layers_detail::source_block(slices[0].b, 0, hidden_, 0, r, dtype_)}};
  clear_lora(slot, stream);
  layers_detail::apply_writes(writes, stream);
  ranks_.set(0, slot, r, stream);
  host_ranks_[static_cast<size_t>(slot)] = r;
}

void VocabEmbeddingWithLora::reset_lora(int slot) {
  const Stream stream = Stream::default_for(device_);
  clear_lora(slot, stream);
  stream.synchronize();
}

void VocabEmbeddingWithLora::reset_lora(int slot, const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, "VocabEmbeddingWithLora");
  clear_lora(slot, copy_stream);
}

void VocabEmbeddingWithLora::clear_lora(int slot, const Stream& stream) {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, "VocabEmbeddingWithLora: reset_lora slot ",
                 slot, " outside [0, ", config_.max_loras, ")");
  ranks_.set(0, slot, 0, stream);
  host_ranks_[static_cast<size_t>(slot)] = 0;
}

Tensor VocabEmbeddingWithLora::forward(const Tensor& token_ids, const PunicaWrapper& punica,
                                       const Stream& stream) {
  LORAPLEX_CHECK(
      token_ids.defined() && token_ids.dim() == 1 && token_ids.size(0) <= max_num_tokens_,
      "VocabEmbeddingWithLora: token ids must be int32 [<= ", max_num_tokens_, "], got ",
      token_ids.defined() ? token_ids.describe() : "undefined");
  if (!out_buffer_.defined())
    out_buffer_ = Tensor::empty({max_num_tokens_, hidden_}, dtype_, device_);
  Tensor y = out_buffer_.narrow(0, 0, token_ids.size(0));
  forward(token_ids, y, punica, stream);
  return y;
}

void VocabEmbeddingWithLora::forward(const Tensor& token_ids, Tensor& y,
                                     const PunicaWrapper& punica, const Stream& stream) {
  const char* k = "VocabEmbeddingWithLora";
  LORAPLEX_CHECK(weight_.defined(), k, ": forward before load_base");
  LORAPLEX_CHECK(token_ids.defined() && token_ids.dtype() == DType::kI32 && token_ids.dim() == 1 &&
                     token_ids.is_contiguous() && token_ids.device() == device_,
                 k, ": token ids must be contiguous int32 [tokens] on ", device_, ", got ",
                 token_ids.defined() ? token_ids.describe() : "undefined");
  const int64_t tokens = token_ids.size(0);
  LORAPLEX_CHECK(tokens <= max_num_tokens_, k, ": ", tokens, " tokens exceed max_num_tokens ",
                 max_num_tokens_);
  layers_detail::check_activation(y, device_, dtype_, k, "y");
  LORAPLEX_CHECK(y.is_contiguous() && y.size(0) == tokens && y.size(1) == hidden_, k,
                 ": y must be contiguous [", tokens, ", ", hidden_, "], got ", y.describe());
  LORAPLEX_CHECK(punica.device() == device_ && punica.max_loras() == config_.max_loras, k,
                 ": the Punica wrapper is on ", punica.device(), " with max_loras ",
                 punica.max_loras(), "; the layer is on ", device_, " with max_loras ",
                 config_.max_loras);
  LORAPLEX_CHECK(punica.token_meta().num_tokens() == tokens, k, ": ", tokens,
                 " token ids, the step's metadata has ", punica.token_meta().num_tokens());
  layer_ops::embedding_lookup(weight_, token_ids, vocab_start_, vocab_, y, stream);
  const bool lora = !punica.token_meta().no_lora();
  if (config_.fully_sharded) {
    if (lora) {
      Tensor local = local_ids_.narrow(0, 0, tokens);
      // Tokens of other shards read the table's last row, which stays zero.
      layer_ops::shard_token_ids(token_ids, vocab_start_, local_rows_,
                                 static_cast<int32_t>(local_rows_), local, stream);
      punica.add_lora_embedding(y, local, lora_a_, lora_b_, ranks_, 1.0f, stream);
    }
    comm().all_reduce_sum(y, stream);
    return;
  }
  comm().all_reduce_sum(y, stream);
  if (lora) punica.add_lora_embedding(y, token_ids, lora_a_, lora_b_, ranks_, 1.0f, stream);
}

}  // namespace loraplex
