// CPU reference of the decoder's non-LoRA ops: threaded over rows, float32 arithmetic, one
// rounding per stored value.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/model_ops.h"

namespace loraplex::kernels::cpu {
namespace {

bool is_activation(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

template <typename Fn>
Status dispatch(DType dtype, const char* op, Fn&& fn) {
  LORAPLEX_ENSURE(is_activation(dtype), op, ": dtype ", dtype,
                  ", expected float32, float16 or bfloat16");
  dispatch_activation_dtype(dtype, fn);
  return Status();
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Adds token t's fused LoRA expand (FusedLoraExpand) to `row`, the consumer's input row in
// float32, rounding each changed value as it would be stored.
template <typename T>
void apply_fused_expand(const FusedLoraExpand& e, int64_t t, std::vector<float>& row) {
  const int32_t k = e.meta.token_lora_mapping[t];
  if (k < 0) return;
  const T* shrink = static_cast<const T*>(e.shrink) + t * e.shrink_row_stride + k * e.slot_cols;
  std::vector<float> s_row(static_cast<size_t>(e.max_rank));
  for (int s = 0; s < e.num_slices; ++s) {
    const int r = std::min(e.ranks[s * e.max_loras + k], e.max_rank);
    if (r <= 0) continue;
    for (int i = 0; i < r; ++i)
      s_row[static_cast<size_t>(i)] = load_float(shrink[s * e.max_rank + i]);
    const T* b = static_cast<const T*>(e.lora_b[s]) + k * e.width[s] * e.max_rank;
    for (int64_t j = 0; j < e.width[s]; ++j) {
      float acc = 0.0f;
      for (int i = 0; i < r; ++i) {
        acc += s_row[static_cast<size_t>(i)] * load_float(b[j * e.max_rank + i]);
      }
      float& v = row[static_cast<size_t>(e.offset[s] + j)];
      v = load_float(store_float<T>(v + acc));
    }
  }
}

// Every LoRA token's slot must have its intermediate in the rows (below num_slots).
Status check_token_slots(const FusedLoraExpand& e, int64_t num_tokens, const char* op) {
  if (!e.active()) return Status();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t k = e.meta.token_lora_mapping[t];
    LORAPLEX_ENSURE(k >= -1 && k < e.num_slots, op, ": token ", t, " has LoRA slot ", k,
                    ", but the fused expand holds slots 0..", e.num_slots - 1);
  }
  return Status();
}

// Where sequence `seq`'s block table starts in a.block_tables.
int64_t table_offset(const PagedAttentionArgs& a, int64_t seq) {
  return a.block_table_indptr != nullptr ? a.block_table_indptr[seq] : seq * a.max_blocks_per_seq;
}

}  // namespace

Status fill_uniform(const FillUniformArgs& a) {
  LORAPLEX_ENSURE(a.n >= 0 && (a.n == 0 || a.out != nullptr), "fill_uniform: bad arguments");
  auto fill = [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* out = static_cast<T*>(a.out);
    parallel_for(0, a.n, 1 << 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) out[i] = store_float<T>(uniform_at(a, i));
    });
  };
  if (a.dtype == DType::kF8E4M3) {
    fill(TypeTag<Fp8E4M3>{});
    return Status();
  }
  return dispatch(a.dtype, "fill_uniform", fill);
}

