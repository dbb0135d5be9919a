// The fused LoRA expand (kernels/model_ops.h FusedLoraExpand) inside the ops that consume a
// projection: RoPE + KV write (q/k/v), SiLU-mul (gate/up) and residual add + RMSNorm (o, down;
// also over sampled rows). Each op with the expand must equal the same op without it run on
// the input with the expand already added in double precision (rounded as stored), for the
// named slot distributions, odd sizes, different ranks per slot and slice, rank-0 slices and
// base-model tokens. The intermediates of slots a token does not use, the columns past a
// slot's rank and B columns past it hold NaN: an op that read any of them would fail. The
// same cases run on CUDA against the CPU (skipped without a GPU).

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder_ops.h"
#include "loraplex/punica/batch_meta.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex::model {
namespace {

using test::SlotDistribution;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One projection's fused output as LoraLinear::forward_fused leaves it: rows of
// [base columns | slot 0 intermediates | slot 1 ... | slot num_slots-1], and the B stacks.
struct ExpandCase {
  DType dtype = DType::kF32;
  int64_t tokens = 0;
  int64_t base_width = 0;  // the consumer's input columns
  int max_loras = 0;
  int max_rank = 0;
  int num_slots = 0;
  std::vector<int64_t> widths, offsets;  // per LoRA slice
  std::vector<int32_t> slots;            // per token
  std::vector<int32_t> ranks;            // [num_slices, max_loras]
  std::vector<double> rows;              // [tokens, row_width], NaN where nothing may be read
  std::vector<std::vector<double>> b;    // per slice [max_loras, width, max_rank]
  int num_slices() const { return static_cast<int>(widths.size()); }
  int64_t slot_cols() const { return static_cast<int64_t>(num_slices()) * max_rank; }
  int64_t row_width() const { return base_width + num_slots * slot_cols(); }
};

double rounded(double v, DType dt) {
  return Tensor::from_vector(std::vector<float>{static_cast<float>(v)}, {1})
      .to(dt)
      .to_double_vector()[0];
}

// The values of a contiguous tensor on any device (its stream synchronised).
std::vector<double> values_of(const Tensor& t) {
  return t.device().is_cpu() ? t.to_double_vector() : t.to(Device::cpu()).to_double_vector();
}

std::vector<double> random_values(size_t n, DType dt, std::mt19937_64& rng, float scale) {
  return test::random_tensor({static_cast<int64_t>(n)}, dt, rng, scale).to_double_vector();
}

// Slices laid side by side over `base_width` columns (widths given), slots from `dist` over
// num_slots slots (a quarter base-model tokens), ranks 1..max_rank with some slices at 0.
ExpandCase make_case(DType dt, int64_t tokens, std::vector<int64_t> widths, int max_loras,
                     int max_rank, SlotDistribution dist, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ExpandCase c;
  c.dtype = dt;
  c.tokens = tokens;
  c.max_loras = max_loras;
  c.max_rank = max_rank;
  c.widths = std::move(widths);
  int64_t off = 0;
  for (int64_t w : c.widths) {
    c.offsets.push_back(off);
    off += w;
  }
  c.base_width = off;
  c.num_slots = max_loras - 1;  // the last slot's intermediates are not in the rows
  c.slots = test::make_slots(dist, static_cast<int>(tokens), c.num_slots, rng, 0.25);
  std::uniform_int_distribution<int> rank_of(1, max_rank);
  c.ranks.assign(static_cast<size_t>(c.num_slices() * max_loras), 0);
  for (int s = 0; s < c.num_slices(); ++s) {
    for (int k = 0; k < max_loras; ++k) {
      // Slot 1 leaves its first slice untargeted; slot 0 is at max rank.
      int r = k == 0 ? max_rank : rank_of(rng);
      if (k == 1 && s == 0 && c.num_slices() > 1) r = 0;
      c.ranks[static_cast<size_t>(s * max_loras + k)] = r;
    }
  }
  const int64_t w = c.row_width();
  c.rows = random_values(static_cast<size_t>(tokens * w), dt, rng, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < c.num_slots; ++k) {
      for (int s = 0; s < c.num_slices(); ++s) {
        const int r = c.ranks[static_cast<size_t>(s * max_loras + k)];
        for (int i = 0; i < max_rank; ++i) {
          const bool read = k == c.slots[static_cast<size_t>(t)] && i < r;
          if (!read) {
            c.rows[static_cast<size_t>(t * w + c.base_width + k * c.slot_cols() + s * max_rank +
                                       i)] = kNaN;
          }
        }
      }
    }
  }
  for (int s = 0; s < c.num_slices(); ++s) {
    const int64_t width = c.widths[static_cast<size_t>(s)];
    std::vector<double> b =
        random_values(static_cast<size_t>(max_loras * width * max_rank), dt, rng, 0.3f);
    for (int k = 0; k < max_loras; ++k) {
      const int r = c.ranks[static_cast<size_t>(s * max_loras + k)];
      for (int64_t j = 0; j < width; ++j) {
        for (int i = r; i < max_rank; ++i)
          b[static_cast<size_t>((k * width + j) * max_rank + i)] = kNaN;
      }
    }
    c.b.push_back(std::move(b));
  }
  return c;
}

