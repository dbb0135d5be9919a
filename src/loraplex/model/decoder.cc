#include "loraplex/model/decoder.h"

#include <cmath>
#include <filesystem>
#include <tuple>

#include "loraplex/core/error.h"
#include "loraplex/model/model_ops.h"
#include "loraplex/model/sampler.h"

namespace loraplex::model {
namespace {

template <typename T>
Tensor upload(const std::vector<T>& v, Device device, const Stream& stream) {
  const Tensor host = Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
  return device.is_cpu() ? host : host.to(device, stream);
}

}  // namespace

std::unique_ptr<Decoder> Decoder::load(const std::string& dir, const DecoderOptions& options) {
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), dir, ": model directory does not exist");
  LORAPLEX_CHECK(
      options.dtype == DType::kF32 || options.dtype == DType::kBF16 || options.dtype == DType::kF16,
      "model dtype ", options.dtype, " is not supported (float32, bfloat16, float16)");
  LORAPLEX_CHECK(options.max_loras >= 1 && options.max_lora_rank >= 1 &&
                     options.max_num_tokens >= 1 && options.max_num_seqs >= 1,
                 "decoder options: max_loras ", options.max_loras, ", max_lora_rank ",
                 options.max_lora_rank, ", max_num_tokens ", options.max_num_tokens,
                 ", max_num_seqs ", options.max_num_seqs, " must all be >= 1");
  std::unique_ptr<Decoder> d(new Decoder());
  d->config_ = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  d->options_ = options;
  d->stream_ = options.device.is_cpu() ? Stream() : Stream::create(options.device);
  const Checkpoint ckpt = Checkpoint::open(dir);
  d->bind(ckpt);
  d->inv_freq_ = upload(rope_inv_freq(d->config_), options.device, d->stream_);
  d->kv_ = std::make_unique<KvCache>(d->config_, options.kv_blocks, options.kv_block_size,
                                     options.dtype, options.device);
  d->punica_ =
      std::make_unique<PunicaWrapper>(options.max_loras, static_cast<int>(options.max_num_tokens),
                                      static_cast<int>(options.max_num_seqs), options.device);
  return d;
}

namespace {

// The MoE layer takes one MoeLoraWeights; the adapter manager hands it the slices of its
// targets: slice 0 / 1 = PEFT's 3-D gate_up_proj / down_proj (packed per expert: a [E, r, in],
// b [E, out, r]), slice 2 + 3e + {0, 1, 2} = expert e's 2-D w1 / w3 / w2.
LoraLayerHandle moe_handle(FusedMoeWithLora& moe, const std::string& name) {
  const int e_count = moe.spec().num_experts;
  const int64_t inter = moe.spec().intermediate;
  FusedMoeWithLora* layer = &moe;
  auto set = [layer, e_count, inter, name](int slot, const std::vector<LoraSlice>& slices,
                                           const Stream& stream) {
    MoeLoraWeights w;
    const bool has_3d_up = slices[0].a.defined();
    const bool has_3d_down = slices[1].a.defined();
    bool has_2d[3] = {false, false, false};
    for (int e = 0; e < e_count; ++e) {
      for (int k = 0; k < 3; ++k) {
        has_2d[k] = has_2d[k] || slices[static_cast<size_t>(2 + 3 * e + k)].a.defined();
      }
    }
    LORAPLEX_CHECK(!(has_3d_up && (has_2d[0] || has_2d[1])) && !(has_3d_down && has_2d[2]), name,
                   ": an adapter targets the experts both as 3-D parameters and per expert");
    if (has_3d_up) {
      for (int e = 0; e < e_count; ++e) {
        const Tensor a = slices[0].a.select(0, e);
        const Tensor b = slices[0].b.select(0, e);
        w.w1.push_back({a, b.narrow(0, 0, inter)});
        w.w3.push_back({a, b.narrow(0, inter, inter)});
      }
    }
    if (has_3d_down) {
      for (int e = 0; e < e_count; ++e) {
        w.w2.push_back({slices[1].a.select(0, e), slices[1].b.select(0, e)});
      }
    }
    std::vector<LoraSliceWeights>* lists[3] = {&w.w1, &w.w3, &w.w2};
    for (int k = 0; k < 3; ++k) {
      if (!has_2d[k]) continue;
      for (int e = 0; e < e_count; ++e) {
        const LoraSlice& sl = slices[static_cast<size_t>(2 + 3 * e + k)];
        lists[k]->push_back({sl.a, sl.b});
      }
    }
    layer->set_lora(slot, w, stream);
  };
  auto reset = [layer](int slot, const Stream& stream) { layer->reset_lora(slot, stream); };
  return LoraLayerHandle(name, 2 + 3 * e_count, set, reset);
}

}  // namespace

