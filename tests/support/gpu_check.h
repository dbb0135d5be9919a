#pragma once
// The one skip check of every test that needs GPUs. By default a test that needs more working
// GPUs than the machine has skips. LORAPLEX_REQUIRE_GPU=N (scripts/gpu.sh test sets the
// machine's GPU count) requires N: a test that needs up to N GPUs fails instead of skipping when
// fewer of them work, whether they are missing or broken (a device works when a small
// allocation, a memset and a synchronise on it succeed); a test that needs more still skips.

#include <gtest/gtest.h>

#include <string>

namespace loraplex::test {

/// CUDA devices that work, probed once (0 in a build without CUDA).
int working_gpus();
/// N of LORAPLEX_REQUIRE_GPU (0 when unset or not a positive integer).
int required_gpus();
/// Empty when `n` GPUs work; else what is missing.
std::string gpus_missing(int n);

}  // namespace loraplex::test

/// Skips the test, or fails it in required mode (see above), unless `n` GPUs work. For test
/// bodies and void helpers (gtest's FAIL and GTEST_SKIP return).
#define LORAPLEX_REQUIRE_GPUS(n)                                                         \
  do {                                                                                   \
    const int need_ = (n);                                                               \
    const std::string why_ = ::loraplex::test::gpus_missing(need_);                      \
    if (!why_.empty()) {                                                                 \
      if (need_ <= ::loraplex::test::required_gpus()) {                                  \
        FAIL() << why_ << " (LORAPLEX_REQUIRE_GPU=" << ::loraplex::test::required_gpus() \
               << " requires them)";                                                     \
      } else {                                                                           \
        GTEST_SKIP() << why_;                                                            \
      }                                                                                  \
    }                                                                                    \
  } while (0)

#define LORAPLEX_REQUIRE_GPU() LORAPLEX_REQUIRE_GPUS(1)