// The consumer's input rows [tokens, base_width] with each token's expand added in double and
// rounded to the dtype: what the op must behave as if it had been given.
std::vector<double> expanded_inputs(const ExpandCase& c) {
  const int64_t w = c.row_width();
  std::vector<double> out(static_cast<size_t>(c.tokens * c.base_width));
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t j = 0; j < c.base_width; ++j) {
      out[static_cast<size_t>(t * c.base_width + j)] = c.rows[static_cast<size_t>(t * w + j)];
    }
    const int k = c.slots[static_cast<size_t>(t)];
    if (k < 0) continue;
    for (int s = 0; s < c.num_slices(); ++s) {
      const int r = c.ranks[static_cast<size_t>(s * c.max_loras + k)];
      const int64_t width = c.widths[static_cast<size_t>(s)];
      if (r == 0) continue;
      for (int64_t j = 0; j < width; ++j) {
        double acc = 0.0;
        for (int i = 0; i < r; ++i) {
          acc += c.rows[static_cast<size_t>(t * w + c.base_width + k * c.slot_cols() +
                                            s * c.max_rank + i)] *
                 c.b[static_cast<size_t>(s)][static_cast<size_t>((k * width + j) * c.max_rank + i)];
        }
        double& v =
            out[static_cast<size_t>(t * c.base_width + c.offsets[static_cast<size_t>(s)] + j)];
        v = rounded(v + acc, c.dtype);
      }
    }
  }
  return out;
}

Tensor to_tensor(const std::vector<double>& v, const Shape& shape, DType dt, Device device,
                 const Stream& stream) {
  const std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, shape).to(dt).to(device, stream);
}

// The device-side pieces of a case: the rows, B stacks, ranks and the step's metadata.
struct DeviceCase {
  Tensor rows;
  std::vector<Tensor> b;
  Tensor ranks;
  std::unique_ptr<LoraBatchMeta> meta;
  ops::FusedLoraExpand lora;
};

DeviceCase upload(const ExpandCase& c, Device device, const Stream& stream) {
  DeviceCase d;
  d.rows = to_tensor(c.rows, {c.tokens, c.row_width()}, c.dtype, device, stream);
  d.ranks = Tensor::from_vector(c.ranks, {static_cast<int64_t>(c.ranks.size())}).to(device, stream);
  d.meta = std::make_unique<LoraBatchMeta>(c.max_loras, static_cast<int>(c.tokens), device);
  d.meta->prepare(c.slots, stream);
  ops::FusedLoraExpand& e = d.lora;
  e.meta = d.meta->view();
  e.num_slices = c.num_slices();
  e.max_loras = c.max_loras;
  e.max_rank = c.max_rank;
  e.num_slots = c.num_slots;
  e.ranks = d.ranks.data<int32_t>();
  e.shrink = static_cast<const uint8_t*>(d.rows.data_ptr()) + c.base_width * dtype_size(c.dtype);
  e.shrink_row_stride = c.row_width();
  e.slot_cols = c.slot_cols();
  for (int s = 0; s < c.num_slices(); ++s) {
    const int64_t width = c.widths[static_cast<size_t>(s)];
    d.b.push_back(to_tensor(c.b[static_cast<size_t>(s)], {c.max_loras, width, c.max_rank}, c.dtype,
                            device, stream));
    e.lora_b[s] = d.b.back().data_ptr();
    e.width[s] = width;
    e.offset[s] = c.offsets[static_cast<size_t>(s)];
  }
  return d;
}

Stream stream_for(Device device) { return device.is_cpu() ? Stream() : Stream::create(device); }

