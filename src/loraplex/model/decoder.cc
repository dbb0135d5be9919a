#include "loraplex/model/decoder.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <tuple>

#include "loraplex/core/allocator.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"
#include "loraplex/model/sampler.h"
#include "loraplex/model/sampling_ops.h"
#include "loraplex/model/shard_layout.h"
#include "loraplex/model/weight_source.h"

namespace loraplex::model {
namespace {

// Batch sizes that get their own captured decode graph; a batch runs in the smallest bucket
// that holds it (padding rows cost little next to reading every weight once per step).
constexpr int64_t kGraphBuckets[] = {1,  2,   4,   8,   16,  24,  32,  40,  48,  56,  64, 80,
                                     96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512};

// The same block of tensors a CPU step and a device step read: a view with a known size.
Tensor rows_of(const Tensor& t, int64_t rows) { return t.narrow(0, 0, rows); }

// Embedding and lm_head base weights are registered for checking adapters' saved copies only
// when they are host views (a checkpoint's); random device weights are not kept twice.
Tensor host_only(const Tensor& t) { return t.device().is_cpu() ? t : Tensor(); }

}  // namespace

int64_t decode_graph_bucket(int64_t n, int64_t max_num_seqs) {
  if (n < 1 || n > max_num_seqs) return 0;
  for (int64_t b : kGraphBuckets) {
    if (b >= n) return std::min(b, max_num_seqs);
  }
  return max_num_seqs <= kGraphBuckets[std::size(kGraphBuckets) - 1] ? max_num_seqs : 0;
}

bool Decoder::GraphKey::operator<(const GraphKey& o) const {
  return std::tie(bucket, token_lora, sampler_lora, fused_slots, sampling) <
         std::tie(o.bucket, o.token_lora, o.sampler_lora, o.fused_slots, o.sampling);
}

struct Decoder::Graph {
  cuda_rt::GraphHandle exec = nullptr;
  ~Graph() { cuda_rt::graph_destroy(exec); }
};

std::unique_ptr<Decoder> Decoder::load(const std::string& dir, const DecoderOptions& options) {
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), dir, ": model directory does not exist");
  const ModelConfig config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  return create(config, CheckpointWeights(dir, config.quant), options);
}

std::unique_ptr<Decoder> Decoder::create_random(const ModelConfig& config,
                                                const DecoderOptions& options, uint64_t seed) {
  // The weights are made on a stream of their own and copied on the same stream, in order.
  WeightUpload upload(options.device);
  return create(config, RandomWeights(config, options.dtype, options.device, seed, upload.stream()),
                options, &upload);
}

std::unique_ptr<Decoder> Decoder::create(const ModelConfig& config, const WeightSource& source,
                                         const DecoderOptions& options, WeightUpload* upload) {
  LORAPLEX_CHECK(
      options.dtype == DType::kF32 || options.dtype == DType::kBF16 || options.dtype == DType::kF16,
      "model dtype ", options.dtype, " is not supported (float32, bfloat16, float16)");
  LORAPLEX_CHECK(
      options.max_loras >= 1 && options.max_lora_rank >= 1 && options.max_num_tokens >= 1 &&
          options.max_num_seqs >= 1 && options.kv_block_size >= 1 && options.max_model_len >= 0,
      "decoder options: max_loras ", options.max_loras, ", max_lora_rank ", options.max_lora_rank,
      ", max_num_tokens ", options.max_num_tokens, ", max_num_seqs ", options.max_num_seqs,
      ", kv_block_size ", options.kv_block_size, " must all be >= 1");
  LORAPLEX_CHECK(!options.lora_dtype || *options.lora_dtype == options.dtype ||
                     *options.lora_dtype == DType::kF8E4M3,
                 "LoRA dtype ", options.lora_dtype.value_or(options.dtype),
                 " is not supported (expected the model dtype ", options.dtype, " or float8_e4m3)");
  LORAPLEX_CHECK(options.lora_dtype != DType::kF8E4M3 || !options.fully_sharded_loras,
                 "fp8 adapter storage with fully sharded LoRA is not supported");
  const int tp = options.comm != nullptr ? options.comm->size() : 1;
  LORAPLEX_CHECK(options.tensor_parallel_size == tp, "decoder options: tensor_parallel_size ",
                 options.tensor_parallel_size, " but ",
                 options.comm != nullptr ? options.comm->describe() : "no communicator",
                 " (a sharded model is loaded with model::load_model, which builds the group)");
  check_shard_layout(config, tp, options.fully_sharded_loras);
  std::unique_ptr<Decoder> d(new Decoder());
  d->config_ = config;
  d->local_ = rank_config(config, tp);
  d->options_ = options;
  d->tp_size_ = tp;
  d->tp_rank_ = options.comm != nullptr ? options.comm->rank() : 0;
  if (d->options_.max_model_len == 0) {
    d->options_.max_model_len = std::max<int64_t>(config.max_position_embeddings, 1);
  }
  d->stream_ = options.device.is_cpu() ? Stream() : Stream::create(options.device);
  d->workspace_ = std::make_shared<LayerWorkspace>(options.device);
  {
    std::optional<WeightUpload> own;
    if (upload == nullptr) upload = &own.emplace(options.device);
    d->bind(source, *upload);
    upload->finish();
    d->weight_bytes_ = upload->bytes();
  }
  const std::vector<float> inv = rope_inv_freq(d->config_);
  d->inv_freq_ = Tensor::from_vector(inv, {static_cast<int64_t>(inv.size())});
  if (options.device.is_cuda()) d->inv_freq_ = d->inv_freq_.to(options.device, d->stream_);
  d->kv_ = std::make_unique<KvCache>(d->local_, options.kv_blocks, options.kv_block_size,
                                     options.dtype, options.device);
  d->punica_ =
      std::make_unique<PunicaWrapper>(options.max_loras, static_cast<int>(options.max_num_tokens),
                                      static_cast<int>(options.max_num_seqs), options.device);
  if (!options.lora_tuning.empty()) d->punica_->set_lora_tuning(options.lora_tuning);
  d->allocate_step_buffers();
  d->workspace_->allocate();
  d->stream_.synchronize();
  // Random weights are made whole and each layer copies its shard out: what they occupied is
  // free now. Returned to the driver, so that the KV cache (sized from the free memory) gets it.
  if (options.device.is_cuda()) cuda_allocator_empty_cache(options.device.index);
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

// `spec` with an fp8 base weight when the projections it merges come in fp8 (all or none: a
// merged layer has one weight storage).
LinearSpec with_fp8(LinearSpec spec, const std::vector<BaseWeight>& weights,
                    const std::string& module) {
  size_t fp8 = 0;
  for (const BaseWeight& w : weights) fp8 += w.is_fp8() ? 1 : 0;
  LORAPLEX_CHECK(fp8 == 0 || fp8 == weights.size(), module, ": ", fp8, " of the ", weights.size(),
                 " projections it merges are float8_e4m3 and the others are not: a merged layer "
                 "takes all of them in FP8 or none");
  spec.fp8_weight = fp8 > 0;
  return spec;
}

}  // namespace

