#pragma once
// A communicator that fails on demand, for the tensor-parallel failure tests (CPU threads and
// NCCL alike).

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>

#include "loraplex/core/error.h"
#include "loraplex/dist/communicator.h"

namespace loraplex::test {

/// One rank's communicator (wrapping a real one) that, once armed, throws (a GPU that
/// failed) or blocks until the group is aborted (a GPU that stopped) at its next collective.
class FaultyCommunicator final : public Communicator {
 public:
  enum class Mode { kThrow, kStall };
  FaultyCommunicator(Communicator& inner, Mode mode) : inner_(inner), mode_(mode) {}

  void arm() { armed_ = true; }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string describe() const override { return inner_.describe(); }
  void all_reduce_sum(Tensor& tensor, const Stream& stream) override {
    fault();
    inner_.all_reduce_sum(tensor, stream);
  }
  void all_gather(const Tensor& in, Tensor& out, int dim, const Stream& stream) override {
    fault();
    inner_.all_gather(in, out, dim, stream);
  }
  std::string async_error() override { return inner_.async_error(); }
  void abort() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_ = true;
    }
    cv_.notify_all();
    inner_.abort();
  }

 private:
  void fault() {
    if (!armed_) return;
    if (mode_ == Mode::kThrow) LORAPLEX_FAIL("injected device failure on ", describe());
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return aborted_; });
    LORAPLEX_FAIL(describe(), ": aborted while stalled");
  }

  Communicator& inner_;
  Mode mode_;
  std::atomic<bool> armed_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool aborted_ = false;
};

}  // namespace loraplex::test
