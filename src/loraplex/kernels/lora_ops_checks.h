#pragma once
// Argument checks shared by the CPU and CUDA launchers, so both reject the same inputs with
// the same messages. They read only sizes, dtypes and pointers, never device memory.

#include "loraplex/core/status.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels {

Status check_shrink_args(const ShrinkArgs& args);
Status check_expand_args(const ExpandArgs& args);
/// Checks a host-resident ranks array [num_slices, max_loras]: every entry in [0, max_rank].
Status check_ranks_host(const int32_t* ranks, int num_slices, int max_loras, int max_rank);
/// Checks a host-resident token mapping: every slot in [-1, max_loras).
Status check_mapping_host(const int32_t* mapping, int64_t num_tokens, int max_loras);

}  // namespace loraplex::kernels
