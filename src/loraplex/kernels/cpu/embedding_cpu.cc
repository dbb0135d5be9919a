#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cpu {
namespace {

template <typename T>
void embedding_typed(const EmbeddingLoraArgs& a) {
  const T* table = static_cast<const T*>(a.lora_a);
  const T* lora_b = static_cast<const T*>(a.lora_b);
  T* y = static_cast<T*>(a.y);
  parallel_for(0, a.num_tokens, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> v(static_cast<size_t>(a.max_rank));
    for (int64_t t = lo; t < hi; ++t) {
      const int32_t slot = a.token_lora_mapping[t];
      if (slot < 0) continue;
      const int32_t rank = a.ranks[slot];
      const T* row = table + (static_cast<int64_t>(slot) * a.vocab + a.token_ids[t]) * a.max_rank;
      for (int32_t r = 0; r < rank; ++r) v[r] = a.scale * load_float(row[r]);
      const T* b = lora_b + static_cast<int64_t>(slot) * a.hidden * a.max_rank;
      T* y_row = y + t * a.y_row_stride;
      for (int64_t j = 0; j < a.hidden; ++j) {
        float acc = 0.0f;
        for (int32_t r = 0; r < rank; ++r) acc += v[r] * load_float(b[j * a.max_rank + r]);
        y_row[j] = store_float<T>(load_float(y_row[j]) + acc);
      }
    }
  });
}

}  // namespace

Status lora_embedding(const EmbeddingLoraArgs& a) {
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16,
                  "lora_embedding: dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.vocab >= 1 && a.hidden >= 1 && a.max_loras >= 1 &&
                      a.max_rank >= 1 && a.y_row_stride >= a.hidden,
                  "lora_embedding: bad sizes (tokens ", a.num_tokens, ", vocab ", a.vocab,
                  ", hidden ", a.hidden, ", max_loras ", a.max_loras, ", max_rank ", a.max_rank,
                  ", row stride ", a.y_row_stride, ")");
  LORAPLEX_RETURN_IF_ERROR(check_ranks_host(a.ranks, 1, a.max_loras, a.max_rank));
  if (a.num_tokens == 0) return Status();
  LORAPLEX_RETURN_IF_ERROR(check_mapping_host(a.token_lora_mapping, a.num_tokens, a.max_loras));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    LORAPLEX_ENSURE(a.token_ids[t] >= 0 && a.token_ids[t] < a.vocab, "lora_embedding: token ", t,
                    " has id ", a.token_ids[t], ", expected 0..", a.vocab - 1);
  }
  dispatch_activation_dtype(a.dtype,
                            [&](auto tag) { embedding_typed<typename decltype(tag)::type>(a); });
  return Status();
}

}  // namespace loraplex::kernels::cpu
