#pragma once
// Routes each LoRA op to the CPU reference or the CUDA kernels by the stream's device
// (kernels/dispatch/route.h; the base model's ops: kernels/dispatch/base_ops.h). The LoRA ops'
// CUDA plans are made for `lora_device` (the device's limits and the tuning table in force);
// nullptr: the stream device's own (lora_device_of).

#include <string>

#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/kernels/planner/lora_plan.h"

namespace loraplex {

/// The device LoRA plans are made for on `device`: a CUDA device's limits and its architecture's
/// tuning table, the defaults on the CPU.
kernels::planner::LoraDevice lora_device_of(Device device);

Status dispatch_build_lora_meta(int32_t num_tokens, int32_t max_loras,
                                const kernels::cpu::LoraMetaBuffers& buffers, const Stream& stream);
Status dispatch_lora_shrink(const kernels::ShrinkArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream,
                            const kernels::planner::LoraDevice* lora_device = nullptr);
Status dispatch_lora_expand(const kernels::ExpandArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream,
                            const kernels::planner::LoraDevice* lora_device = nullptr);
/// Shrink and expand of one layer in one call: on CUDA small batches run the decode kernel
/// pair (split-K shrink partial sums in the metadata's scratch, `shrink.out` not written) or
/// the cluster layer; otherwise shrink into `shrink.out`, then expand from it.
Status dispatch_lora_linear(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                            const kernels::LoraMetaView& meta, const Stream& stream,
                            const kernels::planner::LoraDevice* lora_device = nullptr);
/// The path dispatch_lora_linear takes on `device`: "cpu", or the CUDA plan's
/// (kernels::planner::path_name).
std::string lora_linear_path_of(const kernels::ShrinkArgs& shrink,
                                const kernels::ExpandArgs& expand,
                                const kernels::LoraMetaView& meta, Device device,
                                const kernels::planner::LoraDevice& lora_device);
/// The metadata scratch (floats) that dispatch_lora_linear needs on `device` (0 on the CPU).
int64_t lora_linear_scratch_of(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                               const kernels::LoraMetaView& meta, Device device,
                               const kernels::planner::LoraDevice& lora_device);
Status dispatch_lora_expand_fp8(const kernels::ExpandFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream);
Status dispatch_lora_shrink_fp8(const kernels::ShrinkFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream);
Status dispatch_quantize_intermediate_fp8(const kernels::QuantizeIntermediateArgs& args,
                                          const Stream& stream);
Status dispatch_lora_embedding(const kernels::EmbeddingLoraArgs& args, const Stream& stream);
Status dispatch_moe_lora_align(const kernels::MoeAlignArgs& args, const Stream& stream);
Status dispatch_fused_moe_lora(const kernels::FusedMoeLoraArgs& args, const Stream& stream);

}  // namespace loraplex
