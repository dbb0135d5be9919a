// The logits adjustment on the CPU against a reference written out here (vLLM's order: bias,
// repetition, subtract; unlisted ids to -inf first), in every dtype, on odd sizes; its argument
// checks; and the CUDA op against the CPU, bit for bit (skipped without a GPU).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "loraplex/core/dtype.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/model/logit_adjust_ops.h"
#include "support/gpu_check.h"

namespace loraplex {
namespace {

using model::LogitAdjustment;

struct Case {
  int64_t rows = 0;
  int64_t vocab = 0;
  std::vector<float> logits;  // [rows, vocab]
  std::vector<int32_t> row_begin;
  std::vector<LogitAdjustment> entries;
  std::vector<uint8_t> only_listed;
};

// Random rows: about a third of them only_listed, each with up to 40 distinct ids adjusted
// (some banned), logits of both signs.
Case random_case(int64_t rows, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Case c;
  c.rows = rows;
  c.vocab = vocab;
  for (int64_t i = 0; i < rows * vocab; ++i) c.logits.push_back(normal(rng));
  c.row_begin.push_back(0);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> ids(static_cast<size_t>(vocab));
    for (int32_t j = 0; j < vocab; ++j) ids[static_cast<size_t>(j)] = j;
    std::shuffle(ids.begin(), ids.end(), rng);
    const size_t n = std::min<size_t>(ids.size(), rng() % 41);
    for (size_t k = 0; k < n; ++k) {
      LogitAdjustment e;
      e.id = ids[k];
      e.bias = rng() % 7 == 0 ? -std::numeric_limits<float>::infinity() : normal(rng);
      e.repetition = rng() % 2 ? 1.0f : 0.5f + static_cast<float>(rng() % 100) / 66.0f;
      e.subtract = rng() % 2 ? 0.0f : std::fabs(normal(rng));
      c.entries.push_back(e);
    }
    c.row_begin.push_back(static_cast<int32_t>(c.entries.size()));
    c.only_listed.push_back(rng() % 3 == 0 ? 1 : 0);
  }
  return c;
}

// The rule, written out: what every logit becomes.
std::vector<float> reference(const Case& c) {
  std::vector<float> out = c.logits;
  for (int64_t r = 0; r < c.rows; ++r) {
    float* row = out.data() + r * c.vocab;
    const std::vector<float> before(row, row + c.vocab);
    if (c.only_listed[static_cast<size_t>(r)]) {
      for (int64_t j = 0; j < c.vocab; ++j) row[j] = -std::numeric_limits<float>::infinity();
    }
    for (int32_t k = c.row_begin[static_cast<size_t>(r)];
         k < c.row_begin[static_cast<size_t>(r) + 1]; ++k) {
      const LogitAdjustment& e = c.entries[static_cast<size_t>(k)];
      float l = before[static_cast<size_t>(e.id)] + e.bias;
      if (l > 0.0f) {
        l = l / e.repetition;
      } else {
        l = l * e.repetition;
      }
      row[e.id] = l - e.subtract;
    }
  }
  return out;
}

model::ops::AdjustLogitsArgs args_of(Case& c, void* logits, DType dtype,
                                     std::vector<float>& scratch) {
  scratch.assign(c.entries.size() + 1, 0.0f);
  model::ops::AdjustLogitsArgs a;
  a.dtype = dtype;
  a.num_rows = c.rows;
  a.vocab = c.vocab;
  a.row_stride = c.vocab;
  a.logits = logits;
  a.row_begin = c.row_begin.data();
  a.entries = c.entries.data();
  a.only_listed = c.only_listed.data();
  a.scratch = scratch.data();
  return a;
}

TEST(AdjustLogits, CpuMatchesTheRuleInEveryDtype) {
  for (const auto& [rows, vocab] :
       {std::pair<int64_t, int64_t>{1, 1}, {3, 77}, {17, 199}, {5, 1000}}) {
    Case c = random_case(rows, vocab, static_cast<uint64_t>(rows * 1000 + vocab));
    const std::vector<float> want = reference(c);
    std::vector<float> scratch;
    std::vector<float> f32 = c.logits;
    auto a = args_of(c, f32.data(), DType::kF32, scratch);
    ASSERT_TRUE(model::ops::cpu::adjust_logits(a).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(std::isinf(want[i]), std::isinf(f32[i])) << i;
      if (!std::isinf(want[i])) {
        ASSERT_EQ(f32[i], want[i]) << i;
      }
    }
    for (const DType dt : {DType::kF16, DType::kBF16}) {
      const auto to_bits = dt == DType::kF16 ? float_to_f16_bits : float_to_bf16_bits;
      const auto to_float = dt == DType::kF16 ? f16_bits_to_float : bf16_bits_to_float;
      std::vector<uint16_t> half;
      std::vector<float> rounded;  // the input as the half dtype holds it
      for (float x : c.logits) {
        half.push_back(to_bits(x));
        rounded.push_back(to_float(half.back()));
      }
      Case hc = c;
      hc.logits = rounded;
      const std::vector<float> want_h = reference(hc);
      auto ah = args_of(c, half.data(), dt, scratch);
      ASSERT_TRUE(model::ops::cpu::adjust_logits(ah).ok());
      for (size_t i = 0; i < want_h.size(); ++i) {
        ASSERT_EQ(half[i], to_bits(want_h[i])) << "dtype " << dt << " element " << i;
      }
    }
  }
}

TEST(AdjustLogits, RefusesIdsOutsideTheVocabularyAndBadOffsets) {
  Case c = random_case(2, 10, 3);
  c.entries.push_back({10, 1.0f, 1.0f, 0.0f});
  c.row_begin.back() = static_cast<int32_t>(c.entries.size());
  std::vector<float> scratch;
  std::vector<float> logits = c.logits;
  const Status s = model::ops::cpu::adjust_logits(args_of(c, logits.data(), DType::kF32, scratch));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("id 10"), std::string::npos) << s.message();
  Case d = random_case(2, 10, 4);
  d.row_begin[1] = d.row_begin[2] + 1;
  EXPECT_FALSE(
      model::ops::cpu::adjust_logits(args_of(d, logits.data(), DType::kF32, scratch)).ok());
}

