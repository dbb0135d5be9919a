#include "loraplex/model/lora_modules.h"

#include <algorithm>
#include <vector>

#include "loraplex/core/error.h"
#include "loraplex/core/parallel.h"
#include "loraplex/model/model_ops.h"
#include "loraplex/punica/op_dispatch.h"

namespace loraplex::model {
namespace {

constexpr int64_t kColumnBlock = 256;

void check_float_cpu(const Tensor& t, const char* what) {
  LORAPLEX_CHECK(t.defined() && t.device().is_cpu() && is_floating(t.dtype()) && !is_fp8(t.dtype()),
                 what, ": expected a float32/float16/bfloat16 CPU tensor, got ",
                 t.defined() ? t.describe() : std::string("undefined"));
}

// Copies `src` [rows, cols] (any float dtype) into the top-left corner of `dst` [>= rows,
// >= cols] (contiguous, CPU), converting to dst's dtype.
void copy_corner(Tensor dst, const Tensor& src) {
  dst.narrow(0, 0, src.size(0)).narrow(1, 0, src.size(1)).copy_from(src.contiguous());
}

// Uploads host slab `host` (a view of one slot) into the same place of `device` stack.
void upload_slot(const Tensor& host, Tensor& device, int slot, const Stream& stream) {
  if (device.device().is_cpu()) return;  // the host mirror is the stack itself
  Tensor dst = device.narrow(0, slot, 1);
  dst.copy_from(host.narrow(0, slot, 1), stream);
}

// LoRA weights [max_loras, rows, cols]: a zeroed host tensor and, on a GPU, a device copy.
std::pair<Tensor, Tensor> make_stack(const Shape& shape, const LoraShape& s) {
  Tensor host = Tensor::zeros(shape, s.dtype);
  Tensor device = s.device.is_cpu() ? host : host.to(s.device);
  return {host, device};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
BaseLinear::BaseLinear(const Tensor& weight, const Tensor& bias, DType dtype, Device device)
    : in_(weight.size(1)), out_(weight.size(0)), dtype_(dtype), device_(device) {
  check_float_cpu(weight, "linear weight");
  LORAPLEX_CHECK(weight.dim() == 2, "linear weight must be [out, in], got ", weight.describe());
  if (device.is_cpu()) {
    weight_ = weight.to(DType::kF32).transpose(0, 1).contiguous();
  } else {
    weight_ = weight.to(dtype).contiguous().to(device);
  }
  if (bias.defined()) {
    check_float_cpu(bias, "linear bias");
    LORAPLEX_CHECK(bias.dim() == 1 && bias.size(0) == out_, "linear bias must be [", out_,
                   "], got ", bias.describe());
    bias_ = bias.to(dtype).contiguous().to(device);
  }
}

void BaseLinear::forward(Tensor& y, const Tensor& x, const Stream& stream) const {
  LORAPLEX_CHECK(x.dim() == 2 && x.size(1) == in_ && x.is_contiguous() && x.dtype() == dtype_ &&
                     x.device() == device_,
                 "linear: x must be contiguous ", dtype_, " [tokens, ", in_, "] on ", device_,
                 ", got ", x.describe());
  LORAPLEX_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == out_ && y.is_contiguous() &&
                     y.dtype() == dtype_ && y.device() == device_,
                 "linear: y must be contiguous ", dtype_, " [", x.size(0), ", ", out_, "], got ",
                 y.describe());
  const int64_t tokens = x.size(0);
  if (tokens == 0) return;
  if (!device_.is_cpu()) {
    ops::LinearArgs a;
    a.dtype = dtype_;
    a.num_tokens = tokens;
    a.in = in_;
    a.out = out_;
    a.x = x.data_ptr();
    a.w = weight_.data_ptr();
    a.y = y.data_ptr();
    throw_if_error(ops::cuda::linear(a, stream));
    if (bias_.defined()) {
      ops::BiasArgs b{dtype_, tokens, out_, bias_.data_ptr(), y.data_ptr(), out_};
      throw_if_error(ops::cuda::bias_add(b, stream));
    }
    return;
  }
  const float* w = weight_.data<float>();
  const int64_t blocks = (out_ + kColumnBlock - 1) / kColumnBlock;
  dispatch_activation_dtype(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x.data_ptr());
    T* ys = static_cast<T*>(y.data_ptr());
    const T* bias = bias_.defined() ? static_cast<const T*>(bias_.data_ptr()) : nullptr;
    // Work items are (token, column block); each output is a sequential sum over the inputs,
    // written as an axpy over a column block so the inner loop vectorises.
    parallel_for(0, tokens * blocks, 4, [&](int64_t lo, int64_t hi) {
      float acc[kColumnBlock];
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t t = item / blocks;
        const int64_t c0 = (item % blocks) * kColumnBlock;
        const int64_t width = std::min(kColumnBlock, out_ - c0);
        std::fill(acc, acc + width, 0.0f);
        const T* xr = xs + t * in_;
        for (int64_t i = 0; i < in_; ++i) {
          const float xv = load_float(xr[i]);
          const float* wr = w + i * out_ + c0;
          for (int64_t j = 0; j < width; ++j) acc[j] += xv * wr[j];
        }
        T* yr = ys + t * out_ + c0;
        for (int64_t j = 0; j < width; ++j) {
          yr[j] = store_float<T>(bias != nullptr ? acc[j] + load_float(bias[c0 + j]) : acc[j]);
        }
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
LoraLinear::LoraLinear(const Tensor& weight, const Tensor& bias, std::vector<int64_t> widths,
                       const LoraShape& shape)
    : base_(weight, bias, shape.dtype, shape.device),
      widths_(std::move(widths)),
      shape_(shape),
      ranks_(static_cast<int>(widths_.size()), shape.max_loras, shape.max_rank, shape.device) {
  int64_t total = 0;
  for (int64_t w : widths_) total += w;
  LORAPLEX_CHECK(total == base_.out_features(), "LoraLinear: slices sum to ", total,
                 " outputs, the weight has ", base_.out_features());
  for (int64_t w : widths_) {
    a_.push_back(Tensor::zeros({shape.max_loras, shape.max_rank, base_.in_features()}, shape.dtype,
                               shape.device));
    b_.push_back(Tensor::zeros({shape.max_loras, w, shape.max_rank}, shape.dtype, shape.device));
  }
}

Tensor LoraLinear::forward(const Tensor& x, const StepContext& ctx) const {
  Tensor y = Tensor::empty({x.size(0), base_.out_features()}, shape_.dtype, shape_.device);
  base_.forward(y, x, ctx.stream);
  if (!ctx.punica->token_meta().no_lora()) {
    ctx.punica->add_lora_linear(y, x, a_, b_, ranks_, 1.0f, *ctx.workspace, ctx.stream);
  }
  return y;
}

void LoraLinear::set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "set_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  LORAPLEX_CHECK(slices.size() == widths_.size(), "set_lora: ", slices.size(),
                 " slices, the layer has ", widths_.size());
  for (size_t s = 0; s < slices.size(); ++s) {
    const LoraSliceWeights& w = slices[s];
    if (!w.a.defined() && !w.b.defined()) continue;
    check_float_cpu(w.a, "LoRA A");
    check_float_cpu(w.b, "LoRA B");
    const int64_t r = w.a.size(0);
    LORAPLEX_CHECK(w.a.dim() == 2 && w.a.size(1) == base_.in_features(), "LoRA A of slice ", s,
                   " is ", w.a.describe(), ", expected [rank, ", base_.in_features(), "]");
    LORAPLEX_CHECK(w.b.dim() == 2 && w.b.size(0) == widths_[s] && w.b.size(1) == r,
                   "LoRA B of slice ", s, " is ", w.b.describe(), ", expected [", widths_[s], ", ",
                   r, "]");
    LORAPLEX_CHECK(r >= 1 && r <= shape_.max_rank, "LoRA rank ", r, " of slice ", s,
                   " exceeds max_lora_rank ", shape_.max_rank);
  }
  for (size_t s = 0; s < slices.size(); ++s) {
    const LoraSliceWeights& w = slices[s];
    const int si = static_cast<int>(s);
    Tensor a_host = Tensor::zeros({1, shape_.max_rank, base_.in_features()}, shape_.dtype);
    Tensor b_host = Tensor::zeros({1, widths_[s], shape_.max_rank}, shape_.dtype);
    int32_t rank = 0;
    if (w.a.defined()) {
      rank = static_cast<int32_t>(w.a.size(0));
      copy_corner(a_host.select(0, 0), w.a);
      copy_corner(b_host.select(0, 0), w.b);
    }
    a_[s].narrow(0, slot, 1).copy_from(a_host, Stream());
    b_[s].narrow(0, slot, 1).copy_from(b_host, Stream());
    ranks_.set(si, slot, rank, Stream());
  }
}

void LoraLinear::reset_lora(int slot) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "reset_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  ranks_.set_slot(slot, 0, Stream());
}

// ---------------------------------------------------------------------------------------------
LoraEmbedding::LoraEmbedding(const Tensor& table, const LoraShape& shape)
    : shape_(shape), ranks_(1, shape.max_loras, shape.max_rank, shape.device) {
  check_float_cpu(table, "embedding table");
  LORAPLEX_CHECK(table.dim() == 2, "embedding table must be [vocab, hidden], got ",
                 table.describe());
  table_ = table.to(shape.dtype).contiguous().to(shape.device);
  a_ = Tensor::zeros({shape.max_loras, table.size(0), shape.max_rank}, shape.dtype, shape.device);
  b_ = Tensor::zeros({shape.max_loras, table.size(1), shape.max_rank}, shape.dtype, shape.device);
}

Tensor LoraEmbedding::forward(const Tensor& ids, const StepContext& ctx) const {
  const int64_t n = ids.size(0);
  Tensor y = Tensor::empty({n, table_.size(1)}, shape_.dtype, shape_.device);
  ops::EmbeddingArgs a;
  a.dtype = shape_.dtype;
  a.num_tokens = n;
  a.hidden = table_.size(1);
  a.vocab = table_.size(0);
  a.ids = ids.data<int32_t>();
  a.table = table_.data_ptr();
  a.out = y.data_ptr();
  throw_if_error(ops::run(&ops::cpu::embedding, &ops::cuda::embedding, a, ctx.stream));
  if (!ctx.punica->token_meta().no_lora()) {
    ctx.punica->add_lora_embedding(y, ids, a_, b_, ranks_, 1.0f, ctx.stream);
  }
  return y;
}

void LoraEmbedding::set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "set_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  LORAPLEX_CHECK(slices.size() == 1, "embedding set_lora: ", slices.size(), " slices, expected 1");
  const LoraSliceWeights& w = slices[0];
  const int64_t vocab = table_.size(0);
  const int64_t hidden = table_.size(1);
  Tensor a_host = Tensor::zeros({1, vocab, shape_.max_rank}, shape_.dtype);
  Tensor b_host = Tensor::zeros({1, hidden, shape_.max_rank}, shape_.dtype);
  int32_t rank = 0;
  if (w.a.defined()) {
    check_float_cpu(w.a, "embedding LoRA A");
    check_float_cpu(w.b, "embedding LoRA B");
    rank = static_cast<int32_t>(w.a.size(0));
    LORAPLEX_CHECK(w.a.dim() == 2 && w.a.size(1) == vocab, "embedding LoRA A is ", w.a.describe(),
                   ", expected [rank, ", vocab, "]");
    LORAPLEX_CHECK(w.b.dim() == 2 && w.b.size(0) == hidden && w.b.size(1) == rank,
                   "embedding LoRA B is ", w.b.describe(), ", expected [", hidden, ", ", rank, "]");
    LORAPLEX_CHECK(rank >= 1 && rank <= shape_.max_rank, "embedding LoRA rank ", rank,
                   " exceeds max_lora_rank ", shape_.max_rank);
    copy_corner(a_host.select(0, 0), w.a.transpose(0, 1));
    copy_corner(b_host.select(0, 0), w.b);
  }
  a_.narrow(0, slot, 1).copy_from(a_host, Stream());
  b_.narrow(0, slot, 1).copy_from(b_host, Stream());
  ranks_.set(0, slot, rank, Stream());
}

void LoraEmbedding::reset_lora(int slot) { ranks_.set_slot(slot, 0, Stream()); }

// ---------------------------------------------------------------------------------------------
LoraLogits::LoraLogits(const Tensor& weight, const LoraShape& shape)
    : base_(weight, Tensor(), shape.dtype, shape.device),
      shape_(shape),
      ranks_(1, shape.max_loras, shape.max_rank, shape.device) {
  a_ = Tensor::zeros({shape.max_loras, shape.max_rank, base_.in_features()}, shape.dtype,
                     shape.device);
  b_ = Tensor::zeros({shape.max_loras, base_.out_features(), shape.max_rank}, shape.dtype,
                     shape.device);
}

Tensor LoraLogits::forward(const Tensor& h, const StepContext& ctx) const {
  Tensor y = Tensor::empty({h.size(0), base_.out_features()}, shape_.dtype, shape_.device);
  base_.forward(y, h, ctx.stream);
  if (!ctx.punica->sampler_meta().no_lora()) {
    ctx.punica->add_lora_logits(y, h, a_, b_, ranks_, 1.0f, *ctx.workspace, ctx.stream);
  }
  return y;
}

void LoraLogits::set_lora(int slot, const std::vector<LoraSliceWeights>& slices) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "set_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  LORAPLEX_CHECK(slices.size() == 1, "lm_head set_lora: ", slices.size(), " slices, expected 1");
  const LoraSliceWeights& w = slices[0];
  Tensor a_host = Tensor::zeros({1, shape_.max_rank, base_.in_features()}, shape_.dtype);
  Tensor b_host = Tensor::zeros({1, base_.out_features(), shape_.max_rank}, shape_.dtype);
  int32_t rank = 0;
  if (w.a.defined()) {
    check_float_cpu(w.a, "lm_head LoRA A");
    check_float_cpu(w.b, "lm_head LoRA B");
    rank = static_cast<int32_t>(w.a.size(0));
    LORAPLEX_CHECK(w.a.dim() == 2 && w.a.size(1) == base_.in_features(), "lm_head LoRA A is ",
                   w.a.describe(), ", expected [rank, ", base_.in_features(), "]");
    LORAPLEX_CHECK(w.b.dim() == 2 && w.b.size(0) == base_.out_features() && w.b.size(1) == rank,
                   "lm_head LoRA B is ", w.b.describe(), ", expected [", base_.out_features(), ", ",
                   rank, "]");
    LORAPLEX_CHECK(rank >= 1 && rank <= shape_.max_rank, "lm_head LoRA rank ", rank,
                   " exceeds max_lora_rank ", shape_.max_rank);
    copy_corner(a_host.select(0, 0), w.a);
    copy_corner(b_host.select(0, 0), w.b);
  }
  a_.narrow(0, slot, 1).copy_from(a_host, Stream());
  b_.narrow(0, slot, 1).copy_from(b_host, Stream());
  ranks_.set(0, slot, rank, Stream());
}

