// loraplex._C.ops: the Punica ops on DLPack arrays, with the argument conventions of vLLM's
// Triton ops (lora_shrink, lora_expand, PunicaWrapperGPU.add_lora_linear and
// add_lora_fused_moe) and the batch metadata builder (vLLM's LoRAKernelMeta), over
// PunicaWrapper. Arrays are used in place (no copies); work runs on the caller's stream.
//
// The ops find their metadata through the token mapping they are given: meta_args() hands out
// views of a KernelMeta's own buffers, and its mapping buffer's address names it. The CUDA
// kernels need more than vLLM's seven arrays (split-K scratch, counters, the device count of
// active slots), which the KernelMeta holds.

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "dlpack_tensor.h"
#include "loraplex/core/error.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::python {
namespace {

using Array = nb::ndarray<>;

Stream stream_of(Device device, uintptr_t handle) {
  if (device.is_cpu()) return Stream();
  return Stream::wrap(device, reinterpret_cast<cuda_rt::StreamHandle>(handle));
}

// Host copy of a token mapping (int32 or int64, anywhere); a device mapping is read back on
// `stream` (vLLM's prepare_tensors waits for the device the same way, for its no-LoRA flag).
std::vector<int32_t> host_mapping(const Array& mapping, const Stream& stream) {
  Tensor t = tensor_view(mapping, "token_lora_mapping");
  LORAPLEX_CHECK(t.dim() == 1 && t.is_contiguous(),
                 "token_lora_mapping must be a contiguous 1-D array, got ", t.describe());
  LORAPLEX_CHECK(t.dtype() == DType::kI32 || t.dtype() == DType::kI64,
                 "token_lora_mapping must be int32 or int64, got ", t.dtype());
  if (t.device().is_cuda()) t = t.to(Device::cpu(), stream);
  std::vector<int32_t> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t v = t.dtype() == DType::kI32 ? t.data<int32_t>()[i] : t.data<int64_t>()[i];
    LORAPLEX_CHECK(v >= -1 && v <= INT32_MAX, "token_lora_mapping[", i, "] = ", v,
                   ", expected a slot id or -1");
    out[static_cast<size_t>(i)] = static_cast<int32_t>(v);
  }
  return out;
}

class KernelMeta;

// Live metadata objects by the address of their device mapping buffer.
std::mutex registry_mu;
std::map<const void*, KernelMeta*>& registry() {
  static std::map<const void*, KernelMeta*> r;
  return r;
}

/// vLLM's LoRAKernelMeta: metadata for up to max_num_tokens tokens over max_loras slots, on
/// one device, built on the device from a token mapping.
class KernelMeta {
 public:
  KernelMeta(int max_loras, int max_num_tokens, const std::string& device)
      : device_(Device::parse(device)), punica_(max_loras, max_num_tokens, 1, device_) {
    LORAPLEX_CHECK(device_.is_cpu() || cuda_device_count() > device_.index,
                   "LoRAKernelMeta: ", device, ": no such CUDA device (", cuda_device_count(),
                   " present", built_with_cuda() ? "" : "; this build has no CUDA backend", ")");
    default_active_ = max_loras + 1;
    std::lock_guard<std::mutex> lock(registry_mu);
    registry()[mapping_address()] = this;
  }
  ~KernelMeta() {
    std::lock_guard<std::mutex> lock(registry_mu);
    registry().erase(mapping_address());
  }
  KernelMeta(const KernelMeta&) = delete;
  KernelMeta& operator=(const KernelMeta&) = delete;

  /// The metadata of `mapping` (slot per token, -1 = no LoRA), built on `stream`.
  void prepare(const Array& mapping, uintptr_t stream) {
    const Stream s = stream_of(device_, stream);
    const std::vector<int32_t> slots = host_mapping(mapping, s);
    meta().prepare(slots, s);
    no_lora_ = meta().no_lora() ? 1 : 0;
    num_active_ = static_cast<int32_t>(std::set<int32_t>(slots.begin(), slots.end()).size());
    every_token_lora_ = std::all_of(slots.begin(), slots.end(),
                                    [&](int32_t s) { return s >= 0 && s < max_loras(); });
  }

