// Shrink, expand, BGMV, the fused and split LoRA layer, logits LoRA and CUDA-graph replay:
// each runs through the same entry points on the GPU and on the CPU reference, on the same
// random inputs, and the results are compared.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "kernels_cpu/op_cases.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/kernels/cuda/kernel_trace.h"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/planner/lora_tuning.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex {
namespace {

struct LayerCase {
  DType dtype;
  int tokens;
  int max_loras;
  int max_rank;
  int64_t hidden;
  std::vector<int64_t> widths;
  test::SlotDistribution dist;
  double none_fraction;
  bool random_ranks;  // per (slice, slot) in [0, max_rank], else max_rank everywhere
};

std::string case_name(const LayerCase& c) {
  std::string out(dtype_name(c.dtype));
  out.append(" T").append(std::to_string(c.tokens));
  out.append(" L").append(std::to_string(c.max_loras));
  out.append(" R").append(std::to_string(c.max_rank));
  out.append(" K").append(std::to_string(c.hidden));
  out.append(" N");
  for (size_t i = 0; i < c.widths.size(); ++i) {
    if (i > 0) out.append("/");
    out.append(std::to_string(c.widths[i]));
  }
  out.append(" ").append(test::distribution_name(c.dist));
  if (c.random_ranks) out.append(" ranks~");
  return out;
}

struct LayerData {
  std::vector<int32_t> slots;
  std::vector<int32_t> ranks;  // [slices, max_loras]
  Tensor x;
  std::vector<Tensor> a;
  std::vector<Tensor> b;
  Tensor y0;
  int64_t width = 0;
};

LayerData make_layer(const LayerCase& c, std::mt19937_64& rng) {
  LayerData d;
  const int slices = static_cast<int>(c.widths.size());
  d.slots = test::make_slots(c.dist, c.tokens, c.max_loras, rng, c.none_fraction);
  std::uniform_int_distribution<int32_t> any_rank(1, c.max_rank);
  std::bernoulli_distribution zero(0.1);
  for (int s = 0; s < slices; ++s) {
    for (int k = 0; k < c.max_loras; ++k) {
      d.ranks.push_back(!c.random_ranks ? c.max_rank : (zero(rng) ? 0 : any_rank(rng)));
    }
  }
  const float a_scale = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  const float b_scale = 1.0f / std::sqrt(static_cast<float>(c.max_rank));
  for (int64_t n : c.widths) {
    d.a.push_back(test::random_tensor({c.max_loras, c.max_rank, c.hidden}, c.dtype, rng, a_scale));
    d.b.push_back(test::random_tensor({c.max_loras, n, c.max_rank}, c.dtype, rng, b_scale));
    d.width += n;
  }
  d.x = test::random_tensor({c.tokens, c.hidden}, c.dtype, rng);
  d.y0 = test::random_tensor({c.tokens, d.width}, c.dtype, rng);
  return d;
}

SlotRanks make_ranks(const LayerCase& c, const LayerData& d, Device device, const Stream& stream) {
  const int slices = static_cast<int>(c.widths.size());
  SlotRanks ranks(slices, c.max_loras, c.max_rank, device);
  for (int s = 0; s < slices; ++s) {
    for (int k = 0; k < c.max_loras; ++k) ranks.set(s, k, d.ranks[s * c.max_loras + k], stream);
  }
  return ranks;
}

std::vector<Tensor> to_device(const std::vector<Tensor>& ts, Device device, const Stream& stream) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.to(device, stream));
  return out;
}

using kernels::planner::LoraTuning;

// A layer case on `device`: the wrapper with the case's metadata and the CUDA kernels' tuning
// table, the ranks, the weights, x and a fresh copy of y0.
struct LayerOnDevice {
  LayerOnDevice(const LayerCase& c, const LayerData& d, Device device, const Stream& stream,
                const LoraTuning& tuning = {})
      : wrapper(c.max_loras, c.tokens, 1, device),
        ranks(make_ranks(c, d, device, stream)),
        a(to_device(d.a, device, stream)),
        b(to_device(d.b, device, stream)),
        x(d.x.to(device, stream)),
        y(d.y0.clone().to(device, stream)) {
    wrapper.set_lora_tuning(tuning);
    wrapper.update_metadata(d.slots, {}, stream);
  }
  PunicaWrapper wrapper;
  SlotRanks ranks;
  std::vector<Tensor> a, b;
  Tensor x, y;
};

// y0 + LoRA(x) for the whole layer through PunicaWrapper::add_lora_linear on `device`, with
// `tuning` on CUDA (and the metadata scratch its plan needs).
Tensor run_linear(const LayerCase& c, const LayerData& d, Device device, const Stream& stream,
                  std::string* path = nullptr, float scale = 0.5f, const LoraTuning& tuning = {}) {
  const int slices = static_cast<int>(c.widths.size());
  LayerOnDevice l(c, d, device, stream, tuning);
  Tensor ws =
      Tensor::empty({slices * static_cast<int64_t>(c.tokens) * c.max_rank}, DType::kF32, device);
  l.wrapper.reserve_lora_linear(l.y, l.x, l.a, l.b, l.ranks, ws);
  if (path != nullptr) *path = l.wrapper.lora_linear_path(l.y, l.x, l.a, l.b, l.ranks, ws);
  if (device.is_cpu()) {
    l.wrapper.add_lora_linear(l.y, l.x, l.a, l.b, l.ranks, scale, ws, stream);
    return l.y;
  }
  // NaN in every scratch float: a partial sum read before a kernel wrote it turns into NaN in
  // y on every run, instead of whatever an earlier case left there.
  const kernels::LoraMetaView view = l.wrapper.token_meta().view();
  cuda_rt::memset_async(view.scratch, 0xff, static_cast<size_t>(view.scratch_floats) * 4,
                        stream.handle());
  // Twice: the first op after the metadata build reads nothing before its PDL wait, the
  // second one reads the settled metadata (and A rows) early; the same bits either way.
  Tensor first = l.y.clone(stream);
  l.wrapper.add_lora_linear(first, l.x, l.a, l.b, l.ranks, scale, ws, stream);
  EXPECT_TRUE(l.wrapper.token_meta().view().settled);
  l.wrapper.add_lora_linear(l.y, l.x, l.a, l.b, l.ranks, scale, ws, stream);
  test::expect_identical(test::on_cpu(l.y, stream), test::on_cpu(first, stream), stream,
                         case_name(c) + ": settled metadata against the first op");
  return test::on_cpu(l.y, stream);
}