void LoraLogits::reset_lora(int slot) { ranks_.set_slot(slot, 0, Stream()); }

// ---------------------------------------------------------------------------------------------
LoraMoe::LoraMoe(const std::vector<Tensor>& w1, const std::vector<Tensor>& w3,
                 const std::vector<Tensor>& w2, int top_k, const LoraShape& shape)
    : num_experts_(static_cast<int>(w1.size())),
      top_k_(top_k),
      hidden_(w1.at(0).size(1)),
      inter_(w1.at(0).size(0)),
      shape_(shape),
      ranks13_(2, shape.max_loras, shape.max_rank, shape.device),
      ranks2_(1, shape.max_loras, shape.max_rank, shape.device) {
  LORAPLEX_CHECK(w3.size() == w1.size() && w2.size() == w1.size(), "LoraMoe: ", w1.size(), " w1, ",
                 w3.size(), " w3 and ", w2.size(), " w2 experts");
  const int64_t e_count = num_experts_;
  Tensor w13 = Tensor::empty({e_count, 2 * inter_, hidden_}, shape.dtype);
  Tensor w2s = Tensor::empty({e_count, hidden_, inter_}, shape.dtype);
  for (int64_t e = 0; e < e_count; ++e) {
    const size_t i = static_cast<size_t>(e);
    for (const Tensor* t : {&w1[i], &w3[i]}) {
      check_float_cpu(*t, "expert w1/w3");
      LORAPLEX_CHECK(t->shape() == (Shape{inter_, hidden_}), "expert ", e, " w1/w3 is ",
                     t->describe(), ", expected [", inter_, ", ", hidden_, "]");
    }
    check_float_cpu(w2[i], "expert w2");
    LORAPLEX_CHECK(w2[i].shape() == (Shape{hidden_, inter_}), "expert ", e, " w2 is ",
                   w2[i].describe(), ", expected [", hidden_, ", ", inter_, "]");
    w13.select(0, e).narrow(0, 0, inter_).copy_from(w1[i]);
    w13.select(0, e).narrow(0, inter_, inter_).copy_from(w3[i]);
    w2s.select(0, e).copy_from(w2[i]);
  }
  w13_ = w13.to(shape.device);
  w2_ = w2s.to(shape.device);
  const int64_t r = shape.max_rank;
  const int64_t ml = shape.max_loras;
  const Shape a_shapes[3] = {
      {ml, e_count, r, hidden_}, {ml, e_count, r, hidden_}, {ml, e_count, r, inter_}};
  const Shape b_shapes[3] = {
      {ml, e_count, inter_, r}, {ml, e_count, inter_, r}, {ml, e_count, hidden_, r}};
  for (int k = 0; k < 3; ++k) {
    std::tie(a_host_[k], a_[k]) = make_stack(a_shapes[k], shape);
    std::tie(b_host_[k], b_[k]) = make_stack(b_shapes[k], shape);
  }
  enabled_host_.assign(static_cast<size_t>(shape.max_loras), 0);
  enabled_ = Tensor::from_vector(enabled_host_, {shape.max_loras}).to(shape.device);
}

