#include "loraplex/layers/lora_linear.h"

#include <optional>
#include <utility>

#include "loraplex/core/error.h"
#include "loraplex/layers/layer_util.h"
#include "loraplex/layers/linear_base.h"

namespace loraplex {

using layers_detail::ceil_div;
using layers_detail::host_block;
using layers_detail::PendingWrite;
using layers_detail::source_block;
using layers_detail::workspace_view;

namespace {

std::vector<OutputSlice> plain_slices(const std::vector<int64_t>& sizes) {
  std::vector<OutputSlice> out;
  for (int64_t s : sizes) out.push_back({s, 0});
  return out;
}

}  // namespace

LinearSpec LinearSpec::replicated(int64_t in, int64_t out, DType dtype) {
  LinearSpec s;
  s.kind = "ReplicatedLinear";
  s.style = ParallelStyle::kReplicated;
  s.dtype = dtype;
  s.in_features = in;
  s.outputs = {{out, 0}};
  return s;
}

LinearSpec LinearSpec::column(int64_t in, int64_t out, DType dtype, bool gather_output) {
  LinearSpec s;
  s.kind = "ColumnParallelLinear";
  s.style = ParallelStyle::kColumn;
  s.dtype = dtype;
  s.in_features = in;
  s.outputs = {{out, 0}};
  s.gather_output = gather_output;
  return s;
}

LinearSpec LinearSpec::merged_column(int64_t in, std::vector<int64_t> sizes, DType dtype,
                                     bool gather_output) {
  LinearSpec s = column(in, 0, dtype, gather_output);
  s.kind =
      sizes.size() == 2 ? "MergedColumnParallelLinear" : "MergedColumnParallelLinear(variable)";
  s.outputs = plain_slices(sizes);
  return s;
}

LinearSpec LinearSpec::column_fused_lora(int64_t in, std::vector<int64_t> sizes, DType dtype,
                                         bool gather_output) {
  LinearSpec s = merged_column(in, std::move(sizes), dtype, gather_output);
  s.kind = "ColumnParallelLinear(fused LoRA over merged base)";
  s.fused_lora = true;
  return s;
}

LinearSpec LinearSpec::qkv(int64_t in, int64_t head_size, int64_t num_heads, int64_t num_kv_heads,
                           DType dtype, QkvLora lora, bool gather_output) {
  LinearSpec s = column(in, 0, dtype, gather_output);
  s.kind = lora == QkvLora::kFusedLora ? "QKVParallelLinear" : "MergedQKVParallelLinear";
  s.outputs = {{num_heads * head_size, num_heads},
               {num_kv_heads * head_size, num_kv_heads},
               {num_kv_heads * head_size, num_kv_heads}};
  s.fused_lora = lora == QkvLora::kFusedLora;
  return s;
}

LinearSpec LinearSpec::row(int64_t in, int64_t out, DType dtype, bool input_is_parallel,
                           bool reduce_results) {
  LinearSpec s;
  s.kind = "RowParallelLinear";
  s.style = ParallelStyle::kRow;
  s.dtype = dtype;
  s.in_features = in;
  s.outputs = {{out, 0}};
  s.input_is_parallel = input_is_parallel;
  s.reduce_results = reduce_results;
  return s;
}

LoraLinear::LoraLinear(LinearSpec spec, const LoraConfig& config, Communicator* comm, Device device,
                       int max_num_tokens, std::shared_ptr<LayerWorkspace> workspace)
    : spec_(std::move(spec)),
      config_(config),
      comm_(comm),
      device_(device),
      max_num_tokens_(max_num_tokens),
      workspace_(std::move(workspace)) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(
      spec_.dtype == DType::kF32 || spec_.dtype == DType::kF16 || spec_.dtype == DType::kBF16, k,
      ": dtype ", spec_.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_CHECK(config_.lora_dtype == spec_.dtype || fp8_lora(), k, ": lora_dtype ",
                 config_.lora_dtype, " must equal the activation dtype ", spec_.dtype,
                 " (the Punica ops read x and A in one dtype) or be float8_e4m3 (fp8 adapter "
                 "storage)");
  // The W8A8 GEMM through cuBLASLt (linear_base_fp8) gave the wrong tokens with per-row scales
  // and had no algorithm for some shapes with 128x128 blocks on an H200: until it matches the
  // CPU, FP8 checkpoints run on the CPU only, refused here rather than answered wrongly.
  LORAPLEX_CHECK(!(spec_.fp8_weight && device.is_cuda()), k,
                 ": FP8 (float8_e4m3) base weights run on the CPU only for now: load this "
                 "checkpoint with --device cpu, or a bfloat16 one on the GPU");
  LORAPLEX_CHECK(!(fp8_lora() && config_.fully_sharded), k,
                 ": fp8 adapter storage with fully sharded LoRA is not supported");
  LORAPLEX_CHECK(config_.max_loras >= 1 && config_.max_lora_rank >= 1, k, ": max_loras ",
                 config_.max_loras, " and max_lora_rank ", config_.max_lora_rank, " must be >= 1");
  LORAPLEX_CHECK(max_num_tokens >= 1, k, ": max_num_tokens ", max_num_tokens, ", expected >= 1");
  LORAPLEX_CHECK(spec_.in_features >= 1 && !spec_.outputs.empty() &&
                     static_cast<int>(spec_.outputs.size()) <= kernels::kMaxSlices,
                 k, ": in_features ", spec_.in_features, " and ", spec_.outputs.size(),
                 " output slices (expected >= 1 and 1..", kernels::kMaxSlices, " slices)");
  if (spec_.style != ParallelStyle::kReplicated) {
    tp_ = layers_detail::comm_size(comm_);
    rank_ = layers_detail::comm_rank(comm_);
  }
  const bool row = spec_.style == ParallelStyle::kRow;
  if (row) {
    LORAPLEX_CHECK(spec_.outputs.size() == 1, k,
                   ": row-parallel layers have one output slice, got ", spec_.outputs.size());
    LORAPLEX_CHECK(spec_.in_features % tp_ == 0, k, ": in_features ", spec_.in_features,
                   " is not divisible by the tensor-parallel size ", tp_);
    in_local_ = spec_.in_features / tp_;
    in_offset_ = rank_ * in_local_;
  } else {
    in_local_ = spec_.in_features;
  }
  for (size_t i = 0; i < spec_.outputs.size(); ++i) {
    const OutputSlice& o = spec_.outputs[i];
    LocalSlice ls;
    ls.full_offset = out_full_;
    ls.full_size = o.size;
    if (row) {
      LORAPLEX_CHECK(o.size >= 1, k, ": output width ", o.size, ", expected >= 1");
      ls.local_size = o.size;
    } else {
      const layers_detail::Shard sh = layers_detail::shard_of(
          o.size, o.units, tp_, rank_, k + " output slice " + std::to_string(i));
      ls.local_size = sh.size;
      ls.shard_start = sh.start;
      ls.groups = sh.groups;
    }
    ls.local_offset = out_local_;
    out_full_ += o.size;
    out_local_ += ls.local_size;
    slices_.push_back(ls);
  }
  if (fully_sharded_row()) {
    LORAPLEX_CHECK(out_full_ % tp_ == 0, k, ": fully sharded LoRA splits B by output rows, but ",
                   out_full_, " outputs are not divisible by the tensor-parallel size ", tp_);
  }

  const int num_lora = spec_.fused_lora ? 1 : static_cast<int>(spec_.outputs.size());
  const int64_t max_rank = config_.max_lora_rank;
  const int64_t a_rows = fully_sharded_column() ? ceil_div(max_rank, tp_) : max_rank;
  const int64_t b_cols = fully_sharded_column() ? a_rows * tp_ : max_rank;
  const int64_t a_cols = row ? in_local_ : spec_.in_features;
  // Fused layout: the A of every slot lives in extra rows of the base weight, slot by slot
  // ([W; slot 0: A of slice 0, 1, ...; slot 1: ...]), so one GEMM over the first rows gives the
  // base output and the shrink of the slots in use together (forward_fused). Fully sharded
  // layers keep their own A stacks (A re-laid out by rank, or a shrink that is all-reduced
  // apart from the output).
  fused_layout_ = !config_.fully_sharded && !spec_.fp8_weight && !fp8_lora();
  slot_cols_ = fused_layout_ ? num_lora * max_rank : 0;
  const DType weight_dtype = spec_.fp8_weight ? DType::kF8E4M3 : spec_.dtype;
  storage_ = Tensor::empty({out_local_ + config_.max_loras * slot_cols_, in_local_}, weight_dtype,
                           device_);
  weight_ = storage_.narrow(0, 0, out_local_);
  if (fused_layout_) {
    // Zeros before any upload: slot writes come later on other streams, unordered with this.
    Tensor a_rows_all = storage_.narrow(0, out_local_, config_.max_loras * slot_cols_);
    const Stream zeroing = Stream::default_for(device_);
    a_rows_all.zero_(zeroing);
    zeroing.synchronize();
    a_rows_all = a_rows_all.view({config_.max_loras, num_lora, max_rank, in_local_});
    for (int s = 0; s < num_lora; ++s) lora_a_.push_back(a_rows_all.select(1, s));
  }
  for (int s = 0; s < num_lora; ++s) {
    int64_t width = spec_.fused_lora ? out_local_ : slices_[static_cast<size_t>(s)].local_size;
    if (fully_sharded_row()) width = out_full_ / tp_;
    lora_width_.push_back(width);
    if (!fused_layout_) {
      lora_a_.push_back(
          Tensor::zeros({config_.max_loras, a_rows, a_cols}, config_.lora_dtype, device_));
    }
    lora_b_.push_back(
        Tensor::zeros({config_.max_loras, width, b_cols}, config_.lora_dtype, device_));
    if (fp8_lora()) {
      a_scales_.push_back(Tensor::zeros({config_.max_loras, a_rows}, DType::kF32, device_));
      b_scales_.push_back(Tensor::zeros({config_.max_loras, width}, DType::kF32, device_));
    }
  }
  ranks_ = SlotRanks(num_lora, config_.max_loras, static_cast<int>(a_rows), device_);
  if (fully_sharded_column()) {
    expand_ranks_ = SlotRanks(num_lora, config_.max_loras, static_cast<int>(b_cols), device_);
  }
  host_ranks_.assign(static_cast<size_t>(num_lora * config_.max_loras), 0);

  const bool own_workspace = workspace_ == nullptr;
  if (own_workspace) workspace_ = std::make_shared<LayerWorkspace>(device_);
  LORAPLEX_CHECK(workspace_->device() == device_, k, ": workspace on ", workspace_->device(),
                 ", the layer is on ", device_);
  LayerWorkspace::Carver measure = LayerWorkspace::measure();
  carve(measure, max_num_tokens);
  workspace_->reserve(measure.used());
  if (own_workspace) workspace_->allocate();
}

LoraLinear::Scratch LoraLinear::carve(LayerWorkspace::Carver& carver, int64_t tokens) const {
  Scratch s;
  const int64_t num_lora = num_lora_slices();
  const int64_t a_rows = lora_a_[0].size(1);
  const int64_t b_cols = lora_b_[0].size(2);
  s.lora = carver.take({num_lora * tokens * a_rows}, DType::kF32);
  if (fully_sharded_column()) s.gathered = carver.take({num_lora * tokens * b_cols}, DType::kF32);
  if (spec_.gather_output && tp_ > 1) {
    s.local_out = carver.take({tokens, out_local_}, spec_.dtype);
    s.staging = carver.take({tp_ * tokens, out_local_}, spec_.dtype);
  }
  if (spec_.fp8_weight && device_.is_cuda()) {
    const size_t bytes = kernels::fp8_gemm_scratch_bytes(tokens, in_local_);
    s.fp8 = carver.take({static_cast<int64_t>(bytes)}, DType::kU8);
  }
  return s;
}

bool LoraLinear::fully_sharded_column() const {
  return config_.fully_sharded && spec_.style == ParallelStyle::kColumn;
}

bool LoraLinear::fully_sharded_row() const {
  return config_.fully_sharded && spec_.style == ParallelStyle::kRow;
}

int64_t LoraLinear::input_width() const {
  if (spec_.style == ParallelStyle::kRow && spec_.input_is_parallel) return in_local_;
  return spec_.in_features;
}

int64_t LoraLinear::output_width() const {
  if (spec_.style == ParallelStyle::kColumn && !spec_.gather_output) return out_local_;
  return out_full_;
}

int LoraLinear::lora_rank(int slot, int slice) const {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras && slice >= 0 && slice < num_lora_slices(),
                 spec_.kind, ": lora_rank(slot ", slot, ", slice ", slice, ") out of range");
  return host_ranks_[static_cast<size_t>(slice * config_.max_loras + slot)];
}