Status add_rms_norm(const AddRmsNormArgs& a) {
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.hidden >= 1 && a.residual != nullptr &&
                      a.weight != nullptr && a.out != nullptr &&
                      !(a.clear_delta2 && a.rows != nullptr) &&
                      !(a.lora.active() && a.delta == nullptr),
                  "add_rms_norm: bad arguments (rows ", a.num_rows, ", hidden ", a.hidden, ")");
  LORAPLEX_RETURN_IF_ERROR(check_fused_lora_expand(a.lora, a.hidden, "add_rms_norm"));
  if (a.lora.active()) {
    for (int64_t r = 0; r < a.num_rows; ++r) {
      const int64_t src = a.rows != nullptr ? a.rows[r] : r;
      LORAPLEX_ENSURE(a.lora.meta.token_lora_mapping[src] < a.lora.num_slots, "add_rms_norm: row ",
                      r, " has LoRA slot ", a.lora.meta.token_lora_mapping[src],
                      ", but the fused expand holds slots 0..", a.lora.num_slots - 1);
    }
  }
  const int64_t delta_stride = a.delta_row_stride > 0 ? a.delta_row_stride : a.hidden;
  return dispatch(a.dtype, "add_rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* res = static_cast<const T*>(a.residual);
    const T* delta = static_cast<const T*>(a.delta);
    T* delta2 = static_cast<T*>(a.delta2);
    T* res_out = static_cast<T*>(a.residual_out);
    const T* w = static_cast<const T*>(a.weight);
    T* out = static_cast<T*>(a.out);
    parallel_for(0, a.num_rows, 8, [&](int64_t lo, int64_t hi) {
      std::vector<float> sum(static_cast<size_t>(a.hidden));
      std::vector<float> delta_row(static_cast<size_t>(a.hidden));
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t src = a.rows != nullptr ? a.rows[r] : r;
        if (delta != nullptr) {
          for (int64_t j = 0; j < a.hidden; ++j) {
            delta_row[static_cast<size_t>(j)] = load_float(delta[src * delta_stride + j]);
          }
          if (a.lora.active()) apply_fused_expand<T>(a.lora, src, delta_row);
        }
        float squares = 0.0f;
        for (int64_t j = 0; j < a.hidden; ++j) {
          float v = load_float(res[src * a.hidden + j]);
          if (delta != nullptr || delta2 != nullptr) {
            float add = delta != nullptr ? delta_row[static_cast<size_t>(j)] : 0.0f;
            if (delta2 != nullptr) {
              add += load_float(delta2[src * a.hidden + j]);
              if (a.clear_delta2) delta2[src * a.hidden + j] = store_float<T>(0.0f);
            }
            v = load_float(store_float<T>(v + add));
          }
          sum[static_cast<size_t>(j)] = v;
          squares += v * v;
        }
        const float inv = 1.0f / std::sqrt(squares / static_cast<float>(a.hidden) + a.eps);
        for (int64_t j = 0; j < a.hidden; ++j) {
          const float v = sum[static_cast<size_t>(j)];
          if (res_out != nullptr) res_out[r * a.hidden + j] = store_float<T>(v);
          const float normed = load_float(store_float<T>(v * inv));
          out[r * a.hidden + j] = store_float<T>(load_float(w[j]) * normed);
        }
      }
    });
  });
}

Status rope_kv_write(const RopeKvWriteArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_rope_kv_write_args(a));
  LORAPLEX_RETURN_IF_ERROR(check_token_slots(a.lora, a.num_tokens, "rope_kv_write"));
  const KvCacheView& c = a.cache;
  const int64_t d = c.head_dim;
  const int64_t kv = c.num_kv_heads * d;
  const int64_t num_slots = c.num_blocks * c.block_size;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    LORAPLEX_ENSURE(a.slot_mapping[t] >= -1 && a.slot_mapping[t] < num_slots,
                    "rope_kv_write: token ", t, " maps to cache slot ", a.slot_mapping[t],
                    ", expected -1..", num_slots - 1);
  }
  return dispatch(a.dtype, "rope_kv_write", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* qkv = static_cast<T*>(a.qkv);
    T* kc = static_cast<T*>(c.k);
    T* vc = static_cast<T*>(c.v);
    const int64_t half = d / 2;
    const int64_t heads = a.num_heads + c.num_kv_heads;
    parallel_for(0, a.num_tokens, 4, [&](int64_t lo, int64_t hi) {
      std::vector<float> cos_v(static_cast<size_t>(half)), sin_v(static_cast<size_t>(half));
      std::vector<float> with_lora;
      for (int64_t t = lo; t < hi; ++t) {
        const float pos = static_cast<float>(a.positions[t]);
        for (int64_t i = 0; i < half; ++i) {
          const float angle = pos * a.inv_freq[i];
          cos_v[static_cast<size_t>(i)] = std::cos(angle);
          sin_v[static_cast<size_t>(i)] = std::sin(angle);
        }
        T* row = qkv + t * a.qkv_row_stride;
        if (a.lora.active()) {
          const int64_t width = (heads + c.num_kv_heads) * d;
          with_lora.resize(static_cast<size_t>(width));
          for (int64_t j = 0; j < width; ++j)
            with_lora[static_cast<size_t>(j)] = load_float(row[j]);
          apply_fused_expand<T>(a.lora, t, with_lora);
          for (int64_t j = 0; j < width; ++j)
            row[j] = store_float<T>(with_lora[static_cast<size_t>(j)]);
        }
        if (a.delta != nullptr) {
          const int64_t width = (heads + c.num_kv_heads) * d;
          T* add = static_cast<T*>(a.delta) + t * width;
          for (int64_t j = 0; j < width; ++j) {
            row[j] = store_float<T>(load_float(row[j]) + load_float(add[j]));
            if (a.clear_delta) add[j] = store_float<T>(0.0f);
          }
        }
        for (int64_t h = 0; h < heads; ++h) {
          T* x = row + h * d;
          for (int64_t i = 0; i < half; ++i) {
            const float x0 = load_float(x[i]);
            const float x1 = load_float(x[i + half]);
            x[i] = store_float<T>(x0 * cos_v[static_cast<size_t>(i)] -
                                  x1 * sin_v[static_cast<size_t>(i)]);
            x[i + half] = store_float<T>(x1 * cos_v[static_cast<size_t>(i)] +
                                         x0 * sin_v[static_cast<size_t>(i)]);
          }
        }
        const int64_t slot = a.slot_mapping[t];
        if (slot < 0) continue;
        std::copy_n(row + a.num_heads * d, kv, kc + slot * kv);
        std::copy_n(row + a.num_heads * d + kv, kv, vc + slot * kv);
      }
    });
  });
}