  /// vLLM's meta_args: (token_lora_mapping[:num_tokens], token_indices_sorted_by_lora_ids
  /// [:num_tokens], num_tokens_per_lora, lora_token_start_loc, active_lora_ids,
  /// no_lora_flag_cpu, num_active_loras), views of this object's buffers (`self` keeps them).
  nb::tuple meta_args(nb::handle self, int64_t num_tokens, bool specialize) const {
    LORAPLEX_CHECK(num_tokens == meta().num_tokens(), "meta_args: token_nums ", num_tokens,
                   " but the metadata was prepared for ", meta().num_tokens(), " tokens");
    const kernels::LoraMetaView v = meta().view();
    const int64_t slots = meta().max_loras() + 1;
    return nb::make_tuple(array_of(v.token_lora_mapping, DType::kI32, num_tokens, device_, self),
                          array_of(v.sorted_token_indices, DType::kI32, num_tokens, device_, self),
                          array_of(v.num_tokens_per_lora, DType::kI32, slots, device_, self),
                          array_of(v.lora_token_start_loc, DType::kI32, slots + 1, device_, self),
                          array_of(v.active_lora_ids, DType::kI32, slots, device_, self),
                          array_of(&no_lora_, DType::kU8, 1, Device::cpu(), self),
                          array_of(specialize ? &num_active_ : &default_active_, DType::kI32, 1,
                                   Device::cpu(), self));
  }

  /// The metadata that `mapping` (a meta_args() view) belongs to; throws naming `op` when it
  /// is not one, or when it is not for `num_tokens` tokens.
  static KernelMeta& of(const Array& mapping, int64_t num_tokens, const char* op) {
    KernelMeta* meta = nullptr;
    {
      std::lock_guard<std::mutex> lock(registry_mu);
      const auto it = registry().find(mapping.data());
      if (it != registry().end()) meta = it->second;
    }
    LORAPLEX_CHECK(meta != nullptr, op,
                   ": token_lora_mapping is not from loraplex.ops.LoRAKernelMeta.meta_args() (the "
                   "ops read the metadata that LoRAKernelMeta.prepare_tensors built)");
    LORAPLEX_CHECK(mapping.ndim() == 1 && static_cast<int64_t>(mapping.shape(0)) == num_tokens, op,
                   ": token_lora_mapping has ", mapping.ndim() == 1 ? mapping.shape(0) : 0,
                   " entries, the inputs have ", num_tokens, " tokens");
    LORAPLEX_CHECK(meta->meta().num_tokens() == num_tokens, op, ": the inputs have ", num_tokens,
                   " tokens, the metadata was prepared for ", meta->meta().num_tokens());
    return *meta;
  }

  Device device() const { return device_; }
  bool no_lora() const { return meta().no_lora(); }
  /// Every token of the prepared mapping has an adapter (a slot in [0, max_loras)).
  bool every_token_lora() const { return every_token_lora_; }
  int max_loras() const { return punica_.max_loras(); }
  int max_num_tokens() const { return meta().max_num_tokens(); }
  int64_t num_tokens() const { return meta().num_tokens(); }
  PunicaWrapper& punica() { return punica_; }

  /// Every slot of every slice at the full rank: vLLM's ops run each slot at the rank of the
  /// stacked weights (smaller adapters are zero-padded there).
  const SlotRanks& full_ranks(int num_slices, int max_rank) {
    const auto key = std::make_pair(num_slices, max_rank);
    auto it = ranks_.find(key);
    if (it == ranks_.end()) {
      LORAPLEX_CHECK(num_slices >= 1 && max_rank >= 1, "ranks: ", num_slices, " slices of rank ",
                     max_rank, ", expected >= 1 each");
      SlotRanks ranks(num_slices, max_loras(), max_rank, device_);
      const Stream s = device_.is_cpu() ? Stream() : Stream::default_for(device_);
      for (int slot = 0; slot < max_loras(); ++slot) ranks.set_slot(slot, max_rank, s);
      s.synchronize();
      it = ranks_.emplace(key, std::move(ranks)).first;
    }
    return it->second;
  }

  /// A float32 buffer of at least `elements`, kept for later calls (add_lora_linear without a
  /// caller buffer; one stream at a time, as the metadata's own scratch).
  Tensor workspace(int64_t elements) {
    if (!workspace_.defined() || workspace_.numel() < elements) {
      workspace_ = Tensor::empty({std::max<int64_t>(elements, 1)}, DType::kF32, device_);
    }
    return workspace_;
  }