void LoraLinear::load_base(const std::vector<Tensor>& weights, const std::vector<Tensor>& biases,
                           WeightUpload* upload) {
  std::vector<BaseWeight> base(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) base[i].weight = weights[i];
  load_base(base, biases, upload);
}

void LoraLinear::load_base(const std::vector<BaseWeight>& base, const std::vector<Tensor>& biases,
                           WeightUpload* upload) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(base.size() == spec_.outputs.size(), k, ": load_base got ", base.size(),
                 " weights, expected one per output slice (", spec_.outputs.size(), ")");
  std::vector<Tensor> weights;
  for (const BaseWeight& b : base) weights.push_back(b.weight);
  bool any_bias = false;
  for (const Tensor& b : biases) any_bias = any_bias || b.defined();
  if (any_bias) {
    LORAPLEX_CHECK(biases.size() == spec_.outputs.size(), k, ": load_base got ", biases.size(),
                   " biases, expected one per output slice (", spec_.outputs.size(), ")");
  }
  const DType weight_dtype = storage_.dtype();
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    const int64_t size = spec_.outputs[i].size;
    LORAPLEX_CHECK(base[i].is_fp8() == spec_.fp8_weight, k, ": base weight of slice ", i, " is ",
                   w.defined() ? w.describe() : "undefined", ", the layer takes ",
                   spec_.fp8_weight ? "float8_e4m3 weights with scales" : "float weights");
    LORAPLEX_CHECK(w.defined() && layers_detail::is_weight_source(w, device_, weight_dtype) &&
                       w.dim() == 2 && w.size(0) == size && w.size(1) == spec_.in_features,
                   k, ": base weight of slice ", i, " must be a CPU ",
                   spec_.fp8_weight ? "float8_e4m3" : "float", " [", size, ", ", spec_.in_features,
                   "] (or ", weight_dtype, " on ", device_, "), got ",
                   w.defined() ? w.describe() : "undefined");
    if (any_bias) {
      const Tensor& b = biases[i];
      LORAPLEX_CHECK(b.defined() && layers_detail::is_weight_source(b, device_, spec_.dtype) &&
                         b.dim() == 1 && b.size(0) == size,
                     k, ": bias of slice ", i, " must be a CPU float [", size, "], got ",
                     b.defined() ? b.describe() : "undefined");
    }
  }
  if (spec_.fp8_weight) {
    std::vector<Fp8RowRange> ranges;
    std::vector<const BaseWeight*> all;
    for (size_t i = 0; i < base.size(); ++i) {
      ranges.push_back({&base[i], slices_[i].shard_start, slices_[i].local_size});
      all.push_back(&base[i]);
    }
    const Fp8Scales host = fp8_local_scales(ranges, in_offset_, in_local_, k);
    fp8_.layout = host.layout;
    fp8_.scale = host.scale.to(device_);
    const Tensor input_scale = merged_input_scale(all, k);
    fp8_.input_scale = input_scale.defined() ? input_scale.to(device_) : Tensor();
  }
  std::optional<WeightUpload> own;
  if (upload == nullptr) upload = &own.emplace(device_);
  // The fused GEMM adds the bias to its extra columns too: zeros there. Only those are
  // cleared here: the bias itself is uploaded on another stream, unordered with this one.
  if (any_bias) {
    bias_storage_ = Tensor::empty({storage_.size(0)}, spec_.dtype, device_);
    bias_ = bias_storage_.narrow(0, 0, out_local_);
    bias_storage_.narrow(0, out_local_, storage_.size(0) - out_local_).zero_();
  } else {
    bias_storage_ = Tensor();
    bias_ = Tensor();
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    const LocalSlice& ls = slices_[i];
    upload->copy(
        weight_.narrow(0, ls.local_offset, ls.local_size),
        weights[i].narrow(0, ls.shard_start, ls.local_size).narrow(1, in_offset_, in_local_));
    if (any_bias) {
      upload->copy(bias_.narrow(0, ls.local_offset, ls.local_size),
                   biases[i].narrow(0, ls.shard_start, ls.local_size));
    }
  }
  if (own) own->finish();
  loaded_ = true;
}

