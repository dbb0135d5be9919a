// FP8 base weights in the layers: the scales a layer rebuilds over its rows (fp8_local_scales)
// against each projection's own grid, and LoraLinear with fp8 weights against the same layer
// with float32 weights holding the dequantized values (the same floats go through the same
// GEMM, so the outputs are equal bit for bit), at tensor-parallel sizes 1 and 2 on the CPU.

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "layers/layer_test_util.h"
#include "loraplex/core/error.h"
#include "loraplex/layers/fp8_weight.h"
#include "loraplex/layers/lora_linear.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

// Random e4m3 codes (no NaN) with random positive scales in groups of group_n x group_k.
BaseWeight random_fp8(int64_t out, int64_t in, int64_t group_n, int64_t group_k,
                      std::mt19937_64& rng) {
  BaseWeight b;
  b.weight = test::random_e4m3_codes({out, in}, rng);
  b.group_n = group_n;
  b.group_k = group_k;
  const int64_t gn = (out + group_n - 1) / group_n;
  const int64_t gk = (in + group_k - 1) / group_k;
  std::vector<float> s(static_cast<size_t>(gn * gk));
  std::uniform_real_distribution<float> sd(1.0f / 2048, 1.0f / 512);
  for (float& v : s) v = sd(rng);
  b.scale = Tensor::from_vector(s, {gn, gk});
  return b;
}

float own_scale(const BaseWeight& w, int64_t row, int64_t col) {
  return w.scale.data<float>()[(row / w.group_n) * w.scale.size(1) + col / w.group_k];
}

// w[r, c] = e4m3(q) * scale as float32, from the projection's own grid.
Tensor dequantized(const BaseWeight& w) {
  const int64_t out = w.weight.size(0);
  const int64_t in = w.weight.size(1);
  Tensor d = Tensor::empty({out, in}, DType::kF32);
  const uint8_t* q = static_cast<const uint8_t*>(w.weight.data_ptr());
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t c = 0; c < in; ++c) {
      d.data<float>()[r * in + c] = e4m3_bits_to_float(q[r * in + c]) * own_scale(w, r, c);
    }
  }
  return d;
}

float layout_scale(const Fp8Scales& s, int64_t r, int64_t c) {
  const kernels::Fp8WeightScales& l = s.layout;
  return s.scale.data<float>()[(r / l.group_n) * l.stride_n + (c / l.group_k) * l.stride_k];
}

struct ScalesCase {
  std::vector<int64_t> rows;  // of each projection
  int64_t in;
  int64_t group_n, group_k;  // 0 group_n: per tensor
  int64_t shard_rows_from;   // first row of every projection's shard (0: whole)
  int64_t col0, cols;
  const char* want;  // "row", "blocks" or "row x k-group"
};

TEST(Fp8LocalScales, EveryElementGetsItsProjectionsScale) {
  const ScalesCase cases[] = {
      {{64, 32, 32}, 96, 1, 96, 0, 0, 96, "row"},
      {{64, 32, 32}, 96, 0, 0, 0, 0, 96, "row"},  // per tensor
      {{64, 32, 32}, 96, 16, 32, 0, 0, 96, "blocks"},
      {{64, 32, 32}, 100, 16, 32, 0, 0, 100, "blocks"},  // partial last column block
      {{64, 32, 32}, 96, 48, 32, 0, 0, 96, "row x k-group"},
      {{80, 80}, 200, 128, 128, 0, 0, 200, "row x k-group"},  // a block starting at row 80
      {{80, 80}, 96, 128, 128, 0, 0, 96, "row"},          // one block of columns: a scale per row
      {{64, 64}, 96, 16, 16, 16, 0, 96, "blocks"},        // row shards on a block
      {{64, 64}, 96, 16, 16, 8, 0, 96, "row x k-group"},  // row shards inside a block
      {{64}, 96, 16, 16, 0, 48, 48, "blocks"},            // a column shard on a block
      {{64}, 96, 1, 96, 0, 48, 48, "row"},
  };
  std::mt19937_64 rng(21);
  for (const ScalesCase& c : cases) {
    std::vector<BaseWeight> w;
    for (int64_t rows : c.rows) {
      w.push_back(c.group_n == 0 ? random_fp8(rows, c.in, rows, c.in, rng)
                                 : random_fp8(rows, c.in, c.group_n, c.group_k, rng));
    }
    std::vector<Fp8RowRange> ranges;
    for (const BaseWeight& b : w) {
      const int64_t first = c.shard_rows_from;
      ranges.push_back({&b, first, b.weight.size(0) - first - (first > 0 ? 16 : 0)});
    }
    const Fp8Scales s = fp8_local_scales(ranges, c.col0, c.cols, "layer");
    const kernels::Fp8WeightScales& l = s.layout;
    const std::string kind = l.group_n > 1 ? "blocks" : l.stride_k == 0 ? "row" : "row x k-group";
    EXPECT_EQ(kind, c.want) << c.want << " " << c.rows.size() << " projections";
    if (kind == "blocks") {
      EXPECT_EQ(l.stride_n % 4, 0) << "cuBLASLt's padded block rows";
    }
    int64_t local = 0;
    for (const Fp8RowRange& r : ranges) {
      for (int64_t i = 0; i < r.rows; ++i, ++local) {
        for (int64_t j = 0; j < c.cols; ++j) {
          ASSERT_EQ(layout_scale(s, local, j), own_scale(*r.weight, r.first_row + i, c.col0 + j))
              << c.want << ": local row " << local << ", column " << j;
        }
      }
    }
  }
}