  /// Grows the MoE alignment buffers to what a call needs.
  void reserve_moe(int num_experts, int top_k, int block_size) {
    if (num_experts <= moe_experts_ && top_k <= moe_top_k_ && block_size <= moe_block_) return;
    moe_experts_ = std::max(moe_experts_, num_experts);
    moe_top_k_ = std::max(moe_top_k_, top_k);
    moe_block_ = std::max(moe_block_, block_size);
    punica_.reserve_moe_lora(moe_experts_, moe_top_k_, moe_block_);
  }

 private:
  LoraBatchMeta& meta() { return punica_.token_meta(); }
  const LoraBatchMeta& meta() const { return punica_.token_meta(); }
  const void* mapping_address() const { return meta().mapping_buffer().data_ptr(); }

  Device device_;
  PunicaWrapper punica_;
  uint8_t no_lora_ = 1;
  bool every_token_lora_ = false;
  int32_t num_active_ = 0;
  int32_t default_active_ = 0;
  std::map<std::pair<int, int>, SlotRanks> ranks_;
  Tensor workspace_;
  int moe_experts_ = 0;
  int moe_top_k_ = 0;
  int moe_block_ = 0;
};

// vLLM stacks LoRA weights as [max_loras, 1, rows, cols] (or without the 1).
Tensor stacked_weight(const Array& w, const char* what) {
  Tensor t = tensor_view(w, what);
  if (t.dim() == 4 && t.size(1) == 1 && t.is_contiguous()) {
    t = t.view({t.size(0), t.size(2), t.size(3)});
  }
  return t;
}

std::vector<Tensor> stacked_weights(const std::vector<Array>& ws, const char* what) {
  std::vector<Tensor> out;
  out.reserve(ws.size());
  for (const Array& w : ws) out.push_back(stacked_weight(w, what));
  return out;
}

// Leading dimensions flattened into rows, as vLLM's add_lora_linear does with view(-1, n).
Tensor as_rows(const Array& a, const char* what) {
  Tensor t = tensor_view(a, what);
  if (t.dim() > 2) t = t.view({-1, t.size(-1)});
  return t;
}

int64_t num_rows(const Array& a) { return a.ndim() == 0 ? 0 : static_cast<int64_t>(a.shape(0)); }

void lora_shrink(const Array& inputs, const std::vector<Array>& lora_a, const Array& output,
                 const Array& token_lora_mapping, float scaling, uintptr_t stream) {
  KernelMeta& meta = KernelMeta::of(token_lora_mapping, num_rows(inputs), "lora_shrink");
  if (meta.no_lora()) return;
  const Tensor x = tensor_view(inputs, "lora_shrink: inputs");
  const std::vector<Tensor> a = stacked_weights(lora_a, "lora_shrink: lora_a_weights");
  Tensor out = tensor_view(output, "lora_shrink: output_tensor");
  LORAPLEX_CHECK(!a.empty() && a[0].dim() == 3, "lora_shrink: lora_a_weights must be a list of ",
                 "[max_loras, rank, hidden] arrays");
  const SlotRanks& ranks =
      meta.full_ranks(static_cast<int>(a.size()), static_cast<int>(a[0].size(1)));
  const Stream s = stream_of(meta.device(), stream);
  nb::gil_scoped_release release;
  // vLLM's shrink zeroes its output first (rows of tokens without LoRA are zero). Ours writes
  // every rank of every token with an adapter (the ops' slots all have the full rank), so
  // when all tokens have one and the output is exactly [slices, tokens, rank] nothing is left
  // to zero, and the memset (a launch of its own) is skipped.
  const bool covered = meta.every_token_lora() && out.dim() == 3 &&
                       out.size(0) == static_cast<int64_t>(a.size()) &&
                       out.size(1) == meta.num_tokens() && out.size(2) == a[0].size(1);
  if (out.is_contiguous() && !covered) out.zero_(s);
  meta.punica().add_shrink(out, x, a, ranks, scaling, s);
}