void LoraLinear::set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
  const Stream stream = Stream::default_for(device_);
  write_lora(slot, slices, stream);
  stream.synchronize();
}

void LoraLinear::set_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                          const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, spec_.kind);
  write_lora(slot, slices, copy_stream);
}

void LoraLinear::write_lora(int slot, const std::vector<LoraSliceWeights>& slices,
                            const Stream& stream) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, k, ": set_lora slot ", slot,
                 " outside [0, max_loras ", config_.max_loras, ")");
  const int num_lora = num_lora_slices();
  LORAPLEX_CHECK(static_cast<int>(slices.size()) == num_lora, k, ": set_lora got ", slices.size(),
                 " slices, expected ", num_lora,
                 spec_.fused_lora ? " (one fused LoRA)" : " (one per output slice)");
  const DType dt = config_.lora_dtype;
  const bool row = spec_.style == ParallelStyle::kRow;
  // Everything is validated and staged on the host first, so a bad slice changes nothing.
  std::vector<int> ranks(static_cast<size_t>(num_lora));
  for (int s = 0; s < num_lora; ++s) {
    const int64_t out = spec_.fused_lora ? out_full_ : spec_.outputs[static_cast<size_t>(s)].size;
    ranks[static_cast<size_t>(s)] = layers_detail::check_lora_pair(
        slices[static_cast<size_t>(s)], spec_.in_features, out, config_.max_lora_rank,
        k + " set_lora slot " + std::to_string(slot) + " slice " + std::to_string(s));
  }
  std::vector<PendingWrite> writes;
  std::vector<int32_t> shrink(static_cast<size_t>(num_lora), 0);
  std::vector<int32_t> expand(static_cast<size_t>(num_lora), 0);
  for (int s = 0; s < num_lora; ++s) {
    const int r = ranks[static_cast<size_t>(s)];
    if (r == 0) continue;
    const Tensor& a = slices[static_cast<size_t>(s)].a;
    const Tensor& b = slices[static_cast<size_t>(s)].b;
    Tensor a_slot = lora_a_[static_cast<size_t>(s)].select(0, slot);
    Tensor b_slot = lora_b_[static_cast<size_t>(s)].select(0, slot);
    const int64_t width = lora_width_[static_cast<size_t>(s)];
    shrink[static_cast<size_t>(s)] = r;
    expand[static_cast<size_t>(s)] = r;
    // dst <- the block of src; in fp8, its codes and their per-row scales into dst_scales.
    auto put = [&](Tensor dst, Tensor dst_scales, const Tensor& src, int64_t r0, int64_t nr,
                   int64_t c0, int64_t nc) {
      if (!fp8_lora()) {
        writes.push_back({dst, source_block(src, r0, nr, c0, nc, dt)});
        return;
      }
      const layers_detail::Fp8Block q = layers_detail::fp8_block(src, r0, nr, c0, nc);
      writes.push_back({dst, q.codes});
      writes.push_back({dst_scales, q.scales});
    };
    Tensor a_scales = fp8_lora() ? a_scales_[static_cast<size_t>(s)].select(0, slot) : Tensor();
    Tensor b_scales = fp8_lora() ? b_scales_[static_cast<size_t>(s)].select(0, slot) : Tensor();
    if (row) {
      put(a_slot.narrow(0, 0, r), fp8_lora() ? a_scales.narrow(0, 0, r) : Tensor(), a, 0, r,
          in_offset_, in_local_);
      const int64_t b_start = fully_sharded_row() ? rank_ * width : 0;
      put(b_slot.narrow(1, 0, r), b_scales, b, b_start, width, 0, r);
      continue;
    }
    // Column and replicated: B keeps this rank's output rows of every output slice it spans.
    const size_t first = spec_.fused_lora ? 0 : static_cast<size_t>(s);
    const size_t last = spec_.fused_lora ? slices_.size() : first + 1;
    if (!fully_sharded_column()) {
      put(a_slot.narrow(0, 0, r), fp8_lora() ? a_scales.narrow(0, 0, r) : Tensor(), a, 0, r, 0,
          spec_.in_features);
      int64_t row_out = 0;
      for (size_t o = first; o < last; ++o) {
        const LocalSlice& ls = slices_[o];
        const int64_t b_row = (spec_.fused_lora ? ls.full_offset : 0) + ls.shard_start;
        put(b_slot.narrow(1, 0, r).narrow(0, row_out, ls.local_size),
            fp8_lora() ? b_scales.narrow(0, row_out, ls.local_size) : Tensor(), b, b_row,
            ls.local_size, 0, r);
        row_out += ls.local_size;
      }
      continue;
    }
    Tensor b_local = Tensor::empty({width, r}, dt);
    int64_t row_out = 0;
    for (size_t o = first; o < last; ++o) {
      const LocalSlice& ls = slices_[o];
      const int64_t b_row = (spec_.fused_lora ? ls.full_offset : 0) + ls.shard_start;
      Tensor dst = b_local.narrow(0, row_out, ls.local_size);
      dst.copy_from(b.narrow(0, b_row, ls.local_size));
      row_out += ls.local_size;
    }
    Tensor a_cyclic =
        layers_detail::cyclic_rank_rows(host_block(a, 0, r, 0, spec_.in_features, dt), tp_, rank_);
    const int c = static_cast<int>(a_cyclic.size(0));
    Tensor b_padded = Tensor::zeros({width, static_cast<int64_t>(c) * tp_}, dt);
    Tensor b_head = b_padded.narrow(1, 0, r);
    b_head.copy_from(b_local);
    writes.push_back({a_slot.narrow(0, 0, c), a_cyclic});
    writes.push_back({b_slot.narrow(1, 0, c * tp_), b_padded});
    shrink[static_cast<size_t>(s)] = c;
    expand[static_cast<size_t>(s)] = c * tp_;
  }
  // Rank 0 first: while the weights are being replaced the slot has no effect at all.
  clear_lora(slot, stream);
  layers_detail::apply_writes(writes, stream);
  ranks_.set_slot(slot, shrink, stream);
  if (fully_sharded_column()) expand_ranks_.set_slot(slot, expand, stream);
  for (int s = 0; s < num_lora; ++s) {
    host_ranks_[static_cast<size_t>(s * config_.max_loras + slot)] = ranks[static_cast<size_t>(s)];
  }
}

