#include "loraplex/punica/punica_wrapper.h"

#include <algorithm>
#include <optional>

#include "loraplex/core/error.h"
#include "loraplex/kernels/lora_ops_checks.h"
#include "loraplex/punica/lora_dispatch.h"

namespace loraplex {
namespace {

bool is_activation(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

void check_device(const Tensor& t, Device device, const char* op, const char* name) {
  LORAPLEX_CHECK(t.defined(), op, ": ", name, " is undefined");
  LORAPLEX_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
                 ", expected the wrapper's device ", device);
}

// A 2-D activation with contiguous, non-overlapping rows (the row stride may exceed the
// width, as in a column slice of a wider tensor).
void check_rows(const Tensor& t, Device device, const char* op, const char* name) {
  check_device(t, device, op, name);
  LORAPLEX_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.describe());
  LORAPLEX_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name,
                 " needs contiguous rows (last stride 1), got strides ", shape_str(t.strides()));
  LORAPLEX_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1), op, ": ", name, " rows overlap (row ",
                 "stride ", t.stride(0), " < width ", t.size(1), ")");
  LORAPLEX_CHECK(is_activation(t.dtype()), op, ": ", name, " has dtype ", t.dtype(),
                 ", expected float32, float16 or bfloat16");
}

// Elements between rows of a check_rows() tensor. A single row has no meaningful stride.
int64_t row_stride(const Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); }

// The ranks' host copy must fit the stacked weights and the slice count of the call.
void check_ranks(const SlotRanks& ranks, int num_slices, int max_loras, int max_rank, Device device,
                 const char* op) {
  LORAPLEX_CHECK(ranks.num_slices() > 0, op, ": ranks are empty (default-constructed SlotRanks)");
  LORAPLEX_CHECK(ranks.device().device() == device, op, ": ranks live on ", ranks.device().device(),
                 ", expected the wrapper's device ", device);
  LORAPLEX_CHECK(ranks.num_slices() == num_slices && ranks.max_loras() == max_loras, op,
                 ": ranks are [", ranks.num_slices(), ", ", ranks.max_loras(),
                 "], expected [num_slices ", num_slices, ", max_loras ", max_loras, "]");
  throw_if_error(
      kernels::check_ranks_host(ranks.host().data<int32_t>(), num_slices, max_loras, max_rank));
}

struct StackDims {
  int64_t max_loras = 0;
  int64_t rows = 0;
  int64_t cols = 0;
};

// A slot-stacked weight [max_loras, rows, cols], contiguous, on `device`.
StackDims check_stack(const Tensor& w, Device device, DType dtype, int64_t max_loras,
                      const char* op, const char* name, int slice) {
  check_device(w, device, op, name);
  LORAPLEX_CHECK(w.dim() == 3, op, ": ", name, " of slice ", slice,
                 " must be [max_loras, rows, cols], got ", w.describe());
  LORAPLEX_CHECK(w.is_contiguous(), op, ": ", name, " of slice ", slice,
                 " must be contiguous, got strides ", shape_str(w.strides()));
  LORAPLEX_CHECK(w.dtype() == dtype, op, ": ", name, " of slice ", slice, " has dtype ", w.dtype(),
                 ", expected ", dtype);
  LORAPLEX_CHECK(w.size(0) == max_loras, op, ": ", name, " of slice ", slice, " stacks ", w.size(0),
                 " slots, expected max_loras ", max_loras);
  return {w.size(0), w.size(1), w.size(2)};
}

// A slot-stacked LoRA-A [max_loras, rank rows, cols] whose slots may lie further apart than
// one after the other (every slot's rows contiguous, slot k's from row k * slot_rows of a
// larger matrix: LoraLinear keeps A as extra rows of its base weight). Returns slot_rows.
int64_t check_a_stack(const Tensor& w, Device device, DType dtype, int64_t max_loras,
                      const char* op, int slice) {
  check_device(w, device, op, "LoRA-A");
  LORAPLEX_CHECK(w.dim() == 3, op, ": LoRA-A of slice ", slice,
                 " must be [max_loras, rows, cols], got ", w.describe());
  const int64_t cols = w.size(2);
  const bool rows_packed =
      (w.size(2) <= 1 || w.stride(2) == 1) && (w.size(1) <= 1 || w.stride(1) == cols);
  const bool slots_apart =
      w.size(0) <= 1 || (w.stride(0) % cols == 0 && w.stride(0) >= w.size(1) * cols);
  LORAPLEX_CHECK(rows_packed && slots_apart, op, ": LoRA-A of slice ", slice,
                 " must have contiguous rows and slots that do not overlap, got strides ",
                 shape_str(w.strides()));
  LORAPLEX_CHECK(w.dtype() == dtype, op, ": LoRA-A of slice ", slice, " has dtype ", w.dtype(),
                 ", expected ", dtype);
  LORAPLEX_CHECK(w.size(0) == max_loras, op, ": LoRA-A of slice ", slice, " stacks ", w.size(0),
                 " slots, expected max_loras ", max_loras);
  return w.size(0) <= 1 ? w.size(1) : w.stride(0) / cols;
}

// A contiguous tensor of exactly `shape` and `dtype` on `device`.
void check_exact(const Tensor& t, Device device, DType dtype, const Shape& shape, const char* op,
                 const char* name) {
  check_device(t, device, op, name);
  LORAPLEX_CHECK(t.dtype() == dtype && t.shape() == shape && t.is_contiguous(), op, ": ", name,
                 " must be contiguous ", dtype, shape_str(shape), ", got ", t.describe(),
                 t.is_contiguous() ? "" : " (not contiguous)");
}

