// Every LoRA linear kind of vLLM, on the CPU at tensor-parallel sizes 1, 2 and 4 (in-process
// ranks), on one GPU and over NCCL on two GPUs, against base + sum of (x A^T) B^T computed in
// double directly from the full weights, and fully sharded against not fully sharded.

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>

#include "layers/layer_test_util.h"
#include "loraplex/core/device.h"
#include "loraplex/layers/lora_linear.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

using test::Backend;

constexpr int kMaxLoras = 4;
constexpr int kMaxRank = 16;
constexpr int kTokens = 37;

// A full (unsharded) problem: base weights, adapters and inputs.
struct Problem {
  LinearSpec spec;
  std::vector<Tensor> weights;  // per output slice [size, in]
  std::vector<Tensor> biases;   // per output slice [size] or empty
  Tensor x;                     // [tokens, in]
  std::vector<int32_t> slots;
  // The adapters installed in order (a slot may be installed twice: the last one counts).
  std::vector<std::pair<int, std::vector<LoraSliceWeights>>> installs;
};

int64_t slice_out(const LinearSpec& spec, int lora_slice) {
  if (!spec.fused_lora) return spec.outputs[static_cast<size_t>(lora_slice)].size;
  int64_t total = 0;
  for (const OutputSlice& o : spec.outputs) total += o.size;
  return total;
}

int num_lora_slices(const LinearSpec& spec) {
  return spec.fused_lora ? 1 : static_cast<int>(spec.outputs.size());
}

std::vector<LoraSliceWeights> make_adapter(const LinearSpec& spec, const std::vector<int>& ranks,
                                           DType dtype, std::mt19937_64& rng) {
  std::vector<LoraSliceWeights> slices;
  for (int s = 0; s < num_lora_slices(spec); ++s) {
    const int r = ranks[static_cast<size_t>(s)];
    if (r == 0) {
      slices.push_back({});
      continue;
    }
    slices.push_back({test::random_tensor({r, spec.in_features}, dtype, rng, 0.5f),
                      test::random_tensor({slice_out(spec, s), r}, dtype, rng, 0.2f)});
  }
  return slices;
}

// Slot 0 at max rank; slot 1 installed twice (rank 9 then ranks 5, 7, ...); slot 2 rank 3 with
// its first slice untargeted when there are several; slot 3 never installed (base only).
Problem make_problem(LinearSpec spec, bool with_bias, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.spec = std::move(spec);
  const DType dt = p.spec.dtype;
  for (const OutputSlice& o : p.spec.outputs) {
    p.weights.push_back(test::random_tensor({o.size, p.spec.in_features}, dt, rng, 0.5f));
    if (with_bias) p.biases.push_back(test::random_tensor({o.size}, dt, rng));
  }
  p.x = test::random_tensor({kTokens, p.spec.in_features}, dt, rng);
  p.slots = test::mixed_slots(kTokens, kMaxLoras, rng);
  const int n = num_lora_slices(p.spec);
  std::vector<int> r0(static_cast<size_t>(n), kMaxRank);
  std::vector<int> r1_first(static_cast<size_t>(n), 9);
  std::vector<int> r1(static_cast<size_t>(n));
  std::vector<int> r2(static_cast<size_t>(n), 3);
  for (int s = 0; s < n; ++s) r1[static_cast<size_t>(s)] = 5 + 2 * s;
  if (n > 1) r2[0] = 0;
  p.installs.push_back({0, make_adapter(p.spec, r0, dt, rng)});
  p.installs.push_back({1, make_adapter(p.spec, r1_first, dt, rng)});
  p.installs.push_back({2, make_adapter(p.spec, r2, dt, rng)});
  p.installs.push_back({1, make_adapter(p.spec, r1, dt, rng)});
  return p;
}

int64_t full_width(const LinearSpec& spec) {
  int64_t w = 0;
  for (const OutputSlice& o : spec.outputs) w += o.size;
  return w;
}

// The reference: base (+ bias) + each token's adapter, in double, over the full output.
std::vector<double> reference(const Problem& p) {
  const int64_t width = full_width(p.spec);
  std::vector<double> y(static_cast<size_t>(kTokens * width), 0.0);
  int64_t off = 0;
  for (size_t o = 0; o < p.spec.outputs.size(); ++o) {
    const std::vector<double> base = test::xwt_double(p.x, p.weights[o]);
    const int64_t n = p.spec.outputs[o].size;
    const std::vector<double> bias =
        p.biases.empty() ? std::vector<double>() : p.biases[o].to_double_vector();
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t j = 0; j < n; ++j) {
        y[t * width + off + j] = base[t * n + j] + (bias.empty() ? 0.0 : bias[j]);
      }
    }
    off += n;
  }
  std::map<int, std::vector<LoraSliceWeights>> final_adapters;
  for (const auto& [slot, slices] : p.installs) final_adapters[slot] = slices;
  for (const auto& [slot, slices] : final_adapters) {
    int64_t col = 0;
    for (size_t s = 0; s < slices.size(); ++s) {
      const int64_t n = slice_out(p.spec, static_cast<int>(s));
      if (slices[s].a.defined()) {
        test::add_lora_double(y, width, col, p.x, slices[s].a, slices[s].b, p.slots, slot);
      }
      col += n;
    }
  }
  return y;
}

