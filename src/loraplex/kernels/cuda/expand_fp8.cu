// FP8 LoRA-B expand (e4m3/e5m2 weights with per-tensor, per-channel or block scales;
// weight-only or W8A8 with an fp8 intermediate), the fp8 quantisation of the shrink result,
// and the shrink with fp8 LoRA-A (per-row scales: the fp8 adapter storage). Conversions use the
// hardware's round-to-nearest-even with saturation, as the CPU reference does.

#include <cuda_fp8.h>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float fp8_to_float(uint8_t bits, bool e4m3) {
  const __half_raw h =
      __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits), e4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

__device__ __forceinline__ uint8_t float_to_fp8(float v, bool e4m3) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2));
}

struct Fp8ExpandParams {
  const void* in;
  int in_kind;  // 0: f32, 1: same dtype as y, 2: fp8 (W8A8)
  bool in_e4m3;
  bool in_scale_per_token;
  const float* in_scale;
  int num_slices;
  const uint8_t* b[kMaxSlices];
  const float* b_scale[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t col_begin[kMaxSlices + 1];
  bool w_e4m3;
  int scale_kind;  // Fp8ScaleKind
  int group_n;
  int group_k;
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

// One thread per output column of one token (fp8 expand is not on the hot decode path).
template <typename T>
__global__ void __launch_bounds__(kThreads) expand_fp8_kernel(Fp8ExpandParams p) {
  const int64_t t = blockIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras) || col >= p.col_begin[p.num_slices]) return;
  int s = 0;
  while (col >= p.col_begin[s + 1]) ++s;
  const int64_t j = col - p.col_begin[s];
  const int64_t n = p.width[s];
  const int rank = p.ranks[s * p.max_loras + slot];
  const int64_t row = (s * p.num_tokens + t) * p.max_rank;
  float in_scale = 1.0f;
  if (p.in_kind == 2) in_scale = p.in_scale[p.in_scale_per_token ? s * p.num_tokens + t : s];
  const uint8_t* w = p.b[s] + (slot * n + j) * p.max_rank;
  const float* scales = p.b_scale[s];
  const int64_t blocks_n = (n + p.group_n - 1) / p.group_n;
  const int64_t blocks_k = (p.max_rank + p.group_k - 1) / p.group_k;
  float acc = 0.0f;
  for (int r = 0; r < rank; ++r) {
    float v;
    if (p.in_kind == 0) {
      v = static_cast<const float*>(p.in)[row + r];
    } else if (p.in_kind == 1) {
      v = to_float(static_cast<const T*>(p.in)[row + r]);
    } else {
      v = fp8_to_float(static_cast<const uint8_t*>(p.in)[row + r], p.in_e4m3) * in_scale;
    }
    float scale;
    if (p.scale_kind == static_cast<int>(Fp8ScaleKind::kPerTensor)) {
      scale = scales[slot];
    } else if (p.scale_kind == static_cast<int>(Fp8ScaleKind::kPerChannel)) {
      scale = scales[slot * n + j];
    } else {
      scale = scales[(slot * blocks_n + j / p.group_n) * blocks_k + r / p.group_k];
    }
    acc += v * fp8_to_float(w[r], p.w_e4m3) * scale;
  }
  T* y = static_cast<T*>(p.y) + t * p.y_stride + p.offset_start + col;
  if (p.add_inputs) acc += to_float(*y);
  *y = from_float<T>(acc);
}

struct QuantParams {
  int64_t num_tokens;
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  const int32_t* mapping;
  const float* in;
  uint8_t* out;
  bool e4m3;
  float qmax;
  float* scale;
};

// Per (slice, token) scales: one warp per row.
__global__ void quantize_per_token_kernel(QuantParams p) {
  const int64_t t = blockIdx.x;
  const int s = static_cast<int>(blockIdx.y);
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.max_loras)) return;
  const int rank = p.ranks[s * p.max_loras + slot];
  const int64_t row = (s * p.num_tokens + t) * p.max_rank;
  const int lane = static_cast<int>(threadIdx.x);
  float m = 0.0f;
  for (int r = lane; r < rank; r += 32) m = fmaxf(m, fabsf(p.in[row + r]));
  m = warp_max(m);
  const float scale = m > 0.0f ? m / p.qmax : 1.0f;
  if (lane == 0) p.scale[s * p.num_tokens + t] = scale;
  for (int r = lane; r < rank; r += 32)
    p.out[row + r] = float_to_fp8(p.in[row + r] / scale, p.e4m3);
}

constexpr int kQuantBlock = 1024;

