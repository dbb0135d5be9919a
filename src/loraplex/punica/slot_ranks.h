#pragma once
// The rank of every (slice, slot) of one layer, on the host (for validation) and on the
// layer's device (read by kernels). A rank of 0 means the slot has no LoRA for that slice.
//
// Updates change the host table at once and the device table in `stream` order (on CUDA a
// small kernel carries the new values, so the host never waits and may update again at once).
// Kernels that read the ranks on another stream must wait for `stream` first.

#include <cstdint>
#include <span>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"

namespace loraplex {

class SlotRanks {
 public:
  SlotRanks() = default;
  SlotRanks(int num_slices, int max_loras, int max_rank, Device device);

  int num_slices() const { return num_slices_; }
  int max_loras() const { return max_loras_; }
  int max_rank() const { return max_rank_; }
  int32_t get(int slice, int slot) const;
  /// Sets one entry on the host and the device; throws if rank is outside [0, max_rank].
  void set(int slice, int slot, int32_t rank, const Stream& stream);
  /// Sets every slice of `slot` to `rank`.
  void set_slot(int slot, int32_t rank, const Stream& stream);
  /// Sets slice s of `slot` to ranks[s] (num_slices() values); validates all before changing any.
  void set_slot(int slot, std::span<const int32_t> ranks, const Stream& stream);

  const Tensor& host() const { return host_; }      // int32 [num_slices, max_loras], CPU
  const Tensor& device() const { return device_; }  // the same on the layer's device

 private:
  void check_rank(int slot, int32_t rank) const;
  // Copies host entries [first_slice, first_slice + count) of `slot` to the device table.
  void upload(int first_slice, int count, int slot, const Stream& stream);

  int num_slices_ = 0;
  int max_loras_ = 0;
  int max_rank_ = 0;
  Tensor host_;
  Tensor device_;
};

}  // namespace loraplex
