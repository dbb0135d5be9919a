#include "loraplex/punica/batch_meta.h"

#include <algorithm>
#include <cstring>

#include "loraplex/core/error.h"
#include "loraplex/kernels/planner/lora_plan.h"
#include "loraplex/punica/lora_dispatch.h"

namespace loraplex {

LoraBatchMeta::LoraBatchMeta(int max_loras, int max_num_tokens, Device device,
                             int64_t scratch_floats)
    : max_loras_(max_loras), max_num_tokens_(max_num_tokens), device_(device) {
  LORAPLEX_CHECK(max_loras >= 1, "LoraBatchMeta: max_loras ", max_loras, ", expected >= 1");
  LORAPLEX_CHECK(max_num_tokens >= 1, "LoraBatchMeta: max_num_tokens ", max_num_tokens,
                 ", expected >= 1");
  const int64_t n = max_num_tokens;
  const int64_t l = max_loras;
  mapping_ = Tensor::empty({n}, DType::kI32, device);
  sorted_ = Tensor::empty({n}, DType::kI32, device);
  active_ids_ = Tensor::empty({l + 1}, DType::kI32, device);
  counts_ = Tensor::empty({l + 1}, DType::kI32, device);
  start_loc_ = Tensor::empty({l + 2}, DType::kI32, device);
  num_active_ = Tensor::empty({1}, DType::kI32, device);
  if (device.is_cuda()) {
    for (int i = 0; i < kStagingSlots; ++i) {
      host_staging_[i] =
          Tensor::empty_with({n}, DType::kI32, Device::cpu(), pinned_host_allocator());
    }
    if (scratch_floats < 0) {
      scratch_floats = kernels::planner::lora_scratch_floats(n, kernels::planner::LoraTuning{});
    }
    scratch_ = Tensor::empty({std::max<int64_t>(scratch_floats, 1)}, DType::kF32, device);
    // Zeroed once here; every op that counts on them leaves them at zero again.
    const Stream setup = Stream::default_for(device);
    counters_ =
        Tensor::zeros({kernels::planner::lora_counters(n, max_loras)}, DType::kI32, device, setup);
    setup.synchronize();
  }
}

void LoraBatchMeta::reserve_scratch(int64_t floats) {
  if (!scratch_.defined() || floats <= scratch_.numel()) return;
  cuda_rt::device_synchronize();
  scratch_ = Tensor();
  scratch_ = Tensor::empty({floats}, DType::kF32, device_);
}

void LoraBatchMeta::prepare(std::span<const int32_t> token_slots, const Stream& stream) {
  const bool no_lora = upload(token_slots, stream);
  prepare_from_buffer(static_cast<int>(token_slots.size()), no_lora, stream);
}

bool LoraBatchMeta::upload(std::span<const int32_t> token_slots, const Stream& stream) {
  const int64_t n = static_cast<int64_t>(token_slots.size());
  LORAPLEX_CHECK(n <= max_num_tokens_, "LoraBatchMeta: ", n, " tokens exceed max_num_tokens ",
                 max_num_tokens_);
  bool no_lora = true;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t slot = token_slots[static_cast<size_t>(t)];
    LORAPLEX_CHECK(slot >= -1 && slot < max_loras_, "token ", t, " has LoRA slot ", slot,
                   ", expected -1 (no LoRA) or a slot in [0, ", max_loras_, ")");
    no_lora = no_lora && slot == -1;
  }
  if (n > 0) {
    if (device_.is_cpu()) {
      std::memcpy(mapping_.data_ptr(), token_slots.data(), static_cast<size_t>(n) * 4);
    } else {
      // The slot's last copy was enqueued two uploads ago: in the engine's pipeline (at most
      // one step running while the next is staged) it has run, and the wait returns at once.
      const int k = next_staging_;
      next_staging_ = (next_staging_ + 1) % kStagingSlots;
      if (staged_[k] != nullptr) staged_[k]->synchronize();
      const Tensor& staging = host_staging_[k];
      std::memcpy(staging.data_ptr(), token_slots.data(), static_cast<size_t>(n) * 4);
      Tensor mapping = mapping_;
      mapping.narrow(0, 0, n).copy_from_async(staging.narrow(0, 0, n), stream);
      if (staged_[k] == nullptr) staged_[k] = std::make_unique<Event>();
      staged_[k]->record(stream);
    }
  }
  return no_lora;
}

