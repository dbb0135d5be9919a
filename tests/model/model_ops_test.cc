// The decoder's non-LoRA ops against direct double-precision formulas: paged attention over
// scattered blocks equals contiguous causal attention, RoPE + KV write, residual add + RMSNorm,
// Qwen3's per-head q/k RMSNorm, SiLU-mul, argmax ties,
// the sampler and the KV-cache block pool. The same cases run on CUDA against the CPU (skipped
// without a GPU).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/layers/embedding_moe_ops.h"
#include "loraplex/model/decoder_ops.h"
#include "loraplex/model/kv_cache.h"
#include "loraplex/model/sampler.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex::model {
namespace {

using test::random_tensor;

// A mixed step over a paged cache: sequences with different context lengths, some tokens
// prefilling, some decoding, blocks scattered over the pool.
struct AttentionCase {
  int64_t heads = 6, kv_heads = 2, head_dim = 20, block_size = 4, num_blocks = 40;
  std::vector<int32_t> positions, token_seq, block_tables, slots;
  int64_t num_seqs = 0, max_blocks = 0, max_context = 0;
  Tensor qkv;     // [T, (heads + 2 kv) * d]
  Tensor k_full;  // [seqs, max_context, kv, d] for the reference, filled by the test
  std::vector<std::vector<int32_t>> seq_tokens;  // token indices of each sequence
};

AttentionCase make_case(DType dtype, std::mt19937_64& rng) {
  AttentionCase c;
  // Sequence lengths before this step and tokens of this step (prefill = many).
  const std::vector<std::pair<int, int>> seqs = {{0, 9}, {11, 1}, {3, 1}, {0, 1}, {5, 6}};
  c.num_seqs = static_cast<int64_t>(seqs.size());
  std::vector<int32_t> pool(static_cast<size_t>(c.num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  for (const auto& [past, now] : seqs) {
    c.max_blocks = std::max<int64_t>(c.max_blocks, (past + now + c.block_size - 1) / c.block_size);
    c.max_context = std::max<int64_t>(c.max_context, past + now);
  }
  c.block_tables.assign(static_cast<size_t>(c.num_seqs * c.max_blocks), -1);
  size_t next = 0;
  for (int64_t s = 0; s < c.num_seqs; ++s) {
    const int64_t need = (seqs[s].first + seqs[s].second + c.block_size - 1) / c.block_size;
    for (int64_t b = 0; b < need; ++b) c.block_tables[s * c.max_blocks + b] = pool[next++];
  }
  c.seq_tokens.resize(seqs.size());
  // Tokens of the step are interleaved across sequences in a fixed shuffled order.
  std::vector<std::pair<int32_t, int32_t>> tokens;  // (seq, position)
  for (int64_t s = 0; s < c.num_seqs; ++s) {
    for (int p = 0; p < seqs[s].first + seqs[s].second; ++p) {
      tokens.push_back({static_cast<int32_t>(s), p});
    }
  }
  for (const auto& [s, p] : tokens) {
    c.seq_tokens[s].push_back(static_cast<int32_t>(c.positions.size()));
    c.positions.push_back(p);
    c.token_seq.push_back(s);
    const int32_t block = c.block_tables[s * c.max_blocks + p / c.block_size];
    c.slots.push_back(static_cast<int32_t>(block * c.block_size + p % c.block_size));
  }
  const int64_t t = static_cast<int64_t>(c.positions.size());
  c.qkv = random_tensor({t, (c.heads + 2 * c.kv_heads) * c.head_dim}, dtype, rng);
  return c;
}

// Writes every token's k/v (all positions, so past tokens too) and runs attention for all.
Tensor run_attention(const AttentionCase& c, DType dtype, Device device) {
  const Stream stream = device.is_cpu() ? Stream() : Stream::create(device);
  const int64_t t = static_cast<int64_t>(c.positions.size());
  Tensor k = Tensor::zeros({c.num_blocks, c.block_size, c.kv_heads, c.head_dim}, dtype, device);
  Tensor v = Tensor::zeros({c.num_blocks, c.block_size, c.kv_heads, c.head_dim}, dtype, device);
  const Tensor qkv = c.qkv.to(device, stream);
  auto up = [&](const std::vector<int32_t>& x) {
    return Tensor::from_vector(x, {static_cast<int64_t>(x.size())}).to(device, stream);
  };
  const Tensor slots = up(c.slots), pos = up(c.positions), seq = up(c.token_seq),
               tables = up(c.block_tables);
  ops::KvCacheView view{c.num_blocks, c.block_size, c.kv_heads,
                        c.head_dim,   k.data_ptr(), v.data_ptr()};
  // A zero rotation (inv_freq 0: cos 1, sin 0 exactly) leaves q and k as they are, so only the
  // cache write matters here; the rotation has its own test.
  const Tensor no_rotation = Tensor::zeros({c.head_dim / 2}, DType::kF32, device, stream);
  ops::RopeKvWriteArgs w;
  w.dtype = dtype;
  w.num_tokens = t;
  w.num_heads = c.heads;
  w.positions = pos.data<int32_t>();
  w.inv_freq = no_rotation.data<float>();
  w.qkv = qkv.data_ptr();
  w.qkv_row_stride = qkv.size(1);
  w.slot_mapping = slots.data<int32_t>();
  w.cache = view;
  throw_if_error(ops::run(&ops::cpu::rope_kv_write, &ops::cuda::rope_kv_write, w, stream));
  Tensor out = Tensor::empty({t, c.heads * c.head_dim}, dtype, device);
  ops::PagedAttentionArgs a;
  a.dtype = dtype;
  a.num_tokens = t;
  a.num_heads = c.heads;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.qkv = qkv.data_ptr();
  a.qkv_row_stride = qkv.size(1);
  a.positions = pos.data<int32_t>();
  a.token_seq = seq.data<int32_t>();
  a.block_tables = tables.data<int32_t>();
  a.num_seqs = c.num_seqs;
  a.max_blocks_per_seq = c.max_blocks;
  a.max_context = c.max_context;
  a.cache = view;
  a.out = out.data_ptr();
  throw_if_error(ops::run(&ops::cpu::paged_attention, &ops::cuda::paged_attention, a, stream));
  return out.to(Device::cpu(), stream);
}

// Causal GQA attention over each sequence's own tokens, in double.
std::vector<double> reference_attention(const AttentionCase& c) {
  const std::vector<double> qkv = c.qkv.to_double_vector();
  const int64_t row = c.qkv.size(1);
  const int64_t d = c.head_dim;
  const int64_t t = static_cast<int64_t>(c.positions.size());
  std::vector<double> out(static_cast<size_t>(t * c.heads * d), 0.0);
  for (int64_t i = 0; i < t; ++i) {
    const auto& mine = c.seq_tokens[c.token_seq[i]];
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t kvh = h / (c.heads / c.kv_heads);
      std::vector<double> s;
      std::vector<int32_t> keys;
      for (int32_t j : mine) {
        if (c.positions[j] > c.positions[i]) continue;
        double dot = 0.0;
        for (int64_t x = 0; x < d; ++x) {
          dot += qkv[i * row + h * d + x] * qkv[j * row + (c.heads + kvh) * d + x];
        }
        s.push_back(dot / std::sqrt(static_cast<double>(d)));
        keys.push_back(j);
      }
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0.0;
      for (double& e : s) z += (e = std::exp(e - m));
      for (size_t k = 0; k < keys.size(); ++k) {
        for (int64_t x = 0; x < d; ++x) {
          out[(i * c.heads + h) * d + x] +=
              s[k] / z * qkv[keys[k] * row + (c.heads + c.kv_heads + kvh) * d + x];
        }
      }
    }
  }
  return out;
}

TEST(PagedAttention, ScatteredBlocksEqualContiguousCausalAttention) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::mt19937_64 rng(11);
    const AttentionCase c = make_case(dtype, rng);
    test::expect_close(run_attention(c, dtype, Device::cpu()), reference_attention(c),
                       dtype == DType::kF32 ? 1e-5 : 2e-2, dtype == DType::kF32 ? 1e-6 : 1e-2,
                       "paged attention");
  }
}