// The columns of the full output that rank `rank` of `tp` holds, by vLLM's sharding rule:
// a slice of `units` heads splits into g = min(tp, units) shards, shard q on ranks
// q * tp / g ... (replicated when there are fewer heads than ranks).
std::vector<int64_t> local_columns(const LinearSpec& spec, int tp, int rank) {
  std::vector<int64_t> cols;
  int64_t off = 0;
  for (const OutputSlice& o : spec.outputs) {
    const int64_t units = o.units == 0 ? o.size : o.units;
    const int64_t g = std::min<int64_t>(tp, units);
    const int64_t q = rank / (tp / g);
    const int64_t local = o.size / g;
    for (int64_t j = 0; j < local; ++j) cols.push_back(off + q * local + j);
    off += o.size;
  }
  return cols;
}

struct RunOptions {
  Backend backend = Backend::kCpu;
  int tp = 1;
  bool fully_sharded = false;
  // LoraLinear::forward_fused over every slot, its expand added here from the returned
  // FusedLoraExpand (in double, from the layer's B and ranks): what a consumer op must see.
  bool fused = false;
};

// forward_fused's output [tokens, output_width()] with the expand it describes applied, written
// from FusedLoraExpand's definition.
std::vector<double> fused_output(LoraLinear& layer, const Tensor& x, const PunicaWrapper& punica,
                                 const std::vector<int32_t>& slots, const Stream& stream) {
  const int num_slots = layer.config().max_loras;
  const int64_t width = layer.fused_row_width(num_slots);
  Tensor y = Tensor::empty({x.size(0), width}, layer.spec().dtype, layer.device());
  const kernels::FusedLoraExpand e = layer.forward_fused(x, y, punica, num_slots, stream);
  stream.synchronize();
  const std::vector<double> rows = test::values_of(y);
  const int64_t out = layer.output_width();
  EXPECT_EQ(e.num_slots, num_slots);
  EXPECT_EQ(e.shrink_row_stride, width);
  std::vector<double> got(static_cast<size_t>(x.size(0) * out));
  for (int64_t t = 0; t < x.size(0); ++t) {
    for (int64_t j = 0; j < out; ++j) {
      got[static_cast<size_t>(t * out + j)] = rows[static_cast<size_t>(t * width + j)];
    }
    const int k = slots[static_cast<size_t>(t)];
    if (k < 0) continue;
    for (int s = 0; s < e.num_slices; ++s) {
      const int r = layer.lora_rank(k, s);
      const std::vector<double> b = test::values_of(layer.lora_b(s).select(0, k));
      const int64_t b_cols = layer.lora_b(s).size(2);
      for (int64_t j = 0; j < e.width[s]; ++j) {
        double acc = 0.0;
        for (int i = 0; i < r; ++i) {
          acc += rows[static_cast<size_t>(t * width + out + k * e.slot_cols + s * e.max_rank + i)] *
                 b[static_cast<size_t>(j * b_cols + i)];
        }
        got[static_cast<size_t>(t * out + e.offset[s] + j)] += acc;
      }
    }
  }
  return got;
}

// Runs the layer on every rank and returns the full output [tokens, full width]; checks that
// ranks holding the same columns agree exactly.
std::vector<double> run_layer(const Problem& p, const RunOptions& opt) {
  std::vector<std::vector<double>> outputs(static_cast<size_t>(opt.tp));
  test::run_ranks(opt.backend, opt.tp, [&](int rank, Communicator* comm) {
    const Device device = test::backend_device(opt.backend, rank);
    const Stream stream = Stream::default_for(device);
    LoraConfig cfg{kMaxLoras, kMaxRank, p.spec.dtype, opt.fully_sharded};
    PunicaWrapper punica(kMaxLoras, kTokens, 4, device);
    punica.update_metadata(p.slots, {}, stream);
    LoraLinear layer(p.spec, cfg, comm, device, kTokens);
    layer.load_base(p.weights, p.biases);
    for (const auto& [slot, slices] : p.installs) layer.set_lora(slot, slices);
    Tensor x = p.x;
    if (p.spec.style == ParallelStyle::kRow && p.spec.input_is_parallel) {
      const int64_t w = p.spec.in_features / layer.tp_size();
      x = p.x.narrow(1, rank * w, w).contiguous();
    }
    if (opt.fused) {
      outputs[static_cast<size_t>(rank)] =
          fused_output(layer, x.to(device, stream), punica, p.slots, stream);
      return;
    }
    const Tensor y = layer.forward(x.to(device, stream), punica, stream);
    stream.synchronize();
    outputs[static_cast<size_t>(rank)] = test::values_of(y);
  });
  const bool local_output =
      p.spec.style == ParallelStyle::kColumn && !p.spec.gather_output && opt.tp > 1;
  if (!local_output) {
    for (int r = 1; r < opt.tp; ++r) {
      EXPECT_EQ(outputs[static_cast<size_t>(r)], outputs[0]) << "rank " << r << " differs";
    }
    return outputs[0];
  }
  const int64_t width = full_width(p.spec);
  std::vector<double> full(static_cast<size_t>(kTokens * width), 0.0);
  std::vector<int> seen(static_cast<size_t>(width), 0);
  for (int r = 0; r < opt.tp; ++r) {
    const std::vector<int64_t> cols = local_columns(p.spec, opt.tp, r);
    const auto& out = outputs[static_cast<size_t>(r)];
    const auto lw = static_cast<int64_t>(cols.size());
    EXPECT_EQ(static_cast<int64_t>(out.size()), kTokens * lw);
    for (int64_t j = 0; j < lw; ++j) {
      const int64_t c = cols[static_cast<size_t>(j)];
      for (int64_t t = 0; t < kTokens; ++t) {
        const double v = out[static_cast<size_t>(t * lw + j)];
        if (seen[static_cast<size_t>(c)] > 0) {
          EXPECT_EQ(full[static_cast<size_t>(t * width + c)], v)
              << "replicated column " << c << " differs on rank " << r;
        }
        full[static_cast<size_t>(t * width + c)] = v;
      }
      ++seen[static_cast<size_t>(c)];
    }
  }
  for (int64_t c = 0; c < width; ++c) EXPECT_GT(seen[static_cast<size_t>(c)], 0) << "column " << c;
  return full;
}