TEST(Fp8LocalScales, RefusesMixedSchemesAndColumnShardsInsideABlock) {
  std::mt19937_64 rng(22);
  const BaseWeight a = random_fp8(32, 64, 1, 64, rng);
  const BaseWeight b = random_fp8(32, 64, 16, 16, rng);
  try {
    fp8_local_scales({{&a, 0, 32}, {&b, 0, 32}}, 0, 64, "qkv_proj");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qkv_proj: its projections' scales differ"),
              std::string::npos)
        << e.what();
  }
  try {
    fp8_local_scales({{&b, 0, 32}}, 8, 32, "o_proj");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("columns start at 8, not on a block of 16 columns"),
              std::string::npos)
        << e.what();
  }
}

TEST(Fp8LocalScales, MergedInputScaleIsTheLargestOfAllOrNone) {
  std::mt19937_64 rng(23);
  BaseWeight a = random_fp8(8, 8, 1, 8, rng);
  BaseWeight b = random_fp8(8, 8, 1, 8, rng);
  EXPECT_FALSE(merged_input_scale({&a, &b}, "l").defined());
  a.input_scale = Tensor::from_vector(std::vector<float>{0.5f}, {1});
  EXPECT_THROW(merged_input_scale({&a, &b}, "l"), Error);
  b.input_scale = Tensor::from_vector(std::vector<float>{0.75f}, {1});
  EXPECT_EQ(merged_input_scale({&a, &b}, "l").data<float>()[0], 0.75f);
}

constexpr int kMaxLoras = 3;
constexpr int kMaxRank = 8;
constexpr int kTokens = 29;

struct LayerCase {
  LinearSpec spec;
  int64_t group_n, group_k;
  int tp;
};

// y of `spec` over every rank (column outputs concatenated by rank when not gathered: both
// layers give the same per-rank layout, so the comparison needs no reordering).
std::vector<double> run(const LinearSpec& spec, const std::vector<BaseWeight>& weights,
                        const Tensor& x, const std::vector<int32_t>& slots,
                        const std::vector<std::vector<LoraSliceWeights>>& adapters, int tp) {
  std::vector<std::vector<double>> out(static_cast<size_t>(tp));
  test::run_ranks(test::Backend::kCpu, tp, [&](int rank, Communicator* comm) {
    const Device cpu = Device::cpu();
    const Stream stream = Stream::default_for(cpu);
    PunicaWrapper punica(kMaxLoras, kTokens, 4, cpu);
    punica.update_metadata(slots, {}, stream);
    LoraLinear layer(spec, LoraConfig{kMaxLoras, kMaxRank, spec.dtype, false}, comm, cpu, kTokens);
    EXPECT_EQ(layer.can_fuse(), !spec.fp8_weight);
    layer.load_base(weights);
    for (int slot = 0; slot < static_cast<int>(adapters.size()); ++slot) {
      layer.set_lora(slot, adapters[static_cast<size_t>(slot)]);
    }
    Tensor xin = x;
    if (spec.style == ParallelStyle::kRow) {
      const int64_t w = spec.in_features / tp;
      xin = x.narrow(1, rank * w, w).contiguous();
    }
    out[static_cast<size_t>(rank)] = test::values_of(layer.forward(xin, punica, stream));
  });
  std::vector<double> all;
  for (const auto& o : out) all.insert(all.end(), o.begin(), o.end());
  return all;
}

