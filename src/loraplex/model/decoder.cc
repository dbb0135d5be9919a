#include "loraplex/model/decoder.h"

#include <cmath>
#include <filesystem>

#include "loraplex/core/error.h"
#include "loraplex/model/model_ops.h"

namespace loraplex::model {
namespace {

template <typename T>
Tensor upload(const std::vector<T>& v, Device device) {
  const Tensor host = Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
  return device.is_cpu() ? host : host.to(device);
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
  d->inv_freq_ = upload(rope_inv_freq(d->config_), options.device);
  d->kv_ = std::make_unique<KvCache>(d->config_, options.kv_blocks, options.kv_block_size,
                                     options.dtype, options.device);
  d->punica_ =
      std::make_unique<PunicaWrapper>(options.max_loras, static_cast<int>(options.max_num_tokens),
                                      static_cast<int>(options.max_num_seqs), options.device);
  const int64_t ws =
      std::max(PunicaWrapper::workspace_elements(3, options.max_num_tokens, options.max_lora_rank),
               PunicaWrapper::workspace_elements(1, options.max_num_seqs, options.max_lora_rank));
  d->workspace_ = Tensor::empty({ws}, DType::kF32, options.device);
  return d;
}

void Decoder::bind(const Checkpoint& ckpt) {
  const ModelConfig& c = config_;
  const LoraShape shape{options_.max_loras, options_.max_lora_rank, options_.dtype,
                        options_.device};
  const int64_t h = c.hidden_size;
  auto weight = [&](const std::string& name, const Shape& s) {
    return ckpt.tensor(name, s, DType::kF32);
  };
  auto norm = [&](const std::string& name) {
    return weight(name, {h}).to(options_.dtype).to(options_.device);
  };
  auto add_target = [&](const std::string& module, LoraTarget t) { targets_.emplace(module, t); };

  const Tensor embed = weight("model.embed_tokens.weight", {c.vocab_size, h});
  embed_ = std::make_unique<LoraEmbedding>(embed, shape);
  add_target("model.embed_tokens",
             {LoraTarget::Kind::kEmbedding, embed_.get(), 0, nullptr, -1, 0, c.vocab_size, h});
  const bool has_head = ckpt.has("lm_head.weight");
  LORAPLEX_CHECK(has_head || c.tie_word_embeddings, ckpt.dir(),
                 ": no lm_head.weight and tie_word_embeddings is false");
  lm_head_ = std::make_unique<LoraLogits>(
      c.tie_word_embeddings ? embed : weight("lm_head.weight", {c.vocab_size, h}), shape);
  add_target("lm_head",
             {LoraTarget::Kind::kLogits, lm_head_.get(), 0, nullptr, -1, 0, h, c.vocab_size});
  final_norm_ = norm("model.norm.weight");

  const int64_t q = c.q_size();
  const int64_t kv = c.kv_size();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer layer;
    layer.input_norm = norm(p + "input_layernorm.weight");
    layer.post_norm = norm(p + "post_attention_layernorm.weight");
    // q, k and v are one fused projection with three LoRA slices.
    const std::string a = p + "self_attn.";
    Tensor qkv_w = Tensor::empty({q + 2 * kv, h}, DType::kF32);
    qkv_w.narrow(0, 0, q).copy_from(weight(a + "q_proj.weight", {q, h}));
    qkv_w.narrow(0, q, kv).copy_from(weight(a + "k_proj.weight", {kv, h}));
    qkv_w.narrow(0, q + kv, kv).copy_from(weight(a + "v_proj.weight", {kv, h}));
    Tensor qkv_b;
    if (c.qkv_bias) {
      qkv_b = Tensor::empty({q + 2 * kv}, DType::kF32);
      qkv_b.narrow(0, 0, q).copy_from(weight(a + "q_proj.bias", {q}));
      qkv_b.narrow(0, q, kv).copy_from(weight(a + "k_proj.bias", {kv}));
      qkv_b.narrow(0, q + kv, kv).copy_from(weight(a + "v_proj.bias", {kv}));
    }
    layer.qkv = std::make_unique<LoraLinear>(qkv_w, qkv_b, std::vector<int64_t>{q, kv, kv}, shape);
    layer.o = std::make_unique<LoraLinear>(weight(a + "o_proj.weight", {h, q}),
                                           c.o_bias ? weight(a + "o_proj.bias", {h}) : Tensor(),
                                           std::vector<int64_t>{h}, shape);
    add_target(a + "q_proj", {LoraTarget::Kind::kLinear, layer.qkv.get(), 0, nullptr, -1, 0, h, q});
    add_target(a + "k_proj",
               {LoraTarget::Kind::kLinear, layer.qkv.get(), 1, nullptr, -1, 0, h, kv});
    add_target(a + "v_proj",
               {LoraTarget::Kind::kLinear, layer.qkv.get(), 2, nullptr, -1, 0, h, kv});
    add_target(a + "o_proj", {LoraTarget::Kind::kLinear, layer.o.get(), 0, nullptr, -1, 0, q, h});

    const int64_t inter = c.intermediate_size;
    if (!c.is_moe()) {
      const std::string m = p + "mlp.";
      Tensor gu = Tensor::empty({2 * inter, h}, DType::kF32);
      gu.narrow(0, 0, inter).copy_from(weight(m + "gate_proj.weight", {inter, h}));
      gu.narrow(0, inter, inter).copy_from(weight(m + "up_proj.weight", {inter, h}));
      Tensor gu_b;
      if (c.mlp_bias) {
        gu_b = Tensor::empty({2 * inter}, DType::kF32);
        gu_b.narrow(0, 0, inter).copy_from(weight(m + "gate_proj.bias", {inter}));
        gu_b.narrow(0, inter, inter).copy_from(weight(m + "up_proj.bias", {inter}));
      }
      layer.gate_up =
          std::make_unique<LoraLinear>(gu, gu_b, std::vector<int64_t>{inter, inter}, shape);
      layer.down =
          std::make_unique<LoraLinear>(weight(m + "down_proj.weight", {h, inter}),
                                       c.mlp_bias ? weight(m + "down_proj.bias", {h}) : Tensor(),
                                       std::vector<int64_t>{h}, shape);
      add_target(m + "gate_proj",
                 {LoraTarget::Kind::kLinear, layer.gate_up.get(), 0, nullptr, -1, 0, h, inter});
      add_target(m + "up_proj",
                 {LoraTarget::Kind::kLinear, layer.gate_up.get(), 1, nullptr, -1, 0, h, inter});
      add_target(m + "down_proj",
                 {LoraTarget::Kind::kLinear, layer.down.get(), 0, nullptr, -1, 0, inter, h});
    } else {
      const int64_t e_count = c.num_experts;
      std::vector<Tensor> w1, w2, w3;
      // transformers 5 still saves Mixtral with the 4.x names (block_sparse_moe.experts.N.wK);
      // a checkpoint with the 5.x fused names (mlp.experts.gate_up_proj) is read as well.
      const std::string old_p = p + "block_sparse_moe.";
      const std::string new_p = p + "mlp.";
      Tensor router_w;
      if (ckpt.has(old_p + "gate.weight")) {
        router_w = weight(old_p + "gate.weight", {e_count, h});
        for (int64_t e = 0; e < e_count; ++e) {
          const std::string ep = old_p + "experts." + std::to_string(e) + ".";
          w1.push_back(weight(ep + "w1.weight", {inter, h}));
          w2.push_back(weight(ep + "w2.weight", {h, inter}));
          w3.push_back(weight(ep + "w3.weight", {inter, h}));
        }
      } else {
        router_w = weight(new_p + "gate.weight", {e_count, h});
        const Tensor gu = weight(new_p + "experts.gate_up_proj", {e_count, 2 * inter, h});
        const Tensor dn = weight(new_p + "experts.down_proj", {e_count, h, inter});
        for (int64_t e = 0; e < e_count; ++e) {
          w1.push_back(gu.select(0, e).narrow(0, 0, inter).contiguous());
          w3.push_back(gu.select(0, e).narrow(0, inter, inter).contiguous());
          w2.push_back(dn.select(0, e).contiguous());
        }
      }
      layer.router = BaseLinear(router_w, Tensor(), options_.dtype, options_.device);
      layer.moe =
          std::make_unique<LoraMoe>(w1, w3, w2, static_cast<int>(c.num_experts_per_tok), shape);
      LoraTarget t3{LoraTarget::Kind::kExperts3d, nullptr, 0, layer.moe.get(), -1, 0, h, h};
      add_target(new_p + "experts", t3);
      for (int64_t e = 0; e < e_count; ++e) {
        const std::string ep = old_p + "experts." + std::to_string(e) + ".";
        add_target(ep + "w1", {LoraTarget::Kind::kExpert2d, nullptr, 0, layer.moe.get(),
                               static_cast<int>(e), 0, h, inter});
        add_target(ep + "w3", {LoraTarget::Kind::kExpert2d, nullptr, 0, layer.moe.get(),
                               static_cast<int>(e), 1, h, inter});
        add_target(ep + "w2", {LoraTarget::Kind::kExpert2d, nullptr, 0, layer.moe.get(),
                               static_cast<int>(e), 2, inter, h});
      }
    }
    layers_.push_back(std::move(layer));
  }
}

void Decoder::reset_slot(int slot) {
  embed_->reset_lora(slot);
  lm_head_->reset_lora(slot);
  for (Layer& l : layers_) {
    l.qkv->reset_lora(slot);
    l.o->reset_lora(slot);
    if (l.moe) {
      l.moe->reset_lora(slot);
    } else {
      l.gate_up->reset_lora(slot);
      l.down->reset_lora(slot);
    }
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
  StepContext ctx{punica_.get(), &workspace_, stream_};
  const Tensor ids = upload(s.token_ids, dev);
  const Tensor positions = upload(s.positions, dev);
  const Tensor token_seq = upload(s.token_seq, dev);
  const Tensor slots = upload(slot_mapping, dev);
  const Tensor tables = upload(s.block_tables, dev);

  Tensor x = embed_->forward(ids, ctx);
  const int64_t q = c.q_size();
  const int64_t kv = c.kv_size();
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    const ops::KvCacheView cache = kv_->view(static_cast<int64_t>(l));
    Tensor h = rms_norm(x, layer.input_norm);
    Tensor qkv = layer.qkv->forward(h, ctx);
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
    add_inplace(x, layer.o->forward(attn, ctx));

    h = rms_norm(x, layer.post_norm);
    if (layer.moe) {
      Tensor router_logits = Tensor::empty({n, c.num_experts}, dt, dev);
      layer.router.forward(router_logits, h, stream_);
      add_inplace(x, layer.moe->forward(h, router_logits, ctx));
    } else {
      const Tensor gu = layer.gate_up->forward(h, ctx);
      Tensor act = Tensor::empty({n, c.intermediate_size}, dt, dev);
      ops::SiluMulArgs sm{dt, n, c.intermediate_size, gu.data_ptr(), act.data_ptr()};
      throw_if_error(ops::run(&ops::cpu::silu_mul, &ops::cuda::silu_mul, sm, stream_));
      add_inplace(x, layer.down->forward(act, ctx));
    }
  }

  // Only the sampled rows need the final norm and the lm_head.
  if (num_sampled == 0) return Tensor::empty({0, c.vocab_size}, dt, dev);
  Tensor rows = Tensor::empty({num_sampled, c.hidden_size}, dt, dev);
  {
    const Tensor sample_ids = upload(s.sample_tokens, dev);
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
  return lm_head_->forward(normed, ctx);
}

}  // namespace loraplex::model