// What bind()'s steps share: where the weights come from and go, and the layers' common
// arguments.
struct Decoder::BindContext {
  const WeightSource& src;
  WeightUpload& upload;
  const ModelConfig& c;
  DType dt;
  Device dev;
  LoraConfig lora;
  // The projections' adapters may be stored in fp8 (options_.lora_dtype).
  LoraConfig linear_lora;
  // Every sharded layer takes this rank's part of the full weights it is given (views of the
  // memory-mapped checkpoint: only that part is read).
  Communicator* comm;
  int max_tokens;

  Tensor weight(const std::string& name, const Shape& s) const { return src.get(name, s); }
  BaseWeight linear(const std::string& module, const Shape& s) const {
    return src.linear(module, s);
  }
  Tensor norm(const std::string& name, int64_t n) const {
    Tensor t = Tensor::empty({n}, dt, dev);
    upload.copy(t, weight(name, {n}));
    return t;
  }
};

void Decoder::bind(const WeightSource& src, WeightUpload& upload) {
  const DType dt = options_.dtype;
  const LoraConfig lora{options_.max_loras, options_.max_lora_rank, dt,
                        options_.fully_sharded_loras};
  LoraConfig linear_lora = lora;
  linear_lora.lora_dtype = options_.lora_dtype.value_or(dt);
  const BindContext b{src,         upload,          config_,
                      dt,          options_.device, lora,
                      linear_lora, options_.comm,   static_cast<int>(options_.max_num_tokens)};
  bind_embedding_and_head(b);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer layer;
    layer.input_norm = b.norm(p + "input_layernorm.weight", config_.hidden_size);
    layer.post_norm = b.norm(p + "post_attention_layernorm.weight", config_.hidden_size);
    bind_attention(b, p, layer);
    if (config_.is_moe()) {
      bind_moe(b, p, layer);
    } else {
      bind_mlp(b, p, layer);
    }
    layers_.push_back(std::move(layer));
  }
}

void Decoder::add_target(const std::string& module, const LoraLayerHandle& handle, int slice,
                         int64_t in, int64_t out, TargetKind kind, Tensor base,
                         bool staged_on_host) {
  LoraTarget t;
  t.module = module;
  t.layer = handle;
  t.slice = slice;
  t.in_features = in;
  t.out_features = out;
  t.kind = kind;
  t.base_weight = std::move(base);
  t.staged_on_host = staged_on_host;
  targets_.add(std::move(t));
}

void Decoder::bind_embedding_and_head(const BindContext& b) {
  const ModelConfig& c = b.c;
  const int64_t h = c.hidden_size;
  const Tensor embed = b.weight("model.embed_tokens.weight", {c.vocab_size, h});
  embed_ = std::make_unique<VocabEmbeddingWithLora>(c.vocab_size, h, b.dt, b.lora, b.comm, b.dev,
                                                    b.max_tokens);
  embed_->load_base(embed, &b.upload);
  add_target("model.embed_tokens",
             LoraLayerHandle::of<LoraSliceWeights>(*embed_, "model.embed_tokens", 1), 0,
             c.vocab_size, h, TargetKind::kEmbedding, host_only(embed));
  LORAPLEX_CHECK(b.src.has("lm_head.weight") || c.tie_word_embeddings, b.src.origin(),
                 ": no lm_head.weight and tie_word_embeddings is false");
  const Tensor head = c.tie_word_embeddings ? embed : b.weight("lm_head.weight", {c.vocab_size, h});
  lm_head_ = std::make_unique<LogitsProcessorWithLora>(h, c.vocab_size, b.dt, b.lora, b.comm, b.dev,
                                                       static_cast<int>(options_.max_num_seqs),
                                                       workspace_);
  lm_head_->load_base(head, Tensor(), &b.upload);
  add_target("lm_head", LoraLayerHandle::of<LoraSliceWeights>(*lm_head_, "lm_head", 1), 0, h,
             c.vocab_size, TargetKind::kLmHead, host_only(head));
  final_norm_ = b.norm("model.norm.weight", h);
}

void Decoder::bind_attention(const BindContext& b, const std::string& p, Layer& layer) {
  const ModelConfig& c = b.c;
  const int64_t h = c.hidden_size;
  const int64_t q = c.q_size();
  const int64_t kv = c.kv_size();
  const std::string a = p + "self_attn.";
  if (c.qk_norm) {
    // One weight over head_dim shared by every head: whole on every rank.
    layer.q_norm = b.norm(a + "q_norm.weight", c.head_dim);
    layer.k_norm = b.norm(a + "k_norm.weight", c.head_dim);
  }
  const std::vector<BaseWeight> qkv_w = {b.linear(a + "q_proj", {q, h}),
                                         b.linear(a + "k_proj", {kv, h}),
                                         b.linear(a + "v_proj", {kv, h})};
  layer.qkv = std::make_unique<LoraLinear>(
      with_fp8(LinearSpec::qkv(h, c.head_dim, c.num_heads, c.num_kv_heads, b.dt), qkv_w,
               a + "qkv_proj"),
      b.linear_lora, b.comm, b.dev, b.max_tokens, workspace_);
  std::vector<Tensor> qkv_b;
  if (c.qkv_bias) {
    qkv_b = {b.weight(a + "q_proj.bias", {q}), b.weight(a + "k_proj.bias", {kv}),
             b.weight(a + "v_proj.bias", {kv})};
  }
  layer.qkv->load_base(qkv_w, qkv_b, &b.upload);
  const std::vector<BaseWeight> o_w = {b.linear(a + "o_proj", {h, q})};
  layer.o = std::make_unique<LoraLinear>(with_fp8(LinearSpec::row(q, h, b.dt), o_w, a + "o_proj"),
                                         b.linear_lora, b.comm, b.dev, b.max_tokens, workspace_);
  std::vector<Tensor> o_b;
  if (c.o_bias) o_b = {b.weight(a + "o_proj.bias", {h})};
  layer.o->load_base(o_w, o_b, &b.upload);
  const LoraLayerHandle qkv_h =
      LoraLayerHandle::of<LoraSliceWeights>(*layer.qkv, a + "qkv_proj", 3);
  add_target(a + "q_proj", qkv_h, 0, h, q);
  add_target(a + "k_proj", qkv_h, 1, h, kv);
  add_target(a + "v_proj", qkv_h, 2, h, kv);
  add_target(a + "o_proj", LoraLayerHandle::of<LoraSliceWeights>(*layer.o, a + "o_proj", 1), 0, q,
             h);
}