void LoraMoe::write_expert(int slot, int which, int expert, const Tensor& a, const Tensor& b) {
  const int64_t in = which == 2 ? inter_ : hidden_;
  const int64_t out = which == 2 ? hidden_ : inter_;
  check_float_cpu(a, "expert LoRA A");
  check_float_cpu(b, "expert LoRA B");
  const int64_t r = a.size(0);
  LORAPLEX_CHECK(a.dim() == 2 && a.size(1) == in, "expert ", expert, " LoRA A is ", a.describe(),
                 ", expected [rank, ", in, "]");
  LORAPLEX_CHECK(b.dim() == 2 && b.size(0) == out && b.size(1) == r, "expert ", expert,
                 " LoRA B is ", b.describe(), ", expected [", out, ", ", r, "]");
  LORAPLEX_CHECK(r >= 1 && r <= shape_.max_rank, "expert LoRA rank ", r, " exceeds max_lora_rank ",
                 shape_.max_rank);
  copy_corner(a_host_[which].select(0, slot).select(0, expert), a);
  copy_corner(b_host_[which].select(0, slot).select(0, expert), b);
  SlotRanks& ranks = which == 2 ? ranks2_ : ranks13_;
  const int slice = which == 2 ? 0 : which;
  ranks.set(slice, slot, std::max(ranks.get(slice, slot), static_cast<int32_t>(r)), Stream());
}