void Decoder::bind(const Checkpoint& ckpt) {
  const ModelConfig& c = config_;
  const DType dt = options_.dtype;
  const Device dev = options_.device;
  const LoraConfig lora{options_.max_loras, options_.max_lora_rank, dt, false};
  const int max_tokens = static_cast<int>(options_.max_num_tokens);
  const int64_t h = c.hidden_size;
  auto weight = [&](const std::string& name, const Shape& s) {
    const Tensor t = ckpt.tensor(name);
    LORAPLEX_CHECK(t.shape() == s, ckpt.dir(), ": tensor '", name, "' has shape ",
                   shape_str(t.shape()), ", expected ", shape_str(s));
    LORAPLEX_CHECK(
        t.dtype() == DType::kF32 || t.dtype() == DType::kF16 || t.dtype() == DType::kBF16,
        ckpt.dir(), ": tensor '", name, "' has dtype ", t.dtype(),
        ", expected float32, float16 or bfloat16");
    return t;
  };
  auto norm = [&](const std::string& name) {
    return weight(name, {h}).to(dt).contiguous().to(dev);
  };
  auto add = [&](const std::string& module, const LoraLayerHandle& handle, int slice, int64_t in,
                 int64_t out, TargetKind kind = TargetKind::kLinear, Tensor base = Tensor()) {
    LoraTarget t;
    t.module = module;
    t.layer = handle;
    t.slice = slice;
    t.in_features = in;
    t.out_features = out;
    t.kind = kind;
    t.base_weight = std::move(base);
    targets_.add(std::move(t));
  };

  const Tensor embed = weight("model.embed_tokens.weight", {c.vocab_size, h});
  embed_ =
      std::make_unique<VocabEmbeddingWithLora>(c.vocab_size, h, dt, lora, nullptr, dev, max_tokens);
  embed_->load_base(embed);
  add("model.embed_tokens", LoraLayerHandle::of<LoraSliceWeights>(*embed_, "model.embed_tokens", 1),
      0, c.vocab_size, h, TargetKind::kEmbedding, embed);
  LORAPLEX_CHECK(ckpt.has("lm_head.weight") || c.tie_word_embeddings, ckpt.dir(),
                 ": no lm_head.weight and tie_word_embeddings is false");
  const Tensor head = c.tie_word_embeddings ? embed : weight("lm_head.weight", {c.vocab_size, h});
  lm_head_ = std::make_unique<LogitsProcessorWithLora>(h, c.vocab_size, dt, lora, nullptr, dev,
                                                       static_cast<int>(options_.max_num_seqs));
  lm_head_->load_base(head);
  add("lm_head", LoraLayerHandle::of<LoraSliceWeights>(*lm_head_, "lm_head", 1), 0, h, c.vocab_size,
      TargetKind::kLmHead, head);
  final_norm_ = norm("model.norm.weight");

  const int64_t q = c.q_size();
  const int64_t kv = c.kv_size();
  const int64_t inter = c.intermediate_size;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer layer;
    layer.input_norm = norm(p + "input_layernorm.weight");
    layer.post_norm = norm(p + "post_attention_layernorm.weight");
    const std::string a = p + "self_attn.";
    layer.qkv = std::make_unique<LoraLinear>(
        LinearSpec::qkv(h, c.head_dim, c.num_heads, c.num_kv_heads, dt), lora, nullptr, dev,
        max_tokens);
    std::vector<Tensor> qkv_b;
    if (c.qkv_bias) {
      qkv_b = {weight(a + "q_proj.bias", {q}), weight(a + "k_proj.bias", {kv}),
               weight(a + "v_proj.bias", {kv})};
    }
    layer.qkv->load_base({weight(a + "q_proj.weight", {q, h}), weight(a + "k_proj.weight", {kv, h}),
                          weight(a + "v_proj.weight", {kv, h})},
                         qkv_b);
    layer.o =
        std::make_unique<LoraLinear>(LinearSpec::row(q, h, dt), lora, nullptr, dev, max_tokens);
    std::vector<Tensor> o_b;
    if (c.o_bias) o_b = {weight(a + "o_proj.bias", {h})};
    layer.o->load_base({weight(a + "o_proj.weight", {h, q})}, o_b);
    const LoraLayerHandle qkv_h =
        LoraLayerHandle::of<LoraSliceWeights>(*layer.qkv, a + "qkv_proj", 3);
    add(a + "q_proj", qkv_h, 0, h, q);
    add(a + "k_proj", qkv_h, 1, h, kv);
    add(a + "v_proj", qkv_h, 2, h, kv);
    add(a + "o_proj", LoraLayerHandle::of<LoraSliceWeights>(*layer.o, a + "o_proj", 1), 0, q, h);

    if (!c.is_moe()) {
      const std::string m = p + "mlp.";
      layer.gate_up = std::make_unique<LoraLinear>(LinearSpec::merged_column(h, {inter, inter}, dt),
                                                   lora, nullptr, dev, max_tokens);
      std::vector<Tensor> gu_b;
      if (c.mlp_bias) {
        gu_b = {weight(m + "gate_proj.bias", {inter}), weight(m + "up_proj.bias", {inter})};
      }
      layer.gate_up->load_base(
          {weight(m + "gate_proj.weight", {inter, h}), weight(m + "up_proj.weight", {inter, h})},
          gu_b);
      layer.down = std::make_unique<LoraLinear>(LinearSpec::row(inter, h, dt), lora, nullptr, dev,
                                                max_tokens);
      std::vector<Tensor> down_b;
      if (c.mlp_bias) down_b = {weight(m + "down_proj.bias", {h})};
      layer.down->load_base({weight(m + "down_proj.weight", {h, inter})}, down_b);
      const LoraLayerHandle gu_h =
          LoraLayerHandle::of<LoraSliceWeights>(*layer.gate_up, m + "gate_up_proj", 2);
      add(m + "gate_proj", gu_h, 0, h, inter);
      add(m + "up_proj", gu_h, 1, h, inter);
      add(m + "down_proj", LoraLayerHandle::of<LoraSliceWeights>(*layer.down, m + "down_proj", 1),
          0, inter, h);
    } else {
      MoeSpec spec;
      spec.num_experts = static_cast<int>(c.num_experts);
      spec.top_k = static_cast<int>(c.num_experts_per_tok);
      spec.hidden = h;
      spec.intermediate = inter;
      spec.dtype = dt;
      spec.renormalize = true;
      layer.moe = std::make_unique<FusedMoeWithLora>(spec, lora, nullptr, dev, max_tokens);
      // transformers 5 still saves Mixtral with the 4.x names (block_sparse_moe.experts.N.wK);
      // a checkpoint with the 5.x fused names (mlp.experts.gate_up_proj) is read as well.
      const std::string old_p = p + "block_sparse_moe.";
      const std::string new_p = p + "mlp.";
      const int64_t e_count = c.num_experts;
      if (ckpt.has(old_p + "gate.weight")) {
        std::vector<Tensor> w1, w2, w3;
        for (int64_t e = 0; e < e_count; ++e) {
          const std::string ep = old_p + "experts." + std::to_string(e) + ".";
          w1.push_back(weight(ep + "w1.weight", {inter, h}));
          w2.push_back(weight(ep + "w2.weight", {h, inter}));
          w3.push_back(weight(ep + "w3.weight", {inter, h}));
        }
        layer.moe->load_base(weight(old_p + "gate.weight", {e_count, h}), w1, w3, w2);
      } else {
        layer.moe->load_base_3d(weight(new_p + "gate.weight", {e_count, h}),
                                weight(new_p + "experts.gate_up_proj", {e_count, 2 * inter, h}),
                                weight(new_p + "experts.down_proj", {e_count, h, inter}));
      }
      const LoraLayerHandle moe_h = moe_handle(*layer.moe, p + "experts");
      // PEFT's 3-D LoRA: A always consumes the projection input (ParamWrapper swaps in/out
      // for transformers-5 [E, out, in] parameters), so both register in forward orientation,
      // in the module's parameter order (which fixes PEFT's wrapper nesting).
      const std::tuple<const char*, int, int64_t, int64_t> params[] = {
          {"gate_up_proj", 0, h, 2 * inter}, {"down_proj", 1, inter, h}};
      for (const auto& [param, slice, in, out] : params) {
        LoraTarget t;
        t.module = new_p + "experts";
        t.layer = moe_h;
        t.slice = slice;
        t.in_features = in;
        t.out_features = out;
        t.kind = TargetKind::kExperts3d;
        t.parameter = param;
        t.num_experts = e_count;
        t.parameter_out_in = false;
        targets_.add(std::move(t));
      }
      for (int64_t e = 0; e < e_count; ++e) {
        const std::string ep = old_p + "experts." + std::to_string(e) + ".";
        const int base = 2 + 3 * static_cast<int>(e);
        add(ep + "w1", moe_h, base + 0, h, inter);
        add(ep + "w3", moe_h, base + 1, h, inter);
        add(ep + "w2", moe_h, base + 2, inter, h);
      }
    }
    layers_.push_back(std::move(layer));
  }
}