double rtol_of(DType dt) { return dt == DType::kF32 ? 1e-4 : test::default_rtol(dt); }

void expect_near_reference(const std::vector<double>& got, const std::vector<double>& ref, DType dt,
                           const std::string& what) {
  // Absolute slack scaled by the output magnitude covers cancellation in long sums.
  const double atol = (dt == DType::kF32 ? 2e-5 : 4e-3) * test::max_abs(ref);
  ASSERT_EQ(got.size(), ref.size()) << what;
  EXPECT_LE(test::tolerance_ratio(got, ref, rtol_of(dt), atol), 1.0) << what;
}

// Two runs of the same problem that differ only in how the work is split (tensor-parallel
// size, fully sharded or not, device): equal up to rounding (summation order; for 16-bit
// dtypes the partial results rounded to the dtype before the reduce).
void expect_same_within_rounding(const std::vector<double>& got, const std::vector<double>& want,
                                 const std::vector<double>& ref, DType dt,
                                 const std::string& what) {
  const bool f32 = dt == DType::kF32;
  const double atol = (f32 ? 2e-6 : 4e-3) * test::max_abs(ref);
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_LE(test::tolerance_ratio(got, want, f32 ? 2e-5 : rtol_of(dt), atol), 1.0) << what;
}

// The layer at size `tp` equals the double reference and (tp > 1) the single-rank layer.
void check_kind(const LinearSpec& spec, Backend backend, int tp, bool bias = true,
                bool fully_sharded = false) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  const Problem p = make_problem(spec, bias, 1234 + tp);
  const std::vector<double> ref = reference(p);
  const std::string name = spec.kind + " on " + test::backend_name(backend) + " tp" +
                           std::to_string(tp) + (fully_sharded ? " fully sharded" : "");
  const std::vector<double> got = run_layer(p, {backend, tp, fully_sharded});
  expect_near_reference(got, ref, spec.dtype, name + " vs double reference");
  if (tp > 1 || backend != Backend::kCpu) {
    const Backend single = backend == Backend::kNccl ? Backend::kCuda : backend;
    const std::vector<double> one = run_layer(p, {single, 1, false});
    expect_same_within_rounding(got, one, ref, spec.dtype, name + " vs the unsharded layer");
  }
}

// The fused path (base GEMM with the shrink as extra rows, the expand left to the consumer)
// equals the reference and the layer's own forward at size `tp`.
void check_fused(const LinearSpec& spec, Backend backend, int tp) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  const Problem p = make_problem(spec, true, 4321 + tp);
  const std::vector<double> ref = reference(p);
  const std::string name =
      spec.kind + " fused on " + test::backend_name(backend) + " tp" + std::to_string(tp);
  const std::vector<double> fused = run_layer(p, {backend, tp, false, true});
  expect_near_reference(fused, ref, spec.dtype, name + " vs double reference");
  const std::vector<double> plain = run_layer(p, {backend, tp, false, false});
  expect_same_within_rounding(fused, plain, ref, spec.dtype, name + " vs forward");
}

// Fully sharded equals not fully sharded (and both the reference) at size `tp`.
void check_sharded(const LinearSpec& spec, Backend backend, int tp) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, tp));
  const Problem p = make_problem(spec, true, 777 + tp);
  const std::vector<double> ref = reference(p);
  const std::vector<double> plain = run_layer(p, {backend, tp, false});
  const std::vector<double> sharded = run_layer(p, {backend, tp, true});
  const std::string name =
      spec.kind + " on " + test::backend_name(backend) + " tp" + std::to_string(tp);
  expect_near_reference(sharded, ref, spec.dtype, name + " fully sharded vs double reference");
  expect_same_within_rounding(sharded, plain, ref, spec.dtype,
                              name + " fully sharded vs not fully sharded");
}

