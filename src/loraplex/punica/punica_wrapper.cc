#include "loraplex/punica/punica_wrapper.h"

#include "loraplex/core/error.h"
#include "loraplex/kernels/lora_ops_checks.h"
#include "loraplex/punica/op_dispatch.h"

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

// A 2-D activation with contiguous rows (the row stride may exceed the width).
void check_rows(const Tensor& t, Device device, const char* op, const char* name) {
  check_device(t, device, op, name);
  LORAPLEX_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.describe());
  LORAPLEX_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name,
                 " needs contiguous rows (last stride 1), got strides ", shape_str(t.strides()));
  LORAPLEX_CHECK(is_activation(t.dtype()), op, ": ", name, " has dtype ", t.dtype(),
                 ", expected float32, float16 or bfloat16");
}

// The ranks' host copy must fit the stacked weights and the slice count of the call.
void check_ranks(const SlotRanks& ranks, int num_slices, int max_loras, int max_rank,
                 const char* op) {
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

kernels::ShrinkArgs make_shrink(const Tensor& out, const Tensor& x, std::span<const Tensor> lora_a,
                                const SlotRanks& ranks, float scale, const LoraBatchMeta& meta,
                                const char* op) {
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
  a.x_row_stride = x.size(1) <= 1 ? x.size(1) : x.stride(0);
  a.num_slices = num_slices;
  a.max_loras = meta.max_loras();
  for (int s = 0; s < num_slices; ++s) {
    const StackDims d =
        check_stack(lora_a[s], device, x.dtype(), meta.max_loras(), op, "LoRA-A", s);
    LORAPLEX_CHECK(d.cols == a.hidden, op, ": LoRA-A of slice ", s, " has input size ", d.cols,
                   ", x has ", a.hidden);
    if (s == 0) a.max_rank = static_cast<int>(d.rows);
    LORAPLEX_CHECK(d.rows == a.max_rank, op, ": LoRA-A of slice ", s, " has rank ", d.rows,
                   ", slice 0 has ", a.max_rank);
    a.lora_a[s] = lora_a[s].data_ptr();
  }
  check_ranks(ranks, num_slices, a.max_loras, a.max_rank, op);
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
  check_ranks(ranks, num_slices, a.max_loras, a.max_rank, op);
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
  a.y_row_stride = y.size(1) <= 1 ? y.size(1) : y.stride(0);
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
      device_(device),
      token_meta_(max_loras, max_num_tokens, device),
      sampler_meta_(max_loras, max_num_seqs, device) {}

void PunicaWrapper::update_metadata(std::span<const int32_t> token_slots,
                                    std::span<const int32_t> sampler_slots, const Stream& stream) {
  token_meta_.prepare(token_slots, stream);
  sampler_meta_.prepare(sampler_slots, stream);
}

void PunicaWrapper::add_shrink(Tensor& y, const Tensor& x, std::span<const Tensor> lora_a,
                               const SlotRanks& ranks, float scale, const Stream& stream) const {
  const kernels::ShrinkArgs a = make_shrink(y, x, lora_a, ranks, scale, token_meta_, "add_shrink");
  if (token_meta_.no_lora()) return;
  throw_if_error(dispatch_lora_shrink(a, token_meta_.view(), stream));
}

void PunicaWrapper::add_expand(Tensor& y, const Tensor& x, std::span<const Tensor> lora_b,
                               const SlotRanks& ranks, int64_t offset_start, bool add_inputs,
                               const Stream& stream) const {
  const kernels::ExpandArgs a =
      make_expand(y, x, lora_b, ranks, offset_start, add_inputs, token_meta_, "add_expand");
  if (token_meta_.no_lora()) return;
  throw_if_error(dispatch_lora_expand(a, token_meta_.view(), stream));
}

void PunicaWrapper::lora_linear_with_meta(Tensor& y, const Tensor& x,
                                          std::span<const Tensor> lora_a,
                                          std::span<const Tensor> lora_b, const SlotRanks& ranks,
                                          float scale, Tensor& workspace, const LoraBatchMeta& meta,
                                          const Stream& stream) const {
  const char* op = "add_lora_linear";
  LORAPLEX_CHECK(lora_a.size() == lora_b.size(), op, ": ", lora_a.size(), " LoRA-A slices but ",
                 lora_b.size(), " LoRA-B slices");
  LORAPLEX_CHECK(!lora_a.empty() && lora_a[0].defined() && lora_a[0].dim() == 3, op,
                 ": LoRA-A of slice 0 must be [max_loras, max_rank, in]");
  const int num_slices = static_cast<int>(lora_a.size());
  Tensor buffer = workspace_view(workspace, num_slices, x.dim() == 2 ? x.size(0) : 0,
                                 lora_a[0].size(1), meta.device(), op);
  const kernels::ShrinkArgs s = make_shrink(buffer, x, lora_a, ranks, scale, meta, op);
  const kernels::ExpandArgs e = make_expand(y, buffer, lora_b, ranks, 0, true, meta, op);
  if (meta.no_lora()) return;
  throw_if_error(dispatch_lora_linear(s, e, meta.view(), stream));
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
  check_ranks(ranks, 1, max_loras_, static_cast<int>(ad.cols), op);
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
  a.y_row_stride = y.size(1) <= 1 ? y.size(1) : y.stride(0);
  throw_if_error(dispatch_lora_embedding(a, stream));
}

}  // namespace loraplex
