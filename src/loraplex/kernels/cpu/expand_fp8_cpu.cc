// FP8 LoRA-B expand, the fp8 quantisation of the shrink result (W8A8), and the shrink with fp8
// LoRA-A (fp8 adapter storage), on the CPU. Each slot's B is dequantised (q * scale) to fp32
// once per thread, then the expand runs the same loops as the bf16/f16/f32 one; the shrink
// dots x with each A row's e4m3 values and multiplies by the row's scale.

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/cpu/cpu_common.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

float fp8_max(DType dtype) { return dtype == DType::kF8E4M3 ? kE4M3Max : kE5M2Max; }

uint8_t float_to_fp8(float v, DType dtype) {
  return dtype == DType::kF8E4M3 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v);
}

// All 256 values of an fp8 format, so that decoding is one load.
std::array<float, 256> fp8_table(DType dtype) {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const uint8_t bits = static_cast<uint8_t>(b);
    t[b] = dtype == DType::kF8E4M3 ? e4m3_bits_to_float(bits) : e5m2_bits_to_float(bits);
  }
  return t;
}

const std::array<float, 256>& fp8_values(DType dtype) {
  static const std::array<float, 256> e4m3 = fp8_table(DType::kF8E4M3);
  static const std::array<float, 256> e5m2 = fp8_table(DType::kF8E5M2);
  return dtype == DType::kF8E4M3 ? e4m3 : e5m2;
}

// B_s[slot][:, :rank] dequantised (q * scale, with the scale layout of the call) and packed.
void dequantize_bt(const ExpandFp8Args& a, int s, int32_t slot, int32_t rank, float* bt) {
  const ExpandArgs& b = a.base;
  const int64_t n = b.slice_width[s];
  const int64_t max_rank = b.max_rank;
  const uint8_t* q = static_cast<const uint8_t*>(b.lora_b[s]) + slot * n * max_rank;
  const float* values = fp8_values(a.weight_dtype).data();
  const float* scales = a.b_scale[s];
  switch (a.scale_kind) {
    case Fp8ScaleKind::kPerTensor:
      detail::pack_panels(n, rank, bt, [&](int64_t j, int32_t r) {
        return values[q[j * max_rank + r]] * scales[slot];
      });
      break;
    case Fp8ScaleKind::kPerChannel:
      detail::pack_panels(n, rank, bt, [&](int64_t j, int32_t r) {
        return values[q[j * max_rank + r]] * scales[slot * n + j];
      });
      break;
    case Fp8ScaleKind::kPerBlock: {
      // Group sizes are only meaningful (and checked to be >= 1) for block scales.
      const int64_t blocks_n = (n + a.group_n - 1) / a.group_n;
      const int64_t blocks_k = (max_rank + a.group_k - 1) / a.group_k;
      detail::pack_panels(n, rank, bt, [&](int64_t j, int32_t r) {
        return values[q[j * max_rank + r]] *
               scales[(slot * blocks_n + j / a.group_n) * blocks_k + r / a.group_k];
      });
      break;
    }
  }
}

template <typename T>
void expand_fp8_typed(const ExpandFp8Args& a, const int32_t* mapping,
                      const detail::LoraTokens& lt) {
  const ExpandArgs& b = a.base;
  auto load_v = [&](int s, int64_t t, int32_t rank, float* v) {
    const int64_t row = (static_cast<int64_t>(s) * b.num_tokens + t) * b.max_rank;
    if (a.w8a8) {
      const float in_scale = a.in_scale[a.in_scale_per_token ? s * b.num_tokens + t : s];
      const float* values = fp8_values(a.in_fp8_dtype).data();
      const uint8_t* q = static_cast<const uint8_t*>(b.in) + row;
      for (int32_t r = 0; r < rank; ++r) v[r] = values[q[r]] * in_scale;
    } else if (b.in_dtype == DType::kF32) {
      detail::load_row(static_cast<const float*>(b.in) + row, rank, v);
    } else {
      detail::load_row(static_cast<const T*>(b.in) + row, rank, v);
    }
  };
  auto load_bt = [&](int s, int32_t slot, int32_t rank, float* bt) {
    dequantize_bt(a, s, slot, rank, bt);
  };
  detail::expand_rows<T>(b, mapping, lt.tokens, lt.count, load_v, load_bt);
}

template <typename T>
void shrink_fp8_typed(const ShrinkFp8Args& a, const int32_t* mapping,
                      const detail::LoraTokens& lt) {
  const ShrinkArgs& b = a.base;
  const int64_t k = b.hidden;
  const int64_t rows = a_slot_rows(b);
  const float* values = fp8_values(DType::kF8E4M3).data();
  const T* x = static_cast<const T*>(b.x);
  float* out = static_cast<float*>(b.out);
  parallel_for(0, lt.count, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> xs(static_cast<size_t>(k));
    std::vector<float> w(static_cast<size_t>(k));
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = lt.tokens[i];
      const int32_t slot = mapping[t];
      detail::load_row(x + t * b.x_row_stride, k, xs.data());
      for (int s = 0; s < b.num_slices; ++s) {
        const int32_t rank = b.ranks[s * b.max_loras + slot];
        const uint8_t* q = static_cast<const uint8_t*>(b.lora_a[s]) + slot * rows * k;
        const float* scales = a.a_scale[s] + slot * rows;
        float* o = out + (static_cast<int64_t>(s) * b.num_tokens + t) * b.max_rank;
        for (int32_t r = 0; r < rank; ++r) {
          for (int64_t c = 0; c < k; ++c) w[static_cast<size_t>(c)] = values[q[r * k + c]];
          o[r] = b.scale * scales[r] * detail::dot(xs.data(), w.data(), k);
        }
      }
    }
  });
}

// The checks both fp8 ops share (sizes and ranks on the host), then run(T tag, mapping,
// tokens) for the tokens with a slot, grouped by slot, with x's / y's element type.
template <typename Args, typename Run>
Status over_lora_tokens(const Args& b, const LoraMetaView& meta, const char* op, Run&& run) {
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(b.ranks, b.num_slices, b.max_loras, b.max_rank));
  if (b.num_tokens == 0) return Status();
  detail::LoraTokens lt;
  LORAPLEX_RETURN_IF_ERROR(detail::tokens_from_meta(meta, b.num_tokens, b.max_loras, op, lt));
  dispatch_activation_dtype(b.dtype, [&](auto tag) { run(tag, meta.token_lora_mapping, lt); });
  return Status();
}

}  // namespace

Status lora_shrink_fp8(const ShrinkFp8Args& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_fp8_args(args));
  return over_lora_tokens(args.base, meta, "lora_shrink_fp8", [&](auto tag, auto map, auto& lt) {
    shrink_fp8_typed<typename decltype(tag)::type>(args, map, lt);
  });
}

Status lora_expand_fp8(const ExpandFp8Args& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_fp8_args(args));
  return over_lora_tokens(args.base, meta, "lora_expand_fp8", [&](auto tag, auto map, auto& lt) {
    expand_fp8_typed<typename decltype(tag)::type>(args, map, lt);
  });
}

Status quantize_intermediate_fp8(const QuantizeIntermediateArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_quantize_args(a));
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