void Decoder::bind_mlp(const BindContext& b, const std::string& p, Layer& layer) {
  const ModelConfig& c = b.c;
  const int64_t h = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  const std::string m = p + "mlp.";
  const std::vector<BaseWeight> gu_w = {b.linear(m + "gate_proj", {inter, h}),
                                        b.linear(m + "up_proj", {inter, h})};
  layer.gate_up = std::make_unique<LoraLinear>(
      with_fp8(LinearSpec::merged_column(h, {inter, inter}, b.dt), gu_w, m + "gate_up_proj"),
      b.linear_lora, b.comm, b.dev, b.max_tokens, workspace_);
  std::vector<Tensor> gu_b;
  if (c.mlp_bias) {
    gu_b = {b.weight(m + "gate_proj.bias", {inter}), b.weight(m + "up_proj.bias", {inter})};
  }
  layer.gate_up->load_base(gu_w, gu_b, &b.upload);
  const std::vector<BaseWeight> down_w = {b.linear(m + "down_proj", {h, inter})};
  layer.down = std::make_unique<LoraLinear>(
      with_fp8(LinearSpec::row(inter, h, b.dt), down_w, m + "down_proj"), b.linear_lora, b.comm,
      b.dev, b.max_tokens, workspace_);
  std::vector<Tensor> down_b;
  if (c.mlp_bias) down_b = {b.weight(m + "down_proj.bias", {h})};
  layer.down->load_base(down_w, down_b, &b.upload);
  const LoraLayerHandle gu_h =
      LoraLayerHandle::of<LoraSliceWeights>(*layer.gate_up, m + "gate_up_proj", 2);
  add_target(m + "gate_proj", gu_h, 0, h, inter);
  add_target(m + "up_proj", gu_h, 1, h, inter);
  add_target(m + "down_proj",
             LoraLayerHandle::of<LoraSliceWeights>(*layer.down, m + "down_proj", 1), 0, inter, h);
}

void Decoder::bind_moe(const BindContext& b, const std::string& p, Layer& layer) {
  const ModelConfig& c = b.c;
  const int64_t h = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  MoeSpec spec;
  spec.num_experts = static_cast<int>(c.num_experts);
  spec.top_k = static_cast<int>(c.num_experts_per_tok);
  spec.hidden = h;
  spec.intermediate = inter;
  spec.dtype = b.dt;
  spec.renormalize = c.moe_renormalize;
  layer.moe =
      std::make_unique<FusedMoeWithLora>(spec, b.lora, b.comm, b.dev, b.max_tokens, workspace_);
  if (options_.moe_host_routing) layer.moe->set_routing(FusedMoeWithLora::Routing::kHost);
  // transformers 5 still saves Mixtral and Qwen3-MoE with the 4.x per-expert names
  // (block_sparse_moe.experts.N.w1/w3/w2; mlp.experts.N.gate_proj/up_proj/down_proj); a
  // checkpoint with the 5.x fused names (mlp.experts.gate_up_proj) is read as well.
  const bool qwen = c.arch == Architecture::kQwen3Moe;
  const std::string new_p = p + "mlp.";
  const std::string old_p = qwen ? new_p : p + "block_sparse_moe.";
  const std::array<std::string, 3> names_2d =
      qwen ? std::array<std::string, 3>{"gate_proj", "up_proj", "down_proj"}
           : std::array<std::string, 3>{"w1", "w3", "w2"};
  const int64_t e_count = c.num_experts;
  if (b.src.has(old_p + "experts.0." + names_2d[0] + ".weight")) {
    std::vector<Tensor> w1, w2, w3;
    for (int64_t e = 0; e < e_count; ++e) {
      const std::string ep = old_p + "experts." + std::to_string(e) + ".";
      w1.push_back(b.weight(ep + names_2d[0] + ".weight", {inter, h}));
      w3.push_back(b.weight(ep + names_2d[1] + ".weight", {inter, h}));
      w2.push_back(b.weight(ep + names_2d[2] + ".weight", {h, inter}));
    }
    layer.moe->load_base(b.weight(old_p + "gate.weight", {e_count, h}), w1, w3, w2, &b.upload);
  } else {
    layer.moe->load_base_3d(b.weight(new_p + "gate.weight", {e_count, h}),
                            b.weight(new_p + "experts.gate_up_proj", {e_count, 2 * inter, h}),
                            b.weight(new_p + "experts.down_proj", {e_count, h, inter}),
                            GateUpLayout::kConcatenated, &b.upload);
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
    t.staged_on_host = true;
    targets_.add(std::move(t));
  }
  for (int64_t e = 0; e < e_count; ++e) {
    const std::string ep = old_p + "experts." + std::to_string(e) + ".";
    const int base = 2 + 3 * static_cast<int>(e);
    const auto add = [&](int k, int64_t in, int64_t out) {
      add_target(ep + names_2d[k], moe_h, base + k, in, out, TargetKind::kLinear, Tensor(),
                 /*staged_on_host=*/true);
    };
    add(0, h, inter);
    add(1, h, inter);
    add(2, inter, h);
  }
}