void lora_expand(const Array& inputs, const std::vector<Array>& lora_b, const Array& output,
                 const Array& token_lora_mapping, int64_t offset_start, bool add_inputs,
                 uintptr_t stream) {
  LORAPLEX_CHECK(inputs.ndim() == 3, "lora_expand: inputs must be [num_slices, num_tokens, ",
                 "rank], got ", inputs.ndim(), " dimensions");
  KernelMeta& meta =
      KernelMeta::of(token_lora_mapping, static_cast<int64_t>(inputs.shape(1)), "lora_expand");
  if (meta.no_lora()) return;
  const Tensor x = tensor_view(inputs, "lora_expand: inputs");
  const std::vector<Tensor> b = stacked_weights(lora_b, "lora_expand: lora_b_weights");
  Tensor y = tensor_view(output, "lora_expand: output_tensor");
  LORAPLEX_CHECK(!b.empty() && b[0].dim() == 3, "lora_expand: lora_b_weights must be a list of ",
                 "[max_loras, hidden, rank] arrays");
  const SlotRanks& ranks =
      meta.full_ranks(static_cast<int>(b.size()), static_cast<int>(b[0].size(2)));
  const Stream s = stream_of(meta.device(), stream);
  nb::gil_scoped_release release;
  meta.punica().add_expand(y, x, b, ranks, offset_start, add_inputs, s);
}

void add_lora_linear(const Array& y, const Array& x, const std::vector<Array>& lora_a,
                     const std::vector<Array>& lora_b, float scale,
                     const std::vector<int64_t>& output_slices, const Array& token_lora_mapping,
                     const std::optional<Array>& buffer, uintptr_t stream) {
  const char* op = "add_lora_linear";
  Tensor xt = as_rows(x, "add_lora_linear: x");
  Tensor yt = as_rows(y, "add_lora_linear: y");
  KernelMeta& meta = KernelMeta::of(token_lora_mapping, xt.size(0), op);
  const std::vector<Tensor> a = stacked_weights(lora_a, "add_lora_linear: lora_a_stacked");
  const std::vector<Tensor> b = stacked_weights(lora_b, "add_lora_linear: lora_b_stacked");
  LORAPLEX_CHECK(a.size() == b.size() && a.size() == output_slices.size(), op, ": ", a.size(),
                 " LoRA-A, ", b.size(), " LoRA-B and ", output_slices.size(),
                 " output slices, expected the same count");
  LORAPLEX_CHECK(!a.empty() && a[0].dim() == 3, op,
                 ": lora_a_stacked must hold [max_loras, rank, in] arrays");
  for (size_t i = 0; i < b.size(); ++i) {
    LORAPLEX_CHECK(b[i].dim() == 3 && b[i].size(1) == output_slices[i], op, ": output_slices[", i,
                   "] = ", output_slices[i], " but its LoRA-B is ", b[i].describe());
  }
  const int num_slices = static_cast<int>(a.size());
  const int max_rank = static_cast<int>(a[0].size(1));
  const SlotRanks& ranks = meta.full_ranks(num_slices, max_rank);
  const int64_t need = PunicaWrapper::workspace_elements(num_slices, xt.size(0), max_rank);
  Tensor workspace =
      buffer ? tensor_view(*buffer, "add_lora_linear: buffer").view({-1}) : meta.workspace(need);
  const Stream s = stream_of(meta.device(), stream);
  nb::gil_scoped_release release;
  meta.punica().add_lora_linear(yt, xt, a, b, ranks, scale, workspace, s);
}

