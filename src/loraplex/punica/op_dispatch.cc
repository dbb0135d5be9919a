#include "loraplex/punica/op_dispatch.h"

#include "loraplex/kernels/cuda/lora_ops_cuda.h"

namespace loraplex {
namespace {

// Kernels launch on the calling thread's current device: make it the stream's device.
Status select_device(const Stream& stream) {
  try {
    const int want = stream.device().index;
    if (cuda_rt::current_device() != want) cuda_rt::set_device(want);
  } catch (const Error& e) {
    return Status(StatusCode::kCudaError, e.what());
  }
  return Status();
}

const kernels::cuda::LoraDevice& or_default(const kernels::cuda::LoraDevice* lora_device,
                                            const Stream& stream,
                                            kernels::cuda::LoraDevice& storage) {
  if (lora_device != nullptr) return *lora_device;
  storage = kernels::cuda::lora_device(stream.device().index);
  return storage;
}

// An op with a CPU version and a CUDA version on a stream handle.
template <typename Args>
Status route(Status (*cpu_fn)(const Args&), Status (*cuda_fn)(const Args&, cuda_rt::StreamHandle),
             const Args& args, const Stream& stream) {
  if (stream.device().is_cpu()) return cpu_fn(args);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return cuda_fn(args, stream.handle());
}

}  // namespace

Status dispatch_build_lora_meta(int32_t num_tokens, int32_t max_loras,
                                const kernels::cpu::LoraMetaBuffers& buffers,
                                const Stream& stream) {
  if (stream.device().is_cpu())
    return kernels::cpu::build_lora_meta(num_tokens, max_loras, buffers);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return kernels::cuda::build_lora_meta(num_tokens, max_loras, buffers, stream.handle());
}

Status dispatch_lora_shrink(const kernels::ShrinkArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream, const kernels::cuda::LoraDevice* lora_device) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_shrink(args, meta);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  kernels::cuda::LoraDevice storage;
  return kernels::cuda::lora_shrink(args, meta, or_default(lora_device, stream, storage),
                                    stream.handle());
}

Status dispatch_lora_expand(const kernels::ExpandArgs& args, const kernels::LoraMetaView& meta,
                            const Stream& stream, const kernels::cuda::LoraDevice* lora_device) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_expand(args, meta);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  kernels::cuda::LoraDevice storage;
  return kernels::cuda::lora_expand(args, meta, or_default(lora_device, stream, storage),
                                    stream.handle());
}

Status dispatch_bgmv_shrink(const kernels::ShrinkArgs& args, const int32_t* token_lora_mapping,
                            const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::bgmv_shrink(args, token_lora_mapping);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return kernels::cuda::bgmv_shrink(args, token_lora_mapping, stream.handle());
}

Status dispatch_bgmv_expand(const kernels::ExpandArgs& args, const int32_t* token_lora_mapping,
                            const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::bgmv_expand(args, token_lora_mapping);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return kernels::cuda::bgmv_expand(args, token_lora_mapping, stream.handle());
}

Status dispatch_lora_linear(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                            const kernels::LoraMetaView& meta, const Stream& stream,
                            const kernels::cuda::LoraDevice* lora_device) {
  if (stream.device().is_cpu()) {
    LORAPLEX_RETURN_IF_ERROR(kernels::cpu::lora_shrink(shrink, meta));
    return kernels::cpu::lora_expand(expand, meta);
  }
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  kernels::cuda::LoraDevice storage;
  return kernels::cuda::lora_linear(shrink, expand, meta, or_default(lora_device, stream, storage),
                                    stream.handle());
}

std::string lora_linear_path_of(const kernels::ShrinkArgs& shrink,
                                const kernels::ExpandArgs& expand,
                                const kernels::LoraMetaView& meta, Device device,
                                const kernels::cuda::LoraDevice& lora_device) {
  if (device.is_cpu()) return "cpu";
  return kernels::cuda::path_name(
      kernels::cuda::plan_lora_linear(kernels::cuda::linear_shape(shrink, expand, meta),
                                      lora_device)
          .path);
}