void LoraLinear::reset_lora(int slot) {
  const Stream stream = Stream::default_for(device_);
  clear_lora(slot, stream);
  stream.synchronize();
}

void LoraLinear::reset_lora(int slot, const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, spec_.kind);
  clear_lora(slot, copy_stream);
}

void LoraLinear::clear_lora(int slot, const Stream& stream) {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, spec_.kind, ": reset_lora slot ", slot,
                 " outside [0, max_loras ", config_.max_loras, ")");
  ranks_.set_slot(slot, 0, stream);
  if (fully_sharded_column()) expand_ranks_.set_slot(slot, 0, stream);
  for (int s = 0; s < num_lora_slices(); ++s) {
    host_ranks_[static_cast<size_t>(s * config_.max_loras + slot)] = 0;
  }
}

Tensor LoraLinear::forward(const Tensor& x, const PunicaWrapper& punica, const Stream& stream) {
  LORAPLEX_CHECK(x.defined() && x.dim() == 2, spec_.kind, ": x must be 2-D [tokens, ",
                 input_width(), "], got ", x.defined() ? x.describe() : "undefined");
  LORAPLEX_CHECK(x.size(0) <= max_num_tokens_, spec_.kind, ": ", x.size(0),
                 " tokens exceed max_num_tokens ", max_num_tokens_);
  if (!out_buffer_.defined()) {
    out_buffer_ = Tensor::empty({max_num_tokens_, output_width()}, spec_.dtype, device_);
  }
  Tensor y = out_buffer_.narrow(0, 0, x.size(0));
  forward(x, y, punica, stream);
  return y;
}