Status qk_rms_norm(const QkRmsNormArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_qk_rms_norm_args(a));
  return dispatch(a.dtype, "qk_rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t d = a.head_dim;
    const int64_t heads = a.num_heads + a.num_kv_heads;
    const int64_t delta_row = (a.num_heads + 2 * a.num_kv_heads) * d;
    const T* qw = static_cast<const T*>(a.q_weight);
    const T* kw = static_cast<const T*>(a.k_weight);
    parallel_for(0, a.num_tokens * heads, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> v(static_cast<size_t>(d));
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t t = item / heads;
        const int64_t h = item % heads;
        T* x = static_cast<T*>(a.qkv) + t * a.qkv_row_stride + h * d;
        T* add = a.delta != nullptr ? static_cast<T*>(a.delta) + t * delta_row + h * d : nullptr;
        const T* w = h < a.num_heads ? qw : kw;
        float squares = 0.0f;
        for (int64_t i = 0; i < d; ++i) {
          float xi = load_float(x[i]);
          if (add != nullptr) {
            xi = load_float(store_float<T>(xi + load_float(add[i])));
            if (a.clear_delta) add[i] = store_float<T>(0.0f);
          }
          v[static_cast<size_t>(i)] = xi;
          squares += xi * xi;
        }
        const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + a.eps);
        for (int64_t i = 0; i < d; ++i) {
          const float normed = load_float(store_float<T>(v[static_cast<size_t>(i)] * inv));
          x[i] = store_float<T>(load_float(w[i]) * normed);
        }
      }
    });
  });
}

Status paged_attention(const PagedAttentionArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_paged_attention_args(a));
  const KvCacheView& c = a.cache;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    LORAPLEX_ENSURE(a.token_seq[t] >= 0 && a.token_seq[t] < a.num_seqs && a.positions[t] >= 0 &&
                        a.positions[t] < a.max_context,
                    "paged_attention: token ", t, " has sequence ", a.token_seq[t],
                    " and position ", a.positions[t], ", expected < ", a.num_seqs, " and < ",
                    a.max_context);
    const int64_t seq = a.token_seq[t];
    const int32_t* table = a.block_tables + table_offset(a, seq);
    const int64_t blocks = a.block_table_indptr != nullptr
                               ? a.block_table_indptr[seq + 1] - a.block_table_indptr[seq]
                               : a.max_blocks_per_seq;
    LORAPLEX_ENSURE(a.positions[t] / c.block_size < std::min(blocks, a.max_blocks_per_seq),
                    "paged_attention: token ", t, " at position ", a.positions[t], " needs block ",
                    a.positions[t] / c.block_size, " of sequence ", seq, ", which has ",
                    std::min(blocks, a.max_blocks_per_seq));
    for (int64_t b = 0; b <= a.positions[t] / c.block_size; ++b) {
      LORAPLEX_ENSURE(table[b] >= 0 && table[b] < c.num_blocks, "paged_attention: sequence ",
                      a.token_seq[t], " block ", b, " is ", table[b], ", expected 0..",
                      c.num_blocks - 1);
    }
  }
  return dispatch(a.dtype, "paged_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* qkv = static_cast<const T*>(a.qkv);
    const T* kc = static_cast<const T*>(c.k);
    const T* vc = static_cast<const T*>(c.v);
    T* out = static_cast<T*>(a.out);
    const int64_t d = c.head_dim;
    const int64_t group = a.num_heads / c.num_kv_heads;
    const int64_t kv_row = c.num_kv_heads * d;
    parallel_for(0, a.num_tokens * a.num_heads, 4, [&](int64_t lo, int64_t hi) {
      std::vector<float> scores(static_cast<size_t>(a.max_context));
      std::vector<float> q(static_cast<size_t>(d)), acc(static_cast<size_t>(d));
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t t = item / a.num_heads;
        const int64_t h = item % a.num_heads;
        const int64_t kvh = h / group;
        const int32_t* table = a.block_tables + table_offset(a, a.token_seq[t]);
        const int64_t ctx = a.positions[t] + 1;
        for (int64_t i = 0; i < d; ++i) q[i] = load_float(qkv[t * a.qkv_row_stride + h * d + i]);
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < ctx; ++j) {
          const int64_t slot = table[j / c.block_size] * c.block_size + j % c.block_size;
          const T* k = kc + slot * kv_row + kvh * d;
          float dot = 0.0f;
          for (int64_t i = 0; i < d; ++i) dot += q[i] * load_float(k[i]);
          scores[j] = dot * a.scale;
          max_score = std::max(max_score, scores[j]);
        }
        float denom = 0.0f;
        for (int64_t j = 0; j < ctx; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          denom += scores[j];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < ctx; ++j) {
          const int64_t slot = table[j / c.block_size] * c.block_size + j % c.block_size;
          const T* v = vc + slot * kv_row + kvh * d;
          const float p = scores[j] / denom;
          for (int64_t i = 0; i < d; ++i) acc[i] += p * load_float(v[i]);
        }
        T* o = out + t * a.num_heads * d + h * d;
        for (int64_t i = 0; i < d; ++i) o[i] = store_float<T>(acc[i]);
      }
    });
  });
}

