#include "loraplex/layers/logits_processor.h"

#include <algorithm>
#include <optional>

#include "loraplex/core/error.h"
#include "loraplex/layers/layer_util.h"
#include "loraplex/layers/linear_base.h"

namespace loraplex {

using layers_detail::source_block;

LogitsProcessorWithLora::LogitsProcessorWithLora(int64_t hidden, int64_t vocab, DType dtype,
                                                 const LoraConfig& config, Communicator* comm,
                                                 Device device, int max_num_seqs,
                                                 std::shared_ptr<LayerWorkspace> workspace)
    : hidden_(hidden),
      vocab_(vocab),
      dtype_(dtype),
      config_(config),
      comm_(comm),
      device_(device),
      max_num_seqs_(max_num_seqs),
      workspace_(std::move(workspace)) {
  const char* k = "LogitsProcessorWithLora";
  LORAPLEX_CHECK(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16, k,
                 ": dtype ", dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_CHECK(config.lora_dtype == dtype, k, ": lora_dtype ", config.lora_dtype,
                 " must equal the activation dtype ", dtype);
  LORAPLEX_CHECK(config.max_loras >= 1 && config.max_lora_rank >= 1 && max_num_seqs >= 1 &&
                     hidden >= 1 && vocab >= 1,
                 k, ": max_loras ", config.max_loras, ", max_lora_rank ", config.max_lora_rank,
                 ", max_num_seqs ", max_num_seqs, ", hidden ", hidden, ", vocab ", vocab,
                 " must be >= 1");
  tp_ = layers_detail::comm_size(comm);
  rank_ = layers_detail::comm_rank(comm);
  shard_ = layers_detail::ceil_div(vocab, tp_);
  vocab_start_ = rank_ * shard_;
  const int64_t b_rows = config.fully_sharded ? shard_ : vocab;
  lora_a_ = Tensor::zeros({config.max_loras, config.max_lora_rank, hidden}, dtype, device);
  lora_b_ = Tensor::zeros({config.max_loras, b_rows, config.max_lora_rank}, dtype, device);
  ranks_ = SlotRanks(1, config.max_loras, config.max_lora_rank, device);
  const bool own_workspace = workspace_ == nullptr;
  if (own_workspace) workspace_ = std::make_shared<LayerWorkspace>(device);
  LORAPLEX_CHECK(workspace_->device() == device, k, ": workspace on ", workspace_->device(),
                 ", the layer is on ", device);
  LayerWorkspace::Carver measure = LayerWorkspace::measure();
  carve(measure, max_num_seqs);
  workspace_->reserve(measure.used());
  if (own_workspace) workspace_->allocate();
  host_ranks_.assign(static_cast<size_t>(config.max_loras), 0);
}

LogitsProcessorWithLora::Scratch LogitsProcessorWithLora::carve(LayerWorkspace::Carver& carver,
                                                                int64_t seqs) const {
  Scratch s;
  if (tp_ > 1) {
    s.local = carver.take({seqs, shard_}, dtype_);
    s.staging = carver.take({tp_ * seqs, shard_}, dtype_);
  }
  s.lora =
      carver.take({PunicaWrapper::workspace_elements(1, seqs, config_.max_lora_rank)}, DType::kF32);
  return s;
}

int LogitsProcessorWithLora::lora_rank(int slot) const {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, "LogitsProcessorWithLora: slot ", slot,
                 " outside [0, ", config_.max_loras, ")");
  return host_ranks_[static_cast<size_t>(slot)];
}

void LogitsProcessorWithLora::load_base(const Tensor& lm_head, const Tensor& bias,
                                        WeightUpload* upload) {
  const char* k = "LogitsProcessorWithLora";
  LORAPLEX_CHECK(layers_detail::is_weight_source(lm_head, device_, dtype_) && lm_head.dim() == 2 &&
                     lm_head.size(0) == vocab_ && lm_head.size(1) == hidden_,
                 k, ": lm_head must be a CPU float [", vocab_, ", ", hidden_, "], got ",
                 lm_head.defined() ? lm_head.describe() : "undefined");
  if (bias.defined()) {
    LORAPLEX_CHECK(layers_detail::is_weight_source(bias, device_, dtype_) && bias.dim() == 1 &&
                       bias.size(0) == vocab_,
                   k, ": bias must be a CPU float [", vocab_, "], got ", bias.describe());
  }
  std::optional<WeightUpload> own;
  if (upload == nullptr) upload = &own.emplace(device_);
  const int64_t rows = std::max<int64_t>(0, std::min(shard_, vocab_ - vocab_start_));
  // Rows past the vocabulary (the last shard's padding) stay zero.
  const Stream setup = Stream::default_for(device_);
  weight_ = Tensor::zeros({shard_, hidden_}, dtype_, device_, setup);
  bias_ = bias.defined() ? Tensor::zeros({shard_}, dtype_, device_, setup) : Tensor();
  setup.synchronize();
  if (rows > 0) {
    upload->copy(weight_.narrow(0, 0, rows), lm_head.narrow(0, vocab_start_, rows));
    if (bias.defined()) upload->copy(bias_.narrow(0, 0, rows), bias.narrow(0, vocab_start_, rows));
  }
  if (own) own->finish();
}

void LogitsProcessorWithLora::set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
  const Stream stream = Stream::default_for(device_);
  write_lora(slot, slices, stream);
  stream.synchronize();
}