const std::vector<LayerCase>& linear_cases() {
  using D = test::SlotDistribution;
  static const std::vector<LayerCase> cases = {
      // Tensor-core eligible (bf16/f16, multiples of 8): decode paths up to 64 tokens, split
      // above.
      {DType::kBF16, 1, 1, 16, 4096, {4096}, D::kOneAdapter, 0.0, false},
      {DType::kBF16, 16, 8, 16, 4096, {4096, 1024, 1024}, D::kUniform, 0.2, false},
      {DType::kBF16, 64, 32, 64, 1024, {512, 128, 128}, D::kZipf, 0.1, true},
      {DType::kF16, 77, 4, 32, 512, {256, 64}, D::kSkewed, 0.0, true},
      {DType::kBF16, 5, 4, 128, 256, {264}, D::kAllDistinct, 0.0, true},
      {DType::kBF16, 128, 3, 8, 64, {24, 8, 16, 40}, D::kUniform, 0.3, true},
      {DType::kBF16, 300, 8, 64, 2048, {1024, 256, 256}, D::kUniform, 0.1, false},
      {DType::kF16, 1100, 32, 16, 1024, {1024}, D::kZipf, 0.05, true},
      {DType::kBF16, 200, 2, 128, 512, {384}, D::kSkewed, 0.0, true},
      // Prefill with K = 4096 (split into 4-8 parts) over full 128-token tiles and partial ones.
      {DType::kBF16, 333, 3, 16, 4096, {1024, 256, 256}, D::kZipf, 0.05, true},
      // ... and 192 A rows over 37 tiles: the wgmma form's K split in 3 to stay in one wave.
      {DType::kBF16, 600, 32, 64, 4096, {1024, 256, 256}, D::kUniform, 0.0, false},
      // Decode sizes for the cluster path: one slot over several 16-token units (clusters of
      // 16); K = 8 x 199 split unevenly over a cluster of 4, ranks not multiples of 8.
      {DType::kBF16, 64, 2, 16, 4096, {4096, 1024, 1024}, D::kOneAdapter, 0.0, false},
      {DType::kF16, 40, 6, 24, 1592, {200, 56}, D::kSkewed, 0.25, true},
      {DType::kBF16, 3, 3, 64, 1592, {1592}, D::kAllDistinct, 0.0, true},
      // Generic kernels: float32, or sizes that are not multiples of 8.
      {DType::kF32, 33, 4, 8, 96, {40, 24}, D::kUniform, 0.2, true},
      {DType::kBF16, 17, 3, 12, 100, {36, 20}, D::kAllDistinct, 0.0, true},
      {DType::kF16, 199, 5, 16, 77, {33}, D::kZipf, 0.1, false},
  };
  return cases;
}

TEST(CudaLoraLinear, DefaultPathMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(101);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  for (const LayerCase& c : linear_cases()) {
    const LayerData d = make_layer(c, rng);
    const Tensor got = run_linear(c, d, test::gpu(), stream);
    const Tensor ref = run_linear(c, d, Device::cpu(), cpu);
    const double rtol = test::default_rtol(c.dtype);
    test::expect_matches(got, ref, stream, rtol, rtol * 2, case_name(c));
  }
}

TEST(CudaLoraLinear, GatherClusterAndSplitPathsAllMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(202);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  // decode_max_tokens 0: the shrink + expand kernels; 1 << 20: the decode-sized paths wherever
  // they apply: the one-kernel cluster layer (cluster 2), else the per-token PDL pair (on every
  // case it supports).
  struct Config {
    int limit;
    int gather_max_token_ranks;
    int cluster;
    const char* name;
  };
  const Config configs[] = {
      {0, 1 << 30, 0, "split"}, {1 << 20, 1 << 30, 0, "gather"}, {1 << 20, 1 << 30, 2, "cluster"}};
  for (const Config& cfg : configs) {
    LoraTuning tuning;
    tuning.decode_max_tokens = cfg.limit;
    tuning.gather_max_token_ranks = cfg.gather_max_token_ranks;
    tuning.decode_cluster = cfg.cluster;
    int ran = 0;
    for (const LayerCase& c : linear_cases()) {
      if (c.dtype == DType::kF32) continue;
      const LayerData d = make_layer(c, rng);
      std::string path;
      const Tensor got = run_linear(c, d, test::gpu(), stream, &path, 0.5f, tuning);
      ran += path == cfg.name ? 1 : 0;
      const Tensor ref = run_linear(c, d, Device::cpu(), cpu);
      const double rtol = test::default_rtol(c.dtype);
      test::expect_matches(got, ref, stream, rtol, rtol * 2, case_name(c) + " " + cfg.name);
    }
    // The configuration reached its path for most cases (the rest fall back).
    EXPECT_GE(ran, 5) << cfg.name;
  }
}