// `a_dtype`: of the A stacks, x's unless they are fp8 (add_shrink_fp8).
kernels::ShrinkArgs make_shrink(const Tensor& out, const Tensor& x, std::span<const Tensor> lora_a,
                                const SlotRanks& ranks, float scale, const LoraBatchMeta& meta,
                                const char* op, std::optional<DType> a_dtype = std::nullopt) {
  const Device device = meta.device();
  check_rows(x, device, op, "x");
  const int num_slices = static_cast<int>(lora_a.size());
  LORAPLEX_CHECK(num_slices >= 1 && num_slices <= kernels::kMaxSlices, op, ": ", num_slices,
                 " LoRA-A slices, expected 1..", kernels::kMaxSlices);
  LORAPLEX_CHECK(x.size(0) == meta.num_tokens(), op, ": x has ", x.size(0),
                 " rows, the batch metadata has ", meta.num_tokens(), " tokens");
  kernels::ShrinkArgs a;
  a.dtype = x.dtype();
  a.num_tokens = x.size(0);
  a.hidden = x.size(1);
  a.x = x.data_ptr();
  a.x_row_stride = row_stride(x);
  a.num_slices = num_slices;
  a.max_loras = meta.max_loras();
  for (int s = 0; s < num_slices; ++s) {
    const int64_t slot_rows =
        check_a_stack(lora_a[s], device, a_dtype.value_or(x.dtype()), meta.max_loras(), op, s);
    const int64_t rows = lora_a[s].size(1);
    LORAPLEX_CHECK(lora_a[s].size(2) == a.hidden, op, ": LoRA-A of slice ", s, " has input size ",
                   lora_a[s].size(2), ", x has ", a.hidden);
    if (s == 0) {
      a.max_rank = static_cast<int>(rows);
      a.a_slot_rows = static_cast<int>(slot_rows);
    }
    LORAPLEX_CHECK(rows == a.max_rank && slot_rows == a.a_slot_rows, op, ": LoRA-A of slice ", s,
                   " has rank ", rows, " and ", slot_rows, " rows between slots; slice 0 has ",
                   a.max_rank, " and ", a.a_slot_rows);
    a.lora_a[s] = lora_a[s].data_ptr();
  }
  check_ranks(ranks, num_slices, a.max_loras, a.max_rank, device, op);
  a.ranks = ranks.device().data<int32_t>();
  a.scale = scale;
  check_device(out, device, op, "output");
  LORAPLEX_CHECK(out.dtype() == DType::kF32 || out.dtype() == x.dtype(), op, ": output dtype ",
                 out.dtype(), ", expected float32 or ", x.dtype());
  LORAPLEX_CHECK(
      out.is_contiguous() && out.shape() == (Shape{num_slices, a.num_tokens, a.max_rank}), op,
      ": output must be contiguous [", num_slices, ", ", a.num_tokens, ", ", a.max_rank, "], got ",
      out.describe());
  a.out_dtype = out.dtype();
  a.out = out.data_ptr();
  return a;
}

kernels::ExpandArgs make_expand(const Tensor& y, const Tensor& in, std::span<const Tensor> lora_b,
                                const SlotRanks& ranks, int64_t offset_start, bool add_inputs,
                                const LoraBatchMeta& meta, const char* op) {
  const Device device = meta.device();
  check_rows(y, device, op, "y");
  const int num_slices = static_cast<int>(lora_b.size());
  LORAPLEX_CHECK(num_slices >= 1 && num_slices <= kernels::kMaxSlices, op, ": ", num_slices,
                 " LoRA-B slices, expected 1..", kernels::kMaxSlices);
  LORAPLEX_CHECK(y.size(0) == meta.num_tokens(), op, ": y has ", y.size(0),
                 " rows, the batch metadata has ", meta.num_tokens(), " tokens");
  kernels::ExpandArgs a;
  a.dtype = y.dtype();
  a.num_tokens = y.size(0);
  a.num_slices = num_slices;
  a.max_loras = meta.max_loras();
  int64_t end = offset_start;
  for (int s = 0; s < num_slices; ++s) {
    const StackDims d =
        check_stack(lora_b[s], device, y.dtype(), meta.max_loras(), op, "LoRA-B", s);
    if (s == 0) a.max_rank = static_cast<int>(d.cols);
    LORAPLEX_CHECK(d.cols == a.max_rank, op, ": LoRA-B of slice ", s, " has rank ", d.cols,
                   ", slice 0 has ", a.max_rank);
    a.lora_b[s] = lora_b[s].data_ptr();
    a.slice_width[s] = d.rows;
    end += d.rows;
  }
  LORAPLEX_CHECK(offset_start >= 0 && end <= y.size(1), op, ": slices cover columns [",
                 offset_start, ", ", end, ") but y has ", y.size(1), " columns");
  check_ranks(ranks, num_slices, a.max_loras, a.max_rank, device, op);
  a.ranks = ranks.device().data<int32_t>();
  check_device(in, device, op, "intermediate");
  LORAPLEX_CHECK(in.dtype() == DType::kF32 || in.dtype() == y.dtype(), op, ": intermediate dtype ",
                 in.dtype(), ", expected float32 or ", y.dtype());
  LORAPLEX_CHECK(in.is_contiguous() && in.shape() == (Shape{num_slices, a.num_tokens, a.max_rank}),
                 op, ": intermediate must be contiguous [", num_slices, ", ", a.num_tokens, ", ",
                 a.max_rank, "], got ", in.describe());
  a.in_dtype = in.dtype();
  a.in = in.data_ptr();
  a.y = y.data_ptr();
  a.y_row_stride = row_stride(y);
  a.offset_start = offset_start;
  a.add_inputs = add_inputs;
  return a;
}