// One scale per slice: one block per slice reduces |v| over every LoRA token's row.
__global__ void __launch_bounds__(kQuantBlock) quantize_per_slice_kernel(QuantParams p) {
  const int s = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  __shared__ float warp_amax[kQuantBlock / 32];
  __shared__ float slice_scale;
  float m = 0.0f;
  for (int64_t t = warp; t < p.num_tokens; t += kQuantBlock / 32) {
    const int32_t slot = p.mapping[t];
    if (!valid_slot(slot, p.max_loras)) continue;
    const int rank = p.ranks[s * p.max_loras + slot];
    const int64_t row = (s * p.num_tokens + t) * p.max_rank;
    for (int r = lane; r < rank; r += 32) m = fmaxf(m, fabsf(p.in[row + r]));
  }
  m = warp_max(m);
  if (lane == 0) warp_amax[warp] = m;
  __syncthreads();
  if (warp == 0) {
    float v = warp_amax[lane];
    v = warp_max(v);
    if (lane == 0) {
      slice_scale = v > 0.0f ? v / p.qmax : 1.0f;
      p.scale[s] = slice_scale;
    }
  }
  __syncthreads();
  const float scale = slice_scale;
  for (int64_t t = warp; t < p.num_tokens; t += kQuantBlock / 32) {
    const int32_t slot = p.mapping[t];
    if (!valid_slot(slot, p.max_loras)) continue;
    const int rank = p.ranks[s * p.max_loras + slot];
    const int64_t row = (s * p.num_tokens + t) * p.max_rank;
    for (int r = lane; r < rank; r += 32) {
      p.out[row + r] = float_to_fp8(p.in[row + r] / scale, p.e4m3);
    }
  }
}

struct Fp8ShrinkParams {
  ShrinkArgs b;
  const float* a_scale[kMaxSlices];
  const int32_t* mapping;
};

constexpr int kShrinkWarps = 4;

// One block per (token, slice), a warp per A row: x . e4m3(A[r]) over k, times the row's scale.
// Plain and obviously correct; the tuned bf16 shrinks are not built for fp8 A.
template <typename T>
__global__ void __launch_bounds__(kShrinkWarps * 32) shrink_fp8_kernel(Fp8ShrinkParams p) {
  const int64_t t = blockIdx.x;
  const int s = static_cast<int>(blockIdx.y);
  const int32_t slot = p.mapping[t];
  if (!valid_slot(slot, p.b.max_loras)) return;
  const int rank = p.b.ranks[s * p.b.max_loras + slot];
  const int64_t k = p.b.hidden;
  const int64_t rows = p.b.a_slot_rows > 0 ? p.b.a_slot_rows : p.b.max_rank;
  const T* x = static_cast<const T*>(p.b.x) + t * p.b.x_row_stride;
  const uint8_t* a = static_cast<const uint8_t*>(p.b.lora_a[s]) + slot * rows * k;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float* out = static_cast<float*>(p.b.out) + (s * p.b.num_tokens + t) * p.b.max_rank;
  for (int r = warp; r < rank; r += kShrinkWarps) {
    float acc = 0.0f;
    for (int64_t c = lane; c < k; c += 32) acc += to_float(x[c]) * fp8_to_float(a[r * k + c], true);
    acc = warp_sum(acc);
    if (lane == 0) out[r] = p.b.scale * p.a_scale[s][slot * rows + r] * acc;
  }
}

}  // namespace

Status lora_shrink_fp8(const ShrinkFp8Args& args, const LoraMetaView& meta, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_fp8_args(args));
  const ShrinkArgs& b = args.base;
  LORAPLEX_ENSURE(meta.num_tokens == b.num_tokens, "lora_shrink_fp8: metadata built for ",
                  meta.num_tokens, " tokens, the call has ", b.num_tokens);
  if (b.num_tokens == 0) return Status();
  Fp8ShrinkParams p{};
  p.b = b;
  for (int s = 0; s < b.num_slices; ++s) p.a_scale[s] = args.a_scale[s];
  p.mapping = meta.token_lora_mapping;
  const dim3 grid(static_cast<unsigned>(b.num_tokens), static_cast<unsigned>(b.num_slices));
  auto st = static_cast<cudaStream_t>(stream);
  dispatch_device_dtype(b.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    shrink_fp8_kernel<T><<<grid, kShrinkWarps * 32, 0, st>>>(p);
  });
  return launch_status("shrink_fp8_kernel");
}