// Runs rope_kv_write on `device` over a cache poisoned with NaN; returns (qkv, k cache, v cache).
struct RopeCase {
  int64_t t = 6, heads = 3, kv = 2, d = 8, stride = (3 + 2 * 2) * 8 + 3, blocks = 4, block = 4;
  std::vector<int32_t> pos = {0, 7, 3, 100, 1, 2047};
  std::vector<int32_t> slots = {5, -1, 0, 15, 9, 2};
  std::vector<float> inv = {1.0f, 0.3f, 0.05f, 0.001f};
};

std::vector<Tensor> run_rope_kv_write(const RopeCase& c, const Tensor& qkv_in, DType dt,
                                      Device device) {
  const Stream stream = device.is_cpu() ? Stream() : Stream::create(device);
  Tensor qkv = qkv_in.clone().to(device, stream);
  const Shape cache_shape = {c.blocks, c.block, c.kv, c.d};
  const std::vector<float> poison(static_cast<size_t>(c.blocks * c.block * c.kv * c.d), NAN);
  Tensor k = Tensor::from_vector(poison, cache_shape).to(dt).to(device, stream);
  Tensor v = k.clone(stream);
  const Tensor pos = Tensor::from_vector(c.pos, {c.t}).to(device, stream);
  const Tensor slots = Tensor::from_vector(c.slots, {c.t}).to(device, stream);
  const Tensor inv = Tensor::from_vector(c.inv, {c.d / 2}).to(device, stream);
  ops::RopeKvWriteArgs a;
  a.dtype = dt;
  a.num_tokens = c.t;
  a.num_heads = c.heads;
  a.positions = pos.data<int32_t>();
  a.inv_freq = inv.data<float>();
  a.qkv = qkv.data_ptr();
  a.qkv_row_stride = c.stride;
  a.slot_mapping = slots.data<int32_t>();
  a.cache = {c.blocks, c.block, c.kv, c.d, k.data_ptr(), v.data_ptr()};
  throw_if_error(ops::run(&ops::cpu::rope_kv_write, &ops::cuda::rope_kv_write, a, stream));
  return {qkv.to(Device::cpu(), stream), k.to(Device::cpu(), stream), v.to(Device::cpu(), stream)};
}