Tensor workspace_view(Tensor& workspace, int num_slices, int64_t num_tokens, int64_t max_rank,
                      Device device, const char* op) {
  const int64_t need =
      PunicaWrapper::workspace_elements(num_slices, num_tokens, static_cast<int>(max_rank));
  check_device(workspace, device, op, "workspace");
  LORAPLEX_CHECK(workspace.dtype() == DType::kF32 && workspace.is_contiguous(), op,
                 ": workspace must be contiguous float32, got ", workspace.describe());
  LORAPLEX_CHECK(workspace.numel() >= need, op, ": workspace has ", workspace.numel(),
                 " elements, needs ", need, " (", num_slices, " slices x ", num_tokens,
                 " tokens x rank ", max_rank, ")");
  return workspace.view({-1}).narrow(0, 0, need).view({num_slices, num_tokens, max_rank});
}

}  // namespace

PunicaWrapper::PunicaWrapper(int max_loras, int max_num_tokens, int max_num_seqs, Device device)
    : max_loras_(max_loras),
      max_num_tokens_(max_num_tokens),
      device_(device),
      lora_device_(lora_device_of(device)),
      token_meta_(max_loras, max_num_tokens, device,
                  kernels::planner::lora_scratch_floats(max_num_tokens, lora_device_.tuning)),
      sampler_meta_(max_loras, max_num_seqs, device,
                    kernels::planner::lora_scratch_floats(max_num_seqs, lora_device_.tuning)) {}

void PunicaWrapper::set_lora_tuning(const kernels::planner::LoraTuning& tuning) {
  throw_if_error(kernels::planner::check_lora_tuning(tuning));
  lora_device_.tuning = tuning;
  // Plans of the new table (longer decode paths, say) may need more scratch than the old's.
  token_meta_.reserve_scratch(kernels::planner::lora_scratch_floats(max_num_tokens_, tuning));
  sampler_meta_.reserve_scratch(
      kernels::planner::lora_scratch_floats(sampler_meta_.max_num_tokens(), tuning));
}

void PunicaWrapper::set_lora_tuning(const std::string& overrides) {
  kernels::planner::LoraTuning tuning = lora_device_.tuning;
  throw_if_error(kernels::planner::parse_lora_tuning(overrides, tuning));
  set_lora_tuning(tuning);
}

void PunicaWrapper::update_metadata(std::span<const int32_t> token_slots,
                                    std::span<const int32_t> sampler_slots, const Stream& stream) {
  token_meta_.prepare(token_slots, stream);
  sampler_meta_.prepare(sampler_slots, stream);
}

std::pair<bool, bool> PunicaWrapper::upload_mappings(std::span<const int32_t> token_slots,
                                                     std::span<const int32_t> sampler_slots,
                                                     const Stream& stream) {
  const bool token_lora = !token_meta_.upload(token_slots, stream);
  const bool sampler_lora = !sampler_meta_.upload(sampler_slots, stream);
  return {token_lora, sampler_lora};
}

void PunicaWrapper::build_metadata(int num_tokens, int num_sampled, bool token_lora,
                                   bool sampler_lora, const Stream& stream) {
  token_meta_.prepare_from_buffer(num_tokens, !token_lora, stream);
  sampler_meta_.prepare_from_buffer(num_sampled, !sampler_lora, stream);
}

void PunicaWrapper::add_shrink(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                               const SlotRanks& ranks, float scale, const Stream& stream) const {
  const kernels::ShrinkArgs a = make_shrink(y, x, lora_a, ranks, scale, token_meta_, "add_shrink");
  if (token_meta_.no_lora()) return;
  throw_if_error(dispatch_lora_shrink(a, token_meta_.view(), stream, &lora_device_));
  token_meta_.note_op_enqueued(stream);
}

void PunicaWrapper::add_shrink_fp8(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                                   std::span<const Tensor> a_scales, const SlotRanks& ranks,
                                   const Stream& stream) const {
  const char* op = "add_shrink_fp8";
  kernels::ShrinkFp8Args f;
  f.base = make_shrink(y, x, lora_a, ranks, 1.0f, token_meta_, op, DType::kF8E4M3);
  LORAPLEX_CHECK(y.dtype() == DType::kF32, op, ": output dtype ", y.dtype(), ", expected float32");
  LORAPLEX_CHECK(a_scales.size() == lora_a.size(), op, ": ", a_scales.size(), " scale stacks for ",
                 lora_a.size(), " LoRA-A slices");
  for (size_t s = 0; s < a_scales.size(); ++s) {
    const Tensor& sc = a_scales[s];
    const Shape want{token_meta_.max_loras(), f.base.max_rank};
    LORAPLEX_CHECK(sc.defined() && sc.dtype() == DType::kF32 && sc.device() == device_ &&
                       sc.is_contiguous() && sc.shape() == want,
                   op, ": scales of slice ", s, " must be contiguous float32 ", shape_str(want),
                   " on ", device_, ", got ", sc.defined() ? sc.describe() : "undefined");
    LORAPLEX_CHECK(f.base.a_slot_rows == f.base.max_rank, op,
                   ": fp8 LoRA-A is a stack of its own (max_rank rows a slot)");
    f.a_scale[s] = sc.data<float>();
  }
  if (token_meta_.no_lora()) return;
  throw_if_error(dispatch_lora_shrink_fp8(f, token_meta_.view(), stream));
  token_meta_.note_op_enqueued(stream);
}

