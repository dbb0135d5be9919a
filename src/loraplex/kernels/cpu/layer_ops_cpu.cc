// CPU versions of kernels/layer_ops.h: threaded over rows, float arithmetic.

#include <algorithm>
#include <cmath>
#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/layer_ops.h"

namespace loraplex::kernels::cpu {
namespace {

template <typename Fn>
Status on_dtype(DType dtype, const char* op, Fn&& fn) {
  LORAPLEX_ENSURE(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16, op,
                  ": dtype ", dtype, ", expected float32, float16 or bfloat16");
  dispatch_activation_dtype(dtype, std::forward<Fn>(fn));
  return Status();
}

}  // namespace

Status embedding_rows(const EmbeddingRowsArgs& a) {
  const char* op = "embedding_lookup";
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    LORAPLEX_ENSURE(a.ids[t] >= 0 && a.ids[t] < a.vocab, op, ": token id ", a.ids[t],
                    " at position ", t, " outside the vocabulary [0, ", a.vocab, ")");
  }
  return on_dtype(a.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* w = static_cast<const T*>(a.weight);
    T* o = static_cast<T*>(a.out);
    parallel_for(0, a.num_tokens, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t local = a.ids[t] - a.vocab_start;
        T* dst = o + t * a.out_stride;
        if (local >= 0 && local < a.rows) {
          std::copy(w + local * a.hidden, w + (local + 1) * a.hidden, dst);
        } else {
          std::fill(dst, dst + a.hidden, store_float<T>(0.0f));
        }
      }
    });
  });
}

Status shard_token_ids(const ShardTokenIdsArgs& a) {
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t l = a.ids[t] - a.vocab_start;
    a.local[t] = (l >= 0 && l < a.rows) ? static_cast<int32_t>(l) : a.outside;
  }
  return Status();
}

Status topk_softmax(const TopkSoftmaxArgs& a) {
  const int num_experts = a.num_experts;
  const int top_k = a.top_k;
  LORAPLEX_ENSURE(top_k >= 1 && top_k <= num_experts, "topk_softmax: top_k ", top_k,
                  " outside [1, ", num_experts, "]");
  return on_dtype(a.dtype, "topk_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* lg = static_cast<const T*>(a.logits);
    parallel_for(0, a.num_tokens, 8, [&](int64_t lo, int64_t hi) {
      std::vector<float> p(static_cast<size_t>(num_experts));
      std::vector<char> taken(static_cast<size_t>(num_experts));
      for (int64_t t = lo; t < hi; ++t) {
        const T* row = lg + t * a.logits_stride;
        float mx = -INFINITY;
        for (int e = 0; e < num_experts; ++e) mx = std::max(mx, load_float(row[e]));
        float sum = 0.0f;
        for (int e = 0; e < num_experts; ++e) {
          p[e] = std::exp(load_float(row[e]) - mx);
          sum += p[e];
        }
        for (int e = 0; e < num_experts; ++e) p[e] /= sum;
        std::fill(taken.begin(), taken.end(), 0);
        float picked = 0.0f;
        for (int k = 0; k < top_k; ++k) {
          int best = -1;
          for (int e = 0; e < num_experts; ++e) {
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
          }
          taken[best] = 1;
          a.ids[t * top_k + k] = best;
          a.weights[t * top_k + k] = p[best];
          picked += p[best];
        }
        if (a.renormalize) {
          for (int k = 0; k < top_k; ++k) a.weights[t * top_k + k] /= picked;
        }
      }
    });
  });
}

Status gather_rows(const GatherRowsArgs& a) {
  for (int64_t i = 0; i < a.n; ++i) {
    LORAPLEX_ENSURE(a.index[i] >= 0 && a.index[i] < a.src_rows, "gather_rows: index ", a.index[i],
                    " outside [0, ", a.src_rows, ")");
  }
  return on_dtype(a.dtype, "gather_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = static_cast<const T*>(a.src);
    T* d = static_cast<T*>(a.dst);
    parallel_for(0, a.n, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* from = s + a.index[i] * a.src_stride;
        std::copy(from, from + a.width, d + i * a.dst_stride);
      }
    });
  });
}

Status scatter_rows(const ScatterRowsArgs& a) {
  for (int64_t i = 0; i < a.n; ++i) {
    LORAPLEX_ENSURE(a.index[i] >= 0 && a.index[i] < a.dst_rows, "scatter_rows: index ", a.index[i],
                    " outside [0, ", a.dst_rows, ")");
  }
  return on_dtype(a.dtype, "scatter_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = static_cast<const T*>(a.src);
    T* d = static_cast<T*>(a.dst);
    parallel_for(0, a.n, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* from = s + i * a.src_stride;
        T* to = d + a.index[i] * a.dst_stride;
        if (a.row_scale == nullptr) {
          std::copy(from, from + a.width, to);
        } else {
          const float f = a.row_scale[a.index[i]];
          for (int64_t j = 0; j < a.width; ++j) to[j] = store_float<T>(load_float(from[j]) * f);
        }
      }
    });
  });
}

Status sum_topk(const SumTopkArgs& a) {
  return on_dtype(a.dtype, "sum_topk", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = static_cast<const T*>(a.in);
    T* d = static_cast<T*>(a.out);
    parallel_for(0, a.num_tokens, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        for (int64_t j = 0; j < a.width; ++j) {
          float acc = 0.0f;
          for (int k = 0; k < a.top_k; ++k) acc += load_float(s[(t * a.top_k + k) * a.width + j]);
          d[t * a.out_stride + j] = store_float<T>(acc);
        }
      }
    });
  });
}

}  // namespace loraplex::kernels::cpu
