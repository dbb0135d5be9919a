// CPU shrink and expand. The SGMV entry points take the tokens grouped by slot from the batch
// metadata; the BGMV entry points group them here (a counting sort), so both convert each
// slot's weights to fp32 once per thread and then run the same fixed-order per-token loops:
// the two forms give bit-identical results.

#include <vector>

#include "loraplex/kernels/cpu/cpu_common.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

using detail::load_row;
using detail::LoraTokens;
using detail::tokens_from_mapping;
using detail::tokens_from_meta;

template <typename T, typename OutT>
void shrink_typed(const ShrinkArgs& a, const int32_t* mapping, const LoraTokens& lt) {
  const int64_t k_dim = a.hidden;
  std::vector<int64_t> prefix(static_cast<size_t>(lt.count) + 1, 0);
  for (int64_t i = 0; i < lt.count; ++i) {
    const int32_t slot = mapping[lt.tokens[i]];
    int64_t cost = k_dim;  // loading the row
    for (int s = 0; s < a.num_slices; ++s) cost += a.ranks[s * a.max_loras + slot] * k_dim;
    prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + cost;
  }
  const T* x = static_cast<const T*>(a.x);
  OutT* out = static_cast<OutT*>(a.out);
  detail::parallel_for_balanced(prefix, detail::kMinPartCost, [&](int64_t lo, int64_t hi) {
    float* xs = detail::scratch(0, k_dim);
    detail::WeightCache cache[kMaxSlices];
    if constexpr (!std::is_same_v<T, float>) {
      for (int s = 0; s < a.num_slices; ++s) {
        cache[s].data = detail::scratch(1 + s, a.max_rank * k_dim);
      }
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = lt.tokens[i];
      const int32_t slot = mapping[t];
      load_row(x + t * a.x_row_stride, k_dim, xs);
      for (int s = 0; s < a.num_slices; ++s) {
        const int32_t rank = a.ranks[s * a.max_loras + slot];
        const T* a_slot = static_cast<const T*>(a.lora_a[s]) +
                          static_cast<int64_t>(slot) * a_slot_rows(a) * k_dim;
        const float* w;
        if constexpr (std::is_same_v<T, float>) {
          w = a_slot;
        } else {
          if (cache[s].key != slot) {
            load_row(a_slot, rank * k_dim, cache[s].data);
            cache[s].key = slot;
          }
          w = cache[s].data;
        }
        OutT* o = out + (static_cast<int64_t>(s) * a.num_tokens + t) * a.max_rank;
        for (int32_t r = 0; r < rank; ++r) {
          o[r] = detail::from_float<OutT>(a.scale * detail::dot(xs, w + r * k_dim, k_dim));
        }
      }
    }
  });
}

template <typename T, typename InT>
void expand_typed(const ExpandArgs& a, const int32_t* mapping, const LoraTokens& lt) {
  const InT* in = static_cast<const InT*>(a.in);
  auto load_v = [&](int s, int64_t t, int32_t rank, float* v) {
    load_row(in + (static_cast<int64_t>(s) * a.num_tokens + t) * a.max_rank, rank, v);
  };
  auto load_bt = [&](int s, int32_t slot, int32_t rank, float* bt) {
    const int64_t n = a.slice_width[s];
    const T* b = static_cast<const T*>(a.lora_b[s]) + static_cast<int64_t>(slot) * n * a.max_rank;
    detail::pack_panels(
        n, rank, bt, [&](int64_t j, int32_t r) { return detail::to_float(b[j * a.max_rank + r]); });
  };
  detail::expand_rows<T>(a, mapping, lt.tokens, lt.count, load_v, load_bt);
}

Status run_shrink(const ShrinkArgs& a, const int32_t* mapping, const LoraTokens& lt) {
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.out_dtype == DType::kF32) {
      shrink_typed<T, float>(a, mapping, lt);
    } else {
      shrink_typed<T, T>(a, mapping, lt);
    }
  });
  return Status();
}

Status run_expand(const ExpandArgs& a, const int32_t* mapping, const LoraTokens& lt) {
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.in_dtype == DType::kF32) {
      expand_typed<T, float>(a, mapping, lt);
    } else {
      expand_typed<T, T>(a, mapping, lt);
    }
  });
  return Status();
}

Status check_shrink(const ShrinkArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(a));
  return check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank);
}

Status check_expand(const ExpandArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(a));
  return check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank);
}

}  // namespace

Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink(args));
  if (args.num_tokens == 0) return Status();
  LoraTokens lt;
  LORAPLEX_RETURN_IF_ERROR(
      tokens_from_meta(meta, args.num_tokens, args.max_loras, "lora_shrink", lt));
  return run_shrink(args, meta.token_lora_mapping, lt);
}

Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink(args));
  if (args.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(token_lora_mapping != nullptr, "bgmv_shrink: token mapping is null");
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(token_lora_mapping, args.num_tokens, args.max_loras));
  LoraTokens lt;
  tokens_from_mapping(token_lora_mapping, args.num_tokens, args.max_loras, lt);
  return run_shrink(args, token_lora_mapping, lt);
}

Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_expand(args));
  if (args.num_tokens == 0) return Status();
  LoraTokens lt;
  LORAPLEX_RETURN_IF_ERROR(
      tokens_from_meta(meta, args.num_tokens, args.max_loras, "lora_expand", lt));
  return run_expand(args, meta.token_lora_mapping, lt);
}

Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping) {
  LORAPLEX_RETURN_IF_ERROR(check_expand(args));
  if (args.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(token_lora_mapping != nullptr, "bgmv_expand: token mapping is null");
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(token_lora_mapping, args.num_tokens, args.max_loras));
  LoraTokens lt;
  tokens_from_mapping(token_lora_mapping, args.num_tokens, args.max_loras, lt);
  return run_expand(args, token_lora_mapping, lt);
}

}  // namespace loraplex::kernels::cpu