TEST(ModelOps, RopeKvWriteRotatesQAndKAndStoresKAndV) {
  std::mt19937_64 rng(3);
  const RopeCase c;
  const Tensor qkv = random_tensor({c.t, c.stride}, DType::kF32, rng);
  const std::vector<double> before = qkv.to_double_vector();
  const std::vector<Tensor> got = run_rope_kv_write(c, qkv, DType::kF32, Device::cpu());
  std::vector<double> want = before;
  for (int64_t i = 0; i < c.t; ++i) {
    for (int64_t h = 0; h < c.heads + c.kv; ++h) {
      for (int64_t j = 0; j < c.d / 2; ++j) {
        const double ang = static_cast<double>(c.pos[i]) * c.inv[j];
        const double x0 = before[i * c.stride + h * c.d + j];
        const double x1 = before[i * c.stride + h * c.d + j + c.d / 2];
        want[i * c.stride + h * c.d + j] = x0 * std::cos(ang) - x1 * std::sin(ang);
        want[i * c.stride + h * c.d + j + c.d / 2] = x1 * std::cos(ang) + x0 * std::sin(ang);
      }
    }
  }
  test::expect_close(got[0], want, 1e-5, 1e-4, "rope");
  // The cache holds the rotated k heads and the v heads at each token's slot; the rest is
  // still the NaN poison (token 1 has slot -1).
  const std::vector<double> k = got[1].to_double_vector(), v = got[2].to_double_vector();
  const std::vector<double> rotated = got[0].to_double_vector();
  const int64_t kv_cols = c.kv * c.d;
  std::vector<bool> written(static_cast<size_t>(c.blocks * c.block), false);
  for (int64_t i = 0; i < c.t; ++i) {
    if (c.slots[i] < 0) continue;
    written[static_cast<size_t>(c.slots[i])] = true;
    for (int64_t j = 0; j < kv_cols; ++j) {
      EXPECT_EQ(k[c.slots[i] * kv_cols + j], rotated[i * c.stride + c.heads * c.d + j]);
      EXPECT_EQ(v[c.slots[i] * kv_cols + j], before[i * c.stride + c.heads * c.d + kv_cols + j]);
    }
  }
  for (size_t s = 0; s < written.size(); ++s) {
    if (!written[s]) {
      EXPECT_TRUE(std::isnan(k[s * static_cast<size_t>(kv_cols)])) << s;
    }
  }
}

// add_rms_norm's reference in double: sum rounded as stored (float32 here), then normalised.
std::vector<double> reference_add_rms_norm(const std::vector<double>& res,
                                           const std::vector<double>& delta,
                                           const std::vector<double>& w,
                                           const std::vector<int32_t>& rows, int64_t n,
                                           std::vector<double>* sums) {
  std::vector<double> out;
  for (int32_t src : rows) {
    std::vector<double> sum(static_cast<size_t>(n));
    double ss = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      sum[j] = res[src * n + j] + (delta.empty() ? 0.0 : delta[src * n + j]);
      ss += sum[j] * sum[j];
    }
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t j = 0; j < n; ++j) {
      out.push_back(sum[j] * inv * w[j]);
      if (sums != nullptr) sums->push_back(sum[j]);
    }
  }
  return out;
}