TEST(Fp8LoraLinear, EqualsTheFloatLayerOnTheDequantizedWeights) {
  const LayerCase cases[] = {
      {LinearSpec::qkv(96, 16, 4, 2, DType::kF32), 1, 96, 1},
      {LinearSpec::qkv(96, 16, 4, 2, DType::kF32), 16, 32, 1},  // blocks line up
      {LinearSpec::qkv(96, 16, 4, 2, DType::kF32), 48, 32, 1},  // k starts inside a block
      {LinearSpec::qkv(96, 16, 4, 2, DType::kF32), 16, 32, 2},
      {LinearSpec::merged_column(96, {80, 80}, DType::kF32), 32, 32, 2},
      {LinearSpec::row(96, 64, DType::kF32), 1, 96, 2},
      {LinearSpec::row(96, 64, DType::kF32), 16, 16, 2},
  };
  std::mt19937_64 rng(24);
  for (const LayerCase& c : cases) {
    const std::string what = c.spec.kind + " groups " + std::to_string(c.group_n) + "x" +
                             std::to_string(c.group_k) + " tp " + std::to_string(c.tp);
    std::vector<BaseWeight> fp8;
    std::vector<BaseWeight> plain;
    for (const OutputSlice& o : c.spec.outputs) {
      fp8.push_back(random_fp8(o.size, c.spec.in_features, c.group_n, c.group_k, rng));
      plain.emplace_back();
      plain.back().weight = dequantized(fp8.back());
    }
    const Tensor x = test::random_tensor({kTokens, c.spec.in_features}, DType::kF32, rng);
    const std::vector<int32_t> slots = test::mixed_slots(kTokens, kMaxLoras, rng);
    std::vector<std::vector<LoraSliceWeights>> adapters(kMaxLoras);
    for (auto& a : adapters) {
      for (const OutputSlice& o : c.spec.outputs) {
        a.push_back({test::random_tensor({5, c.spec.in_features}, DType::kF32, rng, 0.5f),
                     test::random_tensor({o.size, 5}, DType::kF32, rng, 0.2f)});
      }
    }
    LinearSpec fp8_spec = c.spec;
    fp8_spec.fp8_weight = true;
    const std::vector<double> got = run(fp8_spec, fp8, x, slots, adapters, c.tp);
    const std::vector<double> want = run(c.spec, plain, x, slots, adapters, c.tp);
    ASSERT_EQ(got.size(), want.size()) << what;
    EXPECT_EQ(got, want) << what;
    EXPECT_GT(test::max_abs(want), 0.1) << what;
  }
}

TEST(Fp8LoraLinear, TakesFp8WeightsOnlyWhenItsSpecSaysSo) {
  std::mt19937_64 rng(25);
  LinearSpec spec = LinearSpec::row(32, 16, DType::kBF16);
  spec.fp8_weight = true;
  LoraLinear fp8(spec, LoraConfig{1, 4, DType::kBF16, false}, nullptr, Device::cpu(), 4);
  EXPECT_FALSE(fp8.can_fuse());
  EXPECT_EQ(fp8.weight().dtype(), DType::kF8E4M3);
  try {
    fp8.load_base({test::random_tensor({16, 32}, DType::kBF16, rng)});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the layer takes float8_e4m3 weights with scales"),
              std::string::npos)
        << e.what();
  }
  LoraLinear plain(LinearSpec::row(32, 16, DType::kBF16), LoraConfig{1, 4, DType::kBF16, false},
                   nullptr, Device::cpu(), 4);
  EXPECT_TRUE(plain.can_fuse());
  try {
    plain.load_base(std::vector<BaseWeight>{random_fp8(16, 32, 1, 32, rng)});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the layer takes float weights"), std::string::npos)
        << e.what();
  }
  fp8.load_base(std::vector<BaseWeight>{random_fp8(16, 32, 1, 32, rng)});
  EXPECT_EQ(fp8.fp8_scales().scale.numel(), 16);
  EXPECT_FALSE(fp8.fp8_scales().input_scale.defined());
}

// Dequantized codes of `codes` [rows, cols] (a view of a layer stack) with a scale per row.
std::vector<double> dequantized_rows(const Tensor& codes, const Tensor& scales, int64_t rows,
                                     int64_t cols) {
  const Tensor q = codes.narrow(0, 0, rows).narrow(1, 0, cols).contiguous();
  const std::vector<double> s = test::values_of(scales);
  const uint8_t* b = static_cast<const uint8_t*>(q.data_ptr());
  std::vector<double> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[static_cast<size_t>(r * cols + c)] =
          static_cast<double>(e4m3_bits_to_float(b[r * cols + c])) * s[static_cast<size_t>(r)];
    }
  }
  return out;
}