void LoraMoe::upload(int slot, int which) {
  upload_slot(a_host_[which], a_[which], slot, Stream());
  upload_slot(b_host_[which], b_[which], slot, Stream());
  if (enabled_host_[static_cast<size_t>(slot)] == 0) {
    enabled_host_[static_cast<size_t>(slot)] = 1;
    enabled_.copy_from(Tensor::from_vector(enabled_host_, {shape_.max_loras}), Stream());
  }
}

void LoraMoe::set_lora_3d(int slot, int param, const Tensor& a, const Tensor& b) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "set_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  LORAPLEX_CHECK(param == 0 || param == 1, "set_lora_3d: param ", param,
                 ", expected 0 (gate_up_proj) or 1 (down_proj)");
  check_float_cpu(a, "3-D expert LoRA A");
  check_float_cpu(b, "3-D expert LoRA B");
  const int64_t e_count = num_experts_;
  const int64_t in = param == 0 ? hidden_ : inter_;
  const int64_t out = param == 0 ? 2 * inter_ : hidden_;
  LORAPLEX_CHECK(a.dim() == 2 && a.size(0) % e_count == 0 && a.size(1) == in,
                 "3-D expert LoRA A is ", a.describe(), ", expected [rank * ", e_count, ", ", in,
                 "]");
  const int64_t r = a.size(0) / e_count;
  LORAPLEX_CHECK(b.dim() == 2 && b.size(0) == out && b.size(1) == r * e_count,
                 "3-D expert LoRA B is ", b.describe(), ", expected [", out, ", ", r * e_count,
                 "]");
  LORAPLEX_CHECK(r >= 1 && r <= shape_.max_rank, "expert LoRA rank ", r, " exceeds max_lora_rank ",
                 shape_.max_rank);
  // PEFT: A.reshape(E, r, in) (expert-major rows); B.reshape(out, r, E) (column j * E + e).
  const Tensor a3 = a.contiguous().view({e_count, r, in});
  const Tensor b3 = b.contiguous().view({out, r, e_count});
  for (int64_t e = 0; e < e_count; ++e) {
    const Tensor a_e = a3.select(0, e);
    const Tensor b_e = b3.select(2, e);  // [out, r]
    if (param == 0) {
      write_expert(slot, 0, static_cast<int>(e), a_e, b_e.narrow(0, 0, inter_));
      write_expert(slot, 1, static_cast<int>(e), a_e, b_e.narrow(0, inter_, inter_));
    } else {
      write_expert(slot, 2, static_cast<int>(e), a_e, b_e);
    }
  }
  if (param == 0) {
    upload(slot, 0);
    upload(slot, 1);
  } else {
    upload(slot, 2);
  }
}