void Decoder::allocate_kv_cache(int64_t num_blocks) {
  LORAPLEX_CHECK(num_blocks >= 1, "KV cache: ", num_blocks, " blocks, expected >= 1");
  // Captured graphs hold the old cache's addresses.
  graphs_.clear();
  kv_.reset();
  kv_ = std::make_unique<KvCache>(local_, num_blocks, options_.kv_block_size, options_.dtype,
                                  options_.device);
  options_.kv_blocks = num_blocks;
}

int64_t Decoder::kv_block_bytes() const {
  return 2 * local_.num_layers * options_.kv_block_size * local_.num_kv_heads * local_.head_dim *
         static_cast<int64_t>(dtype_size(options_.dtype));
}

void Decoder::allocate_step_buffers() {
  // This rank's widths (heads, MLP columns); hidden size and vocabulary are whole.
  const ModelConfig& c = local_;
  const DType dt = options_.dtype;
  const Device dev = options_.device;
  const int64_t t = options_.max_num_tokens;
  const int64_t s = options_.max_num_seqs;
  act_.x = Tensor::empty({t, c.hidden_size}, dt, dev);
  act_.h = Tensor::empty({t, c.hidden_size}, dt, dev);
  act_.qkv = Tensor::empty({t, c.q_size() + 2 * c.kv_size()}, dt, dev);
  act_.attn = Tensor::empty({t, c.q_size()}, dt, dev);
  act_.delta = Tensor::empty({t, c.hidden_size}, dt, dev);
  if (!c.is_moe()) {
    act_.gate_up = Tensor::empty({t, 2 * c.intermediate_size}, dt, dev);
    act_.act = Tensor::empty({t, c.intermediate_size}, dt, dev);
  }
  act_.rows = Tensor::empty({s, c.hidden_size}, dt, dev);
  act_.logits = Tensor::empty({s, c.vocab_size}, dt, dev);
  act_.ids = Tensor::empty({s}, DType::kI32, dev);
  const LoraDecode path = options_.lora_decode;
  // The fused path needs A in the layers' weight storage: not with fully sharded LoRA, nor in
  // FP8 models (LoraLinear::can_fuse), whose decode steps take the overlap or kernels path.
  bool can_fuse = true;
  for (const Layer& l : layers_) {
    can_fuse = can_fuse && l.qkv->can_fuse() && l.o->can_fuse() &&
               (!l.gate_up || (l.gate_up->can_fuse() && l.down->can_fuse()));
  }
  const Layer& l0 = layers_.front();
  if ((path == LoraDecode::kFused || path == LoraDecode::kAuto) && !options_.fully_sharded_loras &&
      options_.fused_lora_max_tokens > 0 && can_fuse) {
    const int64_t f = std::min(t, options_.fused_lora_max_tokens);
    const int m = options_.max_loras;
    fused_.qkv = Tensor::empty({f * l0.qkv->fused_row_width(m)}, dt, dev);
    fused_.delta = Tensor::empty({f * l0.o->fused_row_width(m)}, dt, dev);
    if (l0.gate_up) fused_.gate_up = Tensor::empty({f * l0.gate_up->fused_row_width(m)}, dt, dev);
  }
  // The LoRA-overlap path runs on one device: a sharded layer's collective needs its LoRA
  // output added before it.
  if (dev.is_cuda() && !c.is_moe() && tp_size_ == 1 &&
      (path == LoraDecode::kOverlap || path == LoraDecode::kAuto)) {
    const int64_t o = std::min(t, kOverlapTokens);
    deltas_.qkv = Tensor::zeros({o, c.q_size() + 2 * c.kv_size()}, dt, dev);
    deltas_.o = Tensor::zeros({o, c.hidden_size}, dt, dev);
    deltas_.gate_up = Tensor::zeros({o, 2 * c.intermediate_size}, dt, dev);
    deltas_.down = Tensor::zeros({o, c.hidden_size}, dt, dev);
    lora_stream_ = Stream::create(dev);
    fork_ = std::make_unique<Event>();
    join_ = std::make_unique<Event>();
  }
  // Section sizes in bytes, each 16-byte aligned.
  const int64_t sizes[kSections] = {4 * t, 4 * t, 4 * t, 4 * t, 4 * s,
                                    4 * s, 4 * s, 4 * s, 4 * s, 4 * s * kMaxBannedTokens,
                                    8 * s};
  int64_t total = 0;
  for (int i = 0; i < kSections; ++i) {
    in_.offset[i] = total;
    total += (sizes[i] + 15) / 16 * 16;
  }
  Allocator& host = dev.is_cpu() ? cpu_allocator() : pinned_host_allocator();
  for (int i = 0; i < kMaxLaunchedSteps; ++i) {
    // On the CPU a step has run when launch returns: one buffer serves every slot, and it is
    // the device buffer too.
    in_.host[i] = dev.is_cpu() && i > 0
                      ? in_.host[0]
                      : Tensor::empty_with({total}, DType::kU8, Device::cpu(), host);
    host_out_[i] = Tensor::empty_with({2, s}, DType::kI32, Device::cpu(), host);
    if (dev.is_cuda()) downloaded_[i] = std::make_unique<Event>();
  }
  in_.device = dev.is_cpu() ? in_.host[0] : Tensor::empty({total}, DType::kU8, dev);
  act_.logprobs = Tensor::empty({s}, DType::kF32, dev);
  sample_workspace_ = Tensor::empty(
      {static_cast<int64_t>(ops::sample_workspace_bytes(s, c.vocab_size)) + 1}, DType::kU8, dev);
  const int64_t max_pages =
      s * ((options_.max_model_len + options_.kv_block_size - 1) / options_.kv_block_size);
  attention_ = std::make_unique<PagedAttention>(
      AttentionShape{c.num_heads, c.num_kv_heads, c.head_dim, options_.kv_block_size, dt}, dev, t,
      s, max_pages);
}

void Decoder::Inputs::upload(Section s, size_t bytes, const Stream& stream) const {
  if (bytes == 0 || stream.device().is_cpu()) return;
  cuda_rt::memcpy_async(device_at<uint8_t>(s), host_at<uint8_t>(s), bytes,
                        cuda_rt::CopyKind::kHostToDevice, stream.handle());
}

