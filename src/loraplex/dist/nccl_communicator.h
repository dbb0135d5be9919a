#pragma once
// NCCL communicator: one GPU per rank, one process or one thread per rank. Compiled only when
// the CUDA backend is (LORAPLEX_WITH_CUDA); the header does not include nccl.h.
//
// The launcher makes one unique id (NcclCommunicator::make_unique_id() on one rank), hands its
// bytes to every rank (argv, a file, a socket: the launcher's choice), and each rank constructs
// its communicator with the same id. NVLink multicast (NVLS) is kept off: NCCL_NVLS_ENABLE is
// set to 0 unless the environment already sets it.

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "loraplex/dist/communicator.h"

namespace loraplex {

/// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};

class NcclCommunicator final : public Communicator {
 public:
  /// A new id for one group; call on one rank and distribute.
  static NcclUniqueId make_unique_id();

  /// Joins the group `id` as `rank` of `size` on CUDA device `device` (blocks until every
  /// rank has joined). Throws loraplex::Error naming the NCCL error.
  NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device);
  /// One group over `devices` of this process (rank r on devices[r]), made at once by one
  /// thread (ncclCommInitAll): no rank waits for others that may never come.
  static std::vector<std::unique_ptr<NcclCommunicator>> create_group(
      const std::vector<int>& devices);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  /// tensor: contiguous f32/f16/bf16/i32 on this communicator's device.
  void all_reduce_sum(Tensor& tensor, const Stream& stream) override;
  /// Along dim 0 NCCL writes `out` directly; along another dim it gathers into a staging
  /// buffer (grown on first use, then reused) and rearranges with strided copies.
  void all_gather(const Tensor& in, Tensor& out, int dim, const Stream& stream) override;
  std::string describe() const override;
  /// ncclCommAbort: NCCL kernels waiting for a peer that will not come return, and every later
  /// collective throws. Callable from any thread (a watchdog, another rank's thread).
  void abort() override;
  /// ncclCommGetAsyncError, as text ("" when none).
  std::string async_error() override;

 private:
  struct Adopt {};
  NcclCommunicator(Adopt, void* comm, int rank, int size, int device);
  // The communicator, or throws naming `who` when it was aborted.
  void* live(const std::string& who) const;

  std::atomic<void*> comm_{nullptr};  // ncclComm_t; null once aborted
  // Held shared while a collective is enqueued, exclusively by abort() and async_error(): the
  // communicator is not freed under a call that is using it, unless that call is itself stuck
  // waiting for a peer (abort() then goes ahead after a while; that is what it is for).
  std::shared_timed_mutex use_mutex_;
  int rank_;
  int size_;
  int device_;
  Tensor staging_;
  // Earlier, smaller staging buffers: a captured CUDA graph may still gather through them.
  std::vector<Tensor> retired_;
};

}  // namespace loraplex
