// The CUDA entry points in a build without CUDA: every op reports that it is unsupported and
// every measurement helper throws, so callers need no #ifs.

#include "loraplex/core/error.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/kernels/cuda/kernel_trace.h"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/fp8_quant.h"
#include "loraplex/kernels/gemm.h"
#include "loraplex/kernels/layer_ops.h"
#include "loraplex/kernels/model_ops.h"
#include "loraplex/kernels/table_write.h"

namespace loraplex::kernels::cuda {
namespace {

Status no_cuda(const char* op) { return unsupported(op, ": this build has no CUDA backend"); }

[[noreturn]] void throw_no_cuda(const char* what) {
  LORAPLEX_FAIL(what, " needs CUDA, and this build has no CUDA backend");
}

}  // namespace

void set_kernel_trace(uint64_t*) {}
uint64_t* kernel_trace() { return nullptr; }

Status build_lora_meta(int32_t, int32_t, const cpu::LoraMetaBuffers&, StreamHandle) {
  return no_cuda("build_lora_meta");
}
LoraDevice lora_device(int) { return LoraDevice{}; }
Status lora_shrink(const ShrinkArgs&, const LoraMetaView&, const LoraDevice&, StreamHandle) {
  return no_cuda("lora_shrink");
}
Status lora_expand(const ExpandArgs&, const LoraMetaView&, const LoraDevice&, StreamHandle) {
  return no_cuda("lora_expand");
}
Status bgmv_shrink(const ShrinkArgs&, const int32_t*, StreamHandle) {
  return no_cuda("bgmv_shrink");
}
Status bgmv_expand(const ExpandArgs&, const int32_t*, StreamHandle) {
  return no_cuda("bgmv_expand");
}
Status lora_linear(const ShrinkArgs&, const ExpandArgs&, const LoraMetaView&, const LoraDevice&,
                   StreamHandle) {
  return no_cuda("lora_linear");
}
Status lora_expand_fp8(const ExpandFp8Args&, const LoraMetaView&, StreamHandle) {
  return no_cuda("lora_expand_fp8");
}
Status lora_shrink_fp8(const ShrinkFp8Args&, const LoraMetaView&, StreamHandle) {
  return no_cuda("lora_shrink_fp8");
}
Status quantize_intermediate_fp8(const QuantizeIntermediateArgs&, StreamHandle) {
  return no_cuda("quantize_intermediate_fp8");
}
Status lora_embedding(const EmbeddingLoraArgs&, StreamHandle) { return no_cuda("lora_embedding"); }
Status moe_lora_align_block_size(const MoeAlignArgs&, StreamHandle) {
  return no_cuda("moe_lora_align_block_size");
}
Status fused_moe_lora(const FusedMoeLoraArgs&, StreamHandle) { return no_cuda("fused_moe_lora"); }
Status write_column(const WriteColumnArgs&, StreamHandle) { return no_cuda("write_column"); }
Status gemm_xwt(const GemmArgs&, StreamHandle) { return no_cuda("linear_base"); }
Status quantize_rows_fp8(const QuantizeRowsFp8Args&, StreamHandle) {
  return no_cuda("quantize_rows_fp8");
}

Status fill_uniform(const FillUniformArgs&, StreamHandle) { return no_cuda("fill_uniform"); }
Status add_rms_norm(const AddRmsNormArgs&, StreamHandle) { return no_cuda("add_rms_norm"); }
Status rope_kv_write(const RopeKvWriteArgs&, StreamHandle) { return no_cuda("rope_kv_write"); }
Status qk_rms_norm(const QkRmsNormArgs&, StreamHandle) { return no_cuda("qk_rms_norm"); }
Status paged_attention(const PagedAttentionArgs&, StreamHandle) {
  return no_cuda("paged_attention");
}
Status silu_mul(const SiluMulArgs&, StreamHandle) { return no_cuda("silu_mul"); }
Status argmax(const ArgmaxArgs&, StreamHandle) { return no_cuda("argmax"); }
Status feed_tokens(const FeedTokensArgs&, StreamHandle) { return no_cuda("feed_tokens"); }

Status embedding_rows(const EmbeddingRowsArgs&, StreamHandle) {
  return no_cuda("embedding_lookup");
}
Status shard_token_ids(const ShardTokenIdsArgs&, StreamHandle) {
  return no_cuda("shard_token_ids");
}
Status topk_softmax(const TopkSoftmaxArgs&, StreamHandle) { return no_cuda("topk_softmax"); }
Status gather_rows(const GatherRowsArgs&, StreamHandle) { return no_cuda("gather_rows"); }
Status scatter_rows(const ScatterRowsArgs&, StreamHandle) { return no_cuda("scatter_rows"); }
Status sum_topk(const SumTopkArgs&, StreamHandle) { return no_cuda("sum_topk"); }
Status moe_expert_blocks(const MoeExpertBlocksArgs&, StreamHandle) {
  return no_cuda("moe_expert_blocks");
}
Status moe_expert_gemm(const MoeExpertGemmArgs&, StreamHandle) {
  return no_cuda("moe_expert_gemm");
}

DeviceInfo device_info(int) { throw_no_cuda("device_info"); }
Graph::~Graph() = default;
void Graph::begin_capture(cuda_rt::StreamHandle) { throw_no_cuda("a CUDA graph"); }
void Graph::end_capture() { throw_no_cuda("a CUDA graph"); }
void Graph::replay(cuda_rt::StreamHandle) const { throw_no_cuda("a CUDA graph"); }
Timer::Timer() { throw_no_cuda("a CUDA timer"); }
Timer::~Timer() = default;
void Timer::start(cuda_rt::StreamHandle) { throw_no_cuda("a CUDA timer"); }
void Timer::stop(cuda_rt::StreamHandle) { throw_no_cuda("a CUDA timer"); }
float Timer::elapsed_ms() const { throw_no_cuda("a CUDA timer"); }
void read_buffer(const void*, size_t, float*, cuda_rt::StreamHandle) {
  throw_no_cuda("read_buffer");
}
void fill_random(void*, DType, int64_t, uint64_t, float, cuda_rt::StreamHandle) {
  throw_no_cuda("fill_random");
}
double copy_bandwidth_gbs(size_t, int, cuda_rt::StreamHandle) {
  throw_no_cuda("copy_bandwidth_gbs");
}
double measured_sm_clock_mhz(cuda_rt::StreamHandle) { throw_no_cuda("measured_sm_clock_mhz"); }

}  // namespace loraplex::kernels::cuda
