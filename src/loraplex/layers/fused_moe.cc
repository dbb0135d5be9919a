#include "loraplex/layers/fused_moe.h"

#include <algorithm>
#include <optional>

#include "loraplex/core/allocator.h"
#include "loraplex/core/error.h"
#include "loraplex/kernels/layer_ops.h"
#include "loraplex/layers/embedding_moe_ops.h"
#include "loraplex/layers/layer_util.h"
#include "loraplex/layers/linear_base.h"
#include "loraplex/punica/lora_dispatch.h"

namespace loraplex {

using layers_detail::ceil_div;

namespace {

constexpr int kAlignBlock = 16;
constexpr const char* kName = "FusedMoeWithLora";

bool is_float_cpu_2d(const Tensor& t) {
  return t.defined() && t.device().is_cpu() && is_floating(t.dtype()) && t.dim() == 2;
}

// A base weight: any float on the CPU, or already on a device (WeightUpload checks which).
void check_2d(const Tensor& t, int64_t rows, int64_t cols, const std::string& what) {
  LORAPLEX_CHECK(t.defined() && is_floating(t.dtype()) && t.dim() == 2 && t.size(0) == rows &&
                     t.size(1) == cols,
                 kName, ": ", what, " must be a CPU float [", rows, ", ", cols, "], got ",
                 t.defined() ? t.describe() : "undefined");
}

// Rows of an even/odd interleaved [2n, cols] matrix as an [n, cols] view.
Tensor interleaved_rows(const Tensor& t, int parity) {
  const Tensor c = t.contiguous();
  return c.view({c.size(0) / 2, 2, c.size(1)}).select(1, parity);
}

// A [L, E, rows, cols] 0/1 tensor with ones at (r, col_offset + r) for r < min(rows, cols).
Tensor selector(int max_loras, int experts, int64_t rows, int64_t cols, int64_t col_offset,
                DType dtype, Device device) {
  Tensor host = Tensor::zeros({max_loras, experts, rows, cols}, DType::kF32);
  float* p = host.data<float>();
  for (int64_t le = 0; le < static_cast<int64_t>(max_loras) * experts; ++le) {
    for (int64_t r = 0; r < rows && col_offset + r < cols; ++r) {
      p[(le * rows + r) * cols + col_offset + r] = 1.0f;
    }
  }
  return host.to(dtype).to(device);
}

}  // namespace

std::vector<LoraSliceWeights> peft_3d_expert_lora(const Tensor& a, const Tensor& b,
                                                  int num_experts) {
  LORAPLEX_CHECK(num_experts >= 1, "peft_3d_expert_lora: num_experts ", num_experts,
                 ", expected >= 1");
  LORAPLEX_CHECK(is_float_cpu_2d(a) && is_float_cpu_2d(b),
                 "peft_3d_expert_lora: needs CPU float 2-D A [r * experts, in] and B [out, r * "
                 "experts], got A ",
                 a.defined() ? a.describe() : "undefined", ", B ",
                 b.defined() ? b.describe() : "undefined");
  LORAPLEX_CHECK(a.size(0) % num_experts == 0 && a.size(0) > 0, "peft_3d_expert_lora: A has ",
                 a.size(0), " rows, not a positive multiple of ", num_experts, " experts");
  const int64_t r = a.size(0) / num_experts;
  LORAPLEX_CHECK(b.size(1) == a.size(0), "peft_3d_expert_lora: B has ", b.size(1),
                 " columns, expected r * experts = ", a.size(0));
  // B's columns are rank-major (j * E + e): view them as [out, r, E] and take expert e.
  const Tensor b3 = b.contiguous().view({b.size(0), r, num_experts});
  std::vector<LoraSliceWeights> out;
  for (int e = 0; e < num_experts; ++e) out.push_back({a.narrow(0, e * r, r), b3.select(2, e)});
  return out;
}

void split_gate_up_lora(const std::vector<LoraSliceWeights>& gate_up, int64_t intermediate,
                        GateUpLayout layout, std::vector<LoraSliceWeights>& w1,
                        std::vector<LoraSliceWeights>& w3) {
  w1.clear();
  w3.clear();
  for (size_t e = 0; e < gate_up.size(); ++e) {
    const LoraSliceWeights& g = gate_up[e];
    if (!g.b.defined()) {
      w1.push_back(g);
      w3.push_back(g);
      continue;
    }
    LORAPLEX_CHECK(g.b.dim() == 2 && g.b.size(0) == 2 * intermediate, "split_gate_up_lora: expert ",
                   e, " has gate_up LoRA-B ", g.b.describe(),
                   ", expected [2 * intermediate = ", 2 * intermediate, ", rank]");
    if (layout == GateUpLayout::kConcatenated) {
      w1.push_back({g.a, g.b.narrow(0, 0, intermediate)});
      w3.push_back({g.a, g.b.narrow(0, intermediate, intermediate)});
    } else {
      w1.push_back({g.a, interleaved_rows(g.b, 0)});
      w3.push_back({g.a, interleaved_rows(g.b, 1)});
    }
  }
}

FusedMoeWithLora::FusedMoeWithLora(const MoeSpec& spec, const LoraConfig& config,
                                   Communicator* comm, Device device, int max_num_tokens,
                                   std::shared_ptr<LayerWorkspace> workspace)
    : spec_(spec),
      config_(config),
      comm_(comm),
      device_(device),
      max_num_tokens_(max_num_tokens),
      workspace_(std::move(workspace)) {
  const DType dt = spec.dtype;
  LORAPLEX_CHECK(dt == DType::kF32 || dt == DType::kF16 || dt == DType::kBF16, kName, ": dtype ",
                 dt, ", expected float32, float16 or bfloat16");
  LORAPLEX_CHECK(config.lora_dtype == dt, kName, ": lora_dtype ", config.lora_dtype,
                 " must equal the activation dtype ", dt);
  LORAPLEX_CHECK(spec.num_experts >= 1 && spec.top_k >= 1 && spec.top_k <= spec.num_experts &&
                     spec.hidden >= 1 && spec.intermediate >= 1,
                 kName, ": ", spec.num_experts, " experts, top_k ", spec.top_k, ", hidden ",
                 spec.hidden, ", intermediate ", spec.intermediate,
                 " (expected top_k in [1, experts] and positive sizes)");
  LORAPLEX_CHECK(config.max_loras >= 1 && config.max_lora_rank >= 1 && max_num_tokens >= 1, kName,
                 ": max_loras ", config.max_loras, ", max_lora_rank ", config.max_lora_rank,
                 " and max_num_tokens ", max_num_tokens, " must be >= 1");
  tp_ = layers_detail::comm_size(comm);
  rank_ = layers_detail::comm_rank(comm);
  LORAPLEX_CHECK(spec.intermediate % tp_ == 0, kName, ": intermediate ", spec.intermediate,
                 " is not divisible by the tensor-parallel size ", tp_);
  if (config.fully_sharded) {
    LORAPLEX_CHECK(spec.hidden % tp_ == 0, kName, ": fully sharded LoRA splits w2's B by hidden ",
                   "rows, but hidden ", spec.hidden, " is not divisible by ", tp_);
  }
  inter_local_ = spec.intermediate / tp_;
  const int L = config.max_loras;
  const int E = spec.num_experts;
  const int64_t R = config.max_lora_rank;
  const int64_t H = spec.hidden;
  rank_shard_ = ceil_div(R, tp_);
  rank_pad_ = rank_shard_ * tp_;
  const bool fs = config.fully_sharded;
  for (int s = 0; s < 2; ++s) {
    w13_a_[s] = Tensor::zeros({L, E, fs ? rank_shard_ : R, H}, dt, device);
    w13_b_[s] = Tensor::zeros({L, E, inter_local_, fs ? rank_pad_ : R}, dt, device);
  }
  w2_a_ = Tensor::zeros({L, E, R, inter_local_}, dt, device);
  w2_b_ = Tensor::zeros({L, E, fs ? H / tp_ : H, R}, dt, device);
  ranks13_ = SlotRanks(2, L, static_cast<int>(fs ? rank_shard_ : R), device);
  ranks2_ = SlotRanks(1, L, static_cast<int>(R), device);
  if (fs) {
    ranks13_expand_ = SlotRanks(2, L, static_cast<int>(rank_pad_), device);
    select_shard_ = selector(L, E, rank_shard_, rank_shard_, 0, dt, device);
    for (int s = 0; s < 2; ++s) {
      select_pad_[s] = selector(L, E, rank_pad_, 2 * rank_pad_, s * rank_pad_, dt, device);
    }
    select_rank_ = selector(L, E, R, R, 0, dt, device);
  }
  adapter_enabled_ = Tensor::zeros({L}, DType::kI32, device);
  host_ranks_.assign(static_cast<size_t>(3 * L), 0);

  const int64_t P = static_cast<int64_t>(max_num_tokens) * spec.top_k;
  if (!device.is_cpu()) {
    host_ids_ = Tensor::empty_with({P}, DType::kI32, Device::cpu(), pinned_host_allocator());
    host_order_ = Tensor::empty_with({2, P}, DType::kI32, Device::cpu(), pinned_host_allocator());
  }
  const bool own_workspace = workspace_ == nullptr;
  if (own_workspace) workspace_ = std::make_shared<LayerWorkspace>(device);
  LORAPLEX_CHECK(workspace_->device() == device, kName, ": workspace on ", workspace_->device(),
                 ", the layer is on ", device);
  LayerWorkspace::Carver measure = LayerWorkspace::measure();
  carve(measure, max_num_tokens);
  workspace_->reserve(measure.used());
  if (own_workspace) workspace_->allocate();
}

FusedMoeWithLora::Scratch FusedMoeWithLora::carve(LayerWorkspace::Carver& carver,
                                                  int64_t tokens) const {
  const DType dt = spec_.dtype;
  const int64_t P = tokens * spec_.top_k;
  const int64_t H = spec_.hidden;
  const int L = config_.max_loras;
  Scratch s;
  s.logits = carver.take({tokens, spec_.num_experts}, dt);
  s.topk_ids = carver.take({P}, DType::kI32);
  s.topk_weights = carver.take({P}, DType::kF32);
  s.pair_index = carver.take({2, P}, DType::kI32);
  s.rows_h = carver.take({P, H}, dt);
  s.gate_up_sorted = carver.take({P, 2 * inter_local_}, dt);
  if (s.gate_up_sorted.defined()) {
    s.act_sorted =
        s.gate_up_sorted.view({-1}).narrow(0, 0, P * inter_local_).view({P, inter_local_});
  }
  s.gate_up = carver.take({P, 2 * inter_local_}, dt);
  s.act = carver.take({P, inter_local_}, dt);
  s.down = carver.take({P, H}, dt);
  const kernels::MoeAlignSizes sizes = kernels::moe_align_sizes(P, spec_.num_experts, kAlignBlock);
  s.align_padded = sizes.max_num_tokens_padded;
  s.align_blocks = sizes.max_num_m_blocks;
  s.sorted_ids = carver.take({L, s.align_padded}, DType::kI32);
  s.expert_ids = carver.take({L, s.align_blocks}, DType::kI32);
  s.num_post_pad = carver.take({L}, DType::kI32);
  const int mid_rank = static_cast<int>(std::max<int64_t>(config_.max_lora_rank, rank_pad_));
  s.lora_mid = carver.take({kernels::fused_moe_lora_mid_floats(P, 2, mid_rank)}, DType::kF32);
  const int64_t blocks = kernels::moe_expert_max_blocks(P, spec_.num_experts);
  s.block_expert = carver.take({blocks}, DType::kI32);
  s.block_pairs = carver.take({blocks * kernels::kMoeExpertBlockRows}, DType::kI32);
  if (config_.fully_sharded) {
    s.fs13 = carver.take({P * 2 * rank_shard_}, dt);
    s.fs13_gathered = carver.take({P * 2 * rank_pad_}, dt);
    s.fs2 = carver.take({P * config_.max_lora_rank}, dt);
  }
  return s;
}

int FusedMoeWithLora::lora_rank(int slot, int projection) const {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras && projection >= 0 && projection < 3, kName,
                 ": lora_rank(slot ", slot, ", projection ", projection, ") out of range");
  return host_ranks_[static_cast<size_t>(projection * config_.max_loras + slot)];
}