void LoraMoe::set_lora_expert(int slot, int expert, int which, const Tensor& a, const Tensor& b) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "set_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  LORAPLEX_CHECK(expert >= 0 && expert < num_experts_, "expert ", expert, ", expected 0..",
                 num_experts_ - 1);
  LORAPLEX_CHECK(which >= 0 && which <= 2, "expert projection ", which,
                 ", expected 0 (w1), 1 (w3) or 2 (w2)");
  write_expert(slot, which, expert, a, b);
  upload(slot, which);
}

void LoraMoe::reset_lora(int slot) {
  LORAPLEX_CHECK(slot >= 0 && slot < shape_.max_loras, "reset_lora: slot ", slot, ", expected 0..",
                 shape_.max_loras - 1);
  for (int k = 0; k < 3; ++k) {
    a_host_[k].select(0, slot).zero_();
    b_host_[k].select(0, slot).zero_();
    upload_slot(a_host_[k], a_[k], slot, Stream());
    upload_slot(b_host_[k], b_[k], slot, Stream());
  }
  ranks13_.set_slot(slot, 0, Stream());
  ranks2_.set_slot(slot, 0, Stream());
  enabled_host_[static_cast<size_t>(slot)] = 0;
  enabled_.copy_from(Tensor::from_vector(enabled_host_, {shape_.max_loras}), Stream());
}