double tolerance_of(DType dt) { return dt == DType::kF32 ? 2e-5 : 2e-2; }

// ---- SiLU-mul over gate/up rows -----------------------------------------------------------

// out of silu_mul: with the fused expand over `c`'s rows, or (lora == false) plain over
// `plain_rows` [tokens, 2n].
std::vector<double> run_silu(const ExpandCase& c, Device device, bool lora,
                             const std::vector<double>& plain_rows) {
  const Stream stream = stream_for(device);
  const int64_t n = c.base_width / 2;
  DeviceCase d = upload(c, device, stream);
  Tensor plain =
      lora ? Tensor() : to_tensor(plain_rows, {c.tokens, 2 * n}, c.dtype, device, stream);
  Tensor out = Tensor::empty({c.tokens, n}, c.dtype, device);
  ops::SiluMulArgs a{c.dtype, c.tokens, n, lora ? d.rows.data_ptr() : plain.data_ptr(),
                     out.data_ptr()};
  if (lora) {
    a.x_row_stride = c.row_width();
    a.lora = d.lora;
  }
  throw_if_error(ops::run(&ops::cpu::silu_mul, &ops::cuda::silu_mul, a, stream));
  stream.synchronize();
  return values_of(out);
}

void check_silu(const ExpandCase& c, Device device, const std::string& what) {
  const std::vector<double> want = run_silu(c, Device::cpu(), false, expanded_inputs(c));
  const std::vector<double> got = run_silu(c, device, true, {});
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(test::tolerance_ratio(got, want, tolerance_of(c.dtype), tolerance_of(c.dtype)), 1.0)
      << what;
}

// ---- residual add + RMSNorm over o / down rows ----------------------------------------------

// {out, residual_out} of add_rms_norm: the residual plus the rows (fused expand) or plus
// `plain_rows`; with `pick`, over those rows only (as the final norm over sampled rows).
std::vector<std::vector<double>> run_norm(const ExpandCase& c, Device device, bool lora,
                                          const std::vector<double>& plain_rows,
                                          const std::vector<double>& residual,
                                          const std::vector<double>& weight,
                                          const std::vector<int32_t>& pick) {
  const Stream stream = stream_for(device);
  const int64_t h = c.base_width;
  DeviceCase d = upload(c, device, stream);
  Tensor plain = lora ? Tensor() : to_tensor(plain_rows, {c.tokens, h}, c.dtype, device, stream);
  Tensor res = to_tensor(residual, {c.tokens, h}, c.dtype, device, stream);
  Tensor w = to_tensor(weight, {h}, c.dtype, device, stream);
  const int64_t rows = pick.empty() ? c.tokens : static_cast<int64_t>(pick.size());
  Tensor rows_t;
  if (!pick.empty()) rows_t = Tensor::from_vector(pick, {rows}).to(device, stream);
  Tensor out = Tensor::empty({rows, h}, c.dtype, device);
  Tensor res_out = Tensor::empty({rows, h}, c.dtype, device);
  ops::AddRmsNormArgs a{c.dtype,
                        rows,
                        h,
                        1e-5f,
                        pick.empty() ? nullptr : rows_t.data<int32_t>(),
                        res.data_ptr(),
                        lora ? d.rows.data_ptr() : plain.data_ptr(),
                        res_out.data_ptr(),
                        w.data_ptr(),
                        out.data_ptr()};
  if (lora) {
    a.delta_row_stride = c.row_width();
    a.lora = d.lora;
  }
  throw_if_error(ops::run(&ops::cpu::add_rms_norm, &ops::cuda::add_rms_norm, a, stream));
  stream.synchronize();
  return {values_of(out), values_of(res_out)};
}

void check_norm(const ExpandCase& c, Device device, const std::vector<int32_t>& pick,
                const std::string& what) {
  std::mt19937_64 rng(c.tokens * 31 + c.base_width);
  const std::vector<double> residual =
      random_values(static_cast<size_t>(c.tokens * c.base_width), c.dtype, rng, 1.0f);
  const std::vector<double> weight =
      random_values(static_cast<size_t>(c.base_width), c.dtype, rng, 1.0f);
  const auto want = run_norm(c, Device::cpu(), false, expanded_inputs(c), residual, weight, pick);
  const auto got = run_norm(c, device, true, {}, residual, weight, pick);
  const double tol = tolerance_of(c.dtype);
  EXPECT_LE(test::tolerance_ratio(got[0], want[0], tol, tol), 1.0) << what << " (out)";
  EXPECT_LE(test::tolerance_ratio(got[1], want[1], tol, tol), 1.0) << what << " (residual)";
}