// The per-CTA timelines of `loraplex bench kernels --trace` come from separate kernel
// instantiations: with a trace buffer set, the prefill shrink and both tensor-core expands must
// still match the CPU, and each CTA that ran to its end must have recorded its SM and
// timestamps that never go backwards. The buffer is zeroed before each op, so a row holds one
// launch's values.
TEST(CudaKernelTrace, TracedShrinkAndExpandMatchCpuAndRecordOrderedTimelines) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(404);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  // 300 tokens over 8 slots (the prefill shrink, clusters; the pipelined expand at rank 16),
  // 1100 tokens at rank 64 over 3 slices (the pipelined expand) and at rank 128 over 2 (the
  // expand one item at a time; 2 x 128 A rows are as many as the prefill shrink takes).
  const std::vector<LayerCase> cases = {
      {DType::kBF16, 300, 8, 16, 2048, {1024}, test::SlotDistribution::kUniform, 0.0, false},
      {DType::kBF16, 1100, 4, 64, 1024, {512, 128, 128}, test::SlotDistribution::kZipf, 0.0, false},
      {DType::kBF16, 1100, 4, 128, 1024, {512, 128}, test::SlotDistribution::kZipf, 0.0, false}};
  constexpr int64_t kRows = 4096;
  const int sms = kernels::cuda::device_info(test::gpu().index).sm_count;
  for (const LayerCase& c : cases) {
    const LayerData d = make_layer(c, rng);
    const int slices = static_cast<int>(c.widths.size());
    auto run = [&](Device device, const Stream& st, bool trace, Tensor& mid_out, Tensor& y_out,
                   std::vector<int64_t>* rows_seen) {
      LayerOnDevice l(c, d, device, st);
      Tensor mid = Tensor::zeros({slices, c.tokens, c.max_rank}, DType::kF32, device, st);
      Tensor buf;
      auto check_rows = [&]() {
        const Tensor host = buf.to(Device::cpu(), st);
        st.synchronize();
        const auto* v = static_cast<const int64_t*>(host.data_ptr());
        int64_t complete = 0;
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t* row = v + r * kernels::cuda::kTraceSlots;
          if (row[7] == 0) continue;
          ++complete;
          EXPECT_LT(row[0], sms) << case_name(c) << " CTA " << r;
          int64_t last = 0;
          for (int k = 1; k < kernels::cuda::kTraceSlots; ++k) {
            if (row[k] == 0) continue;
            EXPECT_GE(row[k], last) << case_name(c) << " CTA " << r << " slot " << k;
            last = row[k];
          }
        }
        rows_seen->push_back(complete);
      };
      auto start_trace = [&]() {
        if (!trace) return;
        buf = Tensor::zeros({kRows * kernels::cuda::kTraceSlots}, DType::kI64, device, st);
        kernels::cuda::set_kernel_trace(reinterpret_cast<uint64_t*>(buf.data_ptr()));
      };
      auto stop_trace = [&]() {
        if (!trace) return;
        kernels::cuda::set_kernel_trace(nullptr);
        check_rows();
      };
      start_trace();
      l.wrapper.add_shrink(mid, l.x, l.a, l.ranks, 0.5f, st);
      stop_trace();
      start_trace();
      l.wrapper.add_expand(l.y, mid, l.b, l.ranks, 0, true, st);
      stop_trace();
      mid_out = device.is_cpu() ? mid : test::on_cpu(mid, st);
      y_out = device.is_cpu() ? l.y : test::on_cpu(l.y, st);
    };
    Tensor mid_gpu, y_gpu, mid_cpu, y_cpu;
    std::vector<int64_t> rows;
    run(test::gpu(), stream, true, mid_gpu, y_gpu, &rows);
    run(Device::cpu(), cpu, false, mid_cpu, y_cpu, nullptr);
    const double rtol = test::default_rtol(c.dtype);
    test::expect_matches(mid_gpu, mid_cpu, stream, rtol, rtol * 2, case_name(c) + " shrink");
    test::expect_matches(y_gpu, y_cpu, stream, rtol, rtol * 2, case_name(c) + " expand");
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_GT(rows[0], 0) << case_name(c) << ": no shrink CTA recorded a timeline";
    EXPECT_GT(rows[1], 0) << case_name(c) << ": no expand CTA recorded a timeline";
  }
}

// The q/k/v decode case both traced-layer tests run (ranks 0-16, tokens without LoRA), through
// run_linear with decode_cluster = `cluster` and the kernel trace on: the path taken must be
// `expected_path` and the result the CPU's; returns the trace buffer on the host, kTraceRows rows
// of kTraceSlots values (run_linear runs the layer twice; the second call, with settled
// metadata, writes the timelines).
constexpr int64_t kTraceRows = 4096;
Tensor traced_decode_layer(uint64_t seed, int cluster, const std::string& expected_path) {
  std::mt19937_64 rng(seed);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  const LayerCase c = {
      DType::kBF16, 16,  8, 16, 4096, {4096, 1024, 1024}, test::SlotDistribution::kUniform,
      0.1,          true};
  const LayerData d = make_layer(c, rng);
  Tensor buf =
      Tensor::zeros({kTraceRows * kernels::cuda::kTraceSlots}, DType::kI64, test::gpu(), stream);
  LoraTuning tuning;
  tuning.decode_cluster = cluster;
  kernels::cuda::set_kernel_trace(reinterpret_cast<uint64_t*>(buf.data_ptr()));
  std::string path;
  const Tensor got = run_linear(c, d, test::gpu(), stream, &path, 0.5f, tuning);
  kernels::cuda::set_kernel_trace(nullptr);
  EXPECT_EQ(path, expected_path);
  const Tensor ref = run_linear(c, d, Device::cpu(), cpu);
  const double rtol = test::default_rtol(c.dtype);
  test::expect_matches(got, ref, stream, rtol, rtol * 2, case_name(c) + " traced " + path);
  Tensor host = buf.to(Device::cpu(), stream);
  stream.synchronize();
  return host;
}

