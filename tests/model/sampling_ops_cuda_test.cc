// The GPU sampler against the CPU op on the same random logits (skipped without a GPU): ids
// equal except rows whose decision lies within the documented margin of a boundary (found by
// the long-double reference, and counted), log-probabilities close, repeated runs
// bit-identical, and a captured CUDA graph that samples the new parameters after the host
// rewrites the parameter and uniform buffers between replays.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels_cuda/cuda_test_util.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/dtype.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/model/sampler.h"
#include "loraplex/model/sampling_ops.h"
#include "sampling_reference.h"

namespace loraplex {
namespace {

using model::kMaxBannedTokens;
using model::SamplingParams;

// A device allocation with host copies in and out.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes), ptr_(cuda_rt::device_malloc(bytes, 0)) {}
  ~DeviceBuffer() { cuda_rt::device_free(ptr_, 0); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  void upload(const std::vector<T>& v, const Stream& s) {
    ASSERT_LE(v.size() * sizeof(T), bytes_);
    cuda_rt::memcpy_async(ptr_, v.data(), v.size() * sizeof(T), cuda_rt::CopyKind::kHostToDevice,
                          s.handle());
    s.synchronize();
  }
  template <typename T>
  std::vector<T> download(size_t n, const Stream& s) const {
    std::vector<T> v(n);
    s.synchronize();
    cuda_rt::memcpy_async(v.data(), ptr_, n * sizeof(T), cuda_rt::CopyKind::kDeviceToHost,
                          s.handle());
    s.synchronize();
    return v;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  size_t bytes_;
  void* ptr_;
};

// One batch of rows: logits (as the dtype stores them, and as floats), parameters per row.
struct Batch {
  DType dtype = DType::kBF16;
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t stride = 0;
  std::vector<float> values;   // [rows, stride]: the logits as floats (after rounding to dtype)
  std::vector<uint16_t> bits;  // [rows, stride] for f16 / bf16
  std::vector<float> temperature, top_p, min_p;
  std::vector<int32_t> top_k, banned;
  std::vector<double> uniform;

  std::span<const float> row(int64_t r) const {
    return {values.data() + r * stride, static_cast<size_t>(vocab)};
  }
  std::span<const int32_t> banned_of(int64_t r) const {
    return {banned.data() + r * kMaxBannedTokens, static_cast<size_t>(kMaxBannedTokens)};
  }
  SamplingParams params(int64_t r) const { return {temperature[r], top_k[r], top_p[r], min_p[r]}; }
};

// Mixed parameters, one set per row: greedy, temperature only, top-k small and large, top-p,
// both, top_k >= vocab, top_k 1, min_p alone and with top-k and top-p.
SamplingParams random_params(int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 11);
  std::uniform_real_distribution<float> t(0.25f, 2.5f);
  std::uniform_real_distribution<float> p(0.05f, 0.99f);
  std::uniform_int_distribution<int> k(2, 200);
  const auto v = static_cast<int>(vocab);
  switch (pick(rng)) {
    case 0:
      return {0.0f, 0, 1.0f};
    case 1:
      return {t(rng), 0, 1.0f};
    case 2:
      return {t(rng), k(rng), 1.0f};
    case 3:
      return {t(rng), 0, p(rng)};
    case 4:
      return {t(rng), k(rng), p(rng)};
    case 5:
      return {t(rng), v / 2 + 1, 1.0f};
    case 6:
      return {t(rng), v + 2, p(rng)};
    case 7:
      return {t(rng), 1, 1.0f};
    case 8:
      return {1.0f, 50, 0.95f};
    case 10:
      return {t(rng), 0, 1.0f, p(rng) * 0.5f};
    case 11:
      return {t(rng), k(rng), p(rng), 0.1f};
    default:
      return {0.8f, 0, 0.9f};
  }
}

Batch make_batch(DType dtype, int64_t rows, int64_t vocab, int64_t stride, std::mt19937_64& rng) {
  Batch b;
  b.dtype = dtype;
  b.rows = rows;
  b.vocab = vocab;
  b.stride = stride;
  b.values.assign(static_cast<size_t>(rows * stride), 7.0f);
  b.bits.assign(b.values.size(), 0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> row = test::random_logits(vocab, test::kAllRowKinds[r % 5], rng);
    for (int64_t j = 0; j < vocab; ++j) {
      const size_t at = static_cast<size_t>(r * stride + j);
      float v = row[static_cast<size_t>(j)];
      if (dtype == DType::kF16) {
        b.bits[at] = float_to_f16_bits(v);
        v = f16_bits_to_float(b.bits[at]);
      } else if (dtype == DType::kBF16) {
        b.bits[at] = float_to_bf16_bits(v);
        v = bf16_bits_to_float(b.bits[at]);
      }
      b.values[at] = v;
    }
    const SamplingParams p = random_params(vocab, rng);
    b.temperature.push_back(p.temperature);
    b.top_k.push_back(p.top_k);
    b.top_p.push_back(p.top_p);
    b.min_p.push_back(p.min_p);
    b.uniform.push_back(unit(rng));
    std::vector<int32_t> ban = test::random_banned(vocab, rng);
    ban.resize(kMaxBannedTokens, -1);
    b.banned.insert(b.banned.end(), ban.begin(), ban.end());
  }
  return b;
}

struct Picks {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
};

Picks run_cpu(const Batch& b) {
  Picks out{std::vector<int32_t>(static_cast<size_t>(b.rows)),
            std::vector<float>(static_cast<size_t>(b.rows))};
  std::vector<char> ws(model::ops::sample_workspace_bytes(b.rows, b.vocab));
  model::ops::SampleArgs a;
  a.dtype = DType::kF32;  // the rounded values: the same logits the GPU reads
  a.num_rows = b.rows;
  a.vocab = b.vocab;
  a.logits = b.values.data();
  a.row_stride = b.stride;
  a.temperature = b.temperature.data();
  a.top_k = b.top_k.data();
  a.top_p = b.top_p.data();
  a.min_p = b.min_p.data();
  a.uniform = b.uniform.data();
  a.banned = b.banned.data();
  a.ids = out.ids.data();
  a.logprobs = out.logprobs.data();
  a.workspace = ws.data();
  a.workspace_bytes = ws.size();
  throw_if_error(model::ops::cpu::sample(a));
  return out;
}

// The batch's buffers on the device and the op's arguments over them.
struct GpuBatch {
  GpuBatch(const Batch& b, const Stream& s)
      : logits(b.values.size() * dtype_size(b.dtype)),
        temperature(b.rows * sizeof(float)),
        top_k(b.rows * sizeof(int32_t)),
        top_p(b.rows * sizeof(float)),
        min_p(b.rows * sizeof(float)),
        uniform(b.rows * sizeof(double)),
        banned(b.banned.size() * sizeof(int32_t)),
        ids(b.rows * sizeof(int32_t)),
        logprobs(b.rows * sizeof(float)) {
    if (b.dtype == DType::kF32) {
      logits.upload(b.values, s);
    } else {
      logits.upload(b.bits, s);
    }
    upload_params(b, s);
    args.dtype = b.dtype;
    args.num_rows = b.rows;
    args.vocab = b.vocab;
    args.logits = logits.as<void>();
    args.row_stride = b.stride;
    args.temperature = temperature.as<float>();
    args.top_k = top_k.as<int32_t>();
    args.top_p = top_p.as<float>();
    args.min_p = min_p.as<float>();
    args.uniform = uniform.as<double>();
    args.banned = banned.as<int32_t>();
    args.ids = ids.as<int32_t>();
    args.logprobs = logprobs.as<float>();
  }
  void upload_params(const Batch& b, const Stream& s) {
    temperature.upload(b.temperature, s);
    top_k.upload(b.top_k, s);
    top_p.upload(b.top_p, s);
    min_p.upload(b.min_p, s);
    uniform.upload(b.uniform, s);
    banned.upload(b.banned, s);
  }
  Picks result(const Batch& b, const Stream& s) const {
    return {ids.download<int32_t>(static_cast<size_t>(b.rows), s),
            logprobs.download<float>(static_cast<size_t>(b.rows), s)};
  }
  DeviceBuffer logits, temperature, top_k, top_p, min_p, uniform, banned, ids, logprobs;
  model::ops::SampleArgs args;
};

// The documented margins (sampling_ops_cuda.cu), relative to the kept mass: the walk's double
// sums in another order, the top-p masses in fixed point with F = 63 - bit_width(vocab).
double walk_bound(int64_t vocab) { return 4.0 * static_cast<double>(vocab) * 0x1p-53; }
double top_p_bound(int64_t vocab) {
  const int frac_bits = 63 - std::bit_width(static_cast<uint64_t>(vocab));
  return 2.0 * static_cast<double>(vocab) * std::ldexp(1.0, -(frac_bits + 1));
}

// Compares GPU picks with the CPU's, row by row; returns the number of rows within the margin.
int expect_agreement(const Batch& b, const Picks& gpu, const Picks& cpu, const std::string& what) {
  int unclear = 0;
  for (int64_t r = 0; r < b.rows; ++r) {
    const std::string row_what =
        what + " row " + std::to_string(r) + " T " + std::to_string(b.temperature[r]) + " top_k " +
        std::to_string(b.top_k[r]) + " top_p " + std::to_string(b.top_p[r]) + " min_p " +
        std::to_string(b.min_p[r]) + " u " + std::to_string(b.uniform[r]);
    const int32_t id = gpu.ids[r];
    EXPECT_TRUE(id >= 0 && id < b.vocab) << row_what << ": id " << id;
    if (id < 0 || id >= b.vocab) continue;
    const double want_lp = test::reference_logprob(b.row(r), id);
    if (std::isnan(want_lp)) {
      EXPECT_TRUE(std::isnan(gpu.logprobs[r])) << row_what;
    } else {
      EXPECT_NEAR(gpu.logprobs[r], want_lp, 2e-6 + 2e-6 * std::abs(want_lp)) << row_what;
    }
    if (id == cpu.ids[r]) continue;
    const test::ReferencePick ref =
        test::reference_sample(b.row(r), b.params(r), b.uniform[r], b.banned_of(r));
    const bool near = ref.walk_margin <= walk_bound(b.vocab) ||
                      ref.top_p_margin <= top_p_bound(b.vocab) + walk_bound(b.vocab) ||
                      ref.min_p_margin <= 1e-6;
    EXPECT_TRUE(near) << row_what << ": GPU " << id << ", CPU " << cpu.ids[r] << ", reference "
                      << ref.id << " (margins " << ref.walk_margin << ", " << ref.top_p_margin
                      << ")";
    ++unclear;
  }
  return unclear;
}

struct Shape {
  DType dtype;
  int64_t rows;
  int64_t vocab;
  int64_t stride;
};

TEST(SampleOpCuda, MatchesCpuOnMixedRows) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(2024);
  Stream stream = Stream::create(test::gpu());
  const std::vector<Shape> shapes = {{DType::kBF16, 256, 128256, 128256},
                                     {DType::kF16, 37, 128256, 128256},
                                     {DType::kF32, 64, 128256, 128256},
                                     {DType::kBF16, 1, 128256, 128256},
                                     {DType::kBF16, 19, 50257, 50261},
                                     {DType::kF32, 13, 32003, 32003},
                                     {DType::kF16, 11, 2049, 2051},
                                     {DType::kF32, 9, 77, 77},
                                     {DType::kBF16, 5, 1, 3}};
  int total_rows = 0;
  int unclear = 0;
  for (const Shape& sh : shapes) {
    const Batch b = make_batch(sh.dtype, sh.rows, sh.vocab, sh.stride, rng);
    GpuBatch g(b, stream);
    throw_if_error(model::ops::cuda::sample(g.args, stream));
    const Picks gpu = g.result(b, stream);
    const Picks cpu = run_cpu(b);
    const std::string what = std::string(dtype_name(sh.dtype)) + " " + std::to_string(sh.rows) +
                             "x" + std::to_string(sh.vocab);
    unclear += expect_agreement(b, gpu, cpu, what);
    total_rows += static_cast<int>(sh.rows);
  }
  // At vocab 128256 the margins are ~1e-9 of the mass: a row lands in one about once in 1e4.
  EXPECT_LE(unclear, 2) << unclear << " of " << total_rows << " rows differ within the margin";
}

TEST(SampleOpCuda, SpecialRowsMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  Stream stream = Stream::create(test::gpu());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // vocab 5000: three blocks per row, so the special values sit in different blocks.
  const int64_t vocab = 5000;
  std::mt19937_64 rng(99);
  Batch b = make_batch(DType::kF32, 14, vocab, vocab, rng);
  auto set_row = [&](int64_t r, float fill) {
    for (int64_t j = 0; j < vocab; ++j) b.values[static_cast<size_t>(r * vocab + j)] = fill;
  };
  auto at = [&](int64_t r, int64_t j) -> float& {
    return b.values[static_cast<size_t>(r * vocab + j)];
  };
  auto params = [&](int64_t r, SamplingParams p, double u) {
    b.temperature[r] = p.temperature;
    b.top_k[r] = p.top_k;
    b.top_p[r] = p.top_p;
    b.min_p[r] = p.min_p;
    b.uniform[r] = u;
    std::fill_n(b.banned.begin() + r * kMaxBannedTokens, kMaxBannedTokens, -1);
  };
  set_row(0, nan);  // all NaN: id 0
  params(0, {1.0f, 0, 1.0f}, 0.4);
  set_row(1, -inf);  // all -inf but NaNs before: the first non-NaN
  at(1, 0) = nan;
  at(1, 1) = nan;
  params(1, {1.0f, 0, 1.0f}, 0.4);
  set_row(2, 1.0f);  // all equal: uniform over the vocabulary; greedy id 0
  params(2, {0.0f, 0, 1.0f}, 0.0);
  set_row(3, 1.0f);
  params(3, {1.0f, 0, 1.0f}, 0.73);
  at(4, 4500) = inf;  // two +inf ids in different blocks share the mass
  at(4, 10) = inf;
  params(4, {1.0f, 0, 1.0f}, 0.8);
  at(5, 4500) = inf;
  at(5, 10) = inf;
  params(5, {1.0f, 0, 1.0f}, 0.2);
  at(6, 3000) = 50.0f;  // a banned maximum, greedy
  at(6, 3001) = 50.0f;
  params(6, {0.0f, 0, 1.0f}, 0.0);
  b.banned[6 * kMaxBannedTokens] = 3000;
  set_row(7, 2.0f);  // top_k with every id tied: all kept
  params(7, {1.0f, 10, 1.0f}, 0.999);
  at(8, 1) = 1e30f;  // a temperature that overflows l to +inf
  params(8, {1e-10f, 0, 0.5f}, 0.9);
  params(9, {1.0f, 0, 1e-7f}, 0.99);  // top_p keeping only the maximum
  params(10, {3.0f, static_cast<int>(vocab) - 1, 0.999f}, 0.999999);
  params(11, {0.5f, 2, 1.0f}, 0.5);
  at(12, 4000) = 40.0f;  // a banned maximum in a sampled row: top-2 of the rest
  at(12, 17) = 39.0f;
  at(12, 4999) = 39.5f;
  params(12, {1.0f, 2, 1.0f}, 0.3);
  b.banned[12 * kMaxBannedTokens + 3] = 4000;
  set_row(13, 0.0f);  // only banned and -inf ids with finite values: the raw argmax
  at(13, 2500) = 3.0f;
  at(13, 100) = 3.0f;
  for (int64_t j = 0; j < vocab; ++j) {
    if (j != 2500 && j != 100) at(13, j) = -inf;
  }
  params(13, {0.7f, 0, 0.9f}, 0.5);
  b.banned[13 * kMaxBannedTokens] = 2500;
  b.banned[13 * kMaxBannedTokens + 5] = 100;
  GpuBatch g(b, stream);
  throw_if_error(model::ops::cuda::sample(g.args, stream));
  const Picks gpu = g.result(b, stream);
  const Picks cpu = run_cpu(b);
  EXPECT_EQ(cpu.ids[0], 0);
  EXPECT_EQ(cpu.ids[1], 2);
  EXPECT_EQ(cpu.ids[2], 0);
  EXPECT_EQ(cpu.ids[3], 3650);  // floor(0.73 * 5000)
  EXPECT_EQ(cpu.ids[4], 4500);
  EXPECT_EQ(cpu.ids[5], 10);
  EXPECT_EQ(cpu.ids[6], 3001);
  EXPECT_EQ(cpu.ids[7], 4995);
  EXPECT_EQ(cpu.ids[8], 1);
  EXPECT_EQ(cpu.ids[12], 17);  // weights 1 (4999) and e^-0.5 (17): 0.3 falls on 17 first
  EXPECT_EQ(cpu.ids[13], 100);
  for (int64_t r = 0; r < b.rows; ++r) EXPECT_EQ(gpu.ids[r], cpu.ids[r]) << "row " << r;
  for (int64_t r = 1; r < b.rows; ++r) {
    EXPECT_NEAR(gpu.logprobs[r], cpu.logprobs[r], 2e-6 + 2e-6 * std::abs(cpu.logprobs[r]))
        << "row " << r;
  }
  EXPECT_TRUE(std::isnan(gpu.logprobs[0]));
}

TEST(SampleOpCuda, RepeatedRunsAreBitIdentical) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(31);
  Stream stream = Stream::create(test::gpu());
  const Batch b = make_batch(DType::kBF16, 256, 128256, 128256, rng);
  GpuBatch g(b, stream);
  throw_if_error(model::ops::cuda::sample(g.args, stream));
  const Picks first = g.result(b, stream);
  for (int run = 0; run < 4; ++run) {
    cuda_rt::memset_async(g.ids.as<void>(), 0xff, b.rows * sizeof(int32_t), stream.handle());
    cuda_rt::memset_async(g.logprobs.as<void>(), 0xff, b.rows * sizeof(float), stream.handle());
    throw_if_error(model::ops::cuda::sample(g.args, stream));
    const Picks again = g.result(b, stream);
    ASSERT_EQ(again.ids, first.ids) << "run " << run;
    ASSERT_EQ(std::memcmp(again.logprobs.data(), first.logprobs.data(), b.rows * sizeof(float)), 0)
        << "run " << run;
  }
}