void LoraBatchMeta::prepare_from_buffer(int num_tokens, bool no_lora, const Stream& stream) {
  LORAPLEX_CHECK(num_tokens >= 0 && num_tokens <= max_num_tokens_, "LoraBatchMeta: ", num_tokens,
                 " tokens, expected 0..", max_num_tokens_);
  LORAPLEX_CHECK(stream.device() == device_, "LoraBatchMeta on ", device_,
                 " prepared on a stream of ", stream.device());
  num_tokens_ = num_tokens;
  no_lora_ = no_lora;
  build_stream_ = stream.handle();
  settled_ = false;
  kernels::cpu::LoraMetaBuffers buffers;
  buffers.token_lora_mapping = mapping_.data<int32_t>();
  buffers.sorted_token_indices = sorted_.data<int32_t>();
  buffers.active_lora_ids = active_ids_.data<int32_t>();
  buffers.num_tokens_per_lora = counts_.data<int32_t>();
  buffers.lora_token_start_loc = start_loc_.data<int32_t>();
  buffers.num_active_loras = num_active_.data<int32_t>();
  throw_if_error(dispatch_build_lora_meta(num_tokens, max_loras_, buffers, stream));
}

kernels::LoraMetaView LoraBatchMeta::view() const {
  kernels::LoraMetaView v;
  v.num_tokens = num_tokens_;
  v.max_loras = max_loras_;
  v.token_lora_mapping = mapping_.data<int32_t>();
  v.sorted_token_indices = sorted_.data<int32_t>();
  v.active_lora_ids = active_ids_.data<int32_t>();
  v.num_tokens_per_lora = counts_.data<int32_t>();
  v.lora_token_start_loc = start_loc_.data<int32_t>();
  v.num_active_loras = num_active_.data<int32_t>();
  if (scratch_.defined()) {
    v.scratch = scratch_.data<float>();
    v.scratch_floats = scratch_.numel();
    v.counters = counters_.data<int32_t>();
    v.num_counters = counters_.numel();
  }
  v.settled = settled_;
  return v;
}

void LoraBatchMeta::note_op_enqueued(const Stream& stream) const {
  // Only an op on the build's stream orders the build before later kernels (its first kernel
  // starts after the build, or waits for it before letting anything after it launch).
  if (stream.handle() == build_stream_ && stream.device() == device_ && num_tokens_ > 0) {
    settled_ = true;
  }
}

namespace {
std::vector<int32_t> to_vector(const Tensor& t, int64_t n, const Stream& stream) {
  Tensor host = t.narrow(0, 0, n).to(Device::cpu(), stream);
  const int32_t* p = host.data<int32_t>();
  return std::vector<int32_t>(p, p + n);
}
}  // namespace

LoraBatchMeta::HostCopy LoraBatchMeta::to_host(const Stream& stream) const {
  stream.synchronize();
  HostCopy h;
  h.mapping = to_vector(mapping_, num_tokens_, stream);
  h.sorted_token_indices = to_vector(sorted_, num_tokens_, stream);
  h.active_lora_ids = to_vector(active_ids_, max_loras_ + 1, stream);
  h.num_tokens_per_lora = to_vector(counts_, max_loras_ + 1, stream);
  h.lora_token_start_loc = to_vector(start_loc_, max_loras_ + 2, stream);
  h.num_active_loras = to_vector(num_active_, 1, stream)[0];
  return h;
}

}  // namespace loraplex
