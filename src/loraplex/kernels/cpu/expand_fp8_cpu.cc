// FP8 LoRA-B expand and the fp8 quantisation of the shrink result (W8A8), on the CPU.

#include <algorithm>
#include <cmath>
#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

float fp8_max(DType dtype) { return dtype == DType::kF8E4M3 ? kE4M3Max : kE5M2Max; }

float fp8_to_float(uint8_t bits, DType dtype) {
  return dtype == DType::kF8E4M3 ? e4m3_bits_to_float(bits) : e5m2_bits_to_float(bits);
}

uint8_t float_to_fp8(float v, DType dtype) {
  return dtype == DType::kF8E4M3 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v);
}

// Scale of B element (row j, rank column r) of `slot` in one slice.
float b_scale_at(const ExpandFp8Args& a, int s, int32_t slot, int64_t j, int32_t r) {
  const float* scales = a.b_scale[s];
  const int64_t n = a.base.slice_width[s];
  switch (a.scale_kind) {
    case Fp8ScaleKind::kPerTensor:
      return scales[slot];
    case Fp8ScaleKind::kPerChannel:
      return scales[static_cast<int64_t>(slot) * n + j];
    case Fp8ScaleKind::kPerBlock: {
      const int64_t blocks_n = (n + a.group_n - 1) / a.group_n;
      const int64_t blocks_k = (a.base.max_rank + a.group_k - 1) / a.group_k;
      return scales[(static_cast<int64_t>(slot) * blocks_n + j / a.group_n) * blocks_k +
                    r / a.group_k];
    }
  }
  return 1.0f;
}

Status check_fp8_args(const ExpandFp8Args& a) {
  ExpandArgs plain = a.base;
  // A W8A8 intermediate is fp8 and checked below, not as an activation dtype.
  if (a.w8a8) plain.in_dtype = DType::kF32;
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(plain));
  LORAPLEX_ENSURE(is_fp8(a.weight_dtype), "lora_expand_fp8: weight dtype ", a.weight_dtype,
                  ", expected float8_e4m3 or float8_e5m2");
  if (a.scale_kind == Fp8ScaleKind::kPerBlock) {
    LORAPLEX_ENSURE(a.group_n >= 1 && a.group_k >= 1, "lora_expand_fp8: block scale groups ",
                    a.group_n, "x", a.group_k, ", expected >= 1");
  }
  for (int s = 0; s < a.base.num_slices; ++s) {
    LORAPLEX_ENSURE(a.b_scale[s] != nullptr, "lora_expand_fp8: scale of slice ", s, " is null");
  }
  if (a.w8a8) {
    LORAPLEX_ENSURE(is_fp8(a.in_fp8_dtype), "lora_expand_fp8: W8A8 intermediate dtype ",
                    a.in_fp8_dtype, ", expected float8_e4m3 or float8_e5m2");
    LORAPLEX_ENSURE(a.in_scale != nullptr, "lora_expand_fp8: W8A8 needs the intermediate scale");
  }
  return Status();
}

template <typename T>
void expand_fp8_typed(const ExpandFp8Args& a, const LoraMetaView& meta) {
  const ExpandArgs& b = a.base;
  T* y = static_cast<T*>(b.y);
  parallel_for(0, b.num_tokens, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> v(static_cast<size_t>(b.max_rank));
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t t = meta.sorted_token_indices[p];
      const int32_t slot = meta.token_lora_mapping[t];
      if (slot < 0) continue;
      int64_t col = b.offset_start;
      for (int s = 0; s < b.num_slices; ++s) {
        const int64_t n = b.slice_width[s];
        const int32_t rank = b.ranks[s * b.max_loras + slot];
        const int64_t row = (static_cast<int64_t>(s) * b.num_tokens + t) * b.max_rank;
        if (a.w8a8) {
          const float in_scale = a.in_scale[a.in_scale_per_token ? s * b.num_tokens + t : s];
          const uint8_t* q = static_cast<const uint8_t*>(b.in) + row;
          for (int32_t r = 0; r < rank; ++r) v[r] = fp8_to_float(q[r], a.in_fp8_dtype) * in_scale;
        } else if (b.in_dtype == DType::kF32) {
          const float* in = static_cast<const float*>(b.in) + row;
          std::copy(in, in + rank, v.begin());
        } else {
          const T* in = static_cast<const T*>(b.in) + row;
          for (int32_t r = 0; r < rank; ++r) v[r] = load_float(in[r]);
        }
        const uint8_t* w =
            static_cast<const uint8_t*>(b.lora_b[s]) + static_cast<int64_t>(slot) * n * b.max_rank;
        T* y_row = y + t * b.y_row_stride + col;
        for (int64_t j = 0; j < n; ++j) {
          float acc = 0.0f;
          for (int32_t r = 0; r < rank; ++r) {
            acc += v[r] * fp8_to_float(w[j * b.max_rank + r], a.weight_dtype) *
                   b_scale_at(a, s, slot, j, r);
          }
          if (b.add_inputs) acc += load_float(y_row[j]);
          y_row[j] = store_float<T>(acc);
        }
        col += n;
      }
    }
  });
}

}  // namespace