Decoder::Staged Decoder::stage(const StepBatch& batch, int64_t padded, bool graph, bool fed) {
  const int64_t bs = kv_->block_size();
  int32_t* ids = in_.host_at<int32_t>(kTokenIds);
  int32_t* pos = in_.host_at<int32_t>(kPositions);
  int32_t* slots = in_.host_at<int32_t>(kKvSlots);
  int32_t* feed = in_.host_at<int32_t>(kFeedRows);
  int32_t* sample_rows = in_.host_at<int32_t>(kSampleRows);
  float* temperature = in_.host_at<float>(kTemperature);
  float* top_p = in_.host_at<float>(kTopP);
  float* min_p = in_.host_at<float>(kMinP);
  int32_t* top_k = in_.host_at<int32_t>(kTopK);
  int32_t* banned = in_.host_at<int32_t>(kBanned);
  double* uniform = in_.host_at<double>(kUniform);
  std::vector<int32_t> token_slots;
  std::vector<int32_t> sample_slots;
  token_slots.reserve(static_cast<size_t>(padded));
  AttentionStep att;
  att.qo_indptr.push_back(0);
  att.page_indptr.push_back(0);
  int64_t t = 0;
  auto sampled_row = [&](int64_t row, int32_t lora, const SamplingParams& p, double u,
                         const std::vector<int32_t>& ban) {
    const size_t r = sample_slots.size();
    sample_rows[r] = static_cast<int32_t>(row);
    temperature[r] = p.temperature;
    top_p[r] = p.top_p;
    min_p[r] = p.min_p;
    top_k[r] = p.top_k;
    uniform[r] = u;
    for (size_t k = 0; k < static_cast<size_t>(kMaxBannedTokens); ++k) {
      banned[r * kMaxBannedTokens + k] = k < ban.size() ? ban[k] : -1;
    }
    sample_slots.push_back(lora);
  };
  for (const SequenceStep& q : batch.seqs) {
    for (size_t k = 0; k < q.tokens.size(); ++k, ++t) {
      const int32_t p = q.start_position + static_cast<int32_t>(k);
      // A fed token's host value is a placeholder; a valid id stands in until the feed.
      const bool fed = q.feed_row >= 0 && k + 1 == q.tokens.size();
      ids[t] = fed ? 0 : q.tokens[k];
      feed[t] = fed ? q.feed_row : -1;
      pos[t] = p;
      slots[t] = static_cast<int32_t>(q.blocks[static_cast<size_t>(p / bs)] * bs + p % bs);
      token_slots.push_back(q.lora_slot);
    }
    const int64_t kv_len = q.start_position + static_cast<int64_t>(q.tokens.size());
    att.qo_indptr.push_back(static_cast<int32_t>(t));
    att.kv_len.push_back(static_cast<int32_t>(kv_len));
    const int64_t pages = (kv_len + bs - 1) / bs;
    att.page_indices.insert(att.page_indices.end(), q.blocks.begin(), q.blocks.begin() + pages);
    att.page_indptr.push_back(static_cast<int32_t>(att.page_indices.size()));
    if (q.sample) sampled_row(t - 1, q.lora_slot, q.sampling, q.uniform, q.banned);
  }
  // Padding: each extra token is a sequence of its own at position 0 on the pad block, not
  // stored in the cache, without LoRA, and sampled greedily (its id is ignored).
  for (; t < padded; ++t) {
    ids[t] = 0;
    pos[t] = 0;
    slots[t] = -1;
    feed[t] = -1;
    token_slots.push_back(-1);
    att.qo_indptr.push_back(static_cast<int32_t>(t + 1));
    att.kv_len.push_back(1);
    att.page_indices.push_back(kv_->pad_block());
    att.page_indptr.push_back(static_cast<int32_t>(att.page_indices.size()));
    sampled_row(t, -1, SamplingParams{}, 0.0, {});
  }
  const size_t rows = sample_slots.size();
  for (Section s : {kTokenIds, kPositions, kKvSlots}) {
    in_.upload(s, static_cast<size_t>(t) * 4, stream_);
  }
  if (fed) in_.upload(kFeedRows, static_cast<size_t>(t) * 4, stream_);
  for (Section s : {kSampleRows, kTemperature, kTopP, kMinP, kTopK})
    in_.upload(s, rows * 4, stream_);
  in_.upload(kBanned, rows * 4 * kMaxBannedTokens, stream_);
  in_.upload(kUniform, rows * 8, stream_);
  attention_->plan(att, stream_, graph ? padded : 0);
  Staged staged;
  std::tie(staged.token_lora, staged.sampler_lora) =
      punica_->upload_mappings(token_slots, sample_slots, stream_);
  for (int32_t slot : token_slots) staged.max_slot = std::max(staged.max_slot, slot);
  return staged;
}

int Decoder::fused_lora_slots(int64_t tokens, const Staged& staged) const {
  // Qwen3's q/k norm comes between the projection and RoPE, which adds the fused q/k LoRA.
  if (!staged.token_lora || !fused_.qkv.defined() || tokens > options_.fused_lora_max_tokens ||
      config_.qk_norm) {
    return 0;
  }
  if (options_.lora_decode == LoraDecode::kAuto && deltas_.qkv.defined() &&
      tokens <= kAutoOverlapTokens) {
    return 0;
  }
  // 1, 2, 4, 8, then multiples of 8: at most 7 slots' rows computed for nothing.
  const int used = staged.max_slot + 1;
  int slots = 1;
  while (slots < used && slots < 8) slots *= 2;
  if (used > 8) slots = (used + 7) / 8 * 8;
  return std::min(slots, options_.max_loras);
}

void Decoder::project(LoraLinear& layer, const Tensor& in, Tensor& out, Tensor* delta) {
  if (delta == nullptr) {
    layer.forward(in, out, *punica_, stream_);
    return;
  }
  fork_->record(stream_);
  fork_->wait_on(lora_stream_);
  // `delta` is zero here: the op that added the last LoRA output to its base output cleared it.
  layer.add_lora_to(in, *delta, *punica_, lora_stream_);
  join_->record(lora_stream_);
  layer.forward_base(in, out, stream_);
  join_->wait_on(stream_);
}