// Bytes of `v` as a tensor on `device`.
template <typename T>
Tensor bytes_on(const std::vector<T>& v, Device device, const Stream& stream) {
  Tensor host =
      Tensor::empty({static_cast<int64_t>(std::max<size_t>(v.size() * sizeof(T), 1))}, DType::kU8);
  if (!v.empty()) std::memcpy(host.data_ptr(), v.data(), v.size() * sizeof(T));
  return host.to(device, stream);
}

TEST(AdjustLogits, CudaMatchesCpuBitForBit) {
  LORAPLEX_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const Stream stream = Stream::create(gpu);
  for (const auto& [rows, vocab] :
       {std::pair<int64_t, int64_t>{1, 1}, {3, 77}, {19, 1999}, {64, 32000}}) {
    Case c = random_case(rows, vocab, static_cast<uint64_t>(rows + vocab));
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint16_t> half;
      if (dt != DType::kF32) {
        for (float x : c.logits) {
          half.push_back(dt == DType::kF16 ? float_to_f16_bits(x) : float_to_bf16_bits(x));
        }
      }
      std::vector<float> f32 = c.logits;
      std::vector<float> scratch;
      void* host_logits = dt == DType::kF32 ? static_cast<void*>(f32.data()) : half.data();
      const size_t logit_bytes = static_cast<size_t>(rows * vocab) * dtype_size(dt);
      std::vector<uint8_t> before(logit_bytes);
      std::memcpy(before.data(), host_logits, logit_bytes);
      Tensor d_logits = bytes_on(before, gpu, stream);
      Tensor d_rows = bytes_on(c.row_begin, gpu, stream);
      Tensor d_entries = bytes_on(c.entries, gpu, stream);
      Tensor d_only = bytes_on(c.only_listed, gpu, stream);
      Tensor d_scratch = bytes_on(std::vector<float>(c.entries.size() + 1, 0.0f), gpu, stream);
      auto cpu_args = args_of(c, host_logits, dt, scratch);
      ASSERT_TRUE(model::ops::cpu::adjust_logits(cpu_args).ok());
      model::ops::AdjustLogitsArgs a = cpu_args;
      a.logits = d_logits.data_ptr();
      a.row_begin = static_cast<const int32_t*>(d_rows.data_ptr());
      a.entries = static_cast<const LogitAdjustment*>(d_entries.data_ptr());
      a.only_listed = static_cast<const uint8_t*>(d_only.data_ptr());
      a.scratch = static_cast<float*>(d_scratch.data_ptr());
      ASSERT_TRUE(model::ops::cuda::adjust_logits(a, stream).ok());
      stream.synchronize();
      const Tensor got = d_logits.to(Device::cpu(), stream);
      stream.synchronize();
      ASSERT_EQ(std::memcmp(got.data_ptr(), host_logits, logit_bytes), 0)
          << "rows " << rows << ", vocab " << vocab << ", dtype " << dt;
    }
  }
}

}  // namespace
}  // namespace loraplex