// The decode pair's traced instantiations (`loraplex bench kernels --trace`): the same result as
// the CPU, and timelines that show the PDL contract: every expand CTA's wait returns after the
// last shrink CTA has finished.
TEST(CudaKernelTrace, TracedDecodePairMatchesCpuAndWaitsForTheShrink) {
  LORAPLEX_REQUIRE_GPU();
  // The pair, not the cluster layer the rule picks at this size.
  const Tensor host = traced_decode_layer(405, 0, "gather");
  const auto* v = static_cast<const int64_t*>(host.data_ptr());
  int64_t shrink_rows = 0;
  int64_t expand_rows = 0;
  int64_t last_shrink_exit = 0;
  int64_t first_expand_wait = INT64_MAX;
  auto ordered = [&](const int64_t* row, int from, int to, int64_t r) {
    for (int k = from + 1; k <= to; ++k) {
      if (row[k] != 0) {
        EXPECT_GE(row[k], row[k - 1]) << "CTA row " << r << " slot " << k;
      }
    }
  };
  for (int64_t r = 0; r < kTraceRows; ++r) {
    const int64_t* row = v + r * kernels::cuda::kTraceSlots;
    if (row[1] != 0) {  // a shrink CTA: entry, wait returned, loads landed, exit
      ++shrink_rows;
      ordered(row, 1, 4, r);
      last_shrink_exit = std::max(last_shrink_exit, row[4]);
    } else if (row[5] != 0) {  // an expand CTA: entry, wait returned, exit
      ++expand_rows;
      if (row[6] != 0) first_expand_wait = std::min(first_expand_wait, row[6]);
    }
  }
  EXPECT_GT(shrink_rows, 0);
  EXPECT_GT(expand_rows, 0);
  ASSERT_NE(first_expand_wait, INT64_MAX) << "no expand CTA passed its wait";
  EXPECT_GE(first_expand_wait, last_shrink_exit)
      << "an expand CTA's PDL wait returned before the last shrink CTA's exit";
}

// The cluster layer's traced instantiation: the same result as the CPU (q/k/v, ranks from 0 to
// 16, tokens without LoRA), and every CTA's timeline in order (entry, PDL wait, loads landed,
// partial sums sent, received, rounded sums received, exit).
TEST(CudaKernelTrace, TracedClusterLayerMatchesCpuAndRecordsOrderedTimelines) {
  LORAPLEX_REQUIRE_GPU();
  const Tensor host = traced_decode_layer(406, 2, "cluster");
  const auto* v = static_cast<const int64_t*>(host.data_ptr());
  int64_t finished = 0;
  for (int64_t r = 0; r < kTraceRows; ++r) {
    const int64_t* row = v + r * kernels::cuda::kTraceSlots;
    if (row[7] == 0) continue;  // no CTA, or one that had no unit or no columns
    ++finished;
    for (int k = 2; k <= 7; ++k) {
      ASSERT_NE(row[k], 0) << "CTA row " << r << " slot " << k;
      EXPECT_GE(row[k], row[k - 1]) << "CTA row " << r << " slot " << k;
    }
  }
  EXPECT_GT(finished, 0);
}