void Decoder::run_device(int64_t n, int64_t num_sampled, bool token_lora, bool sampler_lora,
                         int fused_slots, Sampling sampling) {
  const ModelConfig& c = local_;
  const DType dt = options_.dtype;
  const Stream& st = stream_;
  punica_->build_metadata(static_cast<int>(n), static_cast<int>(num_sampled), token_lora,
                          sampler_lora, st);
  const PunicaWrapper& pw = *punica_;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Tensor x = rows_of(act_.x, n);
  Tensor h = rows_of(act_.h, n);
  Tensor qkv = rows_of(act_.qkv, n);
  Tensor attn = rows_of(act_.attn, n);
  Tensor delta = rows_of(act_.delta, n);
  const int32_t* positions = in_.device_at<int32_t>(kPositions);
  const bool fused = fused_slots > 0;
  const bool overlap = !fused && token_lora && deltas_.qkv.defined() && n <= deltas_.qkv.size(0);
  Tensor d_qkv, d_o, d_gu, d_down;
  if (overlap) {
    d_qkv = rows_of(deltas_.qkv, n);
    d_o = rows_of(deltas_.o, n);
    d_gu = rows_of(deltas_.gate_up, n);
    d_down = rows_of(deltas_.down, n);
  }
  auto ptr = [&](const Tensor& t) -> void* { return overlap ? t.data_ptr() : nullptr; };
  if (overlap) {
    // The consumers clear what they read, except the final norm's gather (d_down's other rows)
    // and a step that failed half-way: start every step from zeros.
    for (Tensor* d : {&d_qkv, &d_o, &d_gu, &d_down}) d->zero_(st);
  }
  // A projection's output as the op after it reads it: its rows, and in the fused path the
  // expand that op applies.
  struct Projected {
    void* data = nullptr;
    int64_t row_stride = 0;
    ops::FusedLoraExpand lora;
  };
  auto run_projection = [&](LoraLinear& layer, const Tensor& in, Tensor& out, Tensor* d,
                            const Tensor& fused_out) {
    Projected p;
    if (fused) {
      p.row_stride = layer.fused_row_width(fused_slots);
      Tensor y = fused_out.narrow(0, 0, n * p.row_stride).view({n, p.row_stride});
      p.lora = layer.forward_fused(in, y, pw, fused_slots, st);
      p.data = y.data_ptr();
      return p;
    }
    project(layer, in, out, d);
    p.data = out.data_ptr();
    p.row_stride = out.size(1);
    return p;
  };
  embed_->forward(
      Tensor::from_blob(in_.device_at<int32_t>(kTokenIds), {n}, DType::kI32, options_.device), x,
      pw, st);
  Projected mlp_out;  // the previous layer's MLP output, which the residual takes next
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    const ops::KvCacheView cache = kv_->view(static_cast<int64_t>(l));
    // The residual takes the previous layer's MLP output as this layer normalises it.
    ops::AddRmsNormArgs in_norm{dt,
                                n,
                                c.hidden_size,
                                eps,
                                nullptr,
                                x.data_ptr(),
                                mlp_out.data,
                                mlp_out.data ? x.data_ptr() : nullptr,
                                layer.input_norm.data_ptr(),
                                h.data_ptr()};
    in_norm.delta_row_stride = mlp_out.row_stride;
    in_norm.lora = mlp_out.lora;
    in_norm.delta2 = l == 0 ? nullptr : ptr(d_down);
    in_norm.clear_delta2 = overlap;
    throw_if_error(ops::run(&ops::cpu::add_rms_norm, &ops::cuda::add_rms_norm, in_norm, st));
    const Projected qkv_out =
        run_projection(*layer.qkv, h, qkv, overlap ? &d_qkv : nullptr, fused_.qkv);
    if (c.qk_norm) {
      // Qwen3: q and k normalised per head after the projection, its LoRA included, and
      // before RoPE (so the fused path, whose q/k LoRA RoPE adds, is off for these models). It
      // adds and clears the q and k part of the LoRA delta; v's stays for RoPE.
      ops::QkRmsNormArgs qk;
      qk.dtype = dt;
      qk.num_tokens = n;
      qk.num_heads = c.num_heads;
      qk.num_kv_heads = c.num_kv_heads;
      qk.head_dim = c.head_dim;
      qk.eps = eps;
      qk.qkv = qkv_out.data;
      qk.qkv_row_stride = qkv_out.row_stride;
      qk.q_weight = layer.q_norm.data_ptr();
      qk.k_weight = layer.k_norm.data_ptr();
      qk.delta = ptr(d_qkv);
      qk.clear_delta = overlap;
      throw_if_error(ops::run(&ops::cpu::qk_rms_norm, &ops::cuda::qk_rms_norm, qk, st));
    }
    ops::RopeKvWriteArgs rope;
    rope.dtype = dt;
    rope.num_tokens = n;
    rope.num_heads = c.num_heads;
    rope.positions = positions;
    rope.inv_freq = inv_freq_.data<float>();
    rope.qkv = qkv_out.data;
    rope.qkv_row_stride = qkv_out.row_stride;
    rope.slot_mapping = in_.device_at<int32_t>(kKvSlots);
    rope.cache = cache;
    rope.delta = ptr(d_qkv);
    rope.clear_delta = overlap;
    rope.lora = qkv_out.lora;
    throw_if_error(ops::run(&ops::cpu::rope_kv_write, &ops::cuda::rope_kv_write, rope, st));
    attention_->run(qkv_out.data, qkv_out.row_stride, cache, attn.data_ptr(), st);
    const Projected o_out =
        run_projection(*layer.o, attn, delta, overlap ? &d_o : nullptr, fused_.delta);
    ops::AddRmsNormArgs post{dt,
                             n,
                             c.hidden_size,
                             eps,
                             nullptr,
                             x.data_ptr(),
                             o_out.data,
                             x.data_ptr(),
                             layer.post_norm.data_ptr(),
                             h.data_ptr()};
    post.delta_row_stride = o_out.row_stride;
    post.lora = o_out.lora;
    post.delta2 = ptr(d_o);
    post.clear_delta2 = overlap;
    throw_if_error(ops::run(&ops::cpu::add_rms_norm, &ops::cuda::add_rms_norm, post, st));
    if (layer.moe) {
      layer.moe->forward(h, delta, pw, st);
      mlp_out = Projected{delta.data_ptr(), c.hidden_size, {}};
    } else {
      Tensor gu = rows_of(act_.gate_up, n);
      Tensor act = rows_of(act_.act, n);
      const Projected gu_out =
          run_projection(*layer.gate_up, h, gu, overlap ? &d_gu : nullptr, fused_.gate_up);
      ops::SiluMulArgs sm{dt, n, c.intermediate_size, gu_out.data, act.data_ptr()};
      sm.x_row_stride = gu_out.row_stride;
      sm.lora = gu_out.lora;
      sm.delta = ptr(d_gu);
      sm.clear_delta = overlap;
      throw_if_error(ops::run(&ops::cpu::silu_mul, &ops::cuda::silu_mul, sm, st));
      mlp_out = run_projection(*layer.down, act, delta, overlap ? &d_down : nullptr, fused_.delta);
    }
  }
  // Only the sampled rows need the last residual add, the final norm and the lm_head.
  Tensor rows = rows_of(act_.rows, num_sampled);
  Tensor logits = rows_of(act_.logits, num_sampled);
  ops::AddRmsNormArgs final_norm{dt,
                                 num_sampled,
                                 c.hidden_size,
                                 eps,
                                 in_.device_at<int32_t>(kSampleRows),
                                 x.data_ptr(),
                                 mlp_out.data,
                                 nullptr,
                                 final_norm_.data_ptr(),
                                 rows.data_ptr()};
  final_norm.delta_row_stride = mlp_out.row_stride;
  final_norm.lora = mlp_out.lora;
  final_norm.delta2 = ptr(d_down);
  throw_if_error(ops::run(&ops::cpu::add_rms_norm, &ops::cuda::add_rms_norm, final_norm, st));
  lm_head_->forward(rows, logits, pw, st);
  // Both no-ops unless the step asks for them; top logprobs are the raw logits'.
  top_[in_.slot].compute(logits.data_ptr(), dt, num_sampled, c.vocab_size, st);
  adjust_.apply(logits.data_ptr(), dt, c.vocab_size, st);
  ops::SampleArgs sa;
  sa.dtype = dt;
  sa.num_rows = num_sampled;
  sa.vocab = c.vocab_size;
  sa.logits = logits.data_ptr();
  sa.row_stride = c.vocab_size;
  sa.temperature = in_.device_at<float>(kTemperature);
  sa.top_k = in_.device_at<int32_t>(kTopK);
  sa.top_p = in_.device_at<float>(kTopP);
  sa.min_p = in_.device_at<float>(kMinP);
  sa.uniform = in_.device_at<double>(kUniform);
  sa.banned = in_.device_at<int32_t>(kBanned);
  sa.ids = act_.ids.data<int32_t>();
  sa.logprobs = sampling == Sampling::kSampleLogprobs ? act_.logprobs.data<float>() : nullptr;
  sa.workspace = sample_workspace_.data_ptr();
  sa.workspace_bytes = static_cast<size_t>(sample_workspace_.numel());
  throw_if_error(ops::run(&ops::cpu::sample, &ops::cuda::sample, sa, st));
}