void LogitsProcessorWithLora::set_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                                       const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, "LogitsProcessorWithLora");
  write_lora(slot, slices, copy_stream);
}

void LogitsProcessorWithLora::write_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                                         const Stream& stream) {
  const std::string where = "LogitsProcessorWithLora set_lora slot " + std::to_string(slot);
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, where, ": slot outside [0, max_loras ",
                 config_.max_loras, ")");
  LORAPLEX_CHECK(slices.size() == 1, where, ": got ", slices.size(),
                 " slices, expected one {lm_head lora_A, lora_B}");
  const int r =
      layers_detail::check_lora_pair(slices[0], hidden_, vocab_, config_.max_lora_rank, where);
  if (r == 0) {
    clear_lora(slot, stream);
    return;
  }
  std::vector<layers_detail::PendingWrite> writes;
  writes.push_back({lora_a_.select(0, slot).narrow(0, 0, r),
                    source_block(slices[0].a, 0, r, 0, hidden_, dtype_)});
  Tensor b_slot = lora_b_.select(0, slot).narrow(1, 0, r);
  if (config_.fully_sharded) {
    // Rows past the vocabulary (padding of the last shard) are never written: they stay zero.
    const int64_t rows = std::max<int64_t>(0, std::min(shard_, vocab_ - vocab_start_));
    if (rows > 0) {
      writes.push_back(
          {b_slot.narrow(0, 0, rows), source_block(slices[0].b, vocab_start_, rows, 0, r, dtype_)});
    }
  } else {
    writes.push_back({b_slot, source_block(slices[0].b, 0, vocab_, 0, r, dtype_)});
  }
  clear_lora(slot, stream);
  layers_detail::apply_writes(writes, stream);
  ranks_.set(0, slot, r, stream);
  host_ranks_[static_cast<size_t>(slot)] = r;
}

void LogitsProcessorWithLora::reset_lora(int slot) {
  const Stream stream = Stream::default_for(device_);
  clear_lora(slot, stream);
  stream.synchronize();
}

void LogitsProcessorWithLora::reset_lora(int slot, const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, "LogitsProcessorWithLora");
  clear_lora(slot, copy_stream);
}

void LogitsProcessorWithLora::clear_lora(int slot, const Stream& stream) {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, "LogitsProcessorWithLora: reset_lora slot ",
                 slot, " outside [0, ", config_.max_loras, ")");
  ranks_.set(0, slot, 0, stream);
  host_ranks_[static_cast<size_t>(slot)] = 0;
}