constexpr DType kF32 = DType::kF32;

LinearSpec replicated() { return LinearSpec::replicated(48, 40, kF32); }
LinearSpec column() { return LinearSpec::column(64, 96, kF32); }
LinearSpec column_gathered() { return LinearSpec::column(64, 96, kF32, /*gather_output=*/true); }
LinearSpec column_fused() { return LinearSpec::column_fused_lora(64, {48, 48}, kF32); }
LinearSpec merged_gate_up() { return LinearSpec::merged_column(64, {80, 80}, kF32); }
LinearSpec merged_variable() { return LinearSpec::merged_column(64, {64, 32, 32, 16}, kF32); }
// 8 query heads and 2 KV heads of size 8: at tp 4 each KV head is replicated on two ranks.
LinearSpec qkv_fused() { return LinearSpec::qkv(64, 8, 8, 2, kF32, QkvLora::kFusedLora); }
LinearSpec merged_qkv() { return LinearSpec::qkv(64, 8, 8, 2, kF32, QkvLora::kPerSliceLora); }
LinearSpec merged_qkv_gathered() {
  return LinearSpec::qkv(64, 8, 8, 2, kF32, QkvLora::kPerSliceLora, /*gather_output=*/true);
}
LinearSpec row() { return LinearSpec::row(96, 64, kF32); }
LinearSpec row_full_input() { return LinearSpec::row(96, 64, kF32, /*input_is_parallel=*/false); }

TEST(ReplicatedLoraLinear, MatchesDoubleReference_tp1) {
  check_kind(replicated(), Backend::kCpu, 1);
}
TEST(ReplicatedLoraLinear, MatchesDoubleReference_tp2) {
  check_kind(replicated(), Backend::kCpu, 2);
}
TEST(ReplicatedLoraLinear, MatchesDoubleReference_tp4) {
  check_kind(replicated(), Backend::kCpu, 4);
}
TEST(ReplicatedLoraLinear, Bf16MatchesDoubleReference_tp1) {
  check_kind(LinearSpec::replicated(48, 40, DType::kBF16), Backend::kCpu, 1);
}
TEST(ReplicatedLoraLinear, Cuda_tp1) { check_kind(replicated(), Backend::kCuda, 1); }

TEST(ColumnParallelLoraLinear, MatchesDoubleReference_tp1) {
  check_kind(column(), Backend::kCpu, 1);
}
TEST(ColumnParallelLoraLinear, MatchesDoubleReference_tp2) {
  check_kind(column(), Backend::kCpu, 2);
}
TEST(ColumnParallelLoraLinear, MatchesDoubleReference_tp4) {
  check_kind(column(), Backend::kCpu, 4);
}
TEST(ColumnParallelLoraLinear, GatherOutput_tp2) {
  check_kind(column_gathered(), Backend::kCpu, 2);
}
TEST(ColumnParallelLoraLinear, GatherOutput_tp4) {
  check_kind(column_gathered(), Backend::kCpu, 4);
}
TEST(ColumnParallelLoraLinear, FusedLoraOverMergedBase_tp1) {
  check_kind(column_fused(), Backend::kCpu, 1);
}
TEST(ColumnParallelLoraLinear, FusedLoraOverMergedBase_tp2) {
  check_kind(column_fused(), Backend::kCpu, 2);
}
TEST(ColumnParallelLoraLinear, FusedLoraOverMergedBase_tp4) {
  check_kind(column_fused(), Backend::kCpu, 4);
}
TEST(ColumnParallelLoraLinear, Cuda_tp1) { check_kind(column(), Backend::kCuda, 1); }
TEST(ColumnParallelLoraLinear, Nccl_tp2) { check_kind(column(), Backend::kNccl, 2); }
TEST(ColumnParallelLoraLinear, NcclGatherOutput_tp2) {
  check_kind(column_gathered(), Backend::kNccl, 2);
}

