// Shrink and expand on CUDA: the entry points and the generic kernels.
//
// lora_shrink runs the decode kernel (decode_lora.cu) for small batches and the tensor-core
// prefill shrink (prefill_shrink.cu) for larger ones; lora_expand runs the pipelined
// tensor-core expand (expand_tc.cu) when rows are aligned. Generic kernels (any dtype, any
// strides) handle everything else and the BGMV forms.

#include <algorithm>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/cuda/lora_paths.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Generic kernels.

struct GenericShrinkParams {
  const void* x;
  int64_t x_stride;
  int64_t hidden;
  const void* a[kMaxSlices];
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  const int32_t* mapping;
  float scale;
  void* out;
  int64_t num_tokens;
};

constexpr int kGenericThreads = 256;

// One block per (token, slice); each warp computes whole rank rows (dot over hidden).
template <typename T, typename OutT>
__global__ void __launch_bounds__(kGenericThreads) shrink_generic_kernel(GenericShrinkParams p) {
  const int64_t t = blockIdx.x;
  const int s = static_cast<int>(blockIdx.y);
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras)) return;
  const int rank = p.ranks[s * p.max_loras + slot];
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride;
  const T* a = static_cast<const T*>(p.a[s]) + static_cast<int64_t>(slot) * p.max_rank * p.hidden;
  OutT* out = static_cast<OutT*>(p.out) + (static_cast<int64_t>(s) * p.num_tokens + t) * p.max_rank;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int r = warp; r < rank; r += kGenericThreads / 32) {
    const T* row = a + static_cast<int64_t>(r) * p.hidden;
    float acc = 0.0f;
    for (int64_t k = lane; k < p.hidden; k += 32) acc += to_float(x[k]) * to_float(row[k]);
    acc = warp_sum(acc);
    if (lane == 0) out[r] = from_float<OutT>(p.scale * acc);
  }
}

struct GenericExpandParams {
  const void* in;
  int num_slices;
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t col_begin[kMaxSlices + 1];  // prefix of widths; col_begin[num_slices] = total
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  const int32_t* mapping;
  void* y;
  int64_t y_stride;
  int64_t offset_start;
  bool add_inputs;
  int64_t num_tokens;
};

// One thread per output column of one token.
template <typename T, typename InT>
__global__ void __launch_bounds__(kGenericThreads) expand_generic_kernel(GenericExpandParams p) {
  const int64_t t = blockIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras) || col >= p.col_begin[p.num_slices]) return;
  int s = 0;
  while (col >= p.col_begin[s + 1]) ++s;
  const int64_t j = col - p.col_begin[s];
  const int rank = p.ranks[s * p.max_loras + slot];
  const InT* in = static_cast<const InT*>(p.in) + (s * p.num_tokens + t) * p.max_rank;
  const T* b = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + j) * p.max_rank;
  float acc = 0.0f;
  for (int r = 0; r < rank; ++r) acc += to_float(in[r]) * to_float(b[r]);
  T* y = static_cast<T*>(p.y) + t * p.y_stride + p.offset_start + col;
  if (p.add_inputs) acc += to_float(*y);
  *y = from_float<T>(acc);
}

Status launch_shrink_generic(const ShrinkArgs& a, const int32_t* mapping, StreamHandle stream) {
  GenericShrinkParams p{};
  p.x = a.x;
  p.x_stride = a.x_row_stride;
  p.hidden = a.hidden;
  for (int s = 0; s < a.num_slices; ++s) p.a[s] = a.lora_a[s];
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.ranks = a.ranks;
  p.mapping = mapping;
  p.scale = a.scale;
  p.out = a.out;
  p.num_tokens = a.num_tokens;
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_slices));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.out_dtype == DType::kF32) {
      shrink_generic_kernel<T, float><<<grid, kGenericThreads, 0, s>>>(p);
    } else {
      shrink_generic_kernel<T, T><<<grid, kGenericThreads, 0, s>>>(p);
    }
  });
  return launch_status("shrink_generic_kernel");
}

GenericExpandParams generic_expand_params(const ExpandArgs& a, const int32_t* mapping) {
  GenericExpandParams p{};
  p.in = a.in;
  p.num_slices = a.num_slices;
  p.col_begin[0] = 0;
  for (int s = 0; s < a.num_slices; ++s) {
    p.b[s] = a.lora_b[s];
    p.width[s] = a.slice_width[s];
    p.col_begin[s + 1] = p.col_begin[s] + a.slice_width[s];
  }
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.ranks = a.ranks;
  p.mapping = mapping;
  p.y = a.y;
  p.y_stride = a.y_row_stride;
  p.offset_start = a.offset_start;
  p.add_inputs = a.add_inputs;
  p.num_tokens = a.num_tokens;
  return p;
}

Status launch_expand_generic(const ExpandArgs& a, const int32_t* mapping, StreamHandle stream) {
  const GenericExpandParams p = generic_expand_params(a, mapping);
  const int64_t total = p.col_begin[a.num_slices];
  const int64_t col_blocks = ceil_div(total, kGenericThreads);
  LORAPLEX_ENSURE(col_blocks <= 65535, "lora_expand: ", total, " output columns exceed the ",
                  65535 * kGenericThreads, " the generic kernel covers");
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(col_blocks));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.in_dtype == DType::kF32) {
      expand_generic_kernel<T, float><<<grid, kGenericThreads, 0, s>>>(p);
    } else {
      expand_generic_kernel<T, T><<<grid, kGenericThreads, 0, s>>>(p);
    }
  });
  return launch_status("expand_generic_kernel");
}

Status check_meta(const LoraMetaView& meta, int64_t num_tokens, int max_loras, const char* op) {
  LORAPLEX_ENSURE(meta.num_tokens == num_tokens, op, ": metadata built for ", meta.num_tokens,
                  " tokens, the call has ", num_tokens);
  LORAPLEX_ENSURE(meta.max_loras == max_loras, op, ": metadata built for max_loras ",
                  meta.max_loras, ", the weights have ", max_loras);
  LORAPLEX_ENSURE(meta.token_lora_mapping != nullptr && meta.sorted_token_indices != nullptr &&
                      meta.active_lora_ids != nullptr && meta.num_tokens_per_lora != nullptr &&
                      meta.lora_token_start_loc != nullptr && meta.num_active_loras != nullptr,
                  op, ": metadata has a null buffer");
  return Status();
}

}  // namespace

Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(args));
  LORAPLEX_RETURN_IF_ERROR(check_meta(meta, args.num_tokens, args.max_loras, "lora_shrink"));
  if (args.num_tokens == 0) return Status();
  if (decode_shrink_applies(args, meta)) return decode_shrink(args, meta, stream);
  if (prefill_shrink_applies(args)) return prefill_shrink(args, meta, stream);
  return launch_shrink_generic(args, meta.token_lora_mapping, stream);
}

Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(args));
  LORAPLEX_RETURN_IF_ERROR(check_meta(meta, args.num_tokens, args.max_loras, "lora_expand"));
  if (args.num_tokens == 0) return Status();
  if (tc_expand_applies(args)) return tc_expand(args, meta, stream);
  return launch_expand_generic(args, meta.token_lora_mapping, stream);
}

Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(args));
  if (args.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(token_lora_mapping != nullptr, "bgmv_shrink: token mapping is null");
  return launch_shrink_generic(args, token_lora_mapping, stream);
}

Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(args));
  if (args.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(token_lora_mapping != nullptr, "bgmv_expand: token mapping is null");
  return launch_expand_generic(args, token_lora_mapping, stream);
}

}  // namespace loraplex::kernels::cuda
