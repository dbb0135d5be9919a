#pragma once
// Tensor parallelism inside one process: one thread per rank, collectives over shared CPU
// memory with barriers. Exists so that every tensor-parallel layer is tested on the CPU.
//
// A collective is two barrier phases: every rank publishes its tensor, then each rank reduces
// (or copies) a disjoint part, then all wait before anyone may touch its tensor again. Sums run
// in rank order in float and are rounded once, so every rank gets bit-identical results.
//
// If one rank fails (throws) the others would wait forever at the next barrier: call
// InProcessGroup::abort() from the failing thread (run_in_process_group() does) and every
// waiting or later collective throws loraplex::Error instead.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "loraplex/dist/communicator.h"

namespace loraplex {

/// The state shared by the ranks of one in-process group.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);

  int size() const { return size_; }
  /// Makes every pending and future collective of the group throw (a rank has failed).
  void abort();
  bool aborted() const;

  // Used by InProcessCommunicator.
  void barrier();
  void publish(int rank, const Tensor* tensor) { published_[static_cast<size_t>(rank)] = tensor; }
  const Tensor& published(int rank) const { return *published_[static_cast<size_t>(rank)]; }

 private:
  int size_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int waiting_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<const Tensor*> published_;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank);

  /// `size` communicators sharing one new group; hand communicator i to thread i.
  static std::vector<std::unique_ptr<InProcessCommunicator>> create_group(int size);

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  /// tensor: CPU, contiguous, f32/f16/bf16.
  void all_reduce_sum(Tensor& tensor, const Stream& stream) override;
  void all_gather(const Tensor& in, Tensor& out, int dim, const Stream& stream) override;
  std::string describe() const override;
  /// Aborts the whole group (InProcessGroup::abort).
  void abort() override { group_->abort(); }
  InProcessGroup& group() { return *group_; }

 private:
  std::shared_ptr<InProcessGroup> group_;
  int rank_;
};

/// Runs fn(rank, communicator) on `size` threads (one per rank) and waits for all of them.
/// The first exception of any rank aborts the group (so the others cannot hang) and is
/// rethrown here after every thread has finished.
void run_in_process_group(int size, const std::function<void(int, Communicator&)>& fn);

}  // namespace loraplex