TEST(MergedColumnLoraLinear, GateUpMatchesDoubleReference_tp1) {
  check_kind(merged_gate_up(), Backend::kCpu, 1);
}
TEST(MergedColumnLoraLinear, GateUpMatchesDoubleReference_tp2) {
  check_kind(merged_gate_up(), Backend::kCpu, 2);
}
TEST(MergedColumnLoraLinear, GateUpMatchesDoubleReference_tp4) {
  check_kind(merged_gate_up(), Backend::kCpu, 4);
}
TEST(MergedColumnLoraLinear, VariableSlicesMatchDoubleReference_tp1) {
  check_kind(merged_variable(), Backend::kCpu, 1);
}
TEST(MergedColumnLoraLinear, VariableSlicesMatchDoubleReference_tp2) {
  check_kind(merged_variable(), Backend::kCpu, 2);
}
TEST(MergedColumnLoraLinear, VariableSlicesMatchDoubleReference_tp4) {
  check_kind(merged_variable(), Backend::kCpu, 4);
}
TEST(MergedColumnLoraLinear, VariableSlicesAcceptSplitFusedLora_tp2) {
  // vLLM's variable-slice layer also takes one fused LoRA: A shared, B split by slice. Slot 3
  // gets one, and must behave as (x A^T) B^T over the whole output.
  Problem p = make_problem(merged_variable(), false, 99);
  std::mt19937_64 rng(5);
  const Tensor a = test::random_tensor({6, 64}, kF32, rng, 0.5f);
  const Tensor b = test::random_tensor({144, 6}, kF32, rng, 0.2f);
  std::vector<double> fused_ref = reference(p);
  test::add_lora_double(fused_ref, 144, 0, p.x, a, b, p.slots, 3);
  p.installs.push_back({3, split_fused_lora(a, b, {64, 32, 32, 16})});
  expect_near_reference(run_layer(p, {Backend::kCpu, 2, false}), fused_ref, kF32,
                        "split fused LoRA");
}
TEST(MergedColumnLoraLinear, Cuda_tp1) { check_kind(merged_gate_up(), Backend::kCuda, 1); }
TEST(MergedColumnLoraLinear, Nccl_tp2) { check_kind(merged_variable(), Backend::kNccl, 2); }

TEST(QkvParallelLoraLinear, FusedLoraMatchesDoubleReference_tp1) {
  check_kind(qkv_fused(), Backend::kCpu, 1);
}
TEST(QkvParallelLoraLinear, FusedLoraMatchesDoubleReference_tp2) {
  check_kind(qkv_fused(), Backend::kCpu, 2);
}
TEST(QkvParallelLoraLinear, ReplicatedKvHeads_tp4) { check_kind(qkv_fused(), Backend::kCpu, 4); }
TEST(QkvParallelLoraLinear, Cuda_tp1) { check_kind(qkv_fused(), Backend::kCuda, 1); }
TEST(QkvParallelLoraLinear, Nccl_tp2) { check_kind(qkv_fused(), Backend::kNccl, 2); }

TEST(MergedQkvLoraLinear, MatchesDoubleReference_tp1) {
  check_kind(merged_qkv(), Backend::kCpu, 1);
}
TEST(MergedQkvLoraLinear, MatchesDoubleReference_tp2) {
  check_kind(merged_qkv(), Backend::kCpu, 2);
}
TEST(MergedQkvLoraLinear, ReplicatedKvHeads_tp4) { check_kind(merged_qkv(), Backend::kCpu, 4); }
TEST(MergedQkvLoraLinear, GatherOutputWithReplicatedKvHeads_tp4) {
  check_kind(merged_qkv_gathered(), Backend::kCpu, 4);
}
TEST(MergedQkvLoraLinear, Bf16MatchesDoubleReference_tp2) {
  check_kind(LinearSpec::qkv(64, 8, 8, 2, DType::kBF16), Backend::kCpu, 2);
}
TEST(MergedQkvLoraLinear, Cuda_tp1) { check_kind(merged_qkv(), Backend::kCuda, 1); }
TEST(MergedQkvLoraLinear, Nccl_tp2) { check_kind(merged_qkv(), Backend::kNccl, 2); }

TEST(RowParallelLoraLinear, MatchesDoubleReference_tp1) { check_kind(row(), Backend::kCpu, 1); }
TEST(RowParallelLoraLinear, MatchesDoubleReference_tp2) { check_kind(row(), Backend::kCpu, 2); }
TEST(RowParallelLoraLinear, MatchesDoubleReference_tp4) { check_kind(row(), Backend::kCpu, 4); }
TEST(RowParallelLoraLinear, FullInputIsSplit_tp4) {
  check_kind(row_full_input(), Backend::kCpu, 4);
}
TEST(RowParallelLoraLinear, Bf16MatchesDoubleReference_tp2) {
  check_kind(LinearSpec::row(96, 64, DType::kBF16), Backend::kCpu, 2);
}
TEST(RowParallelLoraLinear, Cuda_tp1) { check_kind(row(), Backend::kCuda, 1); }
TEST(RowParallelLoraLinear, Nccl_tp2) { check_kind(row(), Backend::kNccl, 2); }

