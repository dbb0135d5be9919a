#include "loraplex/punica/slot_ranks.h"

#include <algorithm>

#include "loraplex/core/error.h"
#include "loraplex/kernels/dispatch/base_ops.h"

namespace loraplex {

SlotRanks::SlotRanks(int num_slices, int max_loras, int max_rank, Device device)
    : num_slices_(num_slices), max_loras_(max_loras), max_rank_(max_rank) {
  LORAPLEX_CHECK(num_slices >= 1 && max_loras >= 1 && max_rank >= 1, "SlotRanks: num_slices ",
                 num_slices, ", max_loras ", max_loras, ", max_rank ", max_rank,
                 "; each must be >= 1");
  host_ = Tensor::zeros({num_slices, max_loras}, DType::kI32);
  device_ = device.is_cpu() ? host_ : host_.to(device);
}

int32_t SlotRanks::get(int slice, int slot) const {
  LORAPLEX_CHECK(slice >= 0 && slice < num_slices_ && slot >= 0 && slot < max_loras_,
                 "SlotRanks: (slice ", slice, ", slot ", slot, ") outside [", num_slices_, ", ",
                 max_loras_, ")");
  return host_.data<int32_t>()[slice * max_loras_ + slot];
}

void SlotRanks::check_rank(int slot, int32_t rank) const {
  LORAPLEX_CHECK(rank >= 0 && rank <= max_rank_, "LoRA rank ", rank, " for slot ", slot,
                 " is outside [0, max_lora_rank ", max_rank_, "]");
}

void SlotRanks::set(int slice, int slot, int32_t rank, const Stream& stream) {
  get(slice, slot);  // validates the indices
  check_rank(slot, rank);
  host_.data<int32_t>()[slice * max_loras_ + slot] = rank;
  upload(slice, 1, slot, stream);
}

void SlotRanks::set_slot(int slot, int32_t rank, const Stream& stream) {
  get(0, slot);
  check_rank(slot, rank);
  for (int s = 0; s < num_slices_; ++s) host_.data<int32_t>()[s * max_loras_ + slot] = rank;
  upload(0, num_slices_, slot, stream);
}

void SlotRanks::set_slot(int slot, std::span<const int32_t> ranks, const Stream& stream) {
  get(0, slot);
  LORAPLEX_CHECK(static_cast<int>(ranks.size()) == num_slices_, "SlotRanks: ", ranks.size(),
                 " ranks for slot ", slot, ", expected one per slice (", num_slices_, ")");
  for (int32_t r : ranks) check_rank(slot, r);
  for (int s = 0; s < num_slices_; ++s) {
    host_.data<int32_t>()[s * max_loras_ + slot] = ranks[static_cast<size_t>(s)];
  }
  upload(0, num_slices_, slot, stream);
}

void SlotRanks::upload(int first_slice, int count, int slot, const Stream& stream) {
  if (!device_.device().is_cuda()) return;  // the CPU table is the host table
  LORAPLEX_CHECK(stream.device() == device_.device(), "SlotRanks: the table is on ",
                 device_.device(), ", the stream on ", stream.device());
  const int32_t* host = host_.data<int32_t>();
  for (int s0 = first_slice; s0 < first_slice + count; s0 += kernels::kMaxColumnValues) {
    kernels::WriteColumnArgs a;
    a.table = device_.data<int32_t>();
    a.row_stride = max_loras_;
    a.first_row = s0;
    a.col = slot;
    a.count = std::min(kernels::kMaxColumnValues, first_slice + count - s0);
    for (int i = 0; i < a.count; ++i) a.values[i] = host[(s0 + i) * max_loras_ + slot];
    throw_if_error(kernels::dispatch_write_column(a, stream));
  }
}

}  // namespace loraplex
