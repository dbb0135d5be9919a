#include "loraplex/punica/lora_dispatch.h"

#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/dispatch/route.h"

namespace loraplex {
namespace {

using kernels::route;

// The plans' device: the caller's, or the stream device's own (read into `storage`).
const kernels::planner::LoraDevice& or_default(const kernels::planner::LoraDevice* lora_device,
                                               const Stream& stream,
                                               kernels::planner::LoraDevice& storage) {
  if (lora_device != nullptr) return *lora_device;
  storage = kernels::cuda::lora_device(stream.device().index);
  return storage;
}

}  // namespace

kernels::planner::LoraDevice lora_device_of(Device device) {
  return device.is_cuda() ? kernels::cuda::lora_device(device.index)
                          : kernels::planner::LoraDevice{};
}

Status dispatch_build_lora_meta(int32_t num_tokens, int32_t max_loras,
                                const kernels::cpu::LoraMetaBuffers& buffers,
                                const Stream& stream) {
  return route(
      stream, [&] { return kernels::cpu::build_lora_meta(num_tokens, max_loras, buffers); },
      [&](cuda_rt::StreamHandle handle) {
        return kernels::cuda::build_lora_meta(num_tokens, max_loras, buffers, handle);
      });
}

Status dispatch_lora_shrink(const kernels::ShrinkArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream, const kernels::planner::LoraDevice* lora_device) {
  return route(
      stream, [&] { return kernels::cpu::lora_shrink(args, meta); },
      [&](cuda_rt::StreamHandle handle) {
        kernels::planner::LoraDevice storage;
        return kernels::cuda::lora_shrink(args, meta, or_default(lora_device, stream, storage),
                                          handle);
      });
}

Status dispatch_lora_expand(const kernels::ExpandArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream, const kernels::planner::LoraDevice* lora_device) {
  return route(
      stream, [&] { return kernels::cpu::lora_expand(args, meta); },
      [&](cuda_rt::StreamHandle handle) {
        kernels::planner::LoraDevice storage;
        return kernels::cuda::lora_expand(args, meta, or_default(lora_device, stream, storage),
                                          handle);
      });
}

Status dispatch_lora_linear(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                            const kernels::LoraMetaView& meta, const Stream& stream,
                            const kernels::planner::LoraDevice* lora_device) {
  return route(
      stream,
      [&] {
        LORAPLEX_RETURN_IF_ERROR(kernels::cpu::lora_shrink(shrink, meta));
        return kernels::cpu::lora_expand(expand, meta);
      },
      [&](cuda_rt::StreamHandle handle) {
        kernels::planner::LoraDevice storage;
        return kernels::cuda::lora_linear(shrink, expand, meta,
                                          or_default(lora_device, stream, storage), handle);
      });
}

std::string lora_linear_path_of(const kernels::ShrinkArgs& shrink,
                                const kernels::ExpandArgs& expand,
                                const kernels::LoraMetaView& meta, Device device,
                                const kernels::planner::LoraDevice& lora_device) {
  if (device.is_cpu()) return "cpu";
  return kernels::planner::path_name(
      kernels::planner::plan_lora_linear(kernels::planner::linear_shape(shrink, expand, meta),
                                         lora_device)
          .path);
}

int64_t lora_linear_scratch_of(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                               const kernels::LoraMetaView& meta, Device device,
                               const kernels::planner::LoraDevice& lora_device) {
  if (device.is_cpu()) return 0;
  return kernels::planner::plan_lora_linear(kernels::planner::linear_shape(shrink, expand, meta),
                                            lora_device)
      .workspace.scratch_floats;
}

Status dispatch_lora_expand_fp8(const kernels::ExpandFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream) {
  return route(
      stream, [&] { return kernels::cpu::lora_expand_fp8(args, meta); },
      [&](cuda_rt::StreamHandle handle) {
        return kernels::cuda::lora_expand_fp8(args, meta, handle);
      });
}

Status dispatch_lora_shrink_fp8(const kernels::ShrinkFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream) {
  return route(
      stream, [&] { return kernels::cpu::lora_shrink_fp8(args, meta); },
      [&](cuda_rt::StreamHandle handle) {
        return kernels::cuda::lora_shrink_fp8(args, meta, handle);
      });
}

Status dispatch_quantize_intermediate_fp8(const kernels::QuantizeIntermediateArgs& args,
                                          const Stream& stream) {
  return route(&kernels::cpu::quantize_intermediate_fp8, &kernels::cuda::quantize_intermediate_fp8,
               args, stream);
}

Status dispatch_lora_embedding(const kernels::EmbeddingLoraArgs& args, const Stream& stream) {
  return route(&kernels::cpu::lora_embedding, &kernels::cuda::lora_embedding, args, stream);
}

Status dispatch_moe_lora_align(const kernels::MoeAlignArgs& args, const Stream& stream) {
  return route(&kernels::cpu::moe_lora_align_block_size, &kernels::cuda::moe_lora_align_block_size,
               args, stream);
}

Status dispatch_fused_moe_lora(const kernels::FusedMoeLoraArgs& args, const Stream& stream) {
  return route(&kernels::cpu::fused_moe_lora, &kernels::cuda::fused_moe_lora, args, stream);
}

}  // namespace loraplex