// Every launch shape the tuning values reach must stay correct: the prefill shrink with clusters
// of 1 and 8,
// its ring 3 and 4 stages deep, its split-K sums met in a cluster and in global memory, its MMA
// on mma.sync and on wgmma (clusters of 8, or 8 parts through global memory, summed in the last
// CTA or by a second kernel), the expands with 1 to 16 CTAs per SM, the pair's shrink on FMA and
// on tensor cores with groups of 1 and 2 tokens and 8 or 16 rows, with and without PDL, the
// cluster layer with clusters of 1, 2 and 16. Each with the decode kernels off and everywhere.
TEST(CudaLoraLinear, TunedLaunchShapesMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(303);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  const std::vector<LoraTuning> shapes = {
      {.decode_cluster = 0,
       .gather_max_token_ranks = 1 << 30,
       .gather_group = 1,
       .gather_rows = 8,
       .gather_shrink = 2,
       .prefill_k_split = 1,
       .prefill_ctas_per_sm = 1,
       .prefill_stages = 3,
       .expand_ctas_per_sm = 1},
      {.decode_cluster = 0,
       .gather_max_token_ranks = 1 << 30,
       .gather_group = 2,
       .gather_rows = 8,
       .gather_shrink = 2,
       .prefill_mma = 1,
       .prefill_k_split = 8,
       .prefill_ctas_per_sm = 8,
       .prefill_stages = 4,
       .prefill_reduce = 1,
       .expand_ctas_per_sm = 16},
      {.decode_cluster = 0,
       .layer_pdl = 2,
       .gather_max_token_ranks = 1 << 30,
       .gather_group = 2,
       .gather_rows = 8,
       .gather_shrink = 1},
      {.decode_cluster = 0,
       .layer_pdl = 0,
       .gather_max_token_ranks = 1 << 30,
       .gather_group = 2,
       .gather_shrink = 2},
      {.decode_cluster = 0,
       .gather_max_token_ranks = 0,
       .prefill_mma = 1,
       .prefill_k_split = 2,
       .prefill_ctas_per_sm = 4,
       .prefill_stages = 4,
       .expand_ctas_per_sm = 2},
      {.prefill_mma = 2, .prefill_k_split = 8, .prefill_ctas_per_sm = 8, .prefill_reduce = 1},
      {.prefill_mma = 2,
       .prefill_k_split = 8,
       .prefill_ctas_per_sm = 8,
       .prefill_stages = 3,
       .prefill_reduce = 2},
      {.prefill_mma = 1},
      {.prefill_k_split = 8, .prefill_ctas_per_sm = 8, .prefill_reduce = 2, .prefill_sum = 2},
      {.prefill_mma = 1,
       .prefill_k_split = 4,
       .prefill_ctas_per_sm = 8,
       .prefill_reduce = 2,
       .prefill_sum = 2},
      {.decode_cluster = 2, .cluster_size = 1},
      {.decode_cluster = 2, .cluster_size = 2},
      {.decode_cluster = 2, .layer_pdl = 2, .cluster_size = 16}};
  for (LoraTuning t : shapes) {
    for (int limit : {0, 1 << 20}) {
      t.decode_max_tokens = limit;
      // The values that differ from the defaults, for the failure messages.
      std::string name;
      const auto defaults = kernels::planner::lora_tuning_values(LoraTuning{});
      const auto values = kernels::planner::lora_tuning_values(t);
      for (size_t i = 0; i < values.size(); ++i) {
        if (values[i].second != defaults[i].second) {
          name += " " + values[i].first + "=" + std::to_string(values[i].second);
        }
      }
      for (const LayerCase& c : linear_cases()) {
        if (c.dtype == DType::kF32) continue;
        const LayerData d = make_layer(c, rng);
        const Tensor got = run_linear(c, d, test::gpu(), stream, nullptr, 0.5f, t);
        const Tensor ref = run_linear(c, d, Device::cpu(), cpu);
        const double rtol = test::default_rtol(c.dtype);
        test::expect_matches(got, ref, stream, rtol, rtol * 2, case_name(c) + name);
      }
    }
  }
}

// The shrink output through PunicaWrapper::add_shrink; entries past each slot's rank and rows
// of base-only tokens must keep their sentinel.
Tensor run_shrink(const LayerCase& c, const LayerData& d, DType out_dtype, Device device,
                  const Stream& stream) {
  const int slices = static_cast<int>(c.widths.size());
  PunicaWrapper wrapper(c.max_loras, c.tokens, 1, device);
  wrapper.update_metadata(d.slots, {}, stream);
  const SlotRanks ranks = make_ranks(c, d, device, stream);
  const auto a = to_device(d.a, device, stream);
  const Tensor x = d.x.to(device, stream);
  Tensor sentinel = Tensor::empty({slices, c.tokens, c.max_rank}, DType::kF32);
  sentinel.fill_(7.0);
  Tensor out = sentinel.to(out_dtype).to(device, stream);
  wrapper.add_shrink(out, x, a, ranks, 0.75f, stream);
  return device.is_cpu() ? out : test::on_cpu(out, stream);
}

TEST(CudaLoraShrink, MatchesCpuWithFloatAndNativeOutputs) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(303);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  for (const LayerCase& c : linear_cases()) {
    for (bool f32_out : {true, false}) {
      const DType out_dtype = f32_out ? DType::kF32 : c.dtype;
      const LayerData d = make_layer(c, rng);
      const Tensor got = run_shrink(c, d, out_dtype, test::gpu(), stream);
      const Tensor ref = run_shrink(c, d, out_dtype, Device::cpu(), cpu);
      const double rtol = test::default_rtol(c.dtype);
      test::expect_matches(got, ref, stream, rtol, rtol,
                           case_name(c) + " out " + std::string(dtype_name(out_dtype)));
    }
  }
}

// Expand through PunicaWrapper::add_expand into a wider y at an offset.
Tensor run_expand(const LayerCase& c, const LayerData& d, const Tensor& in, int64_t offset,
                  bool add_inputs, Device device, const Stream& stream) {
  PunicaWrapper wrapper(c.max_loras, c.tokens, 1, device);
  wrapper.update_metadata(d.slots, {}, stream);
  const SlotRanks ranks = make_ranks(c, d, device, stream);
  const auto b = to_device(d.b, device, stream);
  const Tensor in_dev = in.to(device, stream);
  Tensor y = d.y0.clone().to(device, stream);
  wrapper.add_expand(y, in_dev, b, ranks, offset, add_inputs, stream);
  return device.is_cpu() ? y : test::on_cpu(y, stream);
}

