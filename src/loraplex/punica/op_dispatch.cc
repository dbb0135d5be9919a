#include "loraplex/punica/op_dispatch.h"

namespace loraplex {
namespace {

// The CUDA kernels are wired in by kernels/cuda; until a kernel exists for an op the GPU
// path reports it instead of silently running something else.
Status no_cuda_kernel(const char* op) {
  return unsupported(op, " has no CUDA kernel in this build");
}

}  // namespace

Status dispatch_build_lora_meta(int32_t num_tokens, int32_t max_loras,
                                const kernels::cpu::LoraMetaBuffers& buffers,
                                const Stream& stream) {
  if (stream.device().is_cpu())
    return kernels::cpu::build_lora_meta(num_tokens, max_loras, buffers);
  return no_cuda_kernel("build_lora_meta");
}

Status dispatch_lora_shrink(const kernels::ShrinkArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_shrink(args, meta);
  return no_cuda_kernel("lora_shrink");
}

Status dispatch_lora_expand(const kernels::ExpandArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_expand(args, meta);
  return no_cuda_kernel("lora_expand");
}

Status dispatch_bgmv_shrink(const kernels::ShrinkArgs& args, const int32_t* token_lora_mapping,
                            const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::bgmv_shrink(args, token_lora_mapping);
  return no_cuda_kernel("bgmv_shrink");
}

Status dispatch_bgmv_expand(const kernels::ExpandArgs& args, const int32_t* token_lora_mapping,
                            const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::bgmv_expand(args, token_lora_mapping);
  return no_cuda_kernel("bgmv_expand");
}

Status dispatch_lora_linear(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                            const kernels::LoraMetaView& meta, const Stream& stream) {
  if (stream.device().is_cpu()) {
    LORAPLEX_RETURN_IF_ERROR(kernels::cpu::lora_shrink(shrink, meta));
    return kernels::cpu::lora_expand(expand, meta);
  }
  return no_cuda_kernel("lora_linear");
}

Status dispatch_lora_expand_fp8(const kernels::ExpandFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_expand_fp8(args, meta);
  return no_cuda_kernel("lora_expand_fp8");
}

Status dispatch_quantize_intermediate_fp8(const kernels::QuantizeIntermediateArgs& args,
                                          const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::quantize_intermediate_fp8(args);
  return no_cuda_kernel("quantize_intermediate_fp8");
}

Status dispatch_lora_embedding(const kernels::EmbeddingLoraArgs& args, const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_embedding(args);
  return no_cuda_kernel("lora_embedding");
}

Status dispatch_moe_lora_align(const kernels::MoeAlignArgs& args, const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::moe_lora_align_block_size(args);
  return no_cuda_kernel("moe_lora_align_block_size");
}

Status dispatch_fused_moe_lora(const kernels::FusedMoeLoraArgs& args, const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::fused_moe_lora(args);
  return no_cuda_kernel("fused_moe_lora");
}

}  // namespace loraplex