Tensor Decoder::rms_norm(const Tensor& x, const Tensor& weight) const {
  Tensor out = Tensor::empty(x.shape(), options_.dtype, options_.device);
  ops::RmsNormArgs a;
  a.dtype = options_.dtype;
  a.num_rows = x.size(0);
  a.hidden = x.size(1);
  a.eps = static_cast<float>(config_.rms_norm_eps);
  a.x = x.data_ptr();
  a.x_row_stride = x.size(1);
  a.weight = weight.data_ptr();
  a.out = out.data_ptr();
  throw_if_error(ops::run(&ops::cpu::rms_norm, &ops::cuda::rms_norm, a, stream_));
  return out;
}

void Decoder::add_inplace(Tensor& y, const Tensor& x) const {
  ops::AddArgs a{options_.dtype, y.size(0), y.size(1), x.data_ptr(), y.data_ptr()};
  throw_if_error(ops::run(&ops::cpu::add, &ops::cuda::add, a, stream_));
}

Tensor Decoder::forward(const StepInput& s) {
  const ModelConfig& c = config_;
  const Device dev = options_.device;
  const DType dt = options_.dtype;
  const int64_t n = static_cast<int64_t>(s.token_ids.size());
  const int64_t num_sampled = static_cast<int64_t>(s.sample_tokens.size());
  LORAPLEX_CHECK(n >= 1 && n <= options_.max_num_tokens, "step has ", n,
                 " tokens, expected 1..max_num_tokens ", options_.max_num_tokens);
  LORAPLEX_CHECK(num_sampled <= options_.max_num_seqs, "step samples ", num_sampled,
                 " rows, expected at most max_num_seqs ", options_.max_num_seqs);
  LORAPLEX_CHECK(
      s.positions.size() == s.token_ids.size() && s.token_seq.size() == s.token_ids.size() &&
          s.token_slots.size() == s.token_ids.size() &&
          s.sample_slots.size() == s.sample_tokens.size() &&
          static_cast<int64_t>(s.block_tables.size()) == s.num_seqs * s.max_blocks_per_seq,
      "step input: inconsistent sizes");
  const int64_t bs = kv_->block_size();
  std::vector<int32_t> slot_mapping(static_cast<size_t>(n));
  int64_t max_context = 1;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t seq = s.token_seq[static_cast<size_t>(t)];
    const int32_t pos = s.positions[static_cast<size_t>(t)];
    LORAPLEX_CHECK(seq >= 0 && seq < s.num_seqs && pos >= 0 && pos / bs < s.max_blocks_per_seq,
                   "step input: token ", t, " has sequence ", seq, " and position ", pos);
    const int32_t block =
        s.block_tables[static_cast<size_t>(seq * s.max_blocks_per_seq + pos / bs)];
    slot_mapping[static_cast<size_t>(t)] = static_cast<int32_t>(block * bs + pos % bs);
    max_context = std::max<int64_t>(max_context, pos + 1);
  }
  for (int32_t row : s.sample_tokens) {
    LORAPLEX_CHECK(row >= 0 && row < n, "step input: sampled row ", row, " outside 0..", n - 1);
  }

  punica_->update_metadata(s.token_slots, s.sample_slots, stream_);
  const PunicaWrapper& pw = *punica_;
  const Tensor ids = upload(s.token_ids, dev, stream_);
  const Tensor positions = upload(s.positions, dev, stream_);
  const Tensor token_seq = upload(s.token_seq, dev, stream_);
  const Tensor slots = upload(slot_mapping, dev, stream_);
  const Tensor tables = upload(s.block_tables, dev, stream_);

  // The residual stream is owned here: layer outputs are views of the layers' buffers.
  Tensor x = embed_->forward(ids, pw, stream_).clone(stream_);
  const int64_t q = c.q_size();
  const int64_t kv = c.kv_size();
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    const ops::KvCacheView cache = kv_->view(static_cast<int64_t>(l));
    Tensor h = rms_norm(x, layer.input_norm);
    Tensor qkv = layer.qkv->forward(h, pw, stream_);
    ops::RopeArgs rope;
    rope.dtype = dt;
    rope.num_tokens = n;
    rope.num_heads = c.num_heads;
    rope.num_kv_heads = c.num_kv_heads;
    rope.head_dim = c.head_dim;
    rope.positions = positions.data<int32_t>();
    rope.inv_freq = inv_freq_.data<float>();
    rope.qkv = qkv.data_ptr();
    rope.qkv_row_stride = q + 2 * kv;
    throw_if_error(ops::run(&ops::cpu::rope, &ops::cuda::rope, rope, stream_));
    ops::KvWriteArgs w;
    w.dtype = dt;
    w.num_tokens = n;
    w.num_heads = c.num_heads;
    w.qkv = qkv.data_ptr();
    w.qkv_row_stride = q + 2 * kv;
    w.slot_mapping = slots.data<int32_t>();
    w.cache = cache;
    throw_if_error(ops::run(&ops::cpu::kv_write, &ops::cuda::kv_write, w, stream_));
    Tensor attn = Tensor::empty({n, q}, dt, dev);
    ops::PagedAttentionArgs pa;
    pa.dtype = dt;
    pa.num_tokens = n;
    pa.num_heads = c.num_heads;
    pa.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    pa.qkv = qkv.data_ptr();
    pa.qkv_row_stride = q + 2 * kv;
    pa.positions = positions.data<int32_t>();
    pa.token_seq = token_seq.data<int32_t>();
    pa.block_tables = tables.data<int32_t>();
    pa.num_seqs = s.num_seqs;
    pa.max_blocks_per_seq = s.max_blocks_per_seq;
    pa.max_context = max_context;
    pa.cache = cache;
    pa.out = attn.data_ptr();
    throw_if_error(ops::run(&ops::cpu::paged_attention, &ops::cuda::paged_attention, pa, stream_));
    add_inplace(x, layer.o->forward(attn, pw, stream_));

    h = rms_norm(x, layer.post_norm);
    if (layer.moe) {
      add_inplace(x, layer.moe->forward(h, pw, stream_));
    } else {
      const Tensor gu = layer.gate_up->forward(h, pw, stream_);
      Tensor act = Tensor::empty({n, c.intermediate_size}, dt, dev);
      ops::SiluMulArgs sm{dt, n, c.intermediate_size, gu.data_ptr(), act.data_ptr()};
      throw_if_error(ops::run(&ops::cpu::silu_mul, &ops::cuda::silu_mul, sm, stream_));
      add_inplace(x, layer.down->forward(act, pw, stream_));
    }
  }

  // Only the sampled rows need the final norm and the lm_head.
  if (num_sampled == 0) return Tensor::empty({0, c.vocab_size}, dt, dev);
  Tensor rows = Tensor::empty({num_sampled, c.hidden_size}, dt, dev);
  {
    const Tensor sample_ids = upload(s.sample_tokens, dev, stream_);
    ops::EmbeddingArgs g;
    g.dtype = dt;
    g.num_tokens = num_sampled;
    g.hidden = c.hidden_size;
    g.vocab = n;
    g.ids = sample_ids.data<int32_t>();
    g.table = x.data_ptr();
    g.out = rows.data_ptr();
    throw_if_error(ops::run(&ops::cpu::embedding, &ops::cuda::embedding, g, stream_));
  }
  const Tensor normed = rms_norm(rows, final_norm_);
  return lm_head_->forward(normed, pw, stream_);
}