void LoraLinear::forward(const Tensor& x, Tensor& y, const PunicaWrapper& punica,
                         const Stream& stream) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(loaded_, k, ": forward before load_base");
  layers_detail::check_activation(x, device_, spec_.dtype, k.c_str(), "x");
  layers_detail::check_activation(y, device_, spec_.dtype, k.c_str(), "y");
  const int64_t tokens = x.size(0);
  LORAPLEX_CHECK(tokens <= max_num_tokens_, k, ": ", tokens, " tokens exceed max_num_tokens ",
                 max_num_tokens_);
  LORAPLEX_CHECK(x.size(1) == input_width(), k, ": x has ", x.size(1), " columns, expected ",
                 input_width());
  LORAPLEX_CHECK(y.size(0) == tokens && y.size(1) == output_width(), k, ": y is ",
                 shape_str(y.shape()), ", expected [", tokens, ", ", output_width(), "]");
  LORAPLEX_CHECK(punica.device() == device_ && punica.max_loras() == config_.max_loras, k,
                 ": the Punica wrapper is on ", punica.device(), " with max_loras ",
                 punica.max_loras(), "; the layer is on ", device_, " with max_loras ",
                 config_.max_loras);
  LORAPLEX_CHECK(punica.token_meta().num_tokens() == tokens, k, ": x has ", tokens,
                 " tokens, the step's metadata has ", punica.token_meta().num_tokens());
  const bool row = spec_.style == ParallelStyle::kRow;
  if (row && spec_.reduce_results) {
    LORAPLEX_CHECK(y.is_contiguous(), k, ": y must be contiguous for the all-reduce, got strides ",
                   shape_str(y.strides()));
  }
  const Tensor x_local = row && !spec_.input_is_parallel ? x.narrow(1, in_offset_, in_local_) : x;
  const bool gather = spec_.gather_output && tp_ > 1;
  LayerWorkspace::Carver carver = workspace_->carver();
  Scratch scratch = carve(carver, tokens);
  Tensor target = gather ? scratch.local_out : y;
  // Row layers add the bias on rank 0 only: the all-reduce then adds it exactly once.
  const Tensor bias = row && rank_ != 0 ? Tensor() : bias_;
  base_gemm(x_local, bias, target, scratch, stream);
  add_lora(target, x_local, punica, scratch, stream);
  if (row && spec_.reduce_results && tp_ > 1) comm().all_reduce_sum(y, stream);
  if (gather) gather_output(target, scratch.staging, y, stream);
}