void FusedMoeWithLora::load_base(const Tensor& router, const std::vector<Tensor>& w1,
                                 const std::vector<Tensor>& w3, const std::vector<Tensor>& w2,
                                 WeightUpload* upload) {
  load_experts(router, w1, w3, w2, upload);
}

void FusedMoeWithLora::load_base_3d(const Tensor& router, const Tensor& gate_up, const Tensor& down,
                                    GateUpLayout layout, WeightUpload* upload) {
  const int E = spec_.num_experts;
  const int64_t I = spec_.intermediate;
  const int64_t H = spec_.hidden;
  LORAPLEX_CHECK(gate_up.defined() && gate_up.device().is_cpu() && gate_up.dim() == 3 &&
                     gate_up.shape() == (Shape{E, 2 * I, H}),
                 kName, ": gate_up must be a CPU [", E, ", ", 2 * I, ", ", H, "], got ",
                 gate_up.defined() ? gate_up.describe() : "undefined");
  LORAPLEX_CHECK(down.defined() && down.device().is_cpu() && down.dim() == 3 &&
                     down.shape() == (Shape{E, H, I}),
                 kName, ": down must be a CPU [", E, ", ", H, ", ", I, "], got ",
                 down.defined() ? down.describe() : "undefined");
  std::vector<Tensor> gate;
  std::vector<Tensor> up;
  std::vector<Tensor> dn;
  for (int e = 0; e < E; ++e) {
    const Tensor g = gate_up.select(0, e);
    if (layout == GateUpLayout::kConcatenated) {
      gate.push_back(g.narrow(0, 0, I));
      up.push_back(g.narrow(0, I, I));
    } else {
      gate.push_back(interleaved_rows(g, 0));
      up.push_back(interleaved_rows(g, 1));
    }
    dn.push_back(down.select(0, e));
  }
  load_experts(router, gate, up, dn, upload);
}

