#pragma once
// The launchers of the CUDA LoRA kernels: each runs one plan of kernels/planner/lora_plan.h on the
// arguments' pointers and decides nothing itself. Internal to the CUDA backend (lora_ops_cuda.cc,
// the entry points, plans and calls them). Plain C++ declarations.

#include <cstdint>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/status.h"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels::cuda {

using StreamHandle = cuda_rt::StreamHandle;

/// The per-token shrink + expand pair (gather_lora.cu).
Status launch_gather(const GatherPlan& plan, const ShrinkArgs& shrink, const ExpandArgs& expand,
                     const LoraMetaView& meta, StreamHandle stream);
/// The one-kernel cluster layer (cluster_lora.cu).
Status launch_cluster(const ClusterPlan& plan, const ShrinkArgs& shrink, const ExpandArgs& expand,
                      const LoraMetaView& meta, StreamHandle stream);
/// The tensor-core prefill shrink and, where the plan defers it, its split-K sum kernel
/// (prefill_shrink.cu).
Status launch_prefill(const PrefillPlan& plan, const ShrinkArgs& shrink, const LoraMetaView& meta,
                      StreamHandle stream);
/// The software-pipelined tensor-core expand (expand_pipelined.cu).
Status launch_expand_pipelined(const ExpandPlan& plan, const ExpandArgs& expand,
                               const LoraMetaView& meta, StreamHandle stream);
/// The tensor-core expand one item at a time (shrink_expand.cu).
Status launch_expand_tc(const ExpandPlan& plan, const ExpandArgs& expand, const LoraMetaView& meta,
                        StreamHandle stream);
/// The generic kernels (any dtype and strides), tokens by `mapping` (shrink_expand.cu).
Status launch_shrink_generic(const ShrinkArgs& shrink, const int32_t* mapping, StreamHandle stream);
Status launch_expand_generic(const ExpandArgs& expand, const int32_t* mapping, StreamHandle stream);

}  // namespace loraplex::kernels::cuda