void LoraLinear::forward_base(const Tensor& x, Tensor& y, const Stream& stream) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(loaded_, k, ": forward before load_base");
  LORAPLEX_CHECK(tp_ == 1, k, ": forward_base needs a single device (tensor-parallel size ", tp_,
                 ")");
  layers_detail::check_activation(x, device_, spec_.dtype, k.c_str(), "x");
  layers_detail::check_activation(y, device_, spec_.dtype, k.c_str(), "y");
  LORAPLEX_CHECK(x.size(1) == input_width() && y.size(0) == x.size(0) &&
                     y.size(1) == output_width() && x.size(0) <= max_num_tokens_,
                 k, ": forward_base x ", shape_str(x.shape()), ", y ", shape_str(y.shape()),
                 " (at most max_num_tokens ", max_num_tokens_, " rows)");
  LayerWorkspace::Carver carver = workspace_->carver();
  const Scratch scratch = carve(carver, x.size(0));
  base_gemm(x, bias_, y, scratch, stream);
}

void LoraLinear::base_gemm(const Tensor& x, const Tensor& bias, Tensor& y, const Scratch& scratch,
                           const Stream& stream) const {
  if (spec_.fp8_weight) {
    linear_base_fp8(x, weight_, fp8_, bias, y, scratch.fp8, stream);
  } else {
    linear_base(x, weight_, bias, y, stream);
  }
}

