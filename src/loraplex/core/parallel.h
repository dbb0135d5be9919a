#pragma once
// A small fixed thread pool for the CPU backend. parallel_for splits an index range into
// chunks and blocks until all are done; a call from inside a worker runs inline, so nested
// parallel loops cannot deadlock.

#include <cstdint>
#include <functional>

namespace loraplex {

/// Threads used by parallel_for: LORAPLEX_NUM_THREADS if set, else hardware concurrency.
int num_cpu_threads();

/// Runs `fn(begin, end)` over disjoint chunks covering [begin, end), each at least `grain`
/// long (except the last), on the pool. Exceptions from `fn` are rethrown in the caller.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace loraplex
