#include "loraplex/kernels/dispatch/base_ops.h"

#include "loraplex/kernels/dispatch/route.h"

namespace loraplex::kernels {

Status dispatch_gemm_xwt(const GemmArgs& args, const Stream& stream) {
  return route(&cpu::gemm_xwt, &cuda::gemm_xwt, args, stream);
}
Status dispatch_write_column(const WriteColumnArgs& args, const Stream& stream) {
  return route(&cpu::write_column, &cuda::write_column, args, stream);
}

Status dispatch_fill_uniform(const FillUniformArgs& args, const Stream& stream) {
  return route(&cpu::fill_uniform, &cuda::fill_uniform, args, stream);
}
Status dispatch_add_rms_norm(const AddRmsNormArgs& args, const Stream& stream) {
  return route(&cpu::add_rms_norm, &cuda::add_rms_norm, args, stream);
}
Status dispatch_rope_kv_write(const RopeKvWriteArgs& args, const Stream& stream) {
  return route(&cpu::rope_kv_write, &cuda::rope_kv_write, args, stream);
}
Status dispatch_qk_rms_norm(const QkRmsNormArgs& args, const Stream& stream) {
  return route(&cpu::qk_rms_norm, &cuda::qk_rms_norm, args, stream);
}
Status dispatch_paged_attention(const PagedAttentionArgs& args, const Stream& stream) {
  return route(&cpu::paged_attention, &cuda::paged_attention, args, stream);
}
Status dispatch_silu_mul(const SiluMulArgs& args, const Stream& stream) {
  return route(&cpu::silu_mul, &cuda::silu_mul, args, stream);
}
Status dispatch_argmax(const ArgmaxArgs& args, const Stream& stream) {
  return route(&cpu::argmax, &cuda::argmax, args, stream);
}
Status dispatch_feed_tokens(const FeedTokensArgs& args, const Stream& stream) {
  return route(&cpu::feed_tokens, &cuda::feed_tokens, args, stream);
}

Status dispatch_embedding_rows(const EmbeddingRowsArgs& args, const Stream& stream) {
  return route(&cpu::embedding_rows, &cuda::embedding_rows, args, stream);
}
Status dispatch_shard_token_ids(const ShardTokenIdsArgs& args, const Stream& stream) {
  return route(&cpu::shard_token_ids, &cuda::shard_token_ids, args, stream);
}
Status dispatch_topk_softmax(const TopkSoftmaxArgs& args, const Stream& stream) {
  return route(&cpu::topk_softmax, &cuda::topk_softmax, args, stream);
}
Status dispatch_gather_rows(const GatherRowsArgs& args, const Stream& stream) {
  return route(&cpu::gather_rows, &cuda::gather_rows, args, stream);
}
Status dispatch_scatter_rows(const ScatterRowsArgs& args, const Stream& stream) {
  return route(&cpu::scatter_rows, &cuda::scatter_rows, args, stream);
}
Status dispatch_sum_topk(const SumTopkArgs& args, const Stream& stream) {
  return route(&cpu::sum_topk, &cuda::sum_topk, args, stream);
}
Status dispatch_moe_expert_blocks(const MoeExpertBlocksArgs& args, const Stream& stream) {
  return route(&cpu::moe_expert_blocks, &cuda::moe_expert_blocks, args, stream);
}
Status dispatch_moe_expert_gemm(const MoeExpertGemmArgs& args, const Stream& stream) {
  return route(&cpu::moe_expert_gemm, &cuda::moe_expert_gemm, args, stream);
}

}  // namespace loraplex::kernels