void FusedMoeWithLora::load_experts(const Tensor& router, const std::vector<Tensor>& gate,
                                    const std::vector<Tensor>& up, const std::vector<Tensor>& down,
                                    WeightUpload* upload) {
  const int E = spec_.num_experts;
  const int64_t I = spec_.intermediate;
  const int64_t H = spec_.hidden;
  check_2d(router, E, H, "router weight");
  LORAPLEX_CHECK(static_cast<int>(gate.size()) == E && static_cast<int>(up.size()) == E &&
                     static_cast<int>(down.size()) == E,
                 kName, ": load_base got ", gate.size(), " w1, ", up.size(), " w3 and ",
                 down.size(), " w2 weights, expected ", E, " each");
  for (int e = 0; e < E; ++e) {
    const std::string ex = "expert " + std::to_string(e);
    check_2d(gate[static_cast<size_t>(e)], I, H, ex + " w1 (gate)");
    check_2d(up[static_cast<size_t>(e)], I, H, ex + " w3 (up)");
    check_2d(down[static_cast<size_t>(e)], H, I, ex + " w2 (down)");
  }
  const DType dt = spec_.dtype;
  const int64_t off = rank_ * inter_local_;
  std::optional<WeightUpload> own;
  if (upload == nullptr) upload = &own.emplace(device_);
  router_ = Tensor::empty({E, H}, dt, device_);
  w13_ = Tensor::empty({E, 2 * inter_local_, H}, dt, device_);
  w2_ = Tensor::empty({E, H, inter_local_}, dt, device_);
  upload->copy(router_, router);
  for (int e = 0; e < E; ++e) {
    const auto i = static_cast<size_t>(e);
    upload->copy(w13_.select(0, e).narrow(0, 0, inter_local_),
                 gate[i].narrow(0, off, inter_local_));
    upload->copy(w13_.select(0, e).narrow(0, inter_local_, inter_local_),
                 up[i].narrow(0, off, inter_local_));
    upload->copy(w2_.select(0, e), down[i].narrow(1, off, inter_local_));
  }
  if (own) own->finish();
}