void PunicaWrapper::add_expand(Tensor& y, const Tensor& x, std::span<const Tensor> lora_b,
                               const SlotRanks& ranks, int64_t offset_start, bool add_inputs,
                               const Stream& stream) const {
  const kernels::ExpandArgs a =
      make_expand(y, x, lora_b, ranks, offset_start, add_inputs, token_meta_, "add_expand");
  if (token_meta_.no_lora()) return;
  throw_if_error(dispatch_lora_expand(a, token_meta_.view(), stream, &lora_device_));
  token_meta_.note_op_enqueued(stream);
}

std::pair<kernels::ShrinkArgs, kernels::ExpandArgs> PunicaWrapper::linear_args(
    const Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
    std::span<const Tensor> lora_b, const SlotRanks& ranks, float scale, Tensor& workspace,
    const LoraBatchMeta& meta) const {
  const char* op = "add_lora_linear";
  LORAPLEX_CHECK(lora_a.size() == lora_b.size(), op, ": ", lora_a.size(), " LoRA-A slices but ",
                 lora_b.size(), " LoRA-B slices");
  LORAPLEX_CHECK(!lora_a.empty() && lora_a[0].defined() && lora_a[0].dim() == 3, op,
                 ": LoRA-A of slice 0 must be [max_loras, max_rank, in]");
  const int num_slices = static_cast<int>(lora_a.size());
  Tensor buffer = workspace_view(workspace, num_slices, x.dim() == 2 ? x.size(0) : 0,
                                 lora_a[0].size(1), meta.device(), op);
  return {make_shrink(buffer, x, lora_a, ranks, scale, meta, op),
          make_expand(y, buffer, lora_b, ranks, 0, true, meta, op)};
}

void PunicaWrapper::lora_linear_with_meta(Tensor& y, const Tensor& x,
                                          std::span<const Tensor> lora_a,
                                          std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                          float scale, Tensor& workspace, const LoraBatchMeta& meta,
                                          const Stream& stream) const {
  const auto [s, e] = linear_args(y, x, lora_a, lora_b, ranks, scale, workspace, meta);
  if (meta.no_lora()) return;
  throw_if_error(dispatch_lora_linear(s, e, meta.view(), stream, &lora_device_));
  meta.note_op_enqueued(stream);
}

std::string PunicaWrapper::lora_linear_path(const Tensor& y, const Tensor& x,
                                            std::span<const Tensor> lora_a,
                                            std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                            Tensor& workspace) const {
  const auto [s, e] = linear_args(y, x, lora_a, lora_b, ranks, 1.0f, workspace, token_meta_);
  return lora_linear_path_of(s, e, token_meta_.view(), device_, lora_device_);
}

void PunicaWrapper::reserve_lora_linear(const Tensor& y, const Tensor& x,
                                        std::span<const Tensor> lora_a,
                                        std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                        Tensor& workspace) {
  const auto [s, e] = linear_args(y, x, lora_a, lora_b, ranks, 1.0f, workspace, token_meta_);
  token_meta_.reserve_scratch(
      lora_linear_scratch_of(s, e, token_meta_.view(), device_, lora_device_));
}

void PunicaWrapper::add_lora_linear(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                                    std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                    float scale, Tensor& workspace, const Stream& stream) const {
  lora_linear_with_meta(y, x, lora_a, lora_b, ranks, scale, workspace, token_meta_, stream);
}

void PunicaWrapper::add_lora_logits(Tensor& y, const Tensor& x, const Tensor& lora_a,
                                    const Tensor& lora_b, const SlotRanks& ranks, float scale,
                                    Tensor& workspace, const Stream& stream) const {
  const Tensor a[1] = {lora_a};
  const Tensor b[1] = {lora_b};
  lora_linear_with_meta(y, x, a, b, ranks, scale, workspace, sampler_meta_, stream);
}