// ---- RoPE + KV write over q/k/v rows ----------------------------------------------------------

struct RopeShape {
  int64_t heads = 6, kv_heads = 2, head_dim = 16;
};

// {qkv base columns, K cache, V cache} after rope_kv_write.
std::vector<std::vector<double>> run_rope(const ExpandCase& c, const RopeShape& r, Device device,
                                          bool lora, const std::vector<double>& plain_rows) {
  const Stream stream = stream_for(device);
  DeviceCase d = upload(c, device, stream);
  Tensor plain =
      lora ? Tensor() : to_tensor(plain_rows, {c.tokens, c.base_width}, c.dtype, device, stream);
  const int64_t block = 4;
  const int64_t blocks = (c.tokens + block - 1) / block + 1;
  Tensor k = Tensor::zeros({blocks, block, r.kv_heads, r.head_dim}, c.dtype, device);
  Tensor v = Tensor::zeros({blocks, block, r.kv_heads, r.head_dim}, c.dtype, device);
  std::vector<int32_t> positions, cache_slots;
  std::vector<float> inv_freq;
  for (int64_t t = 0; t < c.tokens; ++t) {
    positions.push_back(static_cast<int32_t>(3 * t + 1));
    cache_slots.push_back(t % 5 == 4 ? -1 : static_cast<int32_t>(t));  // some tokens not stored
  }
  for (int64_t i = 0; i < r.head_dim / 2; ++i) {
    inv_freq.push_back(std::pow(10000.0f, -2.0f * static_cast<float>(i) / r.head_dim));
  }
  const int64_t n = c.tokens;
  Tensor pos = Tensor::from_vector(positions, {n}).to(device, stream);
  Tensor slot_map = Tensor::from_vector(cache_slots, {n}).to(device, stream);
  Tensor freq =
      Tensor::from_vector(inv_freq, {static_cast<int64_t>(inv_freq.size())}).to(device, stream);
  ops::RopeKvWriteArgs a;
  a.dtype = c.dtype;
  a.num_tokens = n;
  a.num_heads = r.heads;
  a.positions = pos.data<int32_t>();
  a.inv_freq = freq.data<float>();
  a.qkv = lora ? d.rows.data_ptr() : plain.data_ptr();
  a.qkv_row_stride = lora ? c.row_width() : c.base_width;
  a.slot_mapping = slot_map.data<int32_t>();
  a.cache = {blocks, block, r.kv_heads, r.head_dim, k.data_ptr(), v.data_ptr()};
  if (lora) a.lora = d.lora;
  throw_if_error(ops::run(&ops::cpu::rope_kv_write, &ops::cuda::rope_kv_write, a, stream));
  stream.synchronize();
  const Tensor qkv = lora ? d.rows.narrow(1, 0, c.base_width).contiguous(stream) : plain;
  stream.synchronize();
  return {values_of(qkv), values_of(k), values_of(v)};
}

void check_rope(const ExpandCase& c, const RopeShape& r, Device device, const std::string& what) {
  const auto want = run_rope(c, r, Device::cpu(), false, expanded_inputs(c));
  const auto got = run_rope(c, r, device, true, {});
  const double tol = tolerance_of(c.dtype);
  const char* parts[] = {"qkv", "k cache", "v cache"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_LE(test::tolerance_ratio(got[i], want[i], tol, tol), 1.0)
        << what << " (" << parts[i] << ")";
  }
}

// ---- the cases ----------------------------------------------------------------------------

std::string name_of(const char* op, DType dt, SlotDistribution d, int64_t tokens) {
  return std::string(op) + " " + std::string(dtype_name(dt)) + " " + test::distribution_name(d) +
         " " + std::to_string(tokens) + " tokens";
}

void silu_cases(Device device, DType dt) {
  uint64_t seed = 1;
  for (SlotDistribution d : test::kAllDistributions) {
    for (int64_t tokens : {1, 7, 37}) {
      // gate and up as two slices, and one fused LoRA over both (odd rank 5 cap: scalar B rows).
      check_silu(make_case(dt, tokens, {40, 40}, 5, 16, d, ++seed), device,
                 name_of("silu_mul", dt, d, tokens));
      check_silu(make_case(dt, tokens, {24}, 4, 5, d, ++seed), device,
                 name_of("silu_mul fused LoRA", dt, d, tokens));
    }
    // Rows of several B tiles, the last one partial, and B rows of rank 32.
    check_silu(make_case(dt, 37, {1032, 1032}, 5, 32, d, ++seed), device,
               name_of("silu_mul wide", dt, d, 37));
  }
}