TEST(ModelOps, AddRmsNormInPlaceAndGatheredAndSiluMul) {
  std::mt19937_64 rng(4);
  const int64_t rows = 7, n = 33;
  Tensor x = random_tensor({rows, n}, DType::kF32, rng);
  const Tensor d = random_tensor({rows, n}, DType::kF32, rng);
  const Tensor w = random_tensor({n}, DType::kF32, rng);
  const std::vector<double> xv = x.to_double_vector(), dv = d.to_double_vector(),
                            wv = w.to_double_vector();
  std::vector<int32_t> all(static_cast<size_t>(rows));
  std::iota(all.begin(), all.end(), 0);
  // In place: x = x + d, out = norm(x + d).
  Tensor out = Tensor::empty({rows, n}, DType::kF32);
  throw_if_error(
      ops::cpu::add_rms_norm({DType::kF32, rows, n, 1e-5f, nullptr, x.data_ptr(), d.data_ptr(),
                              x.data_ptr(), w.data_ptr(), out.data_ptr()}));
  std::vector<double> sums;
  test::expect_close(out, reference_add_rms_norm(xv, dv, wv, all, n, &sums), 1e-5, 1e-6,
                     "add_rms_norm");
  test::expect_close(x, sums, 1e-6, 1e-7, "add_rms_norm residual");
  // Gathered rows, no delta, residual not stored.
  const std::vector<int32_t> pick = {6, 0, 6};
  Tensor picked = Tensor::empty({3, n}, DType::kF32);
  const std::vector<double> now = x.to_double_vector();
  throw_if_error(ops::cpu::add_rms_norm({DType::kF32, 3, n, 1e-5f, pick.data(), x.data_ptr(),
                                         nullptr, nullptr, w.data_ptr(), picked.data_ptr()}));
  test::expect_close(picked, reference_add_rms_norm(now, {}, wv, pick, n, nullptr), 1e-5, 1e-6,
                     "gathered rms_norm");

  std::vector<double> want(static_cast<size_t>(rows * n));
  const Tensor gu = random_tensor({rows, 2 * n}, DType::kF32, rng);
  Tensor act = Tensor::empty({rows, n}, DType::kF32);
  throw_if_error(ops::cpu::silu_mul({DType::kF32, rows, n, gu.data_ptr(), act.data_ptr()}));
  const std::vector<double> g = gu.to_double_vector();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      const double a = g[r * 2 * n + j];
      want[r * n + j] = a / (1.0 + std::exp(-a)) * g[r * 2 * n + n + j];
    }
  }
  test::expect_close(act, want, 1e-5, 1e-6, "silu_mul");
}

// A LoRA output handed to the op that adds it to its base output: the result equals the base
// output plus it, and the op leaves the buffer zeroed for the next layer.
TEST(ModelOps, LoraDeltasAreAddedAndCleared) {
  std::mt19937_64 rng(8);
  const int64_t rows = 5, n = 24;
  const Tensor gu = random_tensor({rows, 2 * n}, DType::kF32, rng);
  Tensor d = random_tensor({rows, 2 * n}, DType::kF32, rng);
  std::vector<double> sum = gu.to_double_vector();
  const std::vector<double> dv = d.to_double_vector();
  for (size_t i = 0; i < sum.size(); ++i) sum[i] += dv[i];
  const Tensor summed =
      Tensor::from_vector(std::vector<float>(sum.begin(), sum.end()), {rows, 2 * n});
  Tensor want = Tensor::empty({rows, n}, DType::kF32), got = Tensor::empty({rows, n}, DType::kF32);
  throw_if_error(ops::cpu::silu_mul({DType::kF32, rows, n, summed.data_ptr(), want.data_ptr()}));
  ops::SiluMulArgs a{DType::kF32, rows, n, gu.data_ptr(), got.data_ptr()};
  a.delta = d.data_ptr();
  a.clear_delta = true;
  throw_if_error(ops::cpu::silu_mul(a));
  test::expect_close(got, want.to_double_vector(), 1e-6, 1e-7, "silu_mul with a delta");
  for (double v : d.to_double_vector()) ASSERT_EQ(v, 0.0);
  // Clearing is refused where a gather would leave rows uncleared.
  const std::vector<int32_t> pick = {0};
  Tensor out = Tensor::empty({1, n}, DType::kF32);
  ops::AddRmsNormArgs g{DType::kF32,   1,       n,       1e-5f,         pick.data(),
                        gu.data_ptr(), nullptr, nullptr, gu.data_ptr(), out.data_ptr()};
  g.delta2 = d.data_ptr();
  g.clear_delta2 = true;
  EXPECT_FALSE(ops::cpu::add_rms_norm(g).ok());
}

// Qwen3's per-head q/k RMSNorm over packed qkv rows: odd head counts and sizes, rows wider than
// the heads (the tail must stay as it was), a LoRA delta added first.
struct QkNormCase {
  int64_t t = 7, heads = 3, kv = 2, d = 13, pad = 5;
  float eps = 1e-6f;
  int64_t width() const { return (heads + 2 * kv) * d; }
  int64_t stride() const { return width() + pad; }
};