Status lora_expand_fp8(const ExpandFp8Args& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_fp8_args(args));
  const ExpandArgs& b = args.base;
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(b.ranks, b.num_slices, b.max_loras, b.max_rank));
  LORAPLEX_ENSURE(meta.num_tokens == b.num_tokens, "lora_expand_fp8: metadata built for ",
                  meta.num_tokens, " tokens, the call has ", b.num_tokens);
  if (b.num_tokens == 0) return Status();
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(meta.token_lora_mapping, b.num_tokens, b.max_loras));
  dispatch_activation_dtype(
      b.dtype, [&](auto tag) { expand_fp8_typed<typename decltype(tag)::type>(args, meta); });
  return Status();
}

Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& a) {
  LORAPLEX_ENSURE(is_fp8(a.out_dtype), "quantize_intermediate_fp8: output dtype ", a.out_dtype,
                  ", expected float8_e4m3 or float8_e5m2");
  LORAPLEX_ENSURE(a.num_slices >= 1 && a.num_slices <= kMaxSlices && a.max_loras >= 1 &&
                      a.max_rank >= 1 && a.num_tokens >= 0,
                  "quantize_intermediate_fp8: bad sizes (slices ", a.num_slices, ", max_loras ",
                  a.max_loras, ", max_rank ", a.max_rank, ", tokens ", a.num_tokens, ")");
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  const float qmax = fp8_max(a.out_dtype);
  uint8_t* out = static_cast<uint8_t*>(a.out);
  for (int s = 0; s < a.num_slices; ++s) {
    const int32_t* ranks = a.ranks + s * a.max_loras;
    auto row = [&](int64_t t) { return (static_cast<int64_t>(s) * a.num_tokens + t) * a.max_rank; };
    auto row_amax = [&](int64_t t, int32_t rank) {
      float m = 0.0f;
      for (int32_t r = 0; r < rank; ++r) m = std::max(m, std::fabs(a.in[row(t) + r]));
      return m;
    };
    float tensor_scale = 1.0f;
    if (!a.per_token) {
      float amax = 0.0f;
      for (int64_t t = 0; t < a.num_tokens; ++t) {
        const int32_t slot = a.token_lora_mapping[t];
        if (slot >= 0) amax = std::max(amax, row_amax(t, ranks[slot]));
      }
      tensor_scale = amax > 0.0f ? amax / qmax : 1.0f;
      a.scale[s] = tensor_scale;
    }
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const int32_t slot = a.token_lora_mapping[t];
      if (slot < 0) continue;
      const int32_t rank = ranks[slot];
      float scale = tensor_scale;
      if (a.per_token) {
        const float amax = row_amax(t, rank);
        scale = amax > 0.0f ? amax / qmax : 1.0f;
        a.scale[s * a.num_tokens + t] = scale;
      }
      for (int32_t r = 0; r < rank; ++r) {
        out[row(t) + r] = float_to_fp8(a.in[row(t) + r] / scale, a.out_dtype);
      }
    }
  }
  return Status();
}

}  // namespace loraplex::kernels::cpu