int64_t lora_linear_scratch_of(const kernels::ShrinkArgs& shrink, const kernels::ExpandArgs& expand,
                               const kernels::LoraMetaView& meta, Device device,
                               const kernels::cuda::LoraDevice& lora_device) {
  if (device.is_cpu()) return 0;
  return kernels::cuda::plan_lora_linear(kernels::cuda::linear_shape(shrink, expand, meta),
                                         lora_device)
      .workspace.scratch_floats;
}

Status dispatch_lora_expand_fp8(const kernels::ExpandFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_expand_fp8(args, meta);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return kernels::cuda::lora_expand_fp8(args, meta, stream.handle());
}

Status dispatch_lora_shrink_fp8(const kernels::ShrinkFp8Args& args,
                                const kernels::LoraMetaView& meta, const Stream& stream) {
  if (stream.device().is_cpu()) return kernels::cpu::lora_shrink_fp8(args, meta);
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return kernels::cuda::lora_shrink_fp8(args, meta, stream.handle());
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

Status dispatch_gemm_xwt(const kernels::GemmArgs& args, const Stream& stream) {
  return route(&kernels::cpu::gemm_xwt, &kernels::cuda::gemm_xwt, args, stream);
}
Status dispatch_write_column(const kernels::WriteColumnArgs& args, const Stream& stream) {
  return route(&kernels::cpu::write_column, &kernels::cuda::write_column, args, stream);
}

Status dispatch_fill_uniform(const kernels::FillUniformArgs& args, const Stream& stream) {
  return route(&kernels::cpu::fill_uniform, &kernels::cuda::fill_uniform, args, stream);
}
Status dispatch_add_rms_norm(const kernels::AddRmsNormArgs& args, const Stream& stream) {
  return route(&kernels::cpu::add_rms_norm, &kernels::cuda::add_rms_norm, args, stream);
}
Status dispatch_rope_kv_write(const kernels::RopeKvWriteArgs& args, const Stream& stream) {
  return route(&kernels::cpu::rope_kv_write, &kernels::cuda::rope_kv_write, args, stream);
}
Status dispatch_qk_rms_norm(const kernels::QkRmsNormArgs& args, const Stream& stream) {
  return route(&kernels::cpu::qk_rms_norm, &kernels::cuda::qk_rms_norm, args, stream);
}
Status dispatch_paged_attention(const kernels::PagedAttentionArgs& args, const Stream& stream) {
  return route(&kernels::cpu::paged_attention, &kernels::cuda::paged_attention, args, stream);
}
Status dispatch_silu_mul(const kernels::SiluMulArgs& args, const Stream& stream) {
  return route(&kernels::cpu::silu_mul, &kernels::cuda::silu_mul, args, stream);
}
Status dispatch_argmax(const kernels::ArgmaxArgs& args, const Stream& stream) {
  return route(&kernels::cpu::argmax, &kernels::cuda::argmax, args, stream);
}
Status dispatch_feed_tokens(const kernels::FeedTokensArgs& args, const Stream& stream) {
  return route(&kernels::cpu::feed_tokens, &kernels::cuda::feed_tokens, args, stream);
}

Status dispatch_embedding_rows(const kernels::EmbeddingRowsArgs& args, const Stream& stream) {
  return route(&kernels::cpu::embedding_rows, &kernels::cuda::embedding_rows, args, stream);
}
Status dispatch_shard_token_ids(const kernels::ShardTokenIdsArgs& args, const Stream& stream) {
  return route(&kernels::cpu::shard_token_ids, &kernels::cuda::shard_token_ids, args, stream);
}
Status dispatch_topk_softmax(const kernels::TopkSoftmaxArgs& args, const Stream& stream) {
  return route(&kernels::cpu::topk_softmax, &kernels::cuda::topk_softmax, args, stream);
}
Status dispatch_gather_rows(const kernels::GatherRowsArgs& args, const Stream& stream) {
  return route(&kernels::cpu::gather_rows, &kernels::cuda::gather_rows, args, stream);
}
Status dispatch_scatter_rows(const kernels::ScatterRowsArgs& args, const Stream& stream) {
  return route(&kernels::cpu::scatter_rows, &kernels::cuda::scatter_rows, args, stream);
}
Status dispatch_sum_topk(const kernels::SumTopkArgs& args, const Stream& stream) {
  return route(&kernels::cpu::sum_topk, &kernels::cuda::sum_topk, args, stream);
}

}  // namespace loraplex