struct QkNormResult {
  Tensor qkv, delta;  // on the CPU
};

// Runs qk_rms_norm on `device` over copies of qkv and delta (undefined: none).
QkNormResult run_qk_norm(const QkNormCase& c, const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                         const Tensor& delta, DType dt, Device device) {
  const Stream stream = device.is_cpu() ? Stream() : Stream::create(device);
  Tensor x = qkv.to(device, stream).clone(stream);
  Tensor dl = delta.defined() ? delta.to(device, stream).clone(stream) : Tensor();
  const Tensor qwd = qw.to(device, stream), kwd = kw.to(device, stream);
  ops::QkRmsNormArgs a;
  a.dtype = dt;
  a.num_tokens = c.t;
  a.num_heads = c.heads;
  a.num_kv_heads = c.kv;
  a.head_dim = c.d;
  a.eps = c.eps;
  a.qkv = x.data_ptr();
  a.qkv_row_stride = c.stride();
  a.q_weight = qwd.data_ptr();
  a.k_weight = kwd.data_ptr();
  a.delta = dl.defined() ? dl.data_ptr() : nullptr;
  a.clear_delta = dl.defined();
  throw_if_error(ops::run(&ops::cpu::qk_rms_norm, &ops::cuda::qk_rms_norm, a, stream));
  return {x.to(Device::cpu(), stream), dl.defined() ? dl.to(Device::cpu(), stream) : Tensor()};
}

// transformers' Qwen3RMSNorm per head, in double: x / sqrt(mean(x^2) + eps) * w for every q and
// k head of x = qkv + delta; v heads and the row's tail as they were.
std::vector<double> reference_qk_norm(const QkNormCase& c, const Tensor& qkv, const Tensor& qw,
                                      const Tensor& kw, const Tensor& delta) {
  std::vector<double> out = qkv.to_double_vector();
  const std::vector<double> dv = delta.defined() ? delta.to_double_vector() : std::vector<double>();
  const std::vector<double> q = qw.to_double_vector(), k = kw.to_double_vector();
  for (int64_t t = 0; t < c.t; ++t) {
    for (int64_t h = 0; h < c.heads + c.kv; ++h) {
      std::vector<double> x(static_cast<size_t>(c.d));
      double squares = 0.0;
      for (int64_t i = 0; i < c.d; ++i) {
        x[i] = out[t * c.stride() + h * c.d + i] +
               (dv.empty() ? 0.0 : dv[t * c.width() + h * c.d + i]);
        squares += x[i] * x[i];
      }
      const double inv = 1.0 / std::sqrt(squares / static_cast<double>(c.d) + c.eps);
      for (int64_t i = 0; i < c.d; ++i) {
        out[t * c.stride() + h * c.d + i] = x[i] * inv * (h < c.heads ? q[i] : k[i]);
      }
    }
  }
  return out;
}

TEST(ModelOps, QkRmsNormNormalisesEachQAndKHeadAndLeavesV) {
  for (const QkNormCase c :
       {QkNormCase{}, QkNormCase{1, 1, 1, 2, 0}, QkNormCase{5, 8, 2, 128, 3}}) {
    std::mt19937_64 rng(static_cast<uint64_t>(c.d));
    // Values far from unit scale, so that a missing normalisation cannot pass.
    const Tensor qkv = random_tensor({c.t, c.stride()}, DType::kF32, rng, 7.0f);
    const Tensor qw = random_tensor({c.d}, DType::kF32, rng),
                 kw = random_tensor({c.d}, DType::kF32, rng);
    const std::string what = "heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv) +
                             " d " + std::to_string(c.d);
    const QkNormResult plain = run_qk_norm(c, qkv, qw, kw, Tensor(), DType::kF32, Device::cpu());
    test::expect_close(plain.qkv, reference_qk_norm(c, qkv, qw, kw, Tensor()), 1e-5, 1e-6,
                       "qk_rms_norm " + what);
    // v heads and the tail are bit for bit what they were.
    const std::vector<double> before = qkv.to_double_vector(), after = plain.qkv.to_double_vector();
    for (int64_t t = 0; t < c.t; ++t) {
      for (int64_t j = (c.heads + c.kv) * c.d; j < c.stride(); ++j) {
        ASSERT_EQ(after[t * c.stride() + j], before[t * c.stride() + j]) << what << " column " << j;
      }
    }
    // With a LoRA delta: q and k become norm(qkv + delta), their delta entries are cleared, and
    // v's delta is left for rope_kv_write (v itself is not touched here).
    const Tensor delta = random_tensor({c.t, c.width()}, DType::kF32, rng, 3.0f);
    const std::vector<double> dv = delta.to_double_vector();
    const QkNormResult with = run_qk_norm(c, qkv, qw, kw, delta, DType::kF32, Device::cpu());
    test::expect_close(with.qkv, reference_qk_norm(c, qkv, qw, kw, delta), 1e-5, 1e-6,
                       "qk_rms_norm with a delta " + what);
    const std::vector<double> left = with.delta.to_double_vector();
    for (int64_t t = 0; t < c.t; ++t) {
      for (int64_t j = 0; j < c.width(); ++j) {
        const size_t i = static_cast<size_t>(t * c.width() + j);
        ASSERT_EQ(left[i], j < (c.heads + c.kv) * c.d ? 0.0 : dv[i]) << what << " delta " << j;
      }
    }
  }
  // Sizes are checked: a row stride narrower than the heads is refused.
  QkNormCase bad;
  Tensor x = Tensor::zeros({bad.t, bad.stride()}, DType::kF32);
  const Tensor w = Tensor::zeros({bad.d}, DType::kF32);
  ops::QkRmsNormArgs a;
  a.num_tokens = bad.t;
  a.num_heads = bad.heads;
  a.num_kv_heads = bad.kv;
  a.head_dim = bad.d;
  a.qkv = x.data_ptr();
  a.qkv_row_stride = bad.width() - 1;
  a.q_weight = a.k_weight = w.data_ptr();
  EXPECT_FALSE(ops::cpu::qk_rms_norm(a).ok());
}