TEST(ReplicatedLoraLinear, Fused_tp1) { check_fused(replicated(), Backend::kCpu, 1); }
TEST(ColumnParallelLoraLinear, Fused_tp2) { check_fused(column(), Backend::kCpu, 2); }
TEST(ColumnParallelLoraLinear, FusedPathFusedLoraOverMergedBase_tp2) {
  check_fused(column_fused(), Backend::kCpu, 2);
}
TEST(MergedColumnLoraLinear, FusedGateUp_tp1) { check_fused(merged_gate_up(), Backend::kCpu, 1); }
TEST(MergedColumnLoraLinear, FusedVariableSlices_tp4) {
  check_fused(merged_variable(), Backend::kCpu, 4);
}
TEST(MergedQkvLoraLinear, Fused_tp1) { check_fused(merged_qkv(), Backend::kCpu, 1); }
TEST(MergedQkvLoraLinear, FusedReplicatedKvHeads_tp4) {
  check_fused(merged_qkv(), Backend::kCpu, 4);
}
TEST(QkvParallelLoraLinear, Fused_tp2) { check_fused(qkv_fused(), Backend::kCpu, 2); }
TEST(RowParallelLoraLinear, Fused_tp1) { check_fused(row(), Backend::kCpu, 1); }
TEST(RowParallelLoraLinear, FusedShrinkInTheAllReduce_tp4) { check_fused(row(), Backend::kCpu, 4); }
TEST(RowParallelLoraLinear, FusedBf16_tp2) {
  check_fused(LinearSpec::row(96, 64, DType::kBF16), Backend::kCpu, 2);
}
TEST(MergedQkvLoraLinear, FusedCuda_tp1) { check_fused(merged_qkv(), Backend::kCuda, 1); }
TEST(RowParallelLoraLinear, FusedNccl_tp2) { check_fused(row(), Backend::kNccl, 2); }
TEST(LoraLinearFused, RefusedWhereItCannotRun) {
  LoraConfig sharded{kMaxLoras, kMaxRank, kF32, true};
  LoraLinear a(column(), sharded, nullptr, Device::cpu(), kTokens);
  EXPECT_FALSE(a.can_fuse());
  LoraConfig plain{kMaxLoras, kMaxRank, kF32, false};
  LoraLinear b(column(), plain, nullptr, Device::cpu(), kTokens);
  EXPECT_TRUE(b.can_fuse());
  PunicaWrapper punica(kMaxLoras, kTokens, 4, Device::cpu());
  std::vector<int32_t> slots(3, 0);
  punica.update_metadata(slots, {}, Stream());
  b.load_base({Tensor::zeros({96, 64}, kF32)});
  Tensor x = Tensor::zeros({3, 64}, kF32);
  Tensor y = Tensor::empty({3, b.fused_row_width(kMaxLoras + 1)}, kF32);
  EXPECT_THROW(b.forward_fused(x, y, punica, kMaxLoras + 1, Stream()), Error);
  Tensor narrow_y = Tensor::empty({3, 96}, kF32);
  EXPECT_THROW(b.forward_fused(x, narrow_y, punica, 2, Stream()), Error);
}

// Adapters written into and cleared from random slots: the base rows of the weight storage
// (which holds every slot's A after them) and every other slot stay exactly as they were.
void check_random_slot_writes(Backend backend) {
  LORAPLEX_REQUIRE_GPUS(test::backend_gpus(backend, 1));
  const Device device = test::backend_device(backend, 0);
  const LinearSpec spec = merged_qkv();
  std::mt19937_64 rng(99);
  LoraLinear layer(spec, LoraConfig{kMaxLoras, kMaxRank, kF32, false}, nullptr, device, kTokens);
  std::vector<Tensor> base;
  for (const OutputSlice& o : spec.outputs) {
    base.push_back(test::random_tensor({o.size, spec.in_features}, kF32, rng));
  }
  layer.load_base(base);
  const std::vector<double> base_values = test::values_of(layer.weight());
  std::map<int, std::vector<LoraSliceWeights>> held;
  std::uniform_int_distribution<int> slot_of(0, kMaxLoras - 1), rank_of(0, kMaxRank);
  for (int step = 0; step < 40; ++step) {
    const int slot = slot_of(rng);
    if (step % 3 == 2) {
      layer.reset_lora(slot);
      held.erase(slot);
    } else {
      std::vector<int> ranks;
      for (int s = 0; s < num_lora_slices(spec); ++s) ranks.push_back(rank_of(rng));
      held[slot] = make_adapter(spec, ranks, kF32, rng);
      layer.set_lora(slot, held[slot]);
    }
    ASSERT_EQ(test::values_of(layer.weight()), base_values) << "step " << step;
    for (int k = 0; k < kMaxLoras; ++k) {
      for (int s = 0; s < num_lora_slices(spec); ++s) {
        const auto it = held.find(k);
        const LoraSliceWeights* w =
            it == held.end() ? nullptr : &it->second[static_cast<size_t>(s)];
        const int r = w != nullptr && w->a.defined() ? static_cast<int>(w->a.size(0)) : 0;
        ASSERT_EQ(layer.lora_rank(k, s), r) << "step " << step << " slot " << k << " slice " << s;
        if (r == 0) continue;
        EXPECT_EQ(test::values_of(layer.lora_a(s).select(0, k).narrow(0, 0, r).contiguous()),
                  w->a.to_double_vector())
            << "step " << step << " slot " << k << " slice " << s;
        EXPECT_EQ(test::values_of(layer.lora_b(s).select(0, k).narrow(1, 0, r).contiguous()),
                  w->b.to_double_vector())
            << "step " << step << " slot " << k << " slice " << s;
      }
    }
  }
}

TEST(LoraLinearSlots, RandomWritesKeepTheBaseAndEveryOtherSlot) {
  check_random_slot_writes(Backend::kCpu);
}
TEST(LoraLinearSlots, RandomWritesKeepTheBaseAndEveryOtherSlotCuda) {
  check_random_slot_writes(Backend::kCuda);
}