void fused_moe_lora(const Array& output, const Array& x, const std::vector<Array>& lora_a,
                    const std::vector<Array>& lora_b, const std::optional<Array>& topk_weights,
                    const Array& topk_ids, const Array& token_lora_mapping, int block_size,
                    const std::optional<Array>& adapter_enabled, bool mul_routed_weight,
                    int64_t offset, bool add_inputs, uintptr_t stream) {
  const char* op = "fused_moe_lora";
  KernelMeta& meta = KernelMeta::of(token_lora_mapping, num_rows(topk_ids), op);
  Tensor y = tensor_view(output, "fused_moe_lora: output");
  const Tensor xt = tensor_view(x, "fused_moe_lora: x");
  const Tensor ids = tensor_view(topk_ids, "fused_moe_lora: topk_ids");
  const std::vector<Tensor> a = stacked_weights(lora_a, "fused_moe_lora: lora_a_stacked");
  const std::vector<Tensor> b = stacked_weights(lora_b, "fused_moe_lora: lora_b_stacked");
  LORAPLEX_CHECK(!a.empty() && a[0].dim() == 4, op,
                 ": lora_a_stacked must hold [max_loras, num_experts, rank, K] arrays");
  LORAPLEX_CHECK(ids.dim() == 2, op, ": topk_ids must be [num_tokens, top_k], got ",
                 ids.describe());
  const int num_experts = static_cast<int>(a[0].size(1));
  const int top_k = static_cast<int>(ids.size(1));
  LORAPLEX_CHECK(block_size >= 1, op, ": block_size ", block_size, ", expected >= 1");
  const SlotRanks& ranks =
      meta.full_ranks(static_cast<int>(a.size()), static_cast<int>(a[0].size(2)));
  Tensor weights;
  if (topk_weights) weights = tensor_view(*topk_weights, "fused_moe_lora: topk_weights");
  Tensor enabled;
  if (adapter_enabled) enabled = tensor_view(*adapter_enabled, "fused_moe_lora: adapter_enabled");
  meta.reserve_moe(num_experts, std::max(top_k, 1), block_size);
  FusedMoeLoraOptions options;
  options.mul_routed_weight = mul_routed_weight;
  options.offset = offset;
  options.add_inputs = add_inputs;
  const Stream s = stream_of(meta.device(), stream);
  nb::gil_scoped_release release;
  const MoeLoraAlignment alignment =
      meta.punica().moe_lora_align_block_size(ids, num_experts, block_size, enabled, s);
  meta.punica().add_lora_fused_moe(y, xt, a, b, ranks, weights, alignment, options, s);
}

}  // namespace

void bind_ops(nb::module_& m) {
  nb::module_ ops = m.def_submodule("ops", "the Punica ops on DLPack arrays");
  nb::class_<KernelMeta>(ops, "KernelMeta")
      .def(nb::init<int, int, const std::string&>(), nb::arg("max_loras"),
           nb::arg("max_num_tokens"), nb::arg("device"))
      .def("prepare", &KernelMeta::prepare, nb::arg("token_lora_mapping"), nb::arg("stream"))
      .def(
          "meta_args",
          [](nb::handle self, int64_t num_tokens, bool specialize) {
            return nb::cast<const KernelMeta&>(self).meta_args(self, num_tokens, specialize);
          },
          nb::arg("token_nums"), nb::arg("specialize_active_lora"))
      .def_prop_ro("max_loras", &KernelMeta::max_loras)
      .def_prop_ro("max_num_tokens", &KernelMeta::max_num_tokens)
      .def_prop_ro("device", [](const KernelMeta& k) { return k.device().str(); });
  ops.def("lora_shrink", &lora_shrink, nb::arg("inputs"), nb::arg("lora_a_weights"),
          nb::arg("output_tensor"), nb::arg("token_lora_mapping"), nb::arg("scaling"),
          nb::arg("stream"));
  ops.def("lora_expand", &lora_expand, nb::arg("inputs"), nb::arg("lora_b_weights"),
          nb::arg("output_tensor"), nb::arg("token_lora_mapping"), nb::arg("offset_start"),
          nb::arg("add_inputs"), nb::arg("stream"));
  ops.def("add_lora_linear", &add_lora_linear, nb::arg("y"), nb::arg("x"),
          nb::arg("lora_a_stacked"), nb::arg("lora_b_stacked"), nb::arg("scale"),
          nb::arg("output_slices"), nb::arg("token_lora_mapping"), nb::arg("buffer").none(),
          nb::arg("stream"));
  ops.def("fused_moe_lora", &fused_moe_lora, nb::arg("output"), nb::arg("x"),
          nb::arg("lora_a_stacked"), nb::arg("lora_b_stacked"), nb::arg("topk_weights").none(),
          nb::arg("topk_ids"), nb::arg("token_lora_mapping"), nb::arg("block_size"),
          nb::arg("adapter_enabled").none(), nb::arg("mul_routed_weight"), nb::arg("offset"),
          nb::arg("add_inputs"), nb::arg("stream"));
}

}  // namespace loraplex::python