void Decoder::replay(int64_t bucket, bool token_lora, bool sampler_lora, int fused_slots,
                     Sampling sampling) {
  const GraphKey key{bucket, token_lora, sampler_lora, fused_slots, sampling};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    // The first run of a bucket is eager, so that everything a step sets up lazily (cuBLASLt
    // plans, workspaces, kernel attributes) exists before capture; the capture then records
    // the same launches.
    run_device(bucket, bucket, token_lora, sampler_lora, fused_slots, sampling);
    auto graph = std::make_shared<Graph>();
    cuda_rt::begin_capture(stream_.handle());
    try {
      run_device(bucket, bucket, token_lora, sampler_lora, fused_slots, sampling);
    } catch (...) {
      try {
        cuda_rt::end_capture(stream_.handle());
      } catch (...) {  // the original error is the one to report
      }
      throw;
    }
    graph->exec = cuda_rt::end_capture(stream_.handle());
    it = graphs_.emplace(key, std::move(graph)).first;
  }
  cuda_rt::graph_launch(it->second->exec, stream_.handle());
}

Decoder::BatchSummary Decoder::summarize(const StepBatch& batch, int64_t feedable) const {
  const int64_t num_seqs = static_cast<int64_t>(batch.seqs.size());
  LORAPLEX_CHECK(num_seqs >= 1 && num_seqs <= options_.max_num_seqs, "step batch has ", num_seqs,
                 " sequences, expected 1..max_num_seqs ", options_.max_num_seqs);
  const int64_t bs = kv_->block_size();
  int64_t n = 0;
  int64_t num_sampled = 0;
  bool pure_decode = true;
  bool fed = false;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const SequenceStep& q = batch.seqs[static_cast<size_t>(i)];
    const int64_t end = q.start_position + static_cast<int64_t>(q.tokens.size());
    LORAPLEX_CHECK(!q.tokens.empty() && q.start_position >= 0, "step batch: sequence ", i, " has ",
                   q.tokens.size(), " tokens at position ", q.start_position);
    LORAPLEX_CHECK(end <= options_.max_model_len, "step batch: sequence ", i, " reaches position ",
                   end - 1, ", beyond max_model_len ", options_.max_model_len);
    LORAPLEX_CHECK(static_cast<int64_t>(q.blocks.size()) * bs >= end, "step batch: sequence ", i,
                   " reaches position ", end - 1, " but its ", q.blocks.size(), " blocks hold ",
                   static_cast<int64_t>(q.blocks.size()) * bs, " positions");
    for (int32_t b : q.blocks) {
      LORAPLEX_CHECK(b >= 0 && b < kv_->num_blocks(), "step batch: sequence ", i, " has block ", b,
                     ", expected 0..", kv_->num_blocks() - 1);
    }
    LORAPLEX_CHECK(feedable > q.feed_row, "step batch: sequence ", i, " takes its token from row ",
                   q.feed_row, " of the previous step, which sampled ", feedable, " rows");
    fed = fed || q.feed_row >= 0;
    // A fed token's host value is a placeholder.
    const size_t known = q.tokens.size() - (q.feed_row >= 0 ? 1 : 0);
    for (size_t k = 0; k < known; ++k) {
      const int32_t id = q.tokens[k];
      LORAPLEX_CHECK(id >= 0 && id < config_.vocab_size, "step batch: sequence ", i,
                     " has token id ", id, ", expected 0..", config_.vocab_size - 1);
    }
    LORAPLEX_CHECK(q.lora_slot >= -1 && q.lora_slot < options_.max_loras, "step batch: sequence ",
                   i, " has LoRA slot ", q.lora_slot, ", expected -1..", options_.max_loras - 1);
    if (q.sample) {
      check_sampling_params(q.sampling);
      LORAPLEX_CHECK(q.banned.size() <= static_cast<size_t>(kMaxBannedTokens),
                     "step batch: sequence ", i, " bans ", q.banned.size(), " tokens, at most ",
                     kMaxBannedTokens);
      LORAPLEX_CHECK(q.uniform >= 0.0 && q.uniform < 1.0, "step batch: sequence ", i,
                     " has uniform draw ", q.uniform, ", expected [0, 1)");
      ++num_sampled;
    }
    n += static_cast<int64_t>(q.tokens.size());
    pure_decode = pure_decode && q.tokens.size() == 1 && q.sample;
  }
  LORAPLEX_CHECK(n <= options_.max_num_tokens, "step batch has ", n,
                 " tokens, more than max_num_tokens ", options_.max_num_tokens);
  return {n, num_sampled, pure_decode, fed};
}

