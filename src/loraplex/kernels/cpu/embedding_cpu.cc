// Embedding LoRA on the CPU: a one-slice expand whose intermediate is the token's row of the
// slot's (transposed) LoRA-A table, scaled.

#include "loraplex/kernels/cpu/cpu_common.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

template <typename T>
void embedding_typed(const EmbeddingLoraArgs& e, const detail::LoraTokens& lt) {
  ExpandArgs a;
  a.dtype = e.dtype;
  a.num_tokens = e.num_tokens;
  a.num_slices = 1;
  a.slice_width[0] = e.hidden;
  a.max_loras = e.max_loras;
  a.max_rank = e.max_rank;
  a.ranks = e.ranks;
  a.y = e.y;
  a.y_row_stride = e.y_row_stride;
  a.add_inputs = true;
  const T* table = static_cast<const T*>(e.lora_a);
  auto load_v = [&](int, int64_t t, int32_t rank, float* v) {
    const int32_t slot = e.token_lora_mapping[t];
    const T* row = table + (static_cast<int64_t>(slot) * e.vocab + e.token_ids[t]) * e.max_rank;
    for (int32_t r = 0; r < rank; ++r) v[r] = e.scale * detail::to_float(row[r]);
  };
  auto load_bt = [&](int, int32_t slot, int32_t rank, float* bt) {
    const int64_t n = e.hidden;
    const T* b = static_cast<const T*>(e.lora_b) + static_cast<int64_t>(slot) * n * e.max_rank;
    detail::pack_panels(
        n, rank, bt, [&](int64_t j, int32_t r) { return detail::to_float(b[j * e.max_rank + r]); });
  };
  detail::expand_rows<T>(a, e.token_lora_mapping, lt.tokens, lt.count, load_v, load_bt);
}

}  // namespace

Status lora_embedding(const EmbeddingLoraArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_embedding_args(a));
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, 1, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  detail::LoraTokens lt;
  detail::tokens_from_mapping(a.token_lora_mapping, a.num_tokens, a.max_loras, lt);
  // Only LoRA tokens index the tables; base-only tokens may carry ids past the LoRA vocab.
  for (int64_t i = 0; i < lt.count; ++i) {
    const int32_t t = lt.tokens[i];
    LORAPLEX_ENSURE(a.token_ids[t] >= 0 && a.token_ids[t] < a.vocab, "lora_embedding: token ", t,
                    " has id ", a.token_ids[t], ", expected 0..", a.vocab - 1);
  }
  dispatch_activation_dtype(
      a.dtype, [&](auto tag) { embedding_typed<typename decltype(tag)::type>(a, lt); });
  return Status();
}

}  // namespace loraplex::kernels::cpu