// Captured once; the parameters, uniforms and bans change on the device between replays.
TEST(SampleOpCuda, CapturedGraphSamplesTheNewParameters) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(8);
  Stream stream = Stream::create(test::gpu());
  Batch b = make_batch(DType::kBF16, 96, 128256, 128256, rng);
  GpuBatch g(b, stream);
  throw_if_error(model::ops::cuda::sample(g.args, stream));  // warm-up outside the capture
  kernels::cuda::Graph graph;
  graph.begin_capture(stream.handle());
  throw_if_error(model::ops::cuda::sample(g.args, stream));
  graph.end_capture();
  int unclear = 0;
  for (int replay = 0; replay < 3; ++replay) {
    if (replay > 0) {
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      for (int64_t r = 0; r < b.rows; ++r) {
        const SamplingParams p = random_params(b.vocab, rng);
        b.temperature[r] = p.temperature;
        b.top_k[r] = p.top_k;
        b.top_p[r] = p.top_p;
        b.min_p[r] = p.min_p;
        b.uniform[r] = unit(rng);
        std::vector<int32_t> ban = test::random_banned(b.vocab, rng);
        ban.resize(kMaxBannedTokens, -1);
        std::copy(ban.begin(), ban.end(), b.banned.begin() + r * kMaxBannedTokens);
      }
      g.upload_params(b, stream);
    }
    cuda_rt::memset_async(g.ids.as<void>(), 0xff, b.rows * sizeof(int32_t), stream.handle());
    graph.replay(stream.handle());
    unclear +=
        expect_agreement(b, g.result(b, stream), run_cpu(b), "replay " + std::to_string(replay));
  }
  EXPECT_LE(unclear, 1);
}

TEST(SampleOpCuda, RejectsTooLargeVocabularies) {
  LORAPLEX_REQUIRE_GPU();
  model::ops::SampleArgs a;
  a.num_rows = 1;
  a.vocab = model::ops::kMaxGpuSampleVocab + 1;
  a.row_stride = a.vocab;
  EXPECT_EQ(model::ops::cuda::sample(a, Stream::create(test::gpu())).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace loraplex