Tensor LoraMoe::forward(const Tensor& h, const Tensor& router_logits,
                        const StepContext& ctx) const {
  const int64_t n = h.size(0);
  const Device dev = shape_.device;
  const DType dt = shape_.dtype;
  Tensor topk_ids = Tensor::empty({n, top_k_}, DType::kI32, dev);
  Tensor topk_w = Tensor::empty({n, top_k_}, DType::kF32, dev);
  ops::MoeRouteArgs route{dt,
                          n,
                          num_experts_,
                          top_k_,
                          router_logits.data_ptr(),
                          topk_ids.data<int32_t>(),
                          topk_w.data<float>()};
  throw_if_error(ops::run(&ops::cpu::moe_route, &ops::cuda::moe_route, route, ctx.stream));

  const int64_t pairs = n * top_k_;
  Tensor g13 = Tensor::empty({pairs, 2 * inter_}, dt, dev);
  ops::MoeExpertLinearArgs up;
  up.dtype = dt;
  up.num_tokens = n;
  up.top_k = top_k_;
  up.num_experts = num_experts_;
  up.in = hidden_;
  up.out_features = 2 * inter_;
  up.x = h.data_ptr();
  up.topk_ids = topk_ids.data<int32_t>();
  up.w = w13_.data_ptr();
  up.out = g13.data_ptr();
  throw_if_error(
      ops::run(&ops::cpu::moe_expert_linear, &ops::cuda::moe_expert_linear, up, ctx.stream));

  const bool lora = !ctx.punica->token_meta().no_lora();
  const int32_t* mapping = ctx.punica->token_meta().mapping_buffer().data<int32_t>();
  auto lora_args = [&](int num_slices, const Tensor* a, const Tensor* b, const SlotRanks& ranks,
                       const Tensor& x, bool rows_are_pairs, int64_t in, int64_t width,
                       Tensor& out) {
    kernels::FusedMoeLoraArgs f;
    f.dtype = dt;
    f.num_tokens = n;
    f.top_k = top_k_;
    f.num_experts = num_experts_;
    f.hidden_in = in;
    f.x = x.data_ptr();
    f.x_rows_are_pairs = rows_are_pairs;
    f.num_slices = num_slices;
    for (int s = 0; s < num_slices; ++s) {
      f.lora_a[s] = a[s].data_ptr();
      f.lora_b[s] = b[s].data_ptr();
    }
    f.n = width;
    f.max_loras = shape_.max_loras;
    f.max_rank = shape_.max_rank;
    f.ranks = ranks.device().data<int32_t>();
    f.token_lora_mapping = mapping;
    f.adapter_enabled = enabled_.data<int32_t>();
    f.topk_ids = topk_ids.data<int32_t>();
    f.topk_weights = topk_w.data<float>();
    f.naive_blocks = true;
    f.out = out.data_ptr();
    f.out_row_width = num_slices * width;
    f.add_inputs = true;
    throw_if_error(dispatch_fused_moe_lora(f, ctx.stream));
  };
  if (lora) lora_args(2, a_, b_, ranks13_, h, false, hidden_, inter_, g13);

  Tensor act = Tensor::empty({pairs, inter_}, dt, dev);
  ops::SiluMulArgs sm{dt, pairs, inter_, g13.data_ptr(), act.data_ptr()};
  throw_if_error(ops::run(&ops::cpu::silu_mul, &ops::cuda::silu_mul, sm, ctx.stream));

  Tensor down = Tensor::empty({pairs, hidden_}, dt, dev);
  ops::MoeExpertLinearArgs dn = up;
  dn.in = inter_;
  dn.out_features = hidden_;
  dn.x = act.data_ptr();
  dn.x_rows_are_pairs = true;
  dn.w = w2_.data_ptr();
  dn.out = down.data_ptr();
  throw_if_error(
      ops::run(&ops::cpu::moe_expert_linear, &ops::cuda::moe_expert_linear, dn, ctx.stream));
  if (lora) lora_args(1, &a_[2], &b_[2], ranks2_, act, true, inter_, hidden_, down);

  Tensor out = Tensor::empty({n, hidden_}, dt, dev);
  ops::MoeCombineArgs comb;
  comb.dtype = dt;
  comb.num_tokens = n;
  comb.top_k = top_k_;
  comb.hidden = hidden_;
  comb.x = down.data_ptr();
  comb.topk_ids = topk_ids.data<int32_t>();
  comb.topk_weights = topk_w.data<float>();
  comb.out = out.data_ptr();
  throw_if_error(ops::run(&ops::cpu::moe_combine, &ops::cuda::moe_combine, comb, ctx.stream));
  return out;
}

}  // namespace loraplex::model
