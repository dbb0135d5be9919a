#include "attention_test_support.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"
#include "support/random_data.h"

namespace loraplex::test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Row, in the table of the shape [num_blocks, block_size, kv_heads, head_dim], of position p of
// sequence i.
int64_t cache_row(const AttentionScenario& s, int64_t i, int64_t p) {
  const int64_t bs = s.shape.block_size;
  const int32_t block = s.step.page_indices[static_cast<size_t>(s.step.page_indptr[i] + p / bs)];
  return static_cast<int64_t>(block) * bs + p % bs;
}

}  // namespace

int64_t blocks_needed(const std::vector<AttnSeq>& seqs, int64_t block_size) {
  int64_t n = 1;
  for (const AttnSeq& q : seqs) {
    if (!q.dummy) n += ceil_div(q.past + q.now, block_size);
  }
  return n;
}

AttentionScenario make_attention_scenario(const model::AttentionShape& shape,
                                          const std::vector<AttnSeq>& seqs, std::mt19937_64& rng,
                                          int64_t num_blocks, const AttentionScenario* same_cache) {
  AttentionScenario s;
  s.shape = shape;
  const int64_t bs = shape.block_size;
  s.num_blocks = same_cache != nullptr ? same_cache->num_blocks
                 : num_blocks > 0      ? num_blocks
                                       : blocks_needed(seqs, bs);
  LORAPLEX_CHECK(s.num_blocks >= blocks_needed(seqs, bs), "scenario: ", s.num_blocks,
                 " blocks, needs ", blocks_needed(seqs, bs));
  std::vector<int32_t> pool(static_cast<size_t>(s.num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;
  s.step.qo_indptr.push_back(0);
  s.step.page_indptr.push_back(0);
  for (const AttnSeq& q : seqs) {
    const int32_t kv_len = q.dummy ? 1 : q.past + q.now;
    const int32_t now = q.dummy ? 1 : q.now;
    s.step.qo_indptr.push_back(s.step.qo_indptr.back() + now);
    s.step.kv_len.push_back(kv_len);
    const int64_t pages = ceil_div(kv_len, bs);
    for (int64_t b = 0; b < pages; ++b) s.step.page_indices.push_back(q.dummy ? 0 : pool[next++]);
    s.step.page_indptr.push_back(static_cast<int32_t>(s.step.page_indices.size()));
  }
  const int64_t tokens = s.step.qo_indptr.back();
  s.row_stride = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim;
  s.q = random_tensor({tokens, s.row_stride}, shape.dtype, rng);
  if (same_cache != nullptr) {
    s.k = same_cache->k;
    s.v = same_cache->v;
    return s;
  }
  const Shape cache = {s.num_blocks, bs, shape.num_kv_heads, shape.head_dim};
  s.k = random_tensor(cache, shape.dtype, rng);
  s.v = random_tensor(cache, shape.dtype, rng);
  return s;
}

Tensor cpu_reference(const AttentionScenario& s) {
  const int64_t n = static_cast<int64_t>(s.step.kv_len.size());
  const int64_t tokens = s.step.qo_indptr.back();
  int64_t width = 1;
  for (int64_t i = 0; i < n; ++i) {
    width = std::max<int64_t>(width, s.step.page_indptr[i + 1] - s.step.page_indptr[i]);
  }
  std::vector<int32_t> positions, token_seq, tables(static_cast<size_t>(n * width), -1);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t qo_len = s.step.qo_indptr[i + 1] - s.step.qo_indptr[i];
    for (int32_t r = 0; r < qo_len; ++r) {
      positions.push_back(s.step.kv_len[i] - qo_len + r);
      token_seq.push_back(static_cast<int32_t>(i));
    }
    for (int32_t p = s.step.page_indptr[i]; p < s.step.page_indptr[i + 1]; ++p) {
      tables[static_cast<size_t>(i * width + p - s.step.page_indptr[i])] =
          s.step.page_indices[static_cast<size_t>(p)];
    }
  }
  Tensor out = Tensor::empty({tokens, s.shape.num_heads * s.shape.head_dim}, s.shape.dtype);
  model::ops::PagedAttentionArgs a;
  a.dtype = s.shape.dtype;
  a.num_tokens = tokens;
  a.num_heads = s.shape.num_heads;
  a.scale = 1.0f / std::sqrt(static_cast<float>(s.shape.head_dim));
  a.qkv = s.q.data_ptr();
  a.qkv_row_stride = s.row_stride;
  a.positions = positions.data();
  a.token_seq = token_seq.data();
  a.block_tables = tables.data();
  a.num_seqs = n;
  a.max_blocks_per_seq = width;
  a.max_context = width * s.shape.block_size;
  a.cache = model::ops::KvCacheView{s.num_blocks,     s.shape.block_size, s.shape.num_kv_heads,
                                    s.shape.head_dim, s.k.data_ptr(),     s.v.data_ptr()};
  a.out = out.data_ptr();
  throw_if_error(model::ops::cpu::paged_attention(a));
  return out;
}

std::vector<double> double_reference(const AttentionScenario& s) {
  const std::vector<double> q = s.q.to_double_vector();
  const std::vector<double> k = s.k.to_double_vector();
  const std::vector<double> v = s.v.to_double_vector();
  const int64_t h_total = s.shape.num_heads, d = s.shape.head_dim;
  const int64_t group = h_total / s.shape.num_kv_heads;
  const int64_t kv_row = s.shape.num_kv_heads * d;
  const int64_t n = static_cast<int64_t>(s.step.kv_len.size());
  const int64_t tokens = s.step.qo_indptr.back();
  std::vector<double> out(static_cast<size_t>(tokens * h_total * d), 0.0);
  std::vector<double> scores;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t qo_len = s.step.qo_indptr[i + 1] - s.step.qo_indptr[i];
    for (int64_t r = 0; r < qo_len; ++r) {
      const int64_t t = s.step.qo_indptr[i] + r;
      const int64_t pos = s.step.kv_len[i] - qo_len + r;  // attends to keys 0..pos
      for (int64_t h = 0; h < h_total; ++h) {
        const int64_t kvh = h / group;
        scores.assign(static_cast<size_t>(pos + 1), 0.0);
        double m = -1e300;
        for (int64_t j = 0; j <= pos; ++j) {
          const int64_t row = cache_row(s, i, j);
          double dot = 0.0;
          for (int64_t x = 0; x < d; ++x) {
            dot += q[t * s.row_stride + h * d + x] * k[row * kv_row + kvh * d + x];
          }
          scores[j] = dot / std::sqrt(static_cast<double>(d));
          m = std::max(m, scores[j]);
        }
        double z = 0.0;
        for (double& e : scores) z += (e = std::exp(e - m));
        double* o = &out[static_cast<size_t>((t * h_total + h) * d)];
        for (int64_t j = 0; j <= pos; ++j) {
          const int64_t row = cache_row(s, i, j);
          for (int64_t x = 0; x < d; ++x) o[x] += scores[j] / z * v[row * kv_row + kvh * d + x];
        }
      }
    }
  }
  return out;
}

RelativeError relative_error(const Tensor& got, const std::vector<double>& ref, int64_t row_len) {
  const std::vector<double> g = got.to_double_vector();
  LORAPLEX_CHECK(g.size() == ref.size(), "relative_error: ", g.size(), " values vs ", ref.size());
  RelativeError e;
  double diff_all = 0.0, ref_all = 0.0;
  const int64_t rows = static_cast<int64_t>(g.size()) / row_len;
  for (int64_t r = 0; r < rows; ++r) {
    double diff = 0.0, norm = 0.0;
    for (int64_t x = r * row_len; x < (r + 1) * row_len; ++x) {
      diff += (g[x] - ref[x]) * (g[x] - ref[x]);
      norm += ref[x] * ref[x];
    }
    diff_all += diff;
    ref_all += norm;
    const double rel = std::sqrt(diff / norm);
    // NaN (a row of NaN or infinity) counts as the worst and stays so.
    if (std::isnan(rel) || (!std::isnan(e.worst_row) && rel > e.worst_row)) {
      e.worst_row = rel;
      e.worst_row_index = r;
    }
  }
  e.total = std::sqrt(diff_all / ref_all);
  return e;
}

}  // namespace loraplex::test
