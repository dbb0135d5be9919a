#include "loraplex/core/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

namespace loraplex {
namespace {

TEST(ParallelFor, CoversEveryIndexOnce) {
  for (int64_t n : {0, 1, 3, 77, 199, 10007}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) hits[static_cast<size_t>(i)]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << n;
  }
}

TEST(ParallelFor, NestedCallsRunAndPropagateErrors) {
  std::atomic<int64_t> sum{0};
  parallel_for(0, 8, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      parallel_for(0, 100, 1, [&](int64_t a, int64_t b) { sum += b - a; });
    }
  });
  EXPECT_EQ(sum.load(), 800);
  EXPECT_THROW(parallel_for(0, 100, 1,
                            [](int64_t lo, int64_t) {
                              if (lo >= 50) throw std::runtime_error("boom");
                            }),
               std::runtime_error);
}

}  // namespace
}  // namespace loraplex