void PunicaWrapper::add_lora_embedding(Tensor& y, const Tensor& token_ids, const Tensor& lora_a,
                                       const Tensor& lora_b, const SlotRanks& ranks, float scale,
                                       const Stream& stream) const {
  const char* op = "add_lora_embedding";
  check_rows(y, device_, op, "y");
  check_device(token_ids, device_, op, "token_ids");
  LORAPLEX_CHECK(token_ids.dtype() == DType::kI32 && token_ids.dim() == 1 &&
                     token_ids.is_contiguous() && token_ids.size(0) == y.size(0),
                 op, ": token_ids must be contiguous int32 [", y.size(0), "], got ",
                 token_ids.describe());
  LORAPLEX_CHECK(y.size(0) == token_meta_.num_tokens(), op, ": y has ", y.size(0),
                 " rows, the batch metadata has ", token_meta_.num_tokens(), " tokens");
  const StackDims ad = check_stack(lora_a, device_, y.dtype(), max_loras_, op, "LoRA-A table", 0);
  const StackDims bd = check_stack(lora_b, device_, y.dtype(), max_loras_, op, "LoRA-B", 0);
  LORAPLEX_CHECK(bd.cols == ad.cols, op, ": LoRA-A table has rank ", ad.cols, ", LoRA-B has rank ",
                 bd.cols);
  LORAPLEX_CHECK(bd.rows == y.size(1), op, ": LoRA-B has ", bd.rows, " output rows, y has ",
                 y.size(1), " columns");
  check_ranks(ranks, 1, max_loras_, static_cast<int>(ad.cols), device_, op);
  if (token_meta_.no_lora()) return;
  kernels::EmbeddingLoraArgs a;
  a.dtype = y.dtype();
  a.num_tokens = y.size(0);
  a.token_ids = token_ids.data<int32_t>();
  a.token_lora_mapping = token_meta_.view().token_lora_mapping;
  a.lora_a = lora_a.data_ptr();
  a.vocab = ad.rows;
  a.lora_b = lora_b.data_ptr();
  a.hidden = bd.rows;
  a.max_loras = max_loras_;
  a.max_rank = static_cast<int>(ad.cols);
  a.ranks = ranks.device().data<int32_t>();
  a.scale = scale;
  a.y = y.data_ptr();
  a.y_row_stride = row_stride(y);
  throw_if_error(dispatch_lora_embedding(a, stream));
}

void PunicaWrapper::add_expand_fp8(Tensor& y, const Tensor& x, const Fp8LoraB& lora_b,
                                   const SlotRanks& ranks, int64_t offset_start, bool add_inputs,
                                   const Stream& stream, const Tensor& x_scale) const {
  const char* op = "add_expand_fp8";
  check_rows(y, device_, op, "y");
  const int num_slices = static_cast<int>(lora_b.weights.size());
  LORAPLEX_CHECK(num_slices >= 1 && num_slices <= kernels::kMaxSlices, op, ": ", num_slices,
                 " LoRA-B slices, expected 1..", kernels::kMaxSlices);
  LORAPLEX_CHECK(lora_b.scales.size() == lora_b.weights.size(), op, ": ", lora_b.scales.size(),
                 " scale tensors for ", num_slices, " LoRA-B slices");
  LORAPLEX_CHECK(y.size(0) == token_meta_.num_tokens(), op, ": y has ", y.size(0),
                 " rows, the batch metadata has ", token_meta_.num_tokens(), " tokens");
  kernels::ExpandFp8Args f;
  kernels::ExpandArgs& a = f.base;
  a.dtype = y.dtype();
  a.num_tokens = y.size(0);
  a.num_slices = num_slices;
  a.max_loras = max_loras_;
  f.scale_kind = lora_b.scale_kind;
  f.group_n = lora_b.group_n;
  f.group_k = lora_b.group_k;
  int64_t end = offset_start;
  for (int s = 0; s < num_slices; ++s) {
    const Tensor& w = lora_b.weights[s];
    check_device(w, device_, op, "LoRA-B");
    LORAPLEX_CHECK(is_fp8(w.dtype()), op, ": LoRA-B of slice ", s, " has dtype ", w.dtype(),
                   ", expected float8_e4m3 or float8_e5m2");
    if (s == 0) f.weight_dtype = w.dtype();
    const StackDims d = check_stack(w, device_, f.weight_dtype, max_loras_, op, "LoRA-B", s);
    if (s == 0) a.max_rank = static_cast<int>(d.cols);
    LORAPLEX_CHECK(d.cols == a.max_rank, op, ": LoRA-B of slice ", s, " has rank ", d.cols,
                   ", slice 0 has ", a.max_rank);
    Shape scale_shape;
    switch (lora_b.scale_kind) {
      case kernels::Fp8ScaleKind::kPerTensor:
        scale_shape = {max_loras_};
        break;
      case kernels::Fp8ScaleKind::kPerChannel:
        scale_shape = {max_loras_, d.rows};
        break;
      case kernels::Fp8ScaleKind::kPerBlock:
        LORAPLEX_CHECK(lora_b.group_n >= 1 && lora_b.group_k >= 1, op, ": block scale groups ",
                       lora_b.group_n, "x", lora_b.group_k, ", expected >= 1");
        scale_shape = {max_loras_, (d.rows + lora_b.group_n - 1) / lora_b.group_n,
                       (d.cols + lora_b.group_k - 1) / lora_b.group_k};
        break;
    }
    check_exact(lora_b.scales[s], device_, DType::kF32, scale_shape, op, "LoRA-B scale");
    a.lora_b[s] = w.data_ptr();
    f.b_scale[s] = lora_b.scales[s].data<float>();
    a.slice_width[s] = d.rows;
    end += d.rows;
  }
  LORAPLEX_CHECK(offset_start >= 0 && end <= y.size(1), op, ": slices cover columns [",
                 offset_start, ", ", end, ") but y has ", y.size(1), " columns");
  check_ranks(ranks, num_slices, max_loras_, a.max_rank, device_, op);
  a.ranks = ranks.device().data<int32_t>();
  check_device(x, device_, op, "intermediate");
  const Shape in_shape = {num_slices, a.num_tokens, a.max_rank};
  f.w8a8 = is_fp8(x.dtype());
  if (f.w8a8) {
    check_exact(x, device_, x.dtype(), in_shape, op, "fp8 intermediate");
    f.in_fp8_dtype = x.dtype();
    check_device(x_scale, device_, op, "intermediate scale");
    f.in_scale_per_token = x_scale.dim() == 2;
    const Shape scale_shape =
        f.in_scale_per_token ? Shape{num_slices, a.num_tokens} : Shape{num_slices};
    check_exact(x_scale, device_, DType::kF32, scale_shape, op, "intermediate scale");
    f.in_scale = x_scale.data<float>();
    a.in_dtype = x.dtype();
  } else {
    LORAPLEX_CHECK(x.dtype() == DType::kF32 || x.dtype() == y.dtype(), op, ": intermediate dtype ",
                   x.dtype(), ", expected float32, ", y.dtype(), " or fp8 (W8A8)");
    check_exact(x, device_, x.dtype(), in_shape, op, "intermediate");
    LORAPLEX_CHECK(!x_scale.defined(), op,
                   ": an intermediate scale was given but the intermediate is not fp8");
    a.in_dtype = x.dtype();
  }
  a.in = x.data_ptr();
  a.y = y.data_ptr();
  a.y_row_stride = row_stride(y);
  a.offset_start = offset_start;
  a.add_inputs = add_inputs;
  if (token_meta_.no_lora()) return;
  throw_if_error(dispatch_lora_expand_fp8(f, token_meta_.view(), stream));
}