TEST(CudaLoraExpand, MatchesCpuWithOffsetsAndOverwrite) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(404);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  for (LayerCase c : linear_cases()) {
    // Leave room in y for an offset: y0 is as wide as the slices plus the largest offset.
    for (int64_t offset : {int64_t{0}, int64_t{8}, int64_t{3}}) {
      for (bool add_inputs : {true, false}) {
        for (bool f32_in : {true, false}) {
          LayerData d = make_layer(c, rng);
          d.y0 = test::random_tensor({c.tokens, d.width + 8}, c.dtype, rng);
          const int slices = static_cast<int>(c.widths.size());
          const Tensor in = test::random_tensor({slices, c.tokens, c.max_rank},
                                                f32_in ? DType::kF32 : c.dtype, rng, 0.5f);
          const Tensor got = run_expand(c, d, in, offset, add_inputs, test::gpu(), stream);
          const Tensor ref = run_expand(c, d, in, offset, add_inputs, Device::cpu(), cpu);
          const double rtol = test::default_rtol(c.dtype);
          test::expect_matches(got, ref, stream, rtol, rtol * 2,
                               case_name(c) + " offset " + std::to_string(offset) +
                                   (add_inputs ? " add" : " overwrite") +
                                   (f32_in ? " f32-in" : " native-in"));
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(CudaBgmv, ShrinkAndExpandMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(505);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  for (const LayerCase& c : linear_cases()) {
    const LayerData d = make_layer(c, rng);
    const int slices = static_cast<int>(c.widths.size());
    Tensor results[2][2];  // [device][shrink, expand]
    for (int dev = 0; dev < 2; ++dev) {
      const Device device = dev == 0 ? test::gpu() : Device::cpu();
      const Stream& s = dev == 0 ? stream : cpu;
      const SlotRanks ranks = make_ranks(c, d, device, s);
      const Tensor mapping = test::int_tensor(d.slots).to(device, s);
      const auto a = to_device(d.a, device, s);
      const auto b = to_device(d.b, device, s);
      const Tensor x = d.x.to(device, s);
      Tensor mid = Tensor::zeros({slices, c.tokens, c.max_rank}, DType::kF32).to(device, s);
      Tensor y = d.y0.clone().to(device, s);
      kernels::ShrinkArgs sa;
      sa.dtype = c.dtype;
      sa.num_tokens = c.tokens;
      sa.hidden = c.hidden;
      sa.x = x.data_ptr();
      sa.x_row_stride = c.hidden;
      sa.num_slices = slices;
      for (int i = 0; i < slices; ++i) sa.lora_a[i] = a[i].data_ptr();
      sa.max_loras = c.max_loras;
      sa.max_rank = c.max_rank;
      sa.ranks = ranks.device().data<int32_t>();
      sa.scale = 1.0f;
      sa.out_dtype = DType::kF32;
      sa.out = mid.data_ptr();
      throw_if_error(test::bgmv_shrink_on(sa, mapping.data<int32_t>(), s));
      kernels::ExpandArgs ea;
      ea.dtype = c.dtype;
      ea.num_tokens = c.tokens;
      ea.in_dtype = DType::kF32;
      ea.in = mid.data_ptr();
      ea.num_slices = slices;
      for (int i = 0; i < slices; ++i) {
        ea.lora_b[i] = b[i].data_ptr();
        ea.slice_width[i] = c.widths[static_cast<size_t>(i)];
      }
      ea.max_loras = c.max_loras;
      ea.max_rank = c.max_rank;
      ea.ranks = ranks.device().data<int32_t>();
      ea.y = y.data_ptr();
      ea.y_row_stride = d.width;
      throw_if_error(test::bgmv_expand_on(ea, mapping.data<int32_t>(), s));
      results[dev][0] = dev == 0 ? test::on_cpu(mid, s) : mid;
      results[dev][1] = dev == 0 ? test::on_cpu(y, s) : y;
    }
    const double rtol = test::default_rtol(c.dtype);
    test::expect_matches(results[0][0], results[1][0], stream, rtol, rtol,
                         case_name(c) + " bgmv shrink");
    test::expect_matches(results[0][1], results[1][1], stream, rtol, rtol * 2,
                         case_name(c) + " bgmv expand");
  }
}

TEST(CudaLoraLogits, SampledRowsMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(606);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  const int seqs = 9;
  const int max_loras = 4;
  const int rank = 16;
  const int64_t hidden = 1024;
  const int64_t vocab = 32000;
  const auto sampler =
      test::make_slots(test::SlotDistribution::kUniform, seqs, max_loras, rng, 0.2);
  const auto tokens = test::make_slots(test::SlotDistribution::kUniform, 20, max_loras, rng, 0.2);
  const Tensor a = test::random_tensor({max_loras, rank, hidden}, DType::kBF16, rng, 0.03f);
  const Tensor b = test::random_tensor({max_loras, vocab, rank}, DType::kBF16, rng, 0.25f);
  const Tensor x = test::random_tensor({seqs, hidden}, DType::kBF16, rng);
  const Tensor y0 = test::random_tensor({seqs, vocab}, DType::kBF16, rng);
  Tensor out[2];
  for (int dev = 0; dev < 2; ++dev) {
    const Device device = dev == 0 ? test::gpu() : Device::cpu();
    const Stream& s = dev == 0 ? stream : cpu;
    PunicaWrapper wrapper(max_loras, 64, seqs, device);
    wrapper.update_metadata(tokens, sampler, s);
    SlotRanks ranks(1, max_loras, rank, device);
    for (int k = 0; k < max_loras; ++k) ranks.set(0, k, k == 2 ? 5 : rank, s);
    Tensor y = y0.clone().to(device, s);
    Tensor ws = Tensor::empty({seqs * rank}, DType::kF32, device);
    wrapper.add_lora_logits(y, x.to(device, s), a.to(device, s), b.to(device, s), ranks, 1.0f, ws,
                            s);
    out[dev] = dev == 0 ? test::on_cpu(y, s) : y;
  }
  test::expect_matches(out[0], out[1], stream, 1.6e-2, 3.2e-2, "logits");
}

// Capture the metadata build and one layer in a CUDA graph, write a new mapping into the
// metadata's device buffer, replay, and compare with the CPU result for the new mapping.
TEST(CudaGraph, ReplayAfterMappingChangeOnDevice) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(707);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  using D = test::SlotDistribution;
  const std::vector<LayerCase> cases = {
      {DType::kBF16, 16, 8, 16, 4096, {4096, 1024, 1024}, D::kUniform, 0.2, true},  // decode
      {DType::kBF16, 300, 8, 32, 1024, {1024}, D::kZipf, 0.1, true},                // split
      {DType::kF32, 40, 4, 8, 96, {40, 24}, D::kUniform, 0.2, true},                // generic
  };
  // The decode-sized case runs the cluster layer (mode 2), the per-token PDL pair (mode 0) and
  // the split kernels (mode 1): each must replay correctly.
  for (int mode : {2, 0, 1}) {
    LoraTuning tuning;
    if (mode == 1) tuning.gather_max_token_ranks = 0;
    tuning.decode_cluster = mode == 2 ? 2 : 0;
    for (const LayerCase& c : cases) {
      const LayerData d = make_layer(c, rng);
      const int slices = static_cast<int>(c.widths.size());
      PunicaWrapper wrapper(c.max_loras, c.tokens, 1, test::gpu());
      wrapper.set_lora_tuning(tuning);
      const SlotRanks ranks = make_ranks(c, d, test::gpu(), stream);
      const auto a = to_device(d.a, test::gpu(), stream);
      const auto b = to_device(d.b, test::gpu(), stream);
      const Tensor x = d.x.to(test::gpu(), stream);
      const Tensor y0 = d.y0.to(test::gpu(), stream);
      Tensor y = y0.clone(stream);
      Tensor ws = Tensor::empty({slices * static_cast<int64_t>(c.tokens) * c.max_rank}, DType::kF32,
                                test::gpu());
      LoraBatchMeta& meta = wrapper.token_meta();
      Tensor mapping_view = meta.mapping_buffer().narrow(0, 0, c.tokens);
      auto step = [&]() {
        meta.prepare_from_buffer(c.tokens, false, stream);
        wrapper.add_lora_linear(y, x, a, b, ranks, 1.0f, ws, stream);
      };
      // Warm-up outside the capture (first launches set kernel attributes).
      mapping_view.copy_from(test::int_tensor(d.slots), stream);
      step();
      kernels::cuda::Graph graph;
      graph.begin_capture(stream.handle());
      step();
      graph.end_capture();
      // A different mapping, written on the device; y reset to y0; one replay.
      LayerData d2 = d;
      d2.slots = test::make_slots(D::kSkewed, c.tokens, c.max_loras, rng, 0.25);
      d2.slots[0] = 0;  // at least one LoRA token: the captured step assumed so
      mapping_view.copy_from(test::int_tensor(d2.slots), stream);
      y.copy_from(y0, stream);
      graph.replay(stream.handle());
      const Tensor got = test::on_cpu(y, stream);
      const Tensor ref = run_linear(c, d2, Device::cpu(), cpu, nullptr, 1.0f);
      const double rtol = test::default_rtol(c.dtype);
      test::expect_matches(got, ref, stream, rtol, rtol * 2,
                           case_name(c) + " graph replay, decode mode " + std::to_string(mode));
    }
  }
}

// The wrapper marks its metadata settled (LoraMetaView::settled: kernels may read it before
// their griddepcontrol.wait) only once an op has been enqueued on the stream it was built on:
// an op on another stream orders nothing on the build's stream.
TEST(CudaLoraLinear, MetadataSettlesOnlyOnTheBuildStream) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(809);
  const Stream build = Stream::create(test::gpu());
  const Stream other = Stream::create(test::gpu());
  const LayerCase c{DType::kBF16, 16,  8, 16, 256, {256}, test::SlotDistribution::kUniform,
                    0.1,          true};
  const LayerData l = make_layer(c, rng);
  PunicaWrapper wrapper(c.max_loras, c.tokens, 1, test::gpu());
  const SlotRanks ranks = make_ranks(c, l, test::gpu(), build);
  const std::vector<Tensor> a = to_device(l.a, test::gpu(), build);
  const std::vector<Tensor> b = to_device(l.b, test::gpu(), build);
  const Tensor x = l.x.to(test::gpu(), build);
  Tensor y = l.y0.clone().to(test::gpu(), build);
  Tensor ws = Tensor::empty({int64_t{c.tokens} * c.max_rank}, DType::kF32, test::gpu());
  build.synchronize();
  wrapper.update_metadata(l.slots, {}, build);
  EXPECT_FALSE(wrapper.token_meta().view().settled);
  build.synchronize();
  wrapper.add_lora_linear(y, x, a, b, ranks, 1.0f, ws, other);
  EXPECT_FALSE(wrapper.token_meta().view().settled);
  other.synchronize();
  wrapper.add_lora_linear(y, x, a, b, ranks, 1.0f, ws, build);
  EXPECT_TRUE(wrapper.token_meta().view().settled);
  wrapper.update_metadata(l.slots, {}, build);
  EXPECT_FALSE(wrapper.token_meta().view().settled);
  build.synchronize();
}

// Layers back to back in one stream, as in a model: with layer_pdl each layer's first kernel is
// resident before the kernel ahead of it has finished and waits in-kernel. A ping-pong chain in
// which every layer's x is the y the layer before it wrote, the metadata rebuilt between two
// layers (its kernel then directly precedes a layer), and the path switched from layer to layer
// (the per-token pair, the cluster layer, the split path's plain launches): run eagerly and in
// five graph replays, compared with the CPU applying the same layers in order. A layer that read
// x, y, its scratch or the metadata before the kernel ahead of it finished would see old values;
// from the second layer after each build the layers read the (settled) metadata and weights
// before their wait. 16 tokens (the pair's FMA shrink) and 64 (its tensor-core shrink); 320
// tokens: every layer on the split path, the prefill shrink letting the layer's expand launch
// under PDL at its start, that expand reading y before its wait.
class ChainedLayers : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(CudaLoraLinear, ChainedLayers, ::testing::Values(16, 64, 320));
TEST_P(ChainedLayers, WithProgrammaticLaunchMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(808);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  using D = test::SlotDistribution;
  constexpr int kLayers = 8;
  constexpr int64_t kHidden = 1024;  // x and y rows alike: each layer's y is the next one's x
  const LayerCase c{DType::kBF16, GetParam(), 8, 16, kHidden, {kHidden}, D::kUniform, 0.1, true};
  std::vector<LayerData> layers;  // weights and ranks per layer; layer 0's slots, x and y0
  for (int i = 0; i < kLayers; ++i) layers.push_back(make_layer(c, rng));
  const std::vector<int32_t> slots2 = test::make_slots(D::kZipf, c.tokens, c.max_loras, rng, 0.2);
  struct PathConfig {
    int cluster;  // decode_cluster
    int limit;    // decode_max_tokens
    const char* name;
  };
  // Every pair of neighbours: pair -> pair, pair -> cluster, cluster -> pair, metadata ->
  // cluster, cluster -> cluster, split -> pair (the split path's plain launches).
  const PathConfig decode_configs[kLayers] = {{0, 1 << 20, "gather"},  {0, 1 << 20, "gather"},
                                              {2, 1 << 20, "cluster"}, {0, 1 << 20, "gather"},
                                              {2, 1 << 20, "cluster"}, {2, 1 << 20, "cluster"},
                                              {0, 0, "split"},         {0, 1 << 20, "gather"}};
  const PathConfig split{0, 0, "split"};
  const bool prefill = c.tokens > 64;
  auto config = [&](int i) { return prefill ? split : decode_configs[i]; };

  struct Chain {
    PunicaWrapper wrapper;
    std::vector<SlotRanks> ranks;
    std::vector<std::vector<Tensor>> a, b;
    Tensor buf[2];
    Tensor ws;
  };
  auto make_chain = [&](Device device, const Stream& s) {
    Chain ch{PunicaWrapper(c.max_loras, c.tokens, 1, device), {}, {}, {}, {}, {}};
    for (const LayerData& l : layers) {
      ch.ranks.push_back(make_ranks(c, l, device, s));
      ch.a.push_back(to_device(l.a, device, s));
      ch.b.push_back(to_device(l.b, device, s));
    }
    ch.buf[0] = layers[0].x.clone().to(device, s);  // to() on the CPU would alias x
    ch.buf[1] = layers[0].y0.clone().to(device, s);
    ch.ws = Tensor::empty({int64_t{c.tokens} * c.max_rank}, DType::kF32, device);
    return ch;
  };
  // Layer i adds LoRA_i(buf[i % 2]) into buf[(i + 1) % 2]; the mapping changes before layer 4.
  auto run_layers = [&](Chain& ch, const Stream& s, const std::function<void(int)>& set_mapping) {
    for (int i = 0; i < kLayers; ++i) {
      if (i == 0 || i == 4) set_mapping(i);
      LoraTuning t;
      t.decode_cluster = config(i).cluster;
      t.layer_pdl = 2;  // every layer's first kernel with PDL, whatever its size
      t.decode_max_tokens = config(i).limit;
      ch.wrapper.set_lora_tuning(t);
      if (s.device().is_cuda()) {
        EXPECT_EQ(ch.wrapper.lora_linear_path(ch.buf[(i + 1) % 2], ch.buf[i % 2], ch.a[i], ch.b[i],
                                              ch.ranks[i], ch.ws),
                  config(i).name)
            << "layer " << i;
      }
      ch.wrapper.add_lora_linear(ch.buf[(i + 1) % 2], ch.buf[i % 2], ch.a[i], ch.b[i], ch.ranks[i],
                                 0.5f, ch.ws, s);
    }
  };

  Chain ref = make_chain(Device::cpu(), cpu);
  run_layers(ref, cpu, [&](int i) {
    ref.wrapper.update_metadata(i == 0 ? layers[0].slots : slots2, {}, cpu);
  });

  Chain gpu = make_chain(test::gpu(), stream);
  const Tensor map1 = test::int_tensor(layers[0].slots).to(test::gpu(), stream);
  const Tensor map2 = test::int_tensor(slots2).to(test::gpu(), stream);
  LoraBatchMeta& meta = gpu.wrapper.token_meta();
  Tensor mapping_view = meta.mapping_buffer().narrow(0, 0, c.tokens);
  auto set_mapping = [&](int i) {
    mapping_view.copy_from(i == 0 ? map1 : map2, stream);  // device to device: capturable
    meta.prepare_from_buffer(c.tokens, false, stream);
  };
  const Tensor start[2] = {gpu.buf[0].clone(stream), gpu.buf[1].clone(stream)};
  auto check = [&](const std::string& what) {
    for (int k = 0; k < 2; ++k) {
      test::expect_matches(test::on_cpu(gpu.buf[k], stream), ref.buf[k], stream, 2.4e-2, 4.8e-2,
                           what + " buffer " + std::to_string(k));
    }
  };
  run_layers(gpu, stream, set_mapping);
  check("eager");
  // Replays launch the kernels back to back (no host gaps between layers): several of them,
  // each from the starting values.
  kernels::cuda::Graph g;
  g.begin_capture(stream.handle());
  run_layers(gpu, stream, set_mapping);
  g.end_capture();
  for (int r = 0; r < 5; ++r) {
    gpu.buf[0].copy_from(start[0], stream);
    gpu.buf[1].copy_from(start[1], stream);
    g.replay(stream.handle());
    check("graph replay " + std::to_string(r));
  }
}

}  // namespace
}  // namespace loraplex
