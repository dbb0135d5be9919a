#include "loraplex/core/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace loraplex {
namespace {

thread_local bool t_inside_worker = false;

class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    wake_.notify_one();
  }

 private:
  void work() {
    t_inside_worker = true;
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

ThreadPool& pool() {
  // The calling thread takes a share of the work too, so the pool has one thread fewer.
  static ThreadPool instance(std::max(0, num_cpu_threads() - 1));
  return instance;
}

}  // namespace

int num_cpu_threads() {
  static const int threads = [] {
    if (const char* env = std::getenv("LORAPLEX_NUM_THREADS")) {
      const int n = std::atoi(env);
      if (n > 0) return n;
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return threads;
}

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t total = end - begin;
  const int64_t max_chunks = std::max<int64_t>(1, total / grain);
  const int64_t chunks = std::min<int64_t>(max_chunks, num_cpu_threads());
  if (chunks <= 1 || t_inside_worker) {
    fn(begin, end);
    return;
  }
  const int64_t step = (total + chunks - 1) / chunks;

  std::mutex mutex;
  std::condition_variable done;
  int64_t remaining = chunks - 1;
  std::exception_ptr error;
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t lo = begin + c * step;
    const int64_t hi = std::min(end, lo + step);
    pool().submit([&, lo, hi] {
      std::exception_ptr local;
      try {
        if (lo < hi) fn(lo, hi);
      } catch (...) {
        local = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (local && !error) error = local;
      if (--remaining == 0) done.notify_one();
    });
  }
  std::exception_ptr own;
  try {
    fn(begin, std::min(end, begin + step));
  } catch (...) {
    own = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return remaining == 0; });
  if (own) std::rethrow_exception(own);
  if (error) std::rethrow_exception(error);
}

}  // namespace loraplex