void PunicaWrapper::quantize_intermediate_fp8(Tensor& out, Tensor& scale, const Tensor& in,
                                              const SlotRanks& ranks, const Stream& stream) const {
  const char* op = "quantize_intermediate_fp8";
  check_device(in, device_, op, "input");
  LORAPLEX_CHECK(in.dim() == 3, op, ": input must be [num_slices, num_tokens, max_rank], got ",
                 in.describe());
  check_exact(in, device_, DType::kF32, in.shape(), op, "input");
  const int num_slices = static_cast<int>(in.size(0));
  LORAPLEX_CHECK(num_slices >= 1 && num_slices <= kernels::kMaxSlices, op, ": ", num_slices,
                 " slices, expected 1..", kernels::kMaxSlices);
  LORAPLEX_CHECK(in.size(1) == token_meta_.num_tokens(), op, ": input has ", in.size(1),
                 " tokens, the batch metadata has ", token_meta_.num_tokens());
  check_device(out, device_, op, "output");
  LORAPLEX_CHECK(is_fp8(out.dtype()), op, ": output dtype ", out.dtype(),
                 ", expected float8_e4m3 or float8_e5m2");
  check_exact(out, device_, out.dtype(), in.shape(), op, "output");
  check_device(scale, device_, op, "scale");
  const bool per_token = scale.dim() == 2;
  check_exact(scale, device_, DType::kF32,
              per_token ? Shape{num_slices, in.size(1)} : Shape{num_slices}, op, "scale");
  const int max_rank = static_cast<int>(in.size(2));
  check_ranks(ranks, num_slices, max_loras_, max_rank, device_, op);
  if (token_meta_.no_lora()) return;
  kernels::QuantizeIntermediateArgs q;
  q.num_tokens = in.size(1);
  q.num_slices = num_slices;
  q.max_loras = max_loras_;
  q.max_rank = max_rank;
  q.ranks = ranks.device().data<int32_t>();
  q.token_lora_mapping = token_meta_.view().token_lora_mapping;
  q.in = in.data<float>();
  q.out_dtype = out.dtype();
  q.out = out.data_ptr();
  q.per_token = per_token;
  q.scale = scale.data<float>();
  throw_if_error(dispatch_quantize_intermediate_fp8(q, stream));
}

void PunicaWrapper::reserve_moe_lora(int num_experts, int max_top_k, int max_block_size) {
  LORAPLEX_CHECK(num_experts >= 1 && max_top_k >= 1 && max_block_size >= 1,
                 "reserve_moe_lora: num_experts ", num_experts, ", max_top_k ", max_top_k,
                 ", max_block_size ", max_block_size, "; each must be >= 1");
  const int64_t max_pairs = static_cast<int64_t>(max_num_tokens_) * max_top_k;
  const kernels::MoeAlignSizes sizes =
      kernels::moe_align_sizes(max_pairs, num_experts, max_block_size);
  // Padded ids grow with the block size, blocks shrink with it; at most one block per pair
  // (or per expert group) whatever the block size, so both bounds hold for smaller blocks.
  const int64_t max_blocks = std::max(sizes.max_num_m_blocks, max_pairs);
  moe_sorted_ids_ = Tensor::empty({max_loras_, sizes.max_num_tokens_padded}, DType::kI32, device_);
  moe_expert_ids_ = Tensor::empty({max_loras_, max_blocks}, DType::kI32, device_);
  moe_num_tokens_post_pad_ = Tensor::empty({max_loras_}, DType::kI32, device_);
  moe_num_experts_ = num_experts;
  moe_max_top_k_ = max_top_k;
  moe_max_block_size_ = max_block_size;
}