Status silu_mul(const SiluMulArgs& a) {
  const int64_t stride = a.x_row_stride > 0 ? a.x_row_stride : 2 * a.n;
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.n >= 1 && stride >= 2 * a.n, "silu_mul: bad sizes (n ", a.n,
                  ", row stride ", stride, ")");
  LORAPLEX_RETURN_IF_ERROR(check_fused_lora_expand(a.lora, 2 * a.n, "silu_mul"));
  LORAPLEX_RETURN_IF_ERROR(check_token_slots(a.lora, a.num_rows, "silu_mul"));
  return dispatch(a.dtype, "silu_mul", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.x);
    T* delta = static_cast<T*>(a.delta);
    T* out = static_cast<T*>(a.out);
    parallel_for(0, a.num_rows, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row_f(static_cast<size_t>(2 * a.n));
      for (int64_t r = lo; r < hi; ++r) {
        const T* row = x + r * stride;
        T* add = delta != nullptr ? delta + r * 2 * a.n : nullptr;
        for (int64_t j = 0; j < 2 * a.n; ++j) row_f[static_cast<size_t>(j)] = load_float(row[j]);
        if (a.lora.active()) apply_fused_expand<T>(a.lora, r, row_f);
        auto at = [&](int64_t j) {
          const float v = row_f[static_cast<size_t>(j)];
          return add != nullptr ? load_float(store_float<T>(v + load_float(add[j]))) : v;
        };
        for (int64_t j = 0; j < a.n; ++j) {
          // transformers rounds silu(gate) to the activation dtype before the multiply.
          const float g = load_float(store_float<T>(silu(at(j))));
          out[r * a.n + j] = store_float<T>(g * at(a.n + j));
        }
        if (add != nullptr && a.clear_delta) std::fill(add, add + 2 * a.n, store_float<T>(0.0f));
      }
    });
  });
}

Status argmax(const ArgmaxArgs& a) {
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.vocab >= 1 && a.row_stride >= a.vocab, "argmax: bad sizes");
  return dispatch(a.dtype, "argmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* logits = static_cast<const T*>(a.logits);
    for (int64_t r = 0; r < a.num_rows; ++r) {
      const T* row = logits + r * a.row_stride;
      int32_t best = 0;
      float best_v = -std::numeric_limits<float>::infinity();
      bool found = false;
      for (int64_t j = 0; j < a.vocab; ++j) {
        const float v = load_float(row[j]);
        if (std::isnan(v)) continue;
        if (!found || v > best_v) {
          best = static_cast<int32_t>(j);
          best_v = v;
          found = true;
        }
      }
      a.ids[r] = best;
    }
  });
}

Status feed_tokens(const FeedTokensArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_feed_tokens_args(a));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int32_t r = a.rows[t];
    if (r >= 0 && r < a.num_sampled) a.tokens[t] = a.sampled[r];
  }
  return Status();
}

}  // namespace loraplex::kernels::cpu
