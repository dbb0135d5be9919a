#include "loraplex/server/elastic_thread_pool.h"

#include <thread>

namespace loraplex::server {

ElasticThreadPool::ElasticThreadPool(size_t min_threads, std::chrono::milliseconds idle_exit)
    : min_threads_(min_threads), idle_exit_(idle_exit) {}

ElasticThreadPool::~ElasticThreadPool() { shutdown(); }

void ElasticThreadPool::enqueue(std::function<void()> task) {
  std::unique_lock<std::mutex> lock(mutex_);
  tasks_.push_back(std::move(task));
  // Each queued task needs a thread of its own: an idle one that has not been handed a task
  // yet, else a new one.
  if (idle_ >= tasks_.size()) {
    work_cv_.notify_one();
    return;
  }
  ++threads_;
  lock.unlock();
  // Detached: shutdown() waits for the count of live threads instead of joining, so that
  // threads that end while idle need nobody to join them.
  std::thread([this] { work(); }).detach();
}

void ElasticThreadPool::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (!tasks_.empty()) {
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;  // whatever it holds goes before the thread counts as idle
      lock.lock();
      continue;
    }
    if (stopping_) break;
    ++idle_;
    const bool woken =
        work_cv_.wait_for(lock, idle_exit_, [&] { return !tasks_.empty() || stopping_; });
    --idle_;
    if (!woken && threads_ > min_threads_) break;
  }
  // The last touch of this object: shutdown() may destroy it as soon as the lock is released.
  if (--threads_ == 0) exit_cv_.notify_all();
}

void ElasticThreadPool::shutdown() {
  std::unique_lock<std::mutex> lock(mutex_);
  stopping_ = true;
  work_cv_.notify_all();
  exit_cv_.wait(lock, [&] { return threads_ == 0; });
}

size_t ElasticThreadPool::threads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return threads_;
}

size_t ElasticThreadPool::busy() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return threads_ - idle_;
}

}  // namespace loraplex::server
