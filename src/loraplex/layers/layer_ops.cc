#include "loraplex/layers/layer_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "loraplex/core/error.h"
#include "loraplex/core/parallel.h"
#if LORAPLEX_WITH_CUDA
#include "loraplex/layers/layer_ops_cuda.h"
#endif

namespace loraplex::layer_ops {
namespace {

int64_t pitch(const Tensor& t) { return std::max(t.stride(0), t.size(1)); }

void check_rows(const Tensor& t, const char* op, const char* name) {
  LORAPLEX_CHECK(t.defined() && t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), op, ": ",
                 name, " must be 2-D with contiguous rows, got ",
                 t.defined() ? t.describe() : "undefined");
  LORAPLEX_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF16 || t.dtype() == DType::kBF16,
                 op, ": ", name, " has dtype ", t.dtype(),
                 ", expected float32, float16 or bfloat16");
}

void check_i32(const Tensor& t, int64_t n, const char* op, const char* name) {
  LORAPLEX_CHECK(t.defined() && t.dtype() == DType::kI32 && t.is_contiguous() && t.numel() == n, op,
                 ": ", name, " must be contiguous int32 with ", n, " elements, got ",
                 t.defined() ? t.describe() : "undefined");
}

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  LORAPLEX_CHECK(a.device() == b.device(), op, ": tensors on ", a.device(), " and ", b.device());
}

template <typename Fn>
void on_dtype(DType dtype, Fn&& fn) {
  dispatch_activation_dtype(dtype, std::forward<Fn>(fn));
}

#if LORAPLEX_WITH_CUDA
void* cu(const Stream& s) { return s.handle(); }
#else
[[noreturn]] void no_cuda(const char* op) {
  LORAPLEX_FAIL(op, ": CUDA tensors need the CUDA backend, which this build does not have");
}
#endif

float silu(float v) { return v / (1.0f + std::exp(-v)); }

}  // namespace

