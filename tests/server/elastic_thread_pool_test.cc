// The connection pool: every task starts at once however many are running (none waits for
// another's thread), idle threads beyond the minimum end, and shutdown waits for every task.

#include "loraplex/server/elastic_thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace loraplex::server {
namespace {

using namespace std::chrono_literals;

// Waits up to 30 s for `pred`.
template <typename Pred>
bool eventually(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(ElasticThreadPool, EveryTaskStartsWhileTheOthersBlock) {
  ElasticThreadPool pool(2, 60s);
  constexpr int kTasks = 300;  // far more than any fixed pool the server had (64)
  std::mutex mutex;
  std::condition_variable cv;
  int started = 0;
  bool release = false;
  for (int i = 0; i < kTasks; ++i) {
    pool.enqueue([&] {
      std::unique_lock<std::mutex> lock(mutex);
      ++started;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });  // holds its thread, as a stream does
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    EXPECT_TRUE(cv.wait_for(lock, 30s, [&] { return started == kTasks; })) << started;
    EXPECT_EQ(pool.busy(), static_cast<size_t>(kTasks));
    release = true;
  }
  cv.notify_all();
  EXPECT_TRUE(eventually([&] { return pool.busy() == 0; }));
}

TEST(ElasticThreadPool, IdleThreadsBeyondTheMinimumEndAndOthersAreReused) {
  ElasticThreadPool pool(3, 50ms);
  std::atomic<int> running{0};
  std::atomic<bool> release{false};
  for (int i = 0; i < 20; ++i) {
    pool.enqueue([&] {
      ++running;
      while (!release) std::this_thread::sleep_for(1ms);
      --running;
    });
  }
  ASSERT_TRUE(eventually([&] { return running == 20; }));
  EXPECT_EQ(pool.threads(), 20u);
  release = true;
  EXPECT_TRUE(eventually([&] { return pool.threads() == 3; })) << pool.threads();
  // Sequential tasks reuse the idle threads rather than adding any.
  for (int i = 0; i < 10; ++i) {
    std::atomic<bool> done{false};
    pool.enqueue([&] { done = true; });
    ASSERT_TRUE(eventually([&] { return done.load(); }));
  }
  EXPECT_EQ(pool.threads(), 3u);
}

TEST(ElasticThreadPool, ShutdownRunsWhatIsQueuedAndWaitsForIt) {
  std::atomic<int> finished{0};
  {
    ElasticThreadPool pool(1, 60s);
    for (int i = 0; i < 50; ++i) {
      pool.enqueue([&] {
        std::this_thread::sleep_for(5ms);
        ++finished;
      });
    }
    pool.shutdown();
    EXPECT_EQ(finished, 50);
    EXPECT_EQ(pool.threads(), 0u);
    pool.shutdown();  // again: nothing left to wait for
  }
  EXPECT_EQ(finished, 50);
}

}  // namespace
}  // namespace loraplex::server
