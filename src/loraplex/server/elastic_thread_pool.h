#pragma once
// The HTTP server's connection threads. A connection holds its thread for its whole life (a
// stream blocks on its request's output; a keep-alive connection waits for its next request),
// so a fixed pool lets a few slow or idle clients starve everyone and caps the engine's batch
// at the pool's size. This pool never queues a task behind running ones: each runs at once on
// an idle thread or a new one; threads idle for `idle_exit` end (down to `min_threads`). What
// bounds the threads is the server's connection cap.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>

namespace loraplex::server {

class ElasticThreadPool {
 public:
  ElasticThreadPool(size_t min_threads, std::chrono::milliseconds idle_exit);
  /// Runs what is queued, then waits for every thread to end (shutdown()).
  ~ElasticThreadPool();
  ElasticThreadPool(const ElasticThreadPool&) = delete;
  ElasticThreadPool& operator=(const ElasticThreadPool&) = delete;

  /// Starts `task` now, on an idle thread or a new one. Thread-safe.
  void enqueue(std::function<void()> task);
  /// Waits until every task has run and every thread has ended. Thread-safe, idempotent; tasks
  /// enqueued meanwhile still run.
  void shutdown();

  /// Threads alive now, and those running a task.
  size_t threads() const;
  size_t busy() const;

 private:
  void work();

  const size_t min_threads_;
  const std::chrono::milliseconds idle_exit_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable exit_cv_;
  std::deque<std::function<void()>> tasks_;
  size_t threads_ = 0;
  size_t idle_ = 0;  // threads waiting for a task
  bool stopping_ = false;
};

}  // namespace loraplex::server