MoeLoraAlignment PunicaWrapper::moe_lora_align_block_size(const Tensor& topk_ids, int num_experts,
                                                          int block_size,
                                                          const Tensor& adapter_enabled,
                                                          const Stream& stream, bool allow_naive) {
  const char* op = "moe_lora_align_block_size";
  LORAPLEX_CHECK(moe_num_experts_ > 0, op, ": call reserve_moe_lora once before aligning");
  check_device(topk_ids, device_, op, "topk_ids");
  const int64_t num_tokens = token_meta_.num_tokens();
  LORAPLEX_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == num_tokens, op,
                 ": topk_ids must be [num_tokens ", num_tokens, ", top_k], got ",
                 topk_ids.describe());
  check_exact(topk_ids, device_, DType::kI32, topk_ids.shape(), op, "topk_ids");
  const int top_k = static_cast<int>(topk_ids.size(1));
  LORAPLEX_CHECK(top_k >= 1 && top_k <= moe_max_top_k_, op, ": top_k ", top_k,
                 " outside the reserved 1..", moe_max_top_k_);
  LORAPLEX_CHECK(num_experts >= 1 && num_experts <= moe_num_experts_, op, ": num_experts ",
                 num_experts, " outside the reserved 1..", moe_num_experts_);
  LORAPLEX_CHECK(block_size >= 1 && block_size <= moe_max_block_size_, op, ": block_size ",
                 block_size, " outside the reserved 1..", moe_max_block_size_);
  if (adapter_enabled.defined()) {
    check_exact(adapter_enabled, device_, DType::kI32, {max_loras_}, op, "adapter_enabled");
  }
  MoeLoraAlignment out;
  out.topk_ids = topk_ids;
  out.adapter_enabled = adapter_enabled;
  out.num_experts = num_experts;
  out.block_size = block_size;
  out.naive =
      allow_naive && kernels::moe_use_naive_blocks(num_tokens, top_k, num_experts, max_loras_);
  if (out.naive) return out;
  out.sorted_ids = moe_sorted_ids_;
  out.expert_ids = moe_expert_ids_;
  out.num_tokens_post_pad = moe_num_tokens_post_pad_;
  kernels::MoeAlignArgs a;
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.num_experts = num_experts;
  a.block_size = block_size;
  a.max_loras = max_loras_;
  a.topk_ids = topk_ids.data<int32_t>();
  a.token_lora_mapping = token_meta_.view().token_lora_mapping;
  a.adapter_enabled = adapter_enabled.defined() ? adapter_enabled.data<int32_t>() : nullptr;
  a.max_num_tokens_padded = moe_sorted_ids_.size(1);
  a.max_num_m_blocks = moe_expert_ids_.size(1);
  a.sorted_ids = moe_sorted_ids_.data<int32_t>();
  a.expert_ids = moe_expert_ids_.data<int32_t>();
  a.num_tokens_post_pad = moe_num_tokens_post_pad_.data<int32_t>();
  throw_if_error(dispatch_moe_lora_align(a, stream));
  return out;
}

