#pragma once
// Collectives of one tensor-parallel group. Every rank of the group must call the same
// collectives in the same order with tensors of the same shape and dtype (as with NCCL).
// Implementations: SingleDeviceCommunicator (size 1: nothing to exchange),
// InProcessCommunicator (one thread per rank over shared memory; tensor parallelism on the
// CPU in CI) and NcclCommunicator (one GPU per rank; built with CUDA only).

#include <string>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"

namespace loraplex {

class Communicator {
 public:
  virtual ~Communicator() = default;

  /// This rank, in [0, size()).
  virtual int rank() const = 0;
  /// Number of ranks in the group.
  virtual int size() const = 0;
  /// Sums `tensor` element-wise over the ranks, in place; every rank gets the same result.
  /// tensor: contiguous, f32/f16/bf16 (NCCL also i32), on the communicator's device; in/out.
  virtual void all_reduce_sum(Tensor& tensor, const Stream& stream) = 0;
  /// Concatenates every rank's `in` along `dim` in rank order into `out`.
  /// in: contiguous [..., d, ...] in; out: contiguous, same shape except size() * d at `dim`;
  /// same dtype and device. `dim` may be negative (counted from the end).
  virtual void all_gather(const Tensor& in, Tensor& out, int dim, const Stream& stream) = 0;
  /// "in-process rank 1 of 4", for messages.
  virtual std::string describe() const = 0;
  /// Stops the group after a failure (a rank that threw, a step that timed out): collectives
  /// blocked in it (on the host, or for NCCL on the device) return, and later ones throw. The
  /// group cannot be used afterwards. May be called from any thread, more than once.
  virtual void abort() {}
  /// An error the group has met in the background (NCCL's asynchronous errors: a peer that
  /// failed or went away), or "" when none.
  virtual std::string async_error() { return {}; }
};

/// A group of one: all_reduce_sum does nothing, all_gather copies (or does nothing when `out`
/// is `in`). Layers also accept a null Communicator* for this case.
class SingleDeviceCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(Tensor& tensor, const Stream& stream) override;
  void all_gather(const Tensor& in, Tensor& out, int dim, const Stream& stream) override;
  std::string describe() const override { return "single device"; }
};

namespace dist_detail {

/// Validates the arguments of all_gather (the same rules for every implementation) and
/// returns the dimension normalised to [0, in.dim()).
int check_all_gather(const Tensor& in, const Tensor& out, int dim, int size, const char* who);
/// Validates the argument of all_reduce_sum.
void check_all_reduce(const Tensor& tensor, const char* who);

}  // namespace dist_detail
}  // namespace loraplex