void LoraLinear::add_lora_to(const Tensor& x, Tensor& d, const PunicaWrapper& punica,
                             const Stream& stream) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(tp_ == 1, k, ": add_lora_to needs a single device (tensor-parallel size ", tp_,
                 ")");
  layers_detail::check_activation(x, device_, spec_.dtype, k.c_str(), "x");
  layers_detail::check_activation(d, device_, spec_.dtype, k.c_str(), "d");
  const int64_t tokens = x.size(0);
  LORAPLEX_CHECK(x.size(1) == input_width() && d.size(0) == tokens && d.size(1) == output_width(),
                 k, ": add_lora_to x ", shape_str(x.shape()), ", d ", shape_str(d.shape()));
  LORAPLEX_CHECK(punica.token_meta().num_tokens() == tokens, k, ": x has ", tokens,
                 " tokens, the step's metadata has ", punica.token_meta().num_tokens());
  LayerWorkspace::Carver carver = workspace_->carver();
  Scratch scratch = carve(carver, tokens);
  add_lora(d, x, punica, scratch, stream);
}

int64_t LoraLinear::fused_row_width(int num_slots) const {
  return output_width() + static_cast<int64_t>(num_slots) * slot_cols_;
}

bool LoraLinear::can_fuse() const {
  return fused_layout_ && !(spec_.gather_output && tp_ > 1) &&
         !(spec_.style == ParallelStyle::kRow && !spec_.input_is_parallel);
}

kernels::FusedLoraExpand LoraLinear::forward_fused(const Tensor& x, Tensor& y,
                                                   const PunicaWrapper& punica, int num_slots,
                                                   const Stream& stream) {
  const std::string& k = spec_.kind;
  LORAPLEX_CHECK(loaded_ && can_fuse(), k,
                 ": forward_fused needs loaded weights, the fused layout (no fully sharded LoRA), "
                 "no gathered output and a parallel input");
  LORAPLEX_CHECK(num_slots >= 0 && num_slots <= config_.max_loras, k, ": forward_fused over ",
                 num_slots, " slots, expected 0..max_loras ", config_.max_loras);
  layers_detail::check_activation(x, device_, spec_.dtype, k.c_str(), "x");
  layers_detail::check_activation(y, device_, spec_.dtype, k.c_str(), "y");
  const int64_t tokens = x.size(0);
  const int64_t width = fused_row_width(num_slots);
  LORAPLEX_CHECK(
      x.size(1) == input_width() && y.size(0) == tokens && y.size(1) == width && y.is_contiguous(),
      k, ": forward_fused x ", shape_str(x.shape()), ", y ", shape_str(y.shape()),
      ", expected y contiguous [", tokens, ", ", width, "]");
  LORAPLEX_CHECK(punica.token_meta().num_tokens() == tokens, k, ": x has ", tokens,
                 " tokens, the step's metadata has ", punica.token_meta().num_tokens());
  const bool row = spec_.style == ParallelStyle::kRow;
  const Tensor w = storage_.narrow(0, 0, width);
  Tensor bias;
  if (bias_storage_.defined() && !(row && rank_ != 0)) bias = bias_storage_.narrow(0, 0, width);
  linear_base(x, w, bias, y, stream);
  // The shrink is linear in x: the partial sums of a row-parallel layer's ranks add up in the
  // same all-reduce as its output.
  if (row && spec_.reduce_results && tp_ > 1) comm().all_reduce_sum(y, stream);
  kernels::FusedLoraExpand e;
  if (punica.token_meta().no_lora() || num_slots == 0) return e;
  e.meta = punica.token_meta().view();
  e.num_slices = num_lora_slices();
  e.max_loras = config_.max_loras;
  e.max_rank = static_cast<int>(config_.max_lora_rank);
  e.num_slots = num_slots;
  e.ranks = ranks_.device().data<int32_t>();
  e.shrink = static_cast<const uint8_t*>(y.data_ptr()) + output_width() * dtype_size(spec_.dtype);
  e.shrink_row_stride = width;
  e.slot_cols = slot_cols_;
  for (int s = 0; s < e.num_slices; ++s) {
    e.lora_b[s] = lora_b_[static_cast<size_t>(s)].data_ptr();
    e.width[s] = lora_width_[static_cast<size_t>(s)];
    e.offset[s] = spec_.fused_lora ? 0 : slices_[static_cast<size_t>(s)].local_offset;
  }
  return e;
}