void FusedMoeWithLora::set_lora(int slot, const MoeLoraWeights& weights) {
  const Stream stream = Stream::default_for(device_);
  write_lora(slot, weights, stream);
  stream.synchronize();
}

void FusedMoeWithLora::set_lora(int slot, const MoeLoraWeights& weights,
                                const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, kName);
  write_lora(slot, weights, copy_stream);
}

void FusedMoeWithLora::write_lora(int slot, const MoeLoraWeights& weights, const Stream& stream) {
  const std::string where = std::string(kName) + " set_lora slot " + std::to_string(slot);
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, where, ": slot outside [0, max_loras ",
                 config_.max_loras, ")");
  const int E = spec_.num_experts;
  const int64_t I = spec_.intermediate;
  const int64_t H = spec_.hidden;
  const int R = config_.max_lora_rank;
  const DType dt = config_.lora_dtype;
  const bool fs = config_.fully_sharded;
  const std::vector<LoraSliceWeights>* lists[3] = {&weights.w1, &weights.w3, &weights.w2};
  const char* names[3] = {"w1 (gate)", "w3 (up)", "w2 (down)"};
  // Validate every expert of every projection before touching the slot.
  int max_rank[3] = {0, 0, 0};
  std::vector<int> ranks[3];
  for (int p = 0; p < 3; ++p) {
    const auto& list = *lists[p];
    LORAPLEX_CHECK(list.empty() || static_cast<int>(list.size()) == E, where, ": ", names[p],
                   " has ", list.size(), " experts, expected ", E, " (or none)");
    for (size_t e = 0; e < list.size(); ++e) {
      const int64_t in = p < 2 ? H : I;
      const int64_t out = p < 2 ? I : H;
      const int r = layers_detail::check_lora_pair(
          list[e], in, out, R, where + " " + names[p] + " expert " + std::to_string(e));
      ranks[p].push_back(r);
      max_rank[p] = std::max(max_rank[p], r);
    }
  }
  const int64_t off = rank_ * inter_local_;
  const int64_t b2_rows = w2_b_.size(2);
  const int64_t b2_start = fs ? rank_ * b2_rows : 0;
  // This rank's part of expert e's A and B of projection p, as views of the full weights.
  auto expert_a = [&](int p, int e) {
    const Tensor& a = (*lists[p])[static_cast<size_t>(e)].a;
    return p < 2 ? a : a.narrow(1, off, inter_local_);
  };
  auto expert_b = [&](int p, int e) {
    const Tensor& b = (*lists[p])[static_cast<size_t>(e)].b;
    return p < 2 ? b.narrow(0, off, inter_local_) : b.narrow(0, b2_start, b2_rows);
  };
  Tensor a_stacks[3] = {w13_a_[0], w13_a_[1], w2_a_};
  Tensor b_stacks[3] = {w13_b_[0], w13_b_[1], w2_b_};
  std::vector<layers_detail::PendingWrite> writes;
  int shrink[3] = {0, 0, max_rank[2]};
  int expand13[2] = {0, 0};
  for (int p = 0; p < 3; ++p) {
    if (max_rank[p] == 0) continue;
    const Tensor a_slot = a_stacks[p].select(0, slot);
    const Tensor b_slot = b_stacks[p].select(0, slot);
    const int c = static_cast<int>(ceil_div(max_rank[p], tp_));
    if (p < 2) {
      shrink[p] = fs ? c : max_rank[p];
      expand13[p] = c * tp_;
    }
    // Stage the slot's full stacks on the host (zero-padded per expert), then one upload per
    // stack: a copy per expert from pageable memory waits for the stream each time, and a
    // 128-expert model has tens of thousands of them per adapter.
    Tensor a_host = Tensor::zeros(a_slot.shape(), dt);
    Tensor b_host = Tensor::zeros(b_slot.shape(), dt);
    for (int e = 0; e < E; ++e) {
      const int r = ranks[p][static_cast<size_t>(e)];
      if (r == 0) continue;
      if (fs && p < 2) {
        const Tensor& a = (*lists[p])[static_cast<size_t>(e)].a;
        for (int j = 0; j < c; ++j) {
          const int k = j * tp_ + rank_;
          if (k >= r) continue;
          Tensor dst = a_host.select(0, e).select(0, j);
          dst.copy_from(a.select(0, k));
        }
      } else {
        Tensor dst = a_host.select(0, e).narrow(0, 0, r);
        dst.copy_from(expert_a(p, e));
      }
      Tensor bdst = b_host.select(0, e).narrow(1, 0, r);
      bdst.copy_from(expert_b(p, e));
    }
    writes.push_back({a_slot, a_host});
    writes.push_back({b_slot, b_host});
  }
  clear_lora(slot, stream);
  layers_detail::apply_writes(writes, stream);
  for (int s = 0; s < 2; ++s) {
    ranks13_.set(s, slot, shrink[s], stream);
    if (fs) ranks13_expand_.set(s, slot, expand13[s], stream);
  }
  ranks2_.set(0, slot, shrink[2], stream);
  for (int p = 0; p < 3; ++p) {
    host_ranks_[static_cast<size_t>(p * config_.max_loras + slot)] = max_rank[p];
  }
  const bool enabled = max_rank[0] + max_rank[1] + max_rank[2] > 0;
  Tensor flag = adapter_enabled_.narrow(0, slot, 1);
  layers_detail::write_int32(flag, enabled ? 1 : 0, stream);
}