void Decoder::allocate_kv_cache(int64_t num_blocks) {
  LORAPLEX_CHECK(num_blocks >= 1, "KV cache: ", num_blocks, " blocks, expected >= 1");
  kv_.reset();
  kv_ = std::make_unique<KvCache>(config_, num_blocks, options_.kv_block_size, options_.dtype,
                                  options_.device);
  options_.kv_blocks = num_blocks;
}

int64_t Decoder::kv_block_bytes() const {
  return 2 * config_.num_layers * options_.kv_block_size * config_.num_kv_heads * config_.head_dim *
         static_cast<int64_t>(dtype_size(options_.dtype));
}

StepResult Decoder::execute(const StepBatch& batch) {
  StepInput s;
  s.num_seqs = static_cast<int64_t>(batch.seqs.size());
  LORAPLEX_CHECK(s.num_seqs >= 1, "step batch has no sequences");
  const int64_t bs = kv_->block_size();
  for (const SequenceStep& q : batch.seqs) {
    s.max_blocks_per_seq =
        std::max<int64_t>(s.max_blocks_per_seq, static_cast<int64_t>(q.blocks.size()));
  }
  s.block_tables.assign(
      static_cast<size_t>(s.num_seqs * std::max<int64_t>(s.max_blocks_per_seq, 1)), 0);
  s.max_blocks_per_seq = std::max<int64_t>(s.max_blocks_per_seq, 1);
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SequenceStep& q = batch.seqs[i];
    const int64_t end = q.start_position + static_cast<int64_t>(q.tokens.size());
    LORAPLEX_CHECK(!q.tokens.empty() && q.start_position >= 0, "step batch: sequence ", i, " has ",
                   q.tokens.size(), " tokens at position ", q.start_position);
    LORAPLEX_CHECK(static_cast<int64_t>(q.blocks.size()) * bs >= end, "step batch: sequence ", i,
                   " reaches position ", end - 1, " but its ", q.blocks.size(), " blocks hold ",
                   static_cast<int64_t>(q.blocks.size()) * bs, " positions");
    LORAPLEX_CHECK(q.lora_slot >= -1 && q.lora_slot < options_.max_loras, "step batch: sequence ",
                   i, " has LoRA slot ", q.lora_slot, ", expected -1..", options_.max_loras - 1);
    std::copy(q.blocks.begin(), q.blocks.end(),
              s.block_tables.begin() + static_cast<std::ptrdiff_t>(i) * s.max_blocks_per_seq);
    for (size_t t = 0; t < q.tokens.size(); ++t) {
      s.token_ids.push_back(q.tokens[t]);
      s.positions.push_back(q.start_position + static_cast<int32_t>(t));
      s.token_seq.push_back(static_cast<int32_t>(i));
      s.token_slots.push_back(q.lora_slot);
    }
    if (q.sample) {
      check_sampling_params(q.sampling);
      LORAPLEX_CHECK(q.banned.size() <= static_cast<size_t>(kMaxBannedTokens),
                     "step batch: sequence ", i, " bans ", q.banned.size(), " tokens, at most ",
                     kMaxBannedTokens);
      s.sample_tokens.push_back(static_cast<int32_t>(s.token_ids.size()) - 1);
      s.sample_slots.push_back(q.lora_slot);
    }
  }
  const Tensor logits = forward(s);
  StepResult r;
  if (logits.size(0) == 0) return r;
  const int64_t vocab = config_.vocab_size;
  const Tensor host = logits.to(Device::cpu(), stream_).to(DType::kF32);
  size_t row = 0;
  for (const SequenceStep& q : batch.seqs) {
    if (!q.sample) continue;
    const std::span<const float> l(host.data<float>() + static_cast<int64_t>(row) * vocab,
                                   static_cast<size_t>(vocab));
    const int32_t id = sample_row(l, q.sampling, q.uniform, q.banned);
    r.token_ids.push_back(id);
    if (batch.want_logprobs) r.logprobs.push_back(token_logprob(l, id));
    ++row;
  }
  return r;
}

}  // namespace loraplex::model
