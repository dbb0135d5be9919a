#include "loraplex/layers/layer_util.h"

#include "loraplex/core/error.h"
#include "loraplex/kernels/dispatch/base_ops.h"
#include "loraplex/kernels/fp8_quant.h"

namespace loraplex {

std::vector<LoraSliceWeights> split_fused_lora(const Tensor& a, const Tensor& b,
                                               const std::vector<int64_t>& sizes) {
  LORAPLEX_CHECK(a.defined() && b.defined() && a.dim() == 2 && b.dim() == 2,
                 "split_fused_lora: needs 2-D A [rank, in] and B [out, rank], got A ",
                 a.defined() ? a.describe() : "undefined", ", B ",
                 b.defined() ? b.describe() : "undefined");
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  LORAPLEX_CHECK(b.size(0) == total, "split_fused_lora: B has ", b.size(0),
                 " rows, the slices sum to ", total);
  std::vector<LoraSliceWeights> out;
  int64_t off = 0;
  for (int64_t s : sizes) {
    out.push_back({a, b.narrow(0, off, s)});
    off += s;
  }
  return out;
}

namespace layers_detail {

Shard shard_of(int64_t size, int64_t units, int tp, int rank, const std::string& what) {
  if (units <= 0) units = size;
  LORAPLEX_CHECK(size >= 1 && units >= 1 && size % units == 0, what, ": width ", size,
                 " is not a whole number of ", units, " units");
  const int groups = static_cast<int>(std::min<int64_t>(tp, units));
  LORAPLEX_CHECK(units % groups == 0 && tp % groups == 0, what, ": ", units,
                 " units (heads) cannot be split over tensor-parallel size ", tp,
                 " (need units divisible by tp, or tp divisible by units)");
  Shard s;
  s.groups = groups;
  s.index = rank / (tp / groups);
  s.size = size / groups;
  s.start = s.index * s.size;
  return s;
}

int check_lora_pair(const LoraSliceWeights& w, int64_t in, int64_t out, int max_rank,
                    const std::string& where) {
  if (!w.a.defined() && !w.b.defined()) return 0;
  LORAPLEX_CHECK(w.a.defined() && w.b.defined(), where,
                 ": LoRA-A and LoRA-B must both be given or both be undefined (A ",
                 w.a.defined() ? "given" : "undefined", ", B ",
                 w.b.defined() ? "given" : "undefined", ")");
  for (const Tensor* t : {&w.a, &w.b}) {
    const char* name = t == &w.a ? "LoRA-A" : "LoRA-B";
    LORAPLEX_CHECK(t->device().is_cpu(), where, ": ", name, " must be on the CPU, got ",
                   t->describe());
    LORAPLEX_CHECK(is_floating(t->dtype()), where, ": ", name, " has dtype ", t->dtype(),
                   ", expected a float dtype");
    LORAPLEX_CHECK(t->dim() == 2, where, ": ", name, " must be 2-D, got ", t->describe());
  }
  const int64_t rank = w.a.size(0);
  LORAPLEX_CHECK(w.a.size(1) == in, where, ": LoRA-A is ", shape_str(w.a.shape()),
                 ", expected [rank, ", in, "] (in_features ", in, ")");
  LORAPLEX_CHECK(w.b.size(0) == out && w.b.size(1) == rank, where, ": LoRA-B is ",
                 shape_str(w.b.shape()), ", expected [", out, ", ", rank,
                 "] (out_features of the slice, rank of LoRA-A)");
  LORAPLEX_CHECK(rank >= 1 && rank <= max_rank, where, ": adapter rank ", rank,
                 " outside [1, max_lora_rank ", max_rank, "]");
  return static_cast<int>(rank);
}

Tensor host_block(const Tensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc, DType dtype) {
  Tensor out = Tensor::empty({nr, nc}, dtype);
  out.copy_from(t.narrow(0, r0, nr).narrow(1, c0, nc));
  return out;
}

Fp8Block fp8_block(const Tensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const Tensor f = host_block(t, r0, nr, c0, nc, DType::kF32);
  Fp8Block b;
  b.codes = Tensor::empty({nr, nc}, DType::kF8E4M3);
  b.scales = Tensor::empty({nr}, DType::kF32);
  kernels::QuantizeRowsFp8Args a;
  a.dtype = DType::kF32;
  a.m = nr;
  a.k = nc;
  a.x = f.data_ptr();
  a.x_row_stride = nc;
  a.group = nc;
  a.q = static_cast<uint8_t*>(b.codes.data_ptr());
  a.scale = b.scales.data<float>();
  throw_if_error(kernels::cpu::quantize_rows_fp8(a));
  return b;
}

bool uploadable(const Tensor& t, DType dtype) {
  if (!t.is_pinned() || t.dtype() != dtype || t.dim() != 2) return false;
  return t.is_contiguous() || (t.stride(1) == 1 && t.stride(0) >= t.size(1));
}

Tensor source_block(const Tensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc, DType dtype) {
  const Tensor view = t.narrow(0, r0, nr).narrow(1, c0, nc);
  return uploadable(view, dtype) ? view : host_block(t, r0, nr, c0, nc, dtype);
}

void apply_writes(const std::vector<PendingWrite>& writes, const Stream& stream) {
  for (const PendingWrite& w : writes) {
    Tensor dst = w.dst;
    if (!w.src.defined()) {
      dst.zero_(stream);
    } else if (w.src.is_pinned()) {
      dst.copy_from_async(w.src, stream);
    } else {
      dst.copy_from(w.src, stream);
    }
  }
}

void write_int32(Tensor& t, int32_t value, const Stream& stream) {
  LORAPLEX_CHECK(t.defined() && t.dtype() == DType::kI32 && t.numel() == 1,
                 "write_int32 needs an int32 [1] view, got ",
                 t.defined() ? t.describe() : "undefined");
  LORAPLEX_CHECK(stream.device() == t.device(), "write_int32: the tensor is on ", t.device(),
                 ", the stream on ", stream.device());
  kernels::WriteColumnArgs a;
  a.table = t.data<int32_t>();
  a.row_stride = 1;
  a.count = 1;
  a.values[0] = value;
  throw_if_error(kernels::dispatch_write_column(a, stream));
}

void check_copy_stream(const Stream& stream, Device device, const std::string& layer) {
  LORAPLEX_CHECK(stream.device() == device, layer, ": copy stream is on ", stream.device(),
                 ", the layer is on ", device);
}

Tensor workspace_view(const Tensor& flat, const Shape& shape) {
  const int64_t n = shape_numel(shape);
  LORAPLEX_CHECK(n <= flat.numel(), "layer workspace of ", flat.numel(),
                 " elements is too small for ", shape_str(shape));
  return flat.narrow(0, 0, n).view(shape);
}

Tensor cyclic_rank_rows(const Tensor& a_converted, int tp, int rank) {
  const int64_t r = a_converted.size(0);
  const int64_t c = ceil_div(r, tp);
  Tensor out = Tensor::zeros({c, a_converted.size(1)}, a_converted.dtype());
  for (int64_t j = 0; j < c; ++j) {
    const int64_t k = j * tp + rank;
    if (k < r) {
      Tensor row = out.select(0, j);
      row.copy_from(a_converted.select(0, k));
    }
  }
  return out;
}

void check_activation(const Tensor& t, Device device, DType dtype, const char* layer,
                      const char* name) {
  LORAPLEX_CHECK(t.defined(), layer, ": ", name, " is undefined");
  LORAPLEX_CHECK(t.device() == device, layer, ": ", name, " is on ", t.device(),
                 ", the layer is on ", device);
  LORAPLEX_CHECK(t.dtype() == dtype, layer, ": ", name, " has dtype ", t.dtype(),
                 ", the layer computes in ", dtype);
  LORAPLEX_CHECK(t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1), layer, ": ", name,
                 " must be 2-D with contiguous rows, got ", t.describe(), " strides ",
                 shape_str(t.strides()));
}

}  // namespace layers_detail
}  // namespace loraplex