Tensor LogitsProcessorWithLora::forward(const Tensor& hidden_states, const PunicaWrapper& punica,
                                        const Stream& stream) {
  LORAPLEX_CHECK(
      hidden_states.defined() && hidden_states.dim() == 2 && hidden_states.size(0) <= max_num_seqs_,
      "LogitsProcessorWithLora: hidden states must be [<= ", max_num_seqs_, ", ", hidden_,
      "], got ", hidden_states.defined() ? hidden_states.describe() : "undefined");
  if (!out_buffer_.defined()) out_buffer_ = Tensor::empty({max_num_seqs_, vocab_}, dtype_, device_);
  Tensor y = out_buffer_.narrow(0, 0, hidden_states.size(0));
  forward(hidden_states, y, punica, stream);
  return y;
}

void LogitsProcessorWithLora::forward(const Tensor& hidden_states, Tensor& logits,
                                      const PunicaWrapper& punica, const Stream& stream) {
  const char* k = "LogitsProcessorWithLora";
  LORAPLEX_CHECK(weight_.defined(), k, ": forward before load_base");
  layers_detail::check_activation(hidden_states, device_, dtype_, k, "hidden states");
  layers_detail::check_activation(logits, device_, dtype_, k, "logits");
  const int64_t seqs = hidden_states.size(0);
  LORAPLEX_CHECK(seqs <= max_num_seqs_ && hidden_states.size(1) == hidden_, k,
                 ": hidden states are ", shape_str(hidden_states.shape()),
                 ", expected [<= ", max_num_seqs_, ", ", hidden_, "]");
  LORAPLEX_CHECK(logits.size(0) == seqs && logits.size(1) == vocab_, k, ": logits are ",
                 shape_str(logits.shape()), ", expected [", seqs, ", ", vocab_, "]");
  LORAPLEX_CHECK(punica.device() == device_ && punica.max_loras() == config_.max_loras, k,
                 ": the Punica wrapper is on ", punica.device(), " with max_loras ",
                 punica.max_loras(), "; the layer is on ", device_, " with max_loras ",
                 config_.max_loras);
  LORAPLEX_CHECK(punica.sampler_meta().num_tokens() == seqs, k, ": ", seqs,
                 " sampled rows, the step's sampler metadata has ",
                 punica.sampler_meta().num_tokens());
  const bool lora = !punica.sampler_meta().no_lora();
  LayerWorkspace::Carver carver = workspace_->carver();
  Scratch scratch = carve(carver, seqs);
  // One rank holds the whole (unpadded) vocabulary: compute straight into the output.
  Tensor local = tp_ == 1 ? logits : scratch.local;
  linear_base(hidden_states, weight_, bias_, local, stream);
  if (lora && config_.fully_sharded) {
    punica.add_lora_logits(local, hidden_states, lora_a_, lora_b_, ranks_, 1.0f, scratch.lora,
                           stream);
  }
  if (tp_ > 1) {
    Tensor& staging = scratch.staging;
    comm().all_gather(local, staging, 0, stream);
    // staging holds [rank][seq][shard]; the full row of seq s is the ranks' pieces in order.
    for (int r = 0; r < tp_; ++r) {
      const int64_t start = r * shard_;
      const int64_t cols = std::min(shard_, vocab_ - start);
      if (cols <= 0) continue;
      Tensor dst = logits.narrow(1, start, cols);
      dst.copy_from(staging.narrow(0, r * seqs, seqs).narrow(1, 0, cols), stream);
    }
  }
  if (lora && !config_.fully_sharded) {
    punica.add_lora_logits(logits, hidden_states, lora_a_, lora_b_, ranks_, 1.0f, scratch.lora,
                           stream);
  }
}

}  // namespace loraplex