TEST(ColumnParallelShardedLoraLinear, MatchesNotSharded_tp1) {
  check_sharded(column(), Backend::kCpu, 1);
}
TEST(ColumnParallelShardedLoraLinear, MatchesNotSharded_tp2) {
  check_sharded(column(), Backend::kCpu, 2);
}
TEST(ColumnParallelShardedLoraLinear, MatchesNotSharded_tp4) {
  check_sharded(column(), Backend::kCpu, 4);
}
TEST(ColumnParallelShardedLoraLinear, GatherOutputMatchesNotSharded_tp4) {
  check_sharded(column_gathered(), Backend::kCpu, 4);
}
TEST(MergedColumnShardedLoraLinear, GateUpMatchesNotSharded_tp2) {
  check_sharded(merged_gate_up(), Backend::kCpu, 2);
}
TEST(MergedColumnShardedLoraLinear, GateUpMatchesNotSharded_tp4) {
  check_sharded(merged_gate_up(), Backend::kCpu, 4);
}
TEST(MergedColumnShardedLoraLinear, VariableSlicesMatchNotSharded_tp4) {
  check_sharded(merged_variable(), Backend::kCpu, 4);
}
TEST(QkvParallelShardedLoraLinear, MatchesNotSharded_tp2) {
  check_sharded(qkv_fused(), Backend::kCpu, 2);
}
TEST(QkvParallelShardedLoraLinear, MatchesNotSharded_tp4) {
  check_sharded(qkv_fused(), Backend::kCpu, 4);
}
TEST(MergedQkvShardedLoraLinear, MatchesNotSharded_tp2) {
  check_sharded(merged_qkv(), Backend::kCpu, 2);
}
TEST(MergedQkvShardedLoraLinear, MatchesNotSharded_tp4) {
  check_sharded(merged_qkv(), Backend::kCpu, 4);
}
TEST(RowParallelShardedLoraLinear, MatchesNotSharded_tp1) {
  check_sharded(row(), Backend::kCpu, 1);
}
TEST(RowParallelShardedLoraLinear, MatchesNotSharded_tp2) {
  check_sharded(row(), Backend::kCpu, 2);
}
TEST(RowParallelShardedLoraLinear, MatchesNotSharded_tp4) {
  check_sharded(row(), Backend::kCpu, 4);
}
TEST(ColumnParallelShardedLoraLinear, Cuda_tp1) { check_sharded(column(), Backend::kCuda, 1); }
TEST(ColumnParallelShardedLoraLinear, Nccl_tp2) { check_sharded(merged_qkv(), Backend::kNccl, 2); }
TEST(RowParallelShardedLoraLinear, Nccl_tp2) { check_sharded(row(), Backend::kNccl, 2); }

// --- reset_lora and set_lora validation --------------------------------------------------

std::vector<double> forward_values(LoraLinear& layer, const PunicaWrapper& punica,
                                   const Tensor& x) {
  return test::values_of(layer.forward(x, punica, Stream()));
}

// reset_lora gives back exactly the output of the layer before any adapter was installed.
void check_reset_exact(const LinearSpec& spec, int tp, bool fully_sharded) {
  const Problem p = make_problem(spec, true, 42);
  test::run_ranks(Backend::kCpu, tp, [&](int rank, Communicator* comm) {
    LoraConfig cfg{kMaxLoras, kMaxRank, spec.dtype, fully_sharded};
    PunicaWrapper punica(kMaxLoras, kTokens, 4, Device::cpu());
    punica.update_metadata(p.slots, {}, Stream());
    LoraLinear layer(spec, cfg, comm, Device::cpu(), kTokens);
    layer.load_base(p.weights, p.biases);
    Tensor x = p.x;
    if (spec.style == ParallelStyle::kRow) {
      const int64_t w = spec.in_features / layer.tp_size();
      x = p.x.narrow(1, rank * w, w).contiguous();
    }
    const std::vector<double> base = forward_values(layer, punica, x);
    for (const auto& [slot, slices] : p.installs) layer.set_lora(slot, slices);
    const std::vector<double> with_lora = forward_values(layer, punica, x);
    EXPECT_NE(with_lora, base) << "the adapters changed nothing";
    for (int slot = 0; slot < kMaxLoras; ++slot) layer.reset_lora(slot);
    for (int slot = 0; slot < kMaxLoras; ++slot) {
      for (int s = 0; s < layer.num_lora_slices(); ++s) EXPECT_EQ(layer.lora_rank(slot, s), 0);
    }
    EXPECT_EQ(forward_values(layer, punica, x), base) << spec.kind << " rank " << rank;
  });
}