TEST(ModelOps, ArgmaxTiesGoToTheLowestIdAndNanNeverWins) {
  const std::vector<float> logits = {1.0f, 3.0f, NAN, 3.0f, -2.0f,  // row 0: tie 1 / 3
                                     NAN,  NAN,  NAN, NAN,  0.5f};  // row 1: only id 4
  std::vector<int32_t> ids(2, -1);
  throw_if_error(ops::cpu::argmax({DType::kF32, 2, 5, logits.data(), 5, ids.data()}));
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(argmax_lowest(std::span<const float>(logits.data(), 5)), 1);
}

TEST(Sampler, GreedyTopKOneAndTinyTopPAgree) {
  std::mt19937_64 rng(1);
  std::vector<float> logits(50);
  for (float& v : logits) v = std::uniform_real_distribution<float>(-3, 3)(rng);
  const int32_t best = argmax_lowest(logits);
  EXPECT_EQ(sample_row(logits, {0.0f, 0, 1.0f}, next_uniform(rng)), best);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(sample_row(logits, {1.5f, 1, 1.0f}, next_uniform(rng)), best);
    EXPECT_EQ(sample_row(logits, {1.5f, 0, 1e-6f}, next_uniform(rng)), best);
  }
  EXPECT_THROW(sample_row(logits, {-1.0f, 0, 1.0f}, 0.5), Error);
  EXPECT_THROW(sample_row(logits, {1.0f, 0, 0.0f}, 0.5), Error);
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(7.0f), -30.0f};
  std::mt19937_64 rng = make_sequence_rng(9, 0);
  std::vector<int> counts(4, 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[sample_row(logits, {1.0f, 0, 1.0f}, next_uniform(rng))];
  EXPECT_NEAR(counts[0] / double(n), 0.1, 0.015);
  EXPECT_NEAR(counts[1] / double(n), 0.2, 0.015);
  EXPECT_NEAR(counts[2] / double(n), 0.7, 0.015);
  // top_k 2 removes token 0; among tokens 2 and 1 (7/9, 2/9) top_p 0.8 keeps both.
  std::fill(counts.begin(), counts.end(), 0);
  for (int i = 0; i < n; ++i) ++counts[sample_row(logits, {1.0f, 2, 0.8f}, next_uniform(rng))];
  EXPECT_EQ(counts[0], 0);
  EXPECT_EQ(counts[3], 0);
  EXPECT_NEAR(counts[2] / double(n), 7.0 / 9.0, 0.015);
}

TEST(KvCache, SizesBlocksAndViewsLayers) {
  ModelConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  KvCache cache(c, 5, 16, DType::kF32, Device::cpu());
  EXPECT_EQ(cache.blocks_for(1), 1);
  EXPECT_EQ(cache.blocks_for(16), 1);
  EXPECT_EQ(cache.blocks_for(17), 2);
  EXPECT_EQ(cache.num_blocks(), 5);
  EXPECT_NE(cache.view(1).k, cache.view(0).k);
  EXPECT_THROW(cache.view(2), Error);
}