void FusedMoeWithLora::reset_lora(int slot) {
  const Stream stream = Stream::default_for(device_);
  clear_lora(slot, stream);
  stream.synchronize();
}

void FusedMoeWithLora::reset_lora(int slot, const Stream& copy_stream) {
  layers_detail::check_copy_stream(copy_stream, device_, kName);
  clear_lora(slot, copy_stream);
}

void FusedMoeWithLora::clear_lora(int slot, const Stream& stream) {
  LORAPLEX_CHECK(slot >= 0 && slot < config_.max_loras, kName, ": reset_lora slot ", slot,
                 " outside [0, max_loras ", config_.max_loras, ")");
  Tensor flag = adapter_enabled_.narrow(0, slot, 1);
  layers_detail::write_int32(flag, 0, stream);
  for (int s = 0; s < 2; ++s) {
    ranks13_.set(s, slot, 0, stream);
    if (config_.fully_sharded) ranks13_expand_.set(s, slot, 0, stream);
  }
  ranks2_.set(0, slot, 0, stream);
  for (int p = 0; p < 3; ++p) host_ranks_[static_cast<size_t>(p * config_.max_loras + slot)] = 0;
}

Tensor FusedMoeWithLora::forward(const Tensor& x, const PunicaWrapper& punica,
                                 const Stream& stream) {
  LORAPLEX_CHECK(x.defined() && x.dim() == 2 && x.size(0) <= max_num_tokens_, kName,
                 ": x must be [<= ", max_num_tokens_, ", ", spec_.hidden, "], got ",
                 x.defined() ? x.describe() : "undefined");
  if (!out_buffer_.defined()) {
    out_buffer_ = Tensor::empty({max_num_tokens_, spec_.hidden}, spec_.dtype, device_);
  }
  Tensor y = out_buffer_.narrow(0, 0, x.size(0));
  forward(x, y, punica, stream);
  return y;
}