void PunicaWrapper::add_lora_fused_moe(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                                       std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                       const Tensor& topk_weights,
                                       const MoeLoraAlignment& alignment,
                                       const FusedMoeLoraOptions& options,
                                       const Stream& stream) const {
  const char* op = "add_lora_fused_moe";
  const int64_t num_tokens = token_meta_.num_tokens();
  const Tensor& topk_ids = alignment.topk_ids;
  check_device(topk_ids, device_, op, "alignment topk_ids");
  LORAPLEX_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == num_tokens, op,
                 ": the alignment's topk_ids are ", topk_ids.describe(), ", expected [", num_tokens,
                 ", top_k] for this batch");
  check_exact(topk_ids, device_, DType::kI32, topk_ids.shape(), op, "alignment topk_ids");
  const int top_k = static_cast<int>(topk_ids.size(1));
  check_device(y, device_, op, "y");
  LORAPLEX_CHECK(y.dim() == 3 && y.size(0) == num_tokens && y.size(1) == top_k, op,
                 ": y must be [num_tokens ", num_tokens, ", top_k ", top_k, ", width], got ",
                 y.describe());
  LORAPLEX_CHECK(is_activation(y.dtype()), op, ": y has dtype ", y.dtype(),
                 ", expected float32, float16 or bfloat16");
  check_exact(y, device_, y.dtype(), y.shape(), op, "y");
  check_device(x, device_, op, "x");
  LORAPLEX_CHECK(x.dim() == 2 && (x.size(0) == num_tokens || x.size(0) == num_tokens * top_k), op,
                 ": x must be [num_tokens ", num_tokens, ", K] (w13) or [num_tokens * top_k ",
                 num_tokens * top_k, ", K] (w2), got ", x.describe());
  check_exact(x, device_, y.dtype(), x.shape(), op, "x");
  const int num_slices = static_cast<int>(lora_a.size());
  LORAPLEX_CHECK(
      num_slices >= 1 && num_slices <= kernels::kMaxSlices && lora_b.size() == lora_a.size(), op,
      ": ", lora_a.size(), " LoRA-A and ", lora_b.size(),
      " LoRA-B slices, expected the same count in 1..", kernels::kMaxSlices);
  kernels::FusedMoeLoraArgs a;
  a.dtype = y.dtype();
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.num_experts = alignment.num_experts;
  a.hidden_in = x.size(1);
  a.x = x.data_ptr();
  a.x_rows_are_pairs = x.size(0) == num_tokens * top_k && top_k > 1;
  a.num_slices = num_slices;
  a.max_loras = max_loras_;
  for (int s = 0; s < num_slices; ++s) {
    const Tensor& wa = lora_a[s];
    const Tensor& wb = lora_b[s];
    check_device(wa, device_, op, "LoRA-A");
    check_device(wb, device_, op, "LoRA-B");
    LORAPLEX_CHECK(wa.dim() == 4 && wb.dim() == 4, op, ": LoRA-A/B of slice ", s,
                   " must be [max_loras, experts, max_rank, K] and [max_loras, experts, n, "
                   "max_rank], got ",
                   wa.describe(), " and ", wb.describe());
    if (s == 0) {
      a.max_rank = static_cast<int>(wa.size(2));
      a.n = wb.size(2);
    }
    check_exact(wa, device_, y.dtype(), {max_loras_, a.num_experts, a.max_rank, a.hidden_in}, op,
                "LoRA-A");
    check_exact(wb, device_, y.dtype(), {max_loras_, a.num_experts, a.n, a.max_rank}, op, "LoRA-B");
    a.lora_a[s] = wa.data_ptr();
    a.lora_b[s] = wb.data_ptr();
  }
  LORAPLEX_CHECK(options.offset >= 0 && options.offset + num_slices * a.n <= y.size(2), op,
                 ": slices cover columns [", options.offset, ", ",
                 options.offset + num_slices * a.n, ") but y rows are ", y.size(2), " wide");
  check_ranks(ranks, num_slices, max_loras_, a.max_rank, device_, op);
  a.ranks = ranks.device().data<int32_t>();
  a.token_lora_mapping = token_meta_.view().token_lora_mapping;
  if (alignment.adapter_enabled.defined()) {
    check_exact(alignment.adapter_enabled, device_, DType::kI32, {max_loras_}, op,
                "adapter_enabled");
    a.adapter_enabled = alignment.adapter_enabled.data<int32_t>();
  }
  a.topk_ids = topk_ids.data<int32_t>();
  a.mul_routed_weight = options.mul_routed_weight;
  if (options.mul_routed_weight) {
    check_exact(topk_weights, device_, DType::kF32, {num_tokens, top_k}, op, "topk_weights");
    a.topk_weights = topk_weights.data<float>();
  }
  a.naive_blocks = alignment.naive;
  a.block_size = alignment.block_size;
  if (!alignment.naive) {
    LORAPLEX_CHECK(alignment.sorted_ids.defined() && alignment.expert_ids.defined() &&
                       alignment.num_tokens_post_pad.defined(),
                   op, ": the alignment has no blocks; use moe_lora_align_block_size");
    a.max_num_tokens_padded = alignment.sorted_ids.size(1);
    a.max_num_m_blocks = alignment.expert_ids.size(1);
    a.sorted_ids = alignment.sorted_ids.data<int32_t>();
    a.expert_ids = alignment.expert_ids.data<int32_t>();
    a.num_tokens_post_pad = alignment.num_tokens_post_pad.data<int32_t>();
  }
  a.out = y.data_ptr();
  a.out_row_width = y.size(2);
  a.offset = options.offset;
  a.add_inputs = options.add_inputs;
  if (token_meta_.no_lora()) return;
  const int64_t mid =
      kernels::fused_moe_lora_mid_floats(num_tokens * top_k, num_slices, a.max_rank);
  if (!moe_lora_mid_.defined() || moe_lora_mid_.numel() < mid) {
    moe_lora_mid_ = Tensor::empty({std::max<int64_t>(mid, 1)}, DType::kF32, device_);
  }
  a.lora_mid = moe_lora_mid_.data<float>();
  throw_if_error(dispatch_fused_moe_lora(a, stream));
}

void PunicaWrapper::add_lora_moe_w13(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                                     std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                     const MoeLoraAlignment& alignment, const Stream& stream,
                                     int64_t offset) const {
  LORAPLEX_CHECK(lora_a.size() == 2 && lora_b.size() == 2, "add_lora_moe_w13: ", lora_a.size(),
                 " LoRA-A and ", lora_b.size(), " LoRA-B slices, expected 2 (gate, up)");
  LORAPLEX_CHECK(x.defined() && x.dim() == 2 && x.size(0) == token_meta_.num_tokens(),
                 "add_lora_moe_w13: x must be [num_tokens ", token_meta_.num_tokens(),
                 ", hidden], got ", x.describe());
  FusedMoeLoraOptions options;
  options.offset = offset;
  add_lora_fused_moe(y, x, lora_a, lora_b, ranks, Tensor(), alignment, options, stream);
}

void PunicaWrapper::add_lora_moe_w2(Tensor& y, const Tensor& x, const Tensor& lora_a,
                                    const Tensor& lora_b, const SlotRanks& ranks,
                                    const Tensor& topk_weights, const MoeLoraAlignment& alignment,
                                    const Stream& stream, int64_t offset) const {
  const int64_t pairs = alignment.topk_ids.defined() && alignment.topk_ids.dim() == 2
                            ? token_meta_.num_tokens() * alignment.topk_ids.size(1)
                            : -1;
  LORAPLEX_CHECK(x.defined() && x.dim() == 2 && x.size(0) == pairs, "add_lora_moe_w2: x must be ",
                 "[num_tokens * top_k ", pairs, ", intermediate] (one row per pair), got ",
                 x.describe());
  const Tensor a[1] = {lora_a};
  const Tensor b[1] = {lora_b};
  FusedMoeLoraOptions options;
  options.mul_routed_weight = true;
  options.offset = offset;
  add_lora_fused_moe(y, x, a, b, ranks, topk_weights, alignment, options, stream);
}

}  // namespace loraplex
