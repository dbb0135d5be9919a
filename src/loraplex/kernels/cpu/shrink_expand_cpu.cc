// CPU shrink and expand. The SGMV and BGMV entry points share one per-token routine and
// differ only in the order tokens are visited: grouped by slot (each slot's A/B rows stay in
// cache across its tokens) or in batch order.

#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

constexpr int64_t kTokenGrain = 4;

template <typename T>
void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_float(src[i]);
}

template <typename T>
float dot_row(const float* x, const T* w, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * load_float(w[i]);
  return acc;
}

// Visits the tokens with a slot >= 0, either in the metadata's slot order or in batch order,
// split over the thread pool. `fn(token, slot, scratch)` gets a per-chunk float scratch.
template <typename Fn>
void for_each_lora_token(int64_t num_tokens, const int32_t* mapping, const int32_t* order,
                         int64_t scratch_floats, Fn&& fn) {
  parallel_for(0, num_tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t t = order != nullptr ? order[p] : p;
      const int32_t slot = mapping[t];
      if (slot >= 0) fn(t, slot, scratch.data());
    }
  });
}

template <typename T, typename OutT>
void shrink_typed(const ShrinkArgs& a, const int32_t* mapping, const int32_t* order) {
  const T* x = static_cast<const T*>(a.x);
  OutT* out = static_cast<OutT*>(a.out);
  const int64_t k_dim = a.hidden;
  for_each_lora_token(a.num_tokens, mapping, order, k_dim, [&](int64_t t, int32_t slot, float* xs) {
    load_row(x + t * a.x_row_stride, k_dim, xs);
    for (int s = 0; s < a.num_slices; ++s) {
      const int32_t rank = a.ranks[s * a.max_loras + slot];
      const T* a_slot =
          static_cast<const T*>(a.lora_a[s]) + static_cast<int64_t>(slot) * a.max_rank * k_dim;
      OutT* o = out + (static_cast<int64_t>(s) * a.num_tokens + t) * a.max_rank;
      for (int32_t r = 0; r < rank; ++r) {
        o[r] = store_float<OutT>(a.scale * dot_row(xs, a_slot + r * k_dim, k_dim));
      }
    }
  });
}

template <typename T, typename InT>
void expand_typed(const ExpandArgs& a, const int32_t* mapping, const int32_t* order) {
  const InT* in = static_cast<const InT*>(a.in);
  T* y = static_cast<T*>(a.y);
  for_each_lora_token(
      a.num_tokens, mapping, order, a.max_rank, [&](int64_t t, int32_t slot, float* v) {
        int64_t col = a.offset_start;
        for (int s = 0; s < a.num_slices; ++s) {
          const int64_t n = a.slice_width[s];
          const int32_t rank = a.ranks[s * a.max_loras + slot];
          load_row(in + (static_cast<int64_t>(s) * a.num_tokens + t) * a.max_rank, rank, v);
          const T* b_slot =
              static_cast<const T*>(a.lora_b[s]) + static_cast<int64_t>(slot) * n * a.max_rank;
          T* y_row = y + t * a.y_row_stride + col;
          for (int64_t j = 0; j < n; ++j) {
            float acc = dot_row(v, b_slot + j * a.max_rank, rank);
            if (a.add_inputs) acc += load_float(y_row[j]);
            y_row[j] = store_float<T>(acc);
          }
          col += n;
        }
      });
}

Status run_shrink(const ShrinkArgs& a, const int32_t* mapping, const int32_t* order) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(a));
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(mapping != nullptr, "lora_shrink: token mapping is null");
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(mapping, a.num_tokens, a.max_loras));
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.out_dtype == DType::kF32) {
      shrink_typed<T, float>(a, mapping, order);
    } else {
      shrink_typed<T, T>(a, mapping, order);
    }
  });
  return Status();
}

Status run_expand(const ExpandArgs& a, const int32_t* mapping, const int32_t* order) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(a));
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, a.num_slices, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(mapping != nullptr, "lora_expand: token mapping is null");
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(mapping, a.num_tokens, a.max_loras));
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.in_dtype == DType::kF32) {
      expand_typed<T, float>(a, mapping, order);
    } else {
      expand_typed<T, T>(a, mapping, order);
    }
  });
  return Status();
}

Status check_meta(const LoraMetaView& meta, int64_t num_tokens, int max_loras, const char* op) {
  LORAPLEX_ENSURE(meta.num_tokens == num_tokens, op, ": metadata built for ", meta.num_tokens,
                  " tokens, the call has ", num_tokens);
  LORAPLEX_ENSURE(meta.max_loras == max_loras, op, ": metadata built for max_loras ",
                  meta.max_loras, ", the weights have ", max_loras);
  return Status();
}

}  // namespace

Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_meta(meta, args.num_tokens, args.max_loras, "lora_shrink"));
  return run_shrink(args, meta.token_lora_mapping, meta.sorted_token_indices);
}

Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping) {
  return run_shrink(args, token_lora_mapping, nullptr);
}

Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta) {
  LORAPLEX_RETURN_IF_ERROR(check_meta(meta, args.num_tokens, args.max_loras, "lora_expand"));
  return run_expand(args, meta.token_lora_mapping, meta.sorted_token_indices);
}

Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping) {
  return run_expand(args, token_lora_mapping, nullptr);
}

}  // namespace loraplex::kernels::cpu