Status lora_expand_fp8(const ExpandFp8Args& args, const LoraMetaView& meta, StreamHandle stream) {
  const ExpandArgs& b = args.base;
  ExpandArgs plain = b;
  if (args.w8a8) plain.in_dtype = DType::kF32;  // the fp8 intermediate is checked below
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(plain));
  LORAPLEX_ENSURE(is_fp8(args.weight_dtype), "lora_expand_fp8: weight dtype ", args.weight_dtype,
                  ", expected float8_e4m3 or float8_e5m2");
  if (args.scale_kind == Fp8ScaleKind::kPerBlock) {
    LORAPLEX_ENSURE(args.group_n >= 1 && args.group_k >= 1, "lora_expand_fp8: block scale groups ",
                    args.group_n, "x", args.group_k, ", expected >= 1");
  }
  for (int s = 0; s < b.num_slices; ++s) {
    LORAPLEX_ENSURE(args.b_scale[s] != nullptr, "lora_expand_fp8: scale of slice ", s, " is null");
  }
  if (args.w8a8) {
    LORAPLEX_ENSURE(is_fp8(args.in_fp8_dtype), "lora_expand_fp8: W8A8 intermediate dtype ",
                    args.in_fp8_dtype, ", expected float8_e4m3 or float8_e5m2");
    LORAPLEX_ENSURE(args.in_scale != nullptr, "lora_expand_fp8: W8A8 needs the intermediate scale");
  }
  LORAPLEX_ENSURE(meta.num_tokens == b.num_tokens, "lora_expand_fp8: metadata built for ",
                  meta.num_tokens, " tokens, the call has ", b.num_tokens);
  if (b.num_tokens == 0) return Status();
  Fp8ExpandParams p{};
  p.in = b.in;
  p.in_kind = args.w8a8 ? 2 : (b.in_dtype == DType::kF32 ? 0 : 1);
  p.in_e4m3 = args.in_fp8_dtype == DType::kF8E4M3;
  p.in_scale_per_token = args.in_scale_per_token;
  p.in_scale = args.in_scale;
  p.num_slices = b.num_slices;
  p.col_begin[0] = 0;
  for (int s = 0; s < b.num_slices; ++s) {
    p.b[s] = static_cast<const uint8_t*>(b.lora_b[s]);
    p.b_scale[s] = args.b_scale[s];
    p.width[s] = b.slice_width[s];
    p.col_begin[s + 1] = p.col_begin[s] + b.slice_width[s];
  }
  p.w_e4m3 = args.weight_dtype == DType::kF8E4M3;
  p.scale_kind = static_cast<int>(args.scale_kind);
  p.group_n = std::max(1, args.group_n);
  p.group_k = std::max(1, args.group_k);
  p.max_loras = b.max_loras;
  p.max_rank = b.max_rank;
  p.ranks = b.ranks;
  p.mapping = meta.token_lora_mapping;
  p.y = b.y;
  p.y_stride = b.y_row_stride;
  p.offset_start = b.offset_start;
  p.add_inputs = b.add_inputs;
  p.num_tokens = b.num_tokens;
  const int64_t col_blocks = ceil_div(p.col_begin[b.num_slices], kThreads);
  LORAPLEX_ENSURE(col_blocks <= 65535, "lora_expand_fp8: ", p.col_begin[b.num_slices],
                  " output columns are too many for one launch");
  const dim3 grid(static_cast<unsigned>(b.num_tokens), static_cast<unsigned>(col_blocks));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_device_dtype(b.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    expand_fp8_kernel<T><<<grid, kThreads, 0, s>>>(p);
  });
  return launch_status("expand_fp8_kernel");
}

Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& a, StreamHandle stream) {
  LORAPLEX_ENSURE(is_fp8(a.out_dtype), "quantize_intermediate_fp8: output dtype ", a.out_dtype,
                  ", expected float8_e4m3 or float8_e5m2");
  LORAPLEX_ENSURE(a.num_slices >= 1 && a.num_slices <= kMaxSlices && a.max_loras >= 1 &&
                      a.max_rank >= 1 && a.num_tokens >= 0,
                  "quantize_intermediate_fp8: bad sizes (slices ", a.num_slices, ", max_loras ",
                  a.max_loras, ", max_rank ", a.max_rank, ", tokens ", a.num_tokens, ")");
  LORAPLEX_ENSURE(a.ranks != nullptr && a.scale != nullptr,
                  "quantize_intermediate_fp8: null ranks or scale");
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(a.token_lora_mapping != nullptr && a.in != nullptr && a.out != nullptr,
                  "quantize_intermediate_fp8: null mapping, input or output");
  QuantParams p{};
  p.num_tokens = a.num_tokens;
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.ranks = a.ranks;
  p.mapping = a.token_lora_mapping;
  p.in = a.in;
  p.out = static_cast<uint8_t*>(a.out);
  p.e4m3 = a.out_dtype == DType::kF8E4M3;
  p.qmax = p.e4m3 ? kE4M3Max : kE5M2Max;
  p.scale = a.scale;
  auto s = static_cast<cudaStream_t>(stream);
  if (a.per_token) {
    const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_slices));
    quantize_per_token_kernel<<<grid, 32, 0, s>>>(p);
    return launch_status("quantize_per_token_kernel");
  }
  quantize_per_slice_kernel<<<a.num_slices, kQuantBlock, 0, s>>>(p);
  return launch_status("quantize_per_slice_kernel");
}

}  // namespace loraplex::kernels::cuda