void LoraLinear::add_lora(Tensor& y, const Tensor& x, const PunicaWrapper& punica, Scratch& scratch,
                          const Stream& stream) {
  // The mapping is the same on every rank, so every rank skips the collectives together.
  if (punica.token_meta().no_lora()) return;
  const int num_lora = num_lora_slices();
  const int64_t tokens = x.size(0);
  if (fully_sharded_column()) {
    const int64_t a_rows = lora_a_[0].size(1);
    const int64_t b_cols = lora_b_[0].size(2);
    Tensor shrunk = workspace_view(scratch.lora, {num_lora, tokens, a_rows});
    punica.add_shrink(shrunk, x, lora_a_, ranks_, 1.0f, stream);
    // Interleaved gather: rank i's column j lands in column j * tp + i.
    Tensor gathered = workspace_view(scratch.gathered, {num_lora, tokens, b_cols});
    Tensor gathered_cols = gathered.view({num_lora * tokens * a_rows, tp_});
    comm().all_gather(shrunk.view({num_lora * tokens * a_rows, 1}), gathered_cols, 1, stream);
    punica.add_expand(y, gathered, lora_b_, expand_ranks_, 0, true, stream);
    return;
  }
  if (fully_sharded_row()) {
    const int64_t max_rank = lora_a_[0].size(1);
    Tensor shrunk = workspace_view(scratch.lora, {1, tokens, max_rank});
    // Columns past a slot's rank and rows of slot -1 tokens are never written by the shrink;
    // zeroing keeps what the all-reduce sums well defined.
    shrunk.zero_(stream);
    punica.add_shrink(shrunk, x, lora_a_, ranks_, 1.0f, stream);
    comm().all_reduce_sum(shrunk, stream);
    punica.add_expand(y, shrunk, lora_b_, ranks_, rank_ * lora_width_[0], true, stream);
    return;
  }
  if (fp8_lora()) {
    Tensor shrunk = workspace_view(scratch.lora, {num_lora, tokens, lora_a_[0].size(1)});
    punica.add_shrink_fp8(shrunk, x, lora_a_, a_scales_, ranks_, stream);
    const Fp8LoraB b{lora_b_, b_scales_, kernels::Fp8ScaleKind::kPerChannel};
    punica.add_expand_fp8(y, shrunk, b, ranks_, 0, true, stream);
    return;
  }
  punica.add_lora_linear(y, x, lora_a_, lora_b_, ranks_, 1.0f, scratch.lora, stream);
}

void LoraLinear::gather_output(const Tensor& local, Tensor& staging, Tensor& y,
                               const Stream& stream) {
  const int64_t tokens = local.size(0);
  comm().all_gather(local, staging, 0, stream);
  for (const LocalSlice& ls : slices_) {
    // Shard q of a slice lives on ranks q * (tp / groups) ... (replicated KV heads).
    for (int q = 0; q < ls.groups; ++q) {
      const int src_rank = q * (tp_ / ls.groups);
      Tensor src =
          staging.narrow(0, src_rank * tokens, tokens).narrow(1, ls.local_offset, ls.local_size);
      Tensor dst = y.narrow(1, ls.full_offset + q * ls.local_size, ls.local_size);
      dst.copy_from(src, stream);
    }
  }
}

}  // namespace loraplex