// CUDA kernels against the CPU versions (skipped without a GPU).
TEST(ModelOpsCuda, PagedAttentionMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::mt19937_64 rng(12);
    const AttentionCase c = make_case(dtype, rng);
    const Tensor cpu = run_attention(c, dtype, Device::cpu());
    const Tensor gpu = run_attention(c, dtype, Device::cuda(0));
    test::expect_close(gpu, cpu.to_double_vector(), dtype == DType::kF32 ? 1e-5 : 2e-2,
                       dtype == DType::kF32 ? 1e-6 : 1e-2, "cuda paged attention");
  }
}

TEST(ModelOpsCuda, ElementwiseOpsMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  const Stream stream = Stream::create(dev);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::mt19937_64 rng(21);
    const int64_t rows = 9, n = 77;
    const double tol = dt == DType::kF32 ? 1e-5 : 2e-2;
    const Tensor x = random_tensor({rows, n}, dt, rng);
    const Tensor xg = x.to(dev, stream);
    // add_rms_norm: in place over rows wider than the registers hold, and gathered.
    for (int64_t hidden : {n, int64_t{5000}}) {
      Tensor res = random_tensor({rows, hidden}, dt, rng);
      const Tensor delta = random_tensor({rows, hidden}, dt, rng);
      const Tensor w = random_tensor({hidden}, dt, rng);
      Tensor resg = res.to(dev, stream);
      const Tensor deltag = delta.to(dev, stream), wg = w.to(dev, stream);
      Tensor out = Tensor::empty({rows, hidden}, dt), outg = Tensor::empty({rows, hidden}, dt, dev);
      throw_if_error(
          ops::cpu::add_rms_norm({dt, rows, hidden, 1e-6f, nullptr, res.data_ptr(),
                                  delta.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr()}));
      throw_if_error(ops::cuda::add_rms_norm(
          {dt, rows, hidden, 1e-6f, nullptr, resg.data_ptr(), deltag.data_ptr(), resg.data_ptr(),
           wg.data_ptr(), outg.data_ptr()},
          stream));
      test::expect_close(outg.to(Device::cpu(), stream), out.to_double_vector(), tol, tol,
                         "add_rms_norm");
      test::expect_close(resg.to(Device::cpu(), stream), res.to_double_vector(), 0, 0,
                         "add_rms_norm residual");
      const std::vector<int32_t> pick = {2, 2, 0, static_cast<int32_t>(rows - 1)};
      const Tensor pickg = Tensor::from_vector(pick, {4}).to(dev, stream);
      Tensor rows_out = Tensor::empty({4, hidden}, dt),
             rows_outg = Tensor::empty({4, hidden}, dt, dev);
      throw_if_error(
          ops::cpu::add_rms_norm({dt, 4, hidden, 1e-6f, pick.data(), res.data_ptr(),
                                  delta.data_ptr(), nullptr, w.data_ptr(), rows_out.data_ptr()}));
      throw_if_error(
          ops::cuda::add_rms_norm({dt, 4, hidden, 1e-6f, pickg.data<int32_t>(), resg.data_ptr(),
                                   deltag.data_ptr(), nullptr, wg.data_ptr(), rows_outg.data_ptr()},
                                  stream));
      test::expect_close(rows_outg.to(Device::cpu(), stream), rows_out.to_double_vector(), tol, tol,
                         "gathered add_rms_norm");
      // A second addend that the op clears after reading it (a LoRA output), on both sides.
      Tensor lora = random_tensor({rows, hidden}, dt, rng);
      Tensor lorag = lora.to(dev, stream);
      ops::AddRmsNormArgs both{dt,           rows,           hidden,           1e-6f,
                               nullptr,      res.data_ptr(), delta.data_ptr(), nullptr,
                               w.data_ptr(), out.data_ptr()};
      both.delta2 = lora.data_ptr();
      both.clear_delta2 = true;
      throw_if_error(ops::cpu::add_rms_norm(both));
      ops::AddRmsNormArgs bothg{dt,
                                rows,
                                hidden,
                                1e-6f,
                                nullptr,
                                resg.data_ptr(),
                                deltag.data_ptr(),
                                nullptr,
                                wg.data_ptr(),
                                outg.data_ptr()};
      bothg.delta2 = lorag.data_ptr();
      bothg.clear_delta2 = true;
      throw_if_error(ops::cuda::add_rms_norm(bothg, stream));
      test::expect_close(outg.to(Device::cpu(), stream), out.to_double_vector(), tol, tol,
                         "add_rms_norm with a cleared second addend");
      for (const Tensor& cleared : {lora, lorag.to(Device::cpu(), stream)}) {
        for (double v : cleared.to_double_vector()) ASSERT_EQ(v, 0.0) << "delta2 not cleared";
      }
    }
    // silu_mul: scalar rows (77) and 16-byte vectors (128).
    for (int64_t width : {n, int64_t{128}}) {
      const Tensor gu = random_tensor({rows, 2 * width}, dt, rng);
      Tensor act = Tensor::empty({rows, width}, dt);
      throw_if_error(ops::cpu::silu_mul({dt, rows, width, gu.data_ptr(), act.data_ptr()}));
      const Tensor gug = gu.to(dev, stream);
      Tensor actg = Tensor::empty({rows, width}, dt, dev);
      throw_if_error(
          ops::cuda::silu_mul({dt, rows, width, gug.data_ptr(), actg.data_ptr()}, stream));
      test::expect_close(actg.to(Device::cpu(), stream), act.to_double_vector(), tol, tol,
                         "silu_mul");
    }
    // rope_kv_write: the rotated qkv and both caches.
    const RopeCase rc;
    const Tensor qkv = random_tensor({rc.t, rc.stride}, dt, rng);
    const std::vector<Tensor> cpu = run_rope_kv_write(rc, qkv, dt, Device::cpu());
    const std::vector<Tensor> gpu = run_rope_kv_write(rc, qkv, dt, dev);
    for (size_t i = 0; i < 3; ++i) {
      const std::vector<double> want = cpu[i].to_double_vector();
      const std::vector<double> got = gpu[i].to_double_vector();
      ASSERT_EQ(want.size(), got.size());
      for (size_t j = 0; j < want.size(); ++j) {
        if (std::isnan(want[j])) {
          EXPECT_TRUE(std::isnan(got[j])) << "rope_kv_write part " << i << " element " << j;
        } else {
          EXPECT_NEAR(got[j], want[j], tol * (1.0 + std::abs(want[j])))
              << "rope_kv_write part " << i << " element " << j;
        }
      }
    }
    // embedding gather (the embedding layers' op, over the whole vocabulary) and argmax
    const std::vector<int32_t> ids = {3, 0, 8, 8, 1};
    const Tensor id_cpu = Tensor::from_vector(ids, {5});
    const Tensor idg = id_cpu.to(dev, stream);
    Tensor rows_cpu = Tensor::empty({5, n}, dt), rows_gpu = Tensor::empty({5, n}, dt, dev);
    layer_ops::embedding_lookup(x, id_cpu, 0, rows, rows_cpu, Stream());
    layer_ops::embedding_lookup(xg, idg, 0, rows, rows_gpu, stream);
    test::expect_close(rows_gpu.to(Device::cpu(), stream), rows_cpu.to_double_vector(), 0, 0,
                       "embedding");
    std::vector<int32_t> am_cpu(static_cast<size_t>(rows));
    throw_if_error(ops::cpu::argmax({dt, rows, n, x.data_ptr(), n, am_cpu.data()}));
    Tensor am_gpu = Tensor::empty({rows}, DType::kI32, dev);
    throw_if_error(
        ops::cuda::argmax({dt, rows, n, xg.data_ptr(), n, am_gpu.data<int32_t>()}, stream));
    const Tensor am_host = am_gpu.to(Device::cpu(), stream);
    for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(am_host.data<int32_t>()[r], am_cpu[r]) << r;
  }
}