void FusedMoeWithLora::route_on_host(int64_t tokens, const Stream& stream) {
  const int K = spec_.top_k;
  const int E = spec_.num_experts;
  const int64_t P = tokens * K;
  const int32_t* ids = s_.topk_ids.data<int32_t>();
  if (!device_.is_cpu()) {
    Tensor dst = host_ids_.narrow(0, 0, P);
    dst.copy_from(s_.topk_ids, stream);  // synchronises
    ids = host_ids_.data<int32_t>();
  }
  expert_offsets_.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t p = 0; p < P; ++p) ++expert_offsets_[static_cast<size_t>(ids[p] + 1)];
  for (int e = 0; e < E; ++e) {
    expert_offsets_[static_cast<size_t>(e + 1)] += expert_offsets_[static_cast<size_t>(e)];
  }
  std::vector<int64_t> next(expert_offsets_.begin(), expert_offsets_.end() - 1);
  // On the CPU the sorted order is written straight into the scratch; on a GPU into pinned
  // memory, then uploaded.
  Tensor staging = device_.is_cpu() ? s_.pair_index : host_order_.narrow(1, 0, P);
  int32_t* order = staging.data<int32_t>();
  int32_t* token = order + staging.stride(0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t pos = next[static_cast<size_t>(ids[p])]++;
    order[pos] = static_cast<int32_t>(p);
    token[pos] = static_cast<int32_t>(p / K);
  }
  if (!device_.is_cpu()) s_.pair_index.copy_from(staging, stream);
}

kernels::FusedMoeLoraArgs FusedMoeWithLora::lora_args(const PunicaWrapper& punica,
                                                      int64_t tokens) const {
  kernels::FusedMoeLoraArgs a;
  a.dtype = spec_.dtype;
  a.num_tokens = tokens;
  a.top_k = spec_.top_k;
  a.num_experts = spec_.num_experts;
  a.max_loras = config_.max_loras;
  a.token_lora_mapping = punica.token_meta().view().token_lora_mapping;
  a.adapter_enabled = adapter_enabled_.data<int32_t>();
  a.topk_ids = s_.topk_ids.data<int32_t>();
  a.topk_weights = s_.topk_weights.data<float>();
  a.naive_blocks = naive_blocks_;
  a.block_size = kAlignBlock;
  a.max_num_tokens_padded = s_.align_padded;
  a.max_num_m_blocks = s_.align_blocks;
  a.sorted_ids = s_.sorted_ids.data<int32_t>();
  a.expert_ids = s_.expert_ids.data<int32_t>();
  a.num_tokens_post_pad = s_.num_post_pad.data<int32_t>();
  a.lora_mid = s_.lora_mid.data<float>();
  a.add_inputs = true;
  return a;
}

void FusedMoeWithLora::add_w13_lora(const Tensor& x, Tensor& gate_up, const PunicaWrapper& punica,
                                    const Stream& stream) {
  const int64_t tokens = x.size(0);
  const int64_t P = tokens * spec_.top_k;
  kernels::FusedMoeLoraArgs a = lora_args(punica, tokens);
  a.num_slices = 2;
  a.n = inter_local_;
  a.out = gate_up.data_ptr();
  a.out_row_width = 2 * inter_local_;
  if (!config_.fully_sharded) {
    a.overlap_preceding_kernel = lora_follows_expert_gemm(tokens);
    a.hidden_in = spec_.hidden;
    a.x = x.data_ptr();
    for (int s = 0; s < 2; ++s) {
      a.lora_a[s] = w13_a_[s].data_ptr();
      a.lora_b[s] = w13_b_[s].data_ptr();
    }
    a.max_rank = config_.max_lora_rank;
    a.ranks = ranks13_.device().data<int32_t>();
    throw_if_error(dispatch_fused_moe_lora(a, stream));
    return;
  }
  // Shrink with this rank's A rows (B = identity), all-gather interleaved, expand with B.
  kernels::FusedMoeLoraArgs shrink = a;
  shrink.hidden_in = spec_.hidden;
  shrink.x = x.data_ptr();
  for (int s = 0; s < 2; ++s) {
    shrink.lora_a[s] = w13_a_[s].data_ptr();
    shrink.lora_b[s] = select_shard_.data_ptr();
  }
  shrink.n = rank_shard_;
  shrink.max_rank = static_cast<int>(rank_shard_);
  shrink.ranks = ranks13_.device().data<int32_t>();
  shrink.out = s_.fs13.data_ptr();
  shrink.out_row_width = 2 * rank_shard_;
  shrink.add_inputs = false;
  throw_if_error(dispatch_fused_moe_lora(shrink, stream));
  const int64_t cols = P * 2 * rank_shard_;
  Tensor gathered = s_.fs13_gathered.view({cols, tp_});
  comm().all_gather(s_.fs13.view({cols, 1}), gathered, 1, stream);
  kernels::FusedMoeLoraArgs expand = a;
  expand.hidden_in = 2 * rank_pad_;
  expand.x = gathered.data_ptr();
  expand.x_rows_are_pairs = true;
  for (int s = 0; s < 2; ++s) {
    expand.lora_a[s] = select_pad_[s].data_ptr();
    expand.lora_b[s] = w13_b_[s].data_ptr();
  }
  expand.max_rank = static_cast<int>(rank_pad_);
  expand.ranks = ranks13_expand_.device().data<int32_t>();
  throw_if_error(dispatch_fused_moe_lora(expand, stream));
}