TEST(ReplicatedLoraLinear, ResetRestoresBaseExactly_tp1) {
  check_reset_exact(replicated(), 1, false);
}
TEST(MergedQkvLoraLinear, ResetRestoresBaseExactly_tp2) {
  check_reset_exact(merged_qkv(), 2, false);
}
TEST(RowParallelLoraLinear, ResetRestoresBaseExactly_tp2) { check_reset_exact(row(), 2, false); }
TEST(MergedColumnShardedLoraLinear, ResetRestoresBaseExactly_tp2) {
  check_reset_exact(merged_gate_up(), 2, true);
}
TEST(RowParallelShardedLoraLinear, ResetRestoresBaseExactly_tp2) {
  check_reset_exact(row(), 2, true);
}

void expect_error_containing(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A rejected set_lora leaves the slot exactly as it was (weights and ranks).
void check_rejects_bad_adapters(const LinearSpec& spec, int tp, bool fully_sharded) {
  const Problem p = make_problem(spec, false, 7);
  test::run_ranks(Backend::kCpu, tp, [&](int rank, Communicator* comm) {
    LoraConfig cfg{kMaxLoras, kMaxRank, spec.dtype, fully_sharded};
    PunicaWrapper punica(kMaxLoras, kTokens, 4, Device::cpu());
    punica.update_metadata(p.slots, {}, Stream());
    LoraLinear layer(spec, cfg, comm, Device::cpu(), kTokens);
    layer.load_base(p.weights, p.biases);
    for (const auto& [slot, slices] : p.installs) layer.set_lora(slot, slices);
    Tensor x = p.x;
    if (spec.style == ParallelStyle::kRow) {
      const int64_t w = spec.in_features / layer.tp_size();
      x = p.x.narrow(1, rank * w, w).contiguous();
    }
    const std::vector<double> before = forward_values(layer, punica, x);
    const int rank1 = layer.lora_rank(1, 0);
    std::mt19937_64 rng(11);
    const int n = layer.num_lora_slices();
    const int64_t in = spec.in_features;
    const int64_t out0 = slice_out(spec, 0);
    auto good = [&](int r) { return make_adapter(spec, std::vector<int>(n, r), spec.dtype, rng); };
    std::vector<LoraSliceWeights> wrong_in = good(4);
    wrong_in.back().a = test::random_tensor({4, in + 1}, spec.dtype, rng);
    expect_error_containing([&] { layer.set_lora(1, wrong_in); },
                            "LoRA-A is [4, " + std::to_string(in + 1));
    std::vector<LoraSliceWeights> wrong_out = good(4);
    wrong_out[0].b = test::random_tensor({out0 - 1, 4}, spec.dtype, rng);
    expect_error_containing([&] { layer.set_lora(1, wrong_out); }, "LoRA-B is");
    std::vector<LoraSliceWeights> too_big = good(kMaxRank + 1);
    expect_error_containing([&] { layer.set_lora(1, too_big); }, "max_lora_rank 16");
    std::vector<LoraSliceWeights> half = good(4);
    half.back().b = Tensor();
    expect_error_containing([&] { layer.set_lora(1, half); }, "both be given");
    std::vector<LoraSliceWeights> extra = good(4);
    extra.push_back(extra[0]);
    expect_error_containing([&] { layer.set_lora(1, extra); }, "slices, expected");
    expect_error_containing([&] { layer.set_lora(kMaxLoras, good(4)); }, "outside [0, max_loras");
    EXPECT_EQ(layer.lora_rank(1, 0), rank1);
    EXPECT_EQ(forward_values(layer, punica, x), before) << spec.kind << " rank " << rank;
  });
}

TEST(ReplicatedLoraLinear, SetLoraRejectsBadAdapterAndKeepsSlot_tp1) {
  check_rejects_bad_adapters(replicated(), 1, false);
}
TEST(MergedQkvLoraLinear, SetLoraRejectsBadAdapterAndKeepsSlot_tp2) {
  check_rejects_bad_adapters(merged_qkv(), 2, false);
}
TEST(RowParallelLoraLinear, SetLoraRejectsBadAdapterAndKeepsSlot_tp2) {
  check_rejects_bad_adapters(row(), 2, false);
}
TEST(ColumnParallelShardedLoraLinear, SetLoraRejectsBadAdapterAndKeepsSlot_tp4) {
  check_rejects_bad_adapters(column(), 4, true);
}

TEST(LoraLinearSpec, RejectsHeadsThatDoNotSplit_tp4) {
  // 3 KV heads over 4 ranks: neither divides the other.
  test::run_ranks(Backend::kCpu, 4, [&](int, Communicator* comm) {
    LoraConfig cfg{kMaxLoras, kMaxRank, kF32, false};
    expect_error_containing(
        [&] { LoraLinear(LinearSpec::qkv(64, 8, 8, 3, kF32), cfg, comm, Device::cpu(), 8); },
        "cannot be split over tensor-parallel size 4");
  });
}

TEST(LoraLinearSpec, RejectsLoraDtypeOtherThanActivations) {
  LoraConfig cfg{kMaxLoras, kMaxRank, DType::kBF16, false};
  expect_error_containing([&] { LoraLinear(column(), cfg, nullptr, Device::cpu(), 8); },
                          "must equal the activation dtype");
}

}  // namespace
}  // namespace loraplex