void embedding_lookup(const Tensor& weight, const Tensor& ids, int64_t vocab_start, int64_t vocab,
                      Tensor& out, const Stream& stream) {
  const char* op = "embedding_lookup";
  check_rows(weight, op, "weight");
  check_rows(out, op, "out");
  check_same(weight, out, op);
  check_same(weight, ids, op);
  const int64_t t_count = out.size(0);
  check_i32(ids, t_count, op, "token ids");
  LORAPLEX_CHECK(out.size(1) == weight.size(1) && out.dtype() == weight.dtype(), op, ": out is ",
                 out.describe(), ", weight is ", weight.describe());
  const int64_t rows = weight.size(0);
  const int64_t hidden = weight.size(1);
  if (weight.device().is_cpu()) {
    const int32_t* id = ids.data<int32_t>();
    for (int64_t t = 0; t < t_count; ++t) {
      LORAPLEX_CHECK(id[t] >= 0 && id[t] < vocab, op, ": token id ", id[t], " at position ", t,
                     " outside the vocabulary [0, ", vocab, ")");
    }
    on_dtype(weight.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* w = weight.data<T>();
      T* o = out.data<T>();
      const int64_t os = pitch(out);
      parallel_for(0, t_count, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t local = id[t] - vocab_start;
          T* dst = o + t * os;
          if (local >= 0 && local < rows) {
            std::copy(w + local * hidden, w + (local + 1) * hidden, dst);
          } else {
            std::fill(dst, dst + hidden, store_float<T>(0.0f));
          }
        }
      });
    });
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::embedding_lookup(weight.dtype(), weight.data_ptr(), rows, hidden,
                                                  ids.data<int32_t>(), t_count, vocab_start,
                                                  out.data_ptr(), pitch(out), cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

void shard_token_ids(const Tensor& ids, int64_t vocab_start, int64_t rows, int32_t outside,
                     Tensor& local, const Stream& stream) {
  const char* op = "shard_token_ids";
  check_i32(ids, ids.numel(), op, "token ids");
  check_i32(local, ids.numel(), op, "local ids");
  check_same(ids, local, op);
  const int64_t n = ids.numel();
  if (ids.device().is_cpu()) {
    const int32_t* in = ids.data<int32_t>();
    int32_t* out = local.data<int32_t>();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t l = in[t] - vocab_start;
      out[t] = (l >= 0 && l < rows) ? static_cast<int32_t>(l) : outside;
    }
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::shard_token_ids(ids.data<int32_t>(), n, vocab_start, rows, outside,
                                                 local.data<int32_t>(), cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

void topk_softmax(const Tensor& logits, int top_k, bool renormalize, Tensor& ids, Tensor& weights,
                  const Stream& stream) {
  const char* op = "topk_softmax";
  check_rows(logits, op, "router logits");
  const int64_t t_count = logits.size(0);
  const int num_experts = static_cast<int>(logits.size(1));
  LORAPLEX_CHECK(top_k >= 1 && top_k <= num_experts, op, ": top_k ", top_k, " outside [1, ",
                 num_experts, "]");
  check_i32(ids, t_count * top_k, op, "topk ids");
  LORAPLEX_CHECK(weights.defined() && weights.dtype() == DType::kF32 && weights.is_contiguous() &&
                     weights.numel() == t_count * top_k,
                 op, ": topk weights must be contiguous float32 [", t_count, ", ", top_k, "]");
  check_same(logits, ids, op);
  check_same(logits, weights, op);
  if (logits.device().is_cpu()) {
    on_dtype(logits.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* lg = logits.data<T>();
      const int64_t ls = pitch(logits);
      int32_t* id = ids.data<int32_t>();
      float* wt = weights.data<float>();
      parallel_for(0, t_count, 8, [&](int64_t lo, int64_t hi) {
        std::vector<float> p(static_cast<size_t>(num_experts));
        std::vector<char> taken(static_cast<size_t>(num_experts));
        for (int64_t t = lo; t < hi; ++t) {
          const T* row = lg + t * ls;
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
            id[t * top_k + k] = best;
            wt[t * top_k + k] = p[best];
            picked += p[best];
          }
          if (renormalize) {
            for (int k = 0; k < top_k; ++k) wt[t * top_k + k] /= picked;
          }
        }
      });
    });
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::topk_softmax(
      logits.dtype(), logits.data_ptr(), pitch(logits), t_count, num_experts, top_k, renormalize,
      ids.data<int32_t>(), weights.data<float>(), cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst, const Stream& stream) {
  const char* op = "gather_rows";
  check_rows(src, op, "src");
  check_rows(dst, op, "dst");
  check_same(src, dst, op);
  check_same(src, index, op);
  const int64_t n = dst.size(0);
  const int64_t width = dst.size(1);
  check_i32(index, n, op, "row index");
  LORAPLEX_CHECK(src.size(1) == width && src.dtype() == dst.dtype(), op, ": src ", src.describe(),
                 ", dst ", dst.describe());
  if (n == 0) return;
  if (src.device().is_cpu()) {
    const int32_t* idx = index.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      LORAPLEX_CHECK(idx[i] >= 0 && idx[i] < src.size(0), op, ": index ", idx[i], " outside [0, ",
                     src.size(0), ")");
    }
    on_dtype(src.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* s = src.data<T>();
      T* d = dst.data<T>();
      const int64_t ss = pitch(src);
      const int64_t ds = pitch(dst);
      parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i)
          std::copy(s + idx[i] * ss, s + idx[i] * ss + width, d + i * ds);
      });
    });
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::gather_rows(src.dtype(), src.data_ptr(), pitch(src),
                                             index.data<int32_t>(), n, width, dst.data_ptr(),
                                             pitch(dst), cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

void scatter_rows(const Tensor& src, const Tensor& index, const Tensor& row_scale, Tensor& dst,
                  const Stream& stream) {
  const char* op = "scatter_rows";
  check_rows(src, op, "src");
  check_rows(dst, op, "dst");
  check_same(src, dst, op);
  check_same(src, index, op);
  const int64_t n = src.size(0);
  const int64_t width = src.size(1);
  check_i32(index, n, op, "row index");
  LORAPLEX_CHECK(dst.size(1) == width && src.dtype() == dst.dtype(), op, ": src ", src.describe(),
                 ", dst ", dst.describe());
  if (row_scale.defined()) {
    LORAPLEX_CHECK(row_scale.dtype() == DType::kF32 && row_scale.is_contiguous() &&
                       row_scale.numel() >= dst.size(0) && row_scale.device() == dst.device(),
                   op, ": row scale must be contiguous float32 with ", dst.size(0),
                   " elements, got ", row_scale.describe());
  }
  if (n == 0) return;
  if (src.device().is_cpu()) {
    const int32_t* idx = index.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      LORAPLEX_CHECK(idx[i] >= 0 && idx[i] < dst.size(0), op, ": index ", idx[i], " outside [0, ",
                     dst.size(0), ")");
    }
    const float* scale = row_scale.defined() ? row_scale.data<float>() : nullptr;
    on_dtype(src.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* s = src.data<T>();
      T* d = dst.data<T>();
      const int64_t ss = pitch(src);
      const int64_t ds = pitch(dst);
      parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const T* from = s + i * ss;
          T* to = d + idx[i] * ds;
          if (scale == nullptr) {
            std::copy(from, from + width, to);
          } else {
            const float f = scale[idx[i]];
            for (int64_t j = 0; j < width; ++j) to[j] = store_float<T>(load_float(from[j]) * f);
          }
        }
      });
    });
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::scatter_rows(
      src.dtype(), src.data_ptr(), pitch(src), index.data<int32_t>(), n, width,
      row_scale.defined() ? row_scale.data<float>() : nullptr, dst.data_ptr(), pitch(dst),
      cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

void silu_and_mul(const Tensor& in, Tensor& out, const Stream& stream) {
  const char* op = "silu_and_mul";
  check_rows(in, op, "in");
  check_rows(out, op, "out");
  check_same(in, out, op);
  const int64_t n = in.size(0);
  const int64_t width = out.size(1);
  LORAPLEX_CHECK(out.size(0) == n && in.size(1) == 2 * width && in.dtype() == out.dtype(), op,
                 ": in ", in.describe(), " must be [n, 2 * width] for out ", out.describe());
  if (n == 0) return;
  if (in.device().is_cpu()) {
    on_dtype(in.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* s = in.data<T>();
      T* d = out.data<T>();
      const int64_t ss = pitch(in);
      const int64_t ds = pitch(out);
      parallel_for(0, n, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const T* row = s + i * ss;
          for (int64_t j = 0; j < width; ++j) {
            d[i * ds + j] = store_float<T>(silu(load_float(row[j])) * load_float(row[width + j]));
          }
        }
      });
    });
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::silu_and_mul(in.dtype(), in.data_ptr(), pitch(in), n, width,
                                              out.data_ptr(), pitch(out), cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

void sum_topk(const Tensor& in, int top_k, Tensor& out, const Stream& stream) {
  const char* op = "sum_topk";
  check_rows(in, op, "in");
  check_rows(out, op, "out");
  check_same(in, out, op);
  LORAPLEX_CHECK(in.is_contiguous(), op, ": in must be contiguous, got ", in.describe());
  const int64_t t_count = out.size(0);
  const int64_t width = out.size(1);
  LORAPLEX_CHECK(top_k >= 1 && in.size(0) == t_count * top_k && in.size(1) == width &&
                     in.dtype() == out.dtype(),
                 op, ": in ", in.describe(), " must be [", t_count, " * top_k ", top_k, ", ", width,
                 "]");
  if (t_count == 0) return;
  if (in.device().is_cpu()) {
    on_dtype(in.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* s = in.data<T>();
      T* d = out.data<T>();
      const int64_t ds = pitch(out);
      parallel_for(0, t_count, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) {
          for (int64_t j = 0; j < width; ++j) {
            float acc = 0.0f;
            for (int k = 0; k < top_k; ++k) acc += load_float(s[(t * top_k + k) * width + j]);
            d[t * ds + j] = store_float<T>(acc);
          }
        }
      });
    });
    return;
  }
#if LORAPLEX_WITH_CUDA
  throw_if_error(layer_ops_cuda::sum_topk(in.dtype(), in.data_ptr(), t_count, top_k, width,
                                          out.data_ptr(), pitch(out), cu(stream)));
#else
  (void)stream;
  no_cuda(op);
#endif
}

}  // namespace loraplex::layer_ops