void FusedMoeWithLora::add_w2_lora(const Tensor& act, Tensor& down, const PunicaWrapper& punica,
                                   const Stream& stream) {
  const int64_t P = act.size(0);
  const int64_t tokens = P / spec_.top_k;
  const int R = config_.max_lora_rank;
  kernels::FusedMoeLoraArgs a = lora_args(punica, tokens);
  a.num_slices = 1;
  a.x_rows_are_pairs = true;
  a.max_rank = R;
  a.ranks = ranks2_.device().data<int32_t>();
  a.out = down.data_ptr();
  a.out_row_width = spec_.hidden;
  if (!config_.fully_sharded) {
    a.overlap_preceding_kernel = lora_follows_expert_gemm(tokens);
    a.hidden_in = inter_local_;
    a.x = act.data_ptr();
    a.lora_a[0] = w2_a_.data_ptr();
    a.lora_b[0] = w2_b_.data_ptr();
    a.n = spec_.hidden;
    a.mul_routed_weight = true;
    throw_if_error(dispatch_fused_moe_lora(a, stream));
    return;
  }
  // Partial shrink over this rank's intermediate columns (B = identity), all-reduce, then
  // expand into this rank's hidden columns (A = identity), router weight applied once.
  Tensor partial = s_.fs2;
  partial.zero_(stream);
  kernels::FusedMoeLoraArgs shrink = a;
  shrink.hidden_in = inter_local_;
  shrink.x = act.data_ptr();
  shrink.lora_a[0] = w2_a_.data_ptr();
  shrink.lora_b[0] = select_rank_.data_ptr();
  shrink.n = R;
  shrink.out = partial.data_ptr();
  shrink.out_row_width = R;
  throw_if_error(dispatch_fused_moe_lora(shrink, stream));
  comm().all_reduce_sum(partial, stream);
  kernels::FusedMoeLoraArgs expand = a;
  expand.hidden_in = R;
  expand.x = partial.data_ptr();
  expand.lora_a[0] = select_rank_.data_ptr();
  expand.lora_b[0] = w2_b_.data_ptr();
  expand.n = w2_b_.size(2);
  expand.offset = rank_ * w2_b_.size(2);
  expand.mul_routed_weight = true;
  throw_if_error(dispatch_fused_moe_lora(expand, stream));
}

// On the device-routed path without alignment, the expert GEMM is the kernel just before each
// of the two LoRA calls, and it writes none of their shrinks' inputs.
bool FusedMoeWithLora::lora_follows_expert_gemm(int64_t tokens) const {
  return routes_on_device(tokens) && naive_blocks_;
}

bool FusedMoeWithLora::routes_on_device(int64_t tokens) const {
  if (routing_ == Routing::kHost || tokens * spec_.top_k > kDeviceRoutedMaxPairs) return false;
  return routing_ == Routing::kDevice || !device_.is_cpu();
}

// One GEMM per expert over its run of the expert-sorted rows (expert_offsets_).
void FusedMoeWithLora::experts_on_host(const Tensor& sorted_in, const Tensor& w, Tensor& sorted_out,
                                       const Stream& stream) {
  for (int e = 0; e < spec_.num_experts; ++e) {
    const int64_t lo = expert_offsets_[static_cast<size_t>(e)];
    const int64_t n = expert_offsets_[static_cast<size_t>(e + 1)] - lo;
    if (n == 0) continue;
    Tensor dst = sorted_out.narrow(0, lo, n);
    linear_base(sorted_in.narrow(0, lo, n), w.select(0, e), Tensor(), dst, stream);
  }
}

// Pairs grouped on the host: the x rows gathered by expert, one GEMM per expert, the gate_up
// rows scattered back into pair order.
void FusedMoeWithLora::gate_up_on_host(const Tensor& x, const Stream& stream) {
  route_on_host(x.size(0), stream);
  layer_ops::gather_rows(x, s_.pair_index.select(0, 1), s_.rows_h, stream);
  experts_on_host(s_.rows_h, w13_, s_.gate_up_sorted, stream);
  layer_ops::scatter_rows(s_.gate_up_sorted, s_.pair_index.select(0, 0), Tensor(), s_.gate_up,
                          stream);
}