void Decoder::check(const StepBatch& batch) const { summarize(batch, feedable_rows_); }

void Decoder::launch(const StepBatch& batch) {
  LORAPLEX_CHECK(launched_.size() < static_cast<size_t>(kMaxLaunchedSteps),
                 "Decoder::launch: ", launched_.size(),
                 " steps launched and not collected; collect() first");
  const int64_t feedable = feedable_rows_;
  const auto [n, num_sampled, pure_decode, fed] = summarize(batch, feedable);
  const int64_t bucket =
      decode_graph_bucket(n, std::min(options_.max_num_seqs, options_.max_num_tokens));
  const int slot = next_slot_;
  in_.slot = slot;
  // Logits adjustments and top logprobs vary from step to step: such a step runs eagerly.
  const bool adjusting = adjust_.stage(batch, local_.vocab_size);
  top_[slot].stage(batch);
  // The batch passed its checks; from here on a launch that fails may have overwritten the
  // ids, and leaves none for the next step to take.
  feedable_rows_ = 0;
  // MoE layers synchronise with the host when they route a step's pairs there.
  bool moe_ok = true;
  for (const Layer& l : layers_) moe_ok = moe_ok && (!l.moe || l.moe->routes_on_device(bucket));
  const bool graph = options_.cuda_graphs && options_.device.is_cuda() && moe_ok && pure_decode &&
                     bucket > 0 && !adjusting && top_[slot].k() == 0;
  const Sampling sampling = batch.want_logprobs ? Sampling::kSampleLogprobs : Sampling::kSample;
  const int64_t padded = graph ? bucket : n;
  const Staged staged = stage(batch, padded, graph, fed);
  if (fed) feed_tokens(padded, feedable);
  const int fused_slots = fused_lora_slots(padded, staged);
  const int64_t rows = graph ? padded : num_sampled;
  if (graph) {
    replay(bucket, staged.token_lora, staged.sampler_lora, fused_slots, sampling);
  } else {
    run_device(n, rows, staged.token_lora, staged.sampler_lora, fused_slots, sampling);
  }
  last_step_ = {n, padded, graph};
  download(slot, num_sampled, batch.want_logprobs);
  launched_.push_back({slot, num_sampled, batch.want_logprobs});
  next_slot_ = (slot + 1) % kMaxLaunchedSteps;
  feedable_rows_ = num_sampled;
}

void Decoder::feed_tokens(int64_t num_tokens, int64_t feedable) {
  ops::FeedTokensArgs a;
  a.num_tokens = num_tokens;
  a.num_sampled = feedable;
  a.rows = in_.device_at<int32_t>(kFeedRows);
  a.sampled = act_.ids.data<int32_t>();
  a.tokens = in_.device_at<int32_t>(kTokenIds);
  throw_if_error(ops::run(&ops::cpu::feed_tokens, &ops::cuda::feed_tokens, a, stream_));
}

void Decoder::download(int slot, int64_t num_sampled, bool logprobs) {
  const Tensor& out = host_out_[slot];
  int32_t* ids = out.data<int32_t>();
  float* host_lp = reinterpret_cast<float*>(ids + out.size(1));
  const size_t bytes = static_cast<size_t>(num_sampled) * 4;
  if (options_.device.is_cpu()) {
    // The next step's sampler writes act_ before this one is collected.
    if (bytes > 0) std::memcpy(ids, act_.ids.data_ptr(), bytes);
    if (logprobs && bytes > 0) std::memcpy(host_lp, act_.logprobs.data_ptr(), bytes);
  } else if (bytes > 0) {
    const auto d2h = cuda_rt::CopyKind::kDeviceToHost;
    cuda_rt::memcpy_async(ids, act_.ids.data_ptr(), bytes, d2h, stream_.handle());
    if (logprobs) {
      cuda_rt::memcpy_async(host_lp, act_.logprobs.data_ptr(), bytes, d2h, stream_.handle());
    }
  }
  top_[slot].download(stream_);
  if (downloaded_[slot] != nullptr) downloaded_[slot]->record(stream_);
}

StepResult Decoder::collect() {
  LORAPLEX_CHECK(!launched_.empty(), "Decoder::collect: no step launched");
  const Launched step = launched_.front();
  launched_.pop_front();
  if (downloaded_[step.slot] != nullptr) downloaded_[step.slot]->synchronize();
  StepResult r;
  const Tensor& out = host_out_[step.slot];
  const int32_t* ids = out.data<int32_t>();
  r.token_ids.assign(ids, ids + step.sampled);
  if (step.logprobs) {
    const float* lp = reinterpret_cast<const float*>(ids + out.size(1));
    r.logprobs.assign(lp, lp + step.sampled);
  }
  top_[step.slot].finish(r);
  return r;
}

}  // namespace loraplex::model