// Every stored value within e4m3's rounding of the adapter's: half an ulp is 2^-4 of a normal
// value, 2^-10 of the row's scale below the normal range.
void expect_round_trip(const std::vector<double>& got, const Tensor& original, const Tensor& scales,
                       const std::string& what) {
  const std::vector<double> want = original.to_double_vector();
  const std::vector<double> s = test::values_of(scales);
  const int64_t cols = original.size(1);
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound =
        std::fabs(want[i]) * 0.0625 + s[i / static_cast<size_t>(cols)] * std::ldexp(1.0, -10);
    ASSERT_LE(std::fabs(got[i] - want[i]), bound) << what << " element " << i;
  }
}

TEST(Fp8LoraStorage, RoundTripWithinE4m3AndForwardUsesTheStoredAdapter) {
  std::mt19937_64 rng(26);
  for (const LinearSpec& spec :
       {LinearSpec::qkv(96, 16, 4, 2, DType::kF32), LinearSpec::row(96, 64, DType::kF32)}) {
    const Device cpu = Device::cpu();
    const Stream stream;
    std::vector<BaseWeight> base;
    for (const OutputSlice& o : spec.outputs) {
      base.emplace_back();
      base.back().weight = test::random_tensor({o.size, spec.in_features}, DType::kF32, rng, 0.5f);
    }
    LoraLinear fp8(spec, LoraConfig{kMaxLoras, kMaxRank, DType::kF8E4M3, false}, nullptr, cpu,
                   kTokens);
    LoraLinear plain(spec, LoraConfig{kMaxLoras, kMaxRank, DType::kF32, false}, nullptr, cpu,
                     kTokens);
    EXPECT_FALSE(fp8.can_fuse());
    EXPECT_EQ(fp8.lora_a(0).dtype(), DType::kF8E4M3);
    fp8.load_base(base);
    plain.load_base(base);
    // Slot 1 gets rank 6 over an earlier rank-8 adapter: the stale columns are never read.
    for (int round = 0; round < 2; ++round) {
      const int64_t r = round == 0 ? 8 : 6;
      std::vector<LoraSliceWeights> adapter;
      for (const OutputSlice& o : spec.outputs) {
        Tensor a = test::random_tensor({r, spec.in_features}, DType::kF32, rng, 0.5f);
        a.narrow(0, 0, 1).zero_();  // a row of zeros: scale 1, codes 0
        adapter.push_back({a, test::random_tensor({o.size, r}, DType::kF32, rng, 0.2f)});
      }
      fp8.set_lora(1, adapter);
      // The float layer gets exactly what the fp8 layer stores, dequantized.
      std::vector<LoraSliceWeights> stored;
      for (int s = 0; s < fp8.num_lora_slices(); ++s) {
        const LoraSliceWeights& w = adapter[static_cast<size_t>(s)];
        const Tensor a_codes = fp8.lora_a(s).select(0, 1);
        const Tensor b_codes = fp8.lora_b(s).select(0, 1);
        const Tensor a_scales = fp8.lora_a_scales(s).select(0, 1).narrow(0, 0, r);
        const Tensor b_scales = fp8.lora_b_scales(s).select(0, 1);
        const std::vector<double> a = dequantized_rows(a_codes, a_scales, r, spec.in_features);
        const std::vector<double> b = dequantized_rows(b_codes, b_scales, w.b.size(0), r);
        expect_round_trip(a, w.a, a_scales, spec.kind + " A");
        expect_round_trip(b, w.b, b_scales, spec.kind + " B");
        EXPECT_EQ(test::values_of(a_scales)[0], 1.0) << "the zero row's scale";
        stored.push_back(
            {Tensor::from_vector(std::vector<float>(a.begin(), a.end()), {r, spec.in_features}),
             Tensor::from_vector(std::vector<float>(b.begin(), b.end()), {w.b.size(0), r})});
      }
      plain.set_lora(1, stored);
    }
    const Tensor x = test::random_tensor({kTokens, spec.in_features}, DType::kF32, rng);
    const std::vector<int32_t> slots = test::mixed_slots(kTokens, kMaxLoras, rng);
    PunicaWrapper punica(kMaxLoras, kTokens, 4, cpu);
    punica.update_metadata(slots, {}, stream);
    const std::vector<double> got = test::values_of(fp8.forward(x, punica, stream));
    const std::vector<double> want = test::values_of(plain.forward(x, punica, stream));
    EXPECT_LE(test::tolerance_ratio(got, want, 1e-5, 1e-5 * test::max_abs(want)), 1.0) << spec.kind;
  }
}

TEST(Fp8LoraStorage, RefusedWithFullyShardedLora) {
  EXPECT_THROW(LoraLinear(LinearSpec::row(32, 16, DType::kBF16),
                          LoraConfig{1, 4, DType::kF8E4M3, true}, nullptr, Device::cpu(), 4),
               Error);
}

}  // namespace
}  // namespace loraplex