// The same grouping for the down projection; the router weights are applied in the scatter.
// The gathered x rows are dead after the gate_up GEMMs: their rows hold the down outputs.
void FusedMoeWithLora::down_on_host(const Stream& stream) {
  const Tensor order = s_.pair_index.select(0, 0);
  layer_ops::gather_rows(s_.act, order, s_.act_sorted, stream);
  experts_on_host(s_.act_sorted, w2_, s_.rows_h, stream);
  layer_ops::scatter_rows(s_.rows_h, order, s_.topk_weights, s_.down, stream);
}

void FusedMoeWithLora::forward(const Tensor& x, Tensor& y, const PunicaWrapper& punica,
                               const Stream& stream) {
  LORAPLEX_CHECK(w13_.defined(), kName, ": forward before load_base");
  layers_detail::check_activation(x, device_, spec_.dtype, kName, "x");
  layers_detail::check_activation(y, device_, spec_.dtype, kName, "y");
  const int64_t tokens = x.size(0);
  LORAPLEX_CHECK(x.is_contiguous() && x.size(1) == spec_.hidden && tokens <= max_num_tokens_, kName,
                 ": x must be contiguous [<= ", max_num_tokens_, ", ", spec_.hidden, "], got ",
                 x.describe());
  LORAPLEX_CHECK(y.is_contiguous() && y.size(0) == tokens && y.size(1) == spec_.hidden, kName,
                 ": y must be contiguous [", tokens, ", ", spec_.hidden, "], got ", y.describe());
  LORAPLEX_CHECK(punica.device() == device_ && punica.max_loras() == config_.max_loras, kName,
                 ": the Punica wrapper is on ", punica.device(), " with max_loras ",
                 punica.max_loras(), "; the layer is on ", device_, " with max_loras ",
                 config_.max_loras);
  LORAPLEX_CHECK(punica.token_meta().num_tokens() == tokens, kName, ": x has ", tokens,
                 " tokens, the step's metadata has ", punica.token_meta().num_tokens());
  if (tokens == 0) return;
  const int K = spec_.top_k;
  LayerWorkspace::Carver carver = workspace_->carver();
  s_ = carve(carver, tokens);
  Tensor& logits = s_.logits;
  linear_base(x, router_, Tensor(), logits, stream);
  Tensor& ids = s_.topk_ids;
  Tensor& weights = s_.topk_weights;
  layer_ops::topk_softmax(logits, K, spec_.renormalize, ids, weights, stream);
  const bool on_device = routes_on_device(tokens);
  if (on_device) {
    layer_ops::moe_expert_blocks(ids, spec_.num_experts, s_.block_expert, s_.block_pairs, stream);
    layer_ops::moe_expert_gemm(x, false, K, w13_, s_.block_expert, s_.block_pairs, Tensor(),
                               s_.gate_up, stream);
  } else {
    gate_up_on_host(x, stream);
  }
  Tensor& gate_up = s_.gate_up;

  const bool lora = !punica.token_meta().no_lora();
  if (lora) {
    naive_blocks_ = kernels::moe_use_naive_blocks(tokens, K, spec_.num_experts, config_.max_loras);
    if (!naive_blocks_) {
      kernels::MoeAlignArgs al;
      al.num_tokens = tokens;
      al.top_k = K;
      al.num_experts = spec_.num_experts;
      al.block_size = kAlignBlock;
      al.max_loras = config_.max_loras;
      al.topk_ids = s_.topk_ids.data<int32_t>();
      al.token_lora_mapping = punica.token_meta().view().token_lora_mapping;
      al.adapter_enabled = adapter_enabled_.data<int32_t>();
      al.max_num_tokens_padded = s_.align_padded;
      al.max_num_m_blocks = s_.align_blocks;
      al.sorted_ids = s_.sorted_ids.data<int32_t>();
      al.expert_ids = s_.expert_ids.data<int32_t>();
      al.num_tokens_post_pad = s_.num_post_pad.data<int32_t>();
      throw_if_error(dispatch_moe_lora_align(al, stream));
    }
    add_w13_lora(x, gate_up, punica, stream);
  }

  Tensor& act = s_.act;
  layer_ops::silu_and_mul(gate_up, act, stream);
  if (on_device) {
    layer_ops::moe_expert_gemm(act, true, K, w2_, s_.block_expert, s_.block_pairs, weights, s_.down,
                               stream);
  } else {
    down_on_host(stream);
  }
  Tensor& down = s_.down;
  if (lora) add_w2_lora(act, down, punica, stream);
  layer_ops::sum_topk(down, K, y, stream);
  comm().all_reduce_sum(y, stream);
}

}  // namespace loraplex
