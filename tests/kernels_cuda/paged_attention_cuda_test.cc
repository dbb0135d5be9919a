// PagedAttention on the GPU -- FlashInfer for bf16/f16 at head dims 64 and 128, the fallback
// kernel for float32 and other head dims -- against ops::cpu::paged_attention on the same
// random inputs (tests/model/paged_attention_test.cc ties the CPU to a double-precision
// attention), eager and replayed from a CUDA graph after re-planning.
//
// Error bound, ||out - ref|| / ||ref||, u = the dtype's unit roundoff (bf16 2^-8, f16 2^-11):
// the CPU rounds each output once from float32; FlashInfer also rounds the softmax weights to
// the dtype before its P.V tensor-core product (relative error <= u each) and sums in a
// different order, so the two differ by the two output roundings plus one rounding of every
// weight: at most about 3u per element, less in the RMS. The whole step must be within 2u and
// every row within 3u. The float32 fallback does the CPU's arithmetic in another order: 1e-5.
// A causal mask off by one key, a wrong block or a wrong GQA head moves rows with short
// contexts by O(1), far outside these bounds.

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/model/paged_attention.h"
#include "model/attention_test_support.h"

namespace loraplex::model {
namespace {

using test::AttnSeq;

struct GpuCase {
  AttentionShape shape;
  bool flashinfer;
};

std::string name_of(const AttentionShape& s) {
  return std::string(dtype_name(s.dtype)) + " " + std::to_string(s.num_heads) + "/" +
         std::to_string(s.num_kv_heads) + " heads of " + std::to_string(s.head_dim);
}

const std::vector<GpuCase>& cases() {
  static const std::vector<GpuCase> c = {
      {{32, 8, 128, 16, DType::kBF16}, true}, {{32, 8, 128, 16, DType::kF16}, true},
      {{4, 2, 64, 16, DType::kBF16}, true},   {{4, 2, 64, 16, DType::kF16}, true},
      {{4, 2, 64, 16, DType::kF32}, false},   {{4, 2, 32, 16, DType::kBF16}, false},
  };
  return c;
}

double bound(DType dtype, bool worst_row) {
  switch (dtype) {
    case DType::kBF16:
      return (worst_row ? 3 : 2) * 0x1p-8;
    case DType::kF16:
      return (worst_row ? 3 : 2) * 0x1p-11;
    default:
      return 1e-5;
  }
}

void expect_matches_cpu(const Tensor& got, const test::AttentionScenario& s,
                        const std::string& what) {
  const Tensor ref = test::cpu_reference(s);
  const test::RelativeError e =
      test::relative_error(got, ref.to_double_vector(), s.shape.num_heads * s.shape.head_dim);
  EXPECT_LE(e.total, bound(s.shape.dtype, false)) << what << ": relative error over the step";
  EXPECT_LE(e.worst_row, bound(s.shape.dtype, true))
      << what << ": relative error of row " << e.worst_row_index;
}

ops::KvCacheView view_of(const test::AttentionScenario& s, const Tensor& k, const Tensor& v) {
  return ops::KvCacheView{s.num_blocks,     s.shape.block_size, s.shape.num_kv_heads,
                          s.shape.head_dim, k.data_ptr(),       v.data_ptr()};
}

// Steps of different kinds: each makes FlashInfer's planner pick another CTA_TILE_Q (128 for
// long prompts, 64 for short chunks, 16 for decodes) or split the KV (few long decodes).
std::vector<std::pair<std::string, std::vector<AttnSeq>>> eager_steps(std::mt19937_64& rng) {
  std::vector<AttnSeq> decodes;
  std::uniform_int_distribution<int32_t> len(0, 400);
  for (int i = 0; i < 256; ++i) decodes.push_back({len(rng), 1});
  return {
      {"mixed prompts, chunks and decodes",
       {{0, 77},
        {41, 3},
        {200, 199},
        {0, 1000},
        {999, 1},
        {15, 1},
        {16, 1},
        {37, 1},
        {0, 1},
        {5, 1}}},
      {"short chunks mid-sequence", {{10, 10}, {0, 17}, {33, 12}, {7, 9}, {100, 30}, {64, 14}}},
      {"256 decodes", decodes},
      {"few long decodes (split KV)", {{2999, 1}, {1500, 1}, {40, 1}}},
  };
}

TEST(CudaPagedAttention, MixedStepsMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  const Stream stream = Stream::create(test::gpu());
  for (const GpuCase& c : cases()) {
    std::mt19937_64 rng(2111);
    PagedAttention pa(c.shape, test::gpu(), 2048, 256, 8192);
    EXPECT_EQ(pa.uses_flashinfer(), c.flashinfer) << name_of(c.shape);
    const auto steps = eager_steps(rng);
    // One random cache, large enough for every step, uploaded once.
    int64_t blocks = 0;
    for (const auto& step : steps) {
      blocks = std::max(blocks, test::blocks_needed(step.second, c.shape.block_size));
    }
    const test::AttentionScenario cache = test::make_attention_scenario(c.shape, {}, rng, blocks);
    const Tensor k = test::on_gpu(cache.k, stream);
    const Tensor v = test::on_gpu(cache.v, stream);
    for (const auto& [what, seqs] : steps) {
      const test::AttentionScenario s =
          test::make_attention_scenario(c.shape, seqs, rng, 0, &cache);
      const Tensor q = test::on_gpu(s.q, stream);
      Tensor out = Tensor::empty({s.step.qo_indptr.back(), c.shape.num_heads * c.shape.head_dim},
                                 c.shape.dtype, test::gpu());
      pa.plan(s.step, stream);
      pa.run(q.data_ptr(), s.row_stride, view_of(s, k, v), out.data_ptr(), stream);
      expect_matches_cpu(test::on_cpu(out, stream), s, name_of(c.shape) + ", " + what);
    }
  }
}

// Random decodes padded to `batch` with dummy sequences (kv_len 1 on the spare block 0).
std::vector<AttnSeq> padded_decodes(int real, int batch, int max_past, std::mt19937_64& rng) {
  std::vector<AttnSeq> seqs;
  std::uniform_int_distribution<int32_t> len(0, max_past);
  for (int i = 0; i < real; ++i) seqs.push_back({len(rng), 1});
  while (static_cast<int>(seqs.size()) < batch) seqs.push_back(test::dummy_seq());
  std::shuffle(seqs.begin(), seqs.end(), rng);
  return seqs;
}

// Per graph batch: plan(graph_batch), one eager run, capture one layer's run() in a CUDA graph;
// then, for new batches of the same size (other lengths, other block tables, new q written into
// the captured buffer), plan + replay and compare with the CPU. Two graph sizes are
// interleaved: each replay must use the plan made just before it.
TEST(CudaPagedAttention, GraphReplayAfterReplanMatchesCpu) {
  LORAPLEX_REQUIRE_GPU();
  const Stream stream = Stream::create(test::gpu());
  const std::vector<int> batches = {48, 8};
  for (const GpuCase& c : cases()) {
    std::mt19937_64 rng(2112);
    PagedAttention pa(c.shape, test::gpu(), 512, 64, 4096);
    const int64_t row = (c.shape.num_heads + 2 * c.shape.num_kv_heads) * c.shape.head_dim;
    // One random cache for every batch below (at most 48 x ceil(1201 / 16) blocks).
    const test::AttentionScenario cache = test::make_attention_scenario(c.shape, {}, rng, 3700);
    const Tensor k = test::on_gpu(cache.k, stream);
    const Tensor v = test::on_gpu(cache.v, stream);
    std::vector<Tensor> q, out;
    std::vector<std::unique_ptr<kernels::cuda::Graph>> graphs;
    auto layer = [&](const test::AttentionScenario& s, size_t g) {
      pa.run(q[g].data_ptr(), row, view_of(s, k, v), out[g].data_ptr(), stream);
    };
    for (size_t g = 0; g < batches.size(); ++g) {
      const int b = batches[g];
      q.push_back(Tensor::empty({b, row}, c.shape.dtype, test::gpu()));
      out.push_back(
          Tensor::empty({b, c.shape.num_heads * c.shape.head_dim}, c.shape.dtype, test::gpu()));
      const test::AttentionScenario s = test::make_attention_scenario(
          c.shape, padded_decodes(b * 2 / 3, b, 300, rng), rng, 0, &cache);
      q[g].copy_from(s.q.to(test::gpu(), stream), stream);
      pa.plan(s.step, stream, b);
      layer(s, g);  // eager first: FlashInfer sets kernel attributes on its first launch
      expect_matches_cpu(test::on_cpu(out[g], stream), s,
                         name_of(c.shape) + ", eager graph_batch " + std::to_string(b));
      graphs.push_back(std::make_unique<kernels::cuda::Graph>());
      graphs[g]->begin_capture(stream.handle());
      layer(s, g);
      graphs[g]->end_capture();
    }
    // Replays: longer contexts (other KV chunk sizes), all-real and mostly-dummy batches.
    const std::vector<std::pair<double, int>> trials = {{1.0, 1200}, {0.1, 3000}, {0.5, 700}};
    for (const auto& [real_fraction, max_past] : trials) {
      for (size_t g = 0; g < batches.size(); ++g) {
        const int b = batches[g];
        const int real = std::max(1, static_cast<int>(b * real_fraction));
        const test::AttentionScenario s = test::make_attention_scenario(
            c.shape, padded_decodes(real, b, max_past, rng), rng, 0, &cache);
        q[g].copy_from(s.q.to(test::gpu(), stream), stream);
        pa.plan(s.step, stream, b);
        graphs[g]->replay(stream.handle());
        expect_matches_cpu(test::on_cpu(out[g], stream), s,
                           name_of(c.shape) + ", replay of graph_batch " + std::to_string(b) +
                               " with " + std::to_string(real) + " real sequences, contexts " +
                               "up to " + std::to_string(max_past + 1));
      }
    }
  }
}

}  // namespace
}  // namespace loraplex::model