void norm_cases(Device device, DType dt) {
  uint64_t seed = 100;
  for (SlotDistribution d : test::kAllDistributions) {
    for (int64_t tokens : {1, 9, 33}) {
      check_norm(make_case(dt, tokens, {64}, 5, 8, d, ++seed), device, {},
                 name_of("add_rms_norm", dt, d, tokens));
      // Odd hidden: the scalar kernel.
      check_norm(make_case(dt, tokens, {45}, 3, 3, d, ++seed), device, {},
                 name_of("add_rms_norm odd", dt, d, tokens));
    }
    // Wider than one 16-byte run per thread of the largest block.
    check_norm(make_case(dt, 9, {4104}, 3, 16, d, ++seed), device, {},
               name_of("add_rms_norm wide", dt, d, 9));
    const std::vector<int32_t> pick = {4, 0, 7};
    check_norm(make_case(dt, 8, {64}, 5, 16, d, ++seed), device, pick,
               name_of("add_rms_norm sampled rows", dt, d, 8));
  }
}

void rope_cases(Device device, DType dt) {
  uint64_t seed = 200;
  const RopeShape r;
  const int64_t q = r.heads * r.head_dim;
  const int64_t kv = r.kv_heads * r.head_dim;
  for (SlotDistribution d : test::kAllDistributions) {
    for (int64_t tokens : {1, 6, 29}) {
      check_rope(make_case(dt, tokens, {q, kv, kv}, 6, 8, d, ++seed), r, device,
                 name_of("rope_kv_write", dt, d, tokens));
      check_rope(make_case(dt, tokens, {q + 2 * kv}, 3, 7, d, ++seed), r, device,
                 name_of("rope_kv_write fused LoRA", dt, d, tokens));
    }
  }
}

TEST(FusedLoraExpand, SiluMulEqualsExpandedInput) {
  for (DType dt : {DType::kF32, DType::kBF16}) silu_cases(Device::cpu(), dt);
}
TEST(FusedLoraExpand, AddRmsNormEqualsExpandedInput) {
  for (DType dt : {DType::kF32, DType::kBF16}) norm_cases(Device::cpu(), dt);
}
TEST(FusedLoraExpand, RopeKvWriteEqualsExpandedInput) {
  for (DType dt : {DType::kF32, DType::kBF16}) rope_cases(Device::cpu(), dt);
}

TEST(FusedLoraExpand, RefusesATokenSlotPastTheRows) {
  ExpandCase c = make_case(DType::kF32, 5, {8, 8}, 4, 4, SlotDistribution::kUniform, 9);
  c.slots[2] = c.num_slots;  // a slot whose intermediates the rows do not hold
  try {
    run_silu(c, Device::cpu(), true, {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 2 has LoRA slot 3"), std::string::npos) << e.what();
  }
}

TEST(FusedLoraExpand, RefusesSlicesPastTheRow) {
  ExpandCase c = make_case(DType::kF32, 3, {8, 8}, 4, 4, SlotDistribution::kUniform, 10);
  const Stream stream;
  DeviceCase d = upload(c, Device::cpu(), stream);
  d.lora.width[1] = 9;  // one column past the 16 the op reads
  Tensor out = Tensor::empty({c.tokens, 8}, c.dtype);
  ops::SiluMulArgs a{c.dtype, c.tokens, 8, d.rows.data_ptr(), out.data_ptr()};
  a.x_row_stride = c.row_width();
  a.lora = d.lora;
  const Status st = ops::cpu::silu_mul(a);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("slice 1"), std::string::npos) << st.message();
}

TEST(FusedLoraExpandCuda, SiluMulMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) silu_cases(Device::cuda(0), dt);
}
TEST(FusedLoraExpandCuda, AddRmsNormMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) norm_cases(Device::cuda(0), dt);
}
TEST(FusedLoraExpandCuda, RopeKvWriteMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) rope_cases(Device::cuda(0), dt);
}

}  // namespace
}  // namespace loraplex::model
