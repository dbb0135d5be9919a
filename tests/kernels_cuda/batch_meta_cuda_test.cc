// The batch metadata built by the GPU kernel equals the CPU build exactly.

#include <gtest/gtest.h>

#include <random>

#include "cuda_test_util.h"
#include "loraplex/punica/batch_meta.h"

namespace loraplex {
namespace {

void expect_same_meta(const LoraBatchMeta::HostCopy& got, const LoraBatchMeta::HostCopy& ref,
                      const std::string& what) {
  EXPECT_EQ(got.num_active_loras, ref.num_active_loras) << what;
  EXPECT_EQ(got.sorted_token_indices, ref.sorted_token_indices) << what;
  EXPECT_EQ(got.active_lora_ids, ref.active_lora_ids) << what;
  EXPECT_EQ(got.num_tokens_per_lora, ref.num_tokens_per_lora) << what;
  EXPECT_EQ(got.lora_token_start_loc, ref.lora_token_start_loc) << what;
}

TEST(CudaBatchMeta, MatchesCpuForEveryDistribution) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(7);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  // Bucket counts from 2 to 2001 cover the 32-warp and the fewer-warp sort layouts.
  for (int max_loras : {1, 4, 32, 100, 600, 2000}) {
    LoraBatchMeta gpu_meta(max_loras, 5000, test::gpu());
    LoraBatchMeta cpu_meta(max_loras, 5000, Device::cpu());
    for (int n : {1, 3, 77, 199, 1024, 4096, 5000}) {
      for (test::SlotDistribution d : test::kAllDistributions) {
        for (double none : {0.0, 0.3}) {
          const auto slots = test::make_slots(d, n, max_loras, rng, none);
          gpu_meta.prepare(slots, stream);
          cpu_meta.prepare(slots, cpu);
          const std::string what = "max_loras " + std::to_string(max_loras) + " tokens " +
                                   std::to_string(n) + " " + test::distribution_name(d) + " none " +
                                   std::to_string(none);
          expect_same_meta(gpu_meta.to_host(stream), cpu_meta.to_host(cpu), what);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(CudaBatchMeta, EmptyBatchAndAllBaseTokens) {
  LORAPLEX_REQUIRE_GPU();
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  LoraBatchMeta gpu_meta(8, 64, test::gpu());
  LoraBatchMeta cpu_meta(8, 64, Device::cpu());
  const std::vector<int32_t> empty;
  gpu_meta.prepare(empty, stream);
  cpu_meta.prepare(empty, cpu);
  expect_same_meta(gpu_meta.to_host(stream), cpu_meta.to_host(cpu), "empty");
  const std::vector<int32_t> base(37, -1);
  gpu_meta.prepare(base, stream);
  cpu_meta.prepare(base, cpu);
  EXPECT_TRUE(gpu_meta.no_lora());
  expect_same_meta(gpu_meta.to_host(stream), cpu_meta.to_host(cpu), "all -1");
}

TEST(CudaBatchMeta, PrepareFromDeviceBufferSeesNewMapping) {
  LORAPLEX_REQUIRE_GPU();
  std::mt19937_64 rng(11);
  Stream stream = Stream::create(test::gpu());
  Stream cpu;
  LoraBatchMeta gpu_meta(16, 300, test::gpu());
  LoraBatchMeta cpu_meta(16, 300, Device::cpu());
  const auto slots = test::make_slots(test::SlotDistribution::kZipf, 250, 16, rng, 0.1);
  Tensor host = test::int_tensor(slots);
  Tensor view = gpu_meta.mapping_buffer().narrow(0, 0, 250);
  view.copy_from(host, stream);
  gpu_meta.prepare_from_buffer(250, false, stream);
  cpu_meta.prepare(slots, cpu);
  expect_same_meta(gpu_meta.to_host(stream), cpu_meta.to_host(cpu), "from buffer");
}

}  // namespace
}  // namespace loraplex