TEST(ModelOpsCuda, QkRmsNormMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  // Heads narrower than a warp, of several lanes' elements, and not a multiple of 32.
  for (const QkNormCase c :
       {QkNormCase{}, QkNormCase{33, 8, 2, 128, 0}, QkNormCase{4, 5, 5, 200, 7}}) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      std::mt19937_64 rng(static_cast<uint64_t>(c.d) + 100);
      const double tol = dt == DType::kF32 ? 1e-5 : 2e-2;
      const Tensor qkv = random_tensor({c.t, c.stride()}, dt, rng, 5.0f);
      const Tensor qw = random_tensor({c.d}, dt, rng), kw = random_tensor({c.d}, dt, rng);
      const Tensor delta = random_tensor({c.t, c.width()}, dt, rng);
      const std::string what = std::string(dtype_name(dt)) + " d " + std::to_string(c.d);
      for (const Tensor& d : {Tensor(), delta}) {
        const QkNormResult cpu = run_qk_norm(c, qkv, qw, kw, d, dt, Device::cpu());
        const QkNormResult gpu = run_qk_norm(c, qkv, qw, kw, d, dt, Device::cuda(0));
        test::expect_close(gpu.qkv, cpu.qkv.to_double_vector(), tol, tol,
                           "cuda qk_rms_norm " + what + (d.defined() ? " with a delta" : ""));
        if (d.defined()) {
          test::expect_close(gpu.delta, cpu.delta.to_double_vector(), 0, 0,
                             "cuda qk_rms_norm delta " + what);
        }
      }
    }
  }
}

}  // namespace
}  // namespace loraplex::model
