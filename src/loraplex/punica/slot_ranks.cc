#include "loraplex/punica/slot_ranks.h"

#include "loraplex/core/error.h"

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

void SlotRanks::set(int slice, int slot, int32_t rank, const Stream& stream) {
  get(slice, slot);  // validates the indices
  LORAPLEX_CHECK(rank >= 0 && rank <= max_rank_, "LoRA rank ", rank, " for slot ", slot,
                 " is outside [0, max_lora_rank ", max_rank_, "]");
  host_.data<int32_t>()[slice * max_loras_ + slot] = rank;
  upload(stream);
}

void SlotRanks::set_slot(int slot, int32_t rank, const Stream& stream) {
  LORAPLEX_CHECK(rank >= 0 && rank <= max_rank_, "LoRA rank ", rank, " for slot ", slot,
                 " is outside [0, max_lora_rank ", max_rank_, "]");
  for (int s = 0; s < num_slices_; ++s) {
    get(s, slot);
    host_.data<int32_t>()[s * max_loras_ + slot] = rank;
  }
  upload(stream);
}

void SlotRanks::upload(const Stream& stream) {
  if (device_.device().is_cuda()) device_.copy_from(host_, stream);
}

}  // namespace loraplex
