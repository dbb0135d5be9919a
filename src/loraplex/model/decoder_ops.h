#pragma once
// The decoder's non-LoRA ops (kernels/model_ops.h) under the names the model code uses: cpu::
// runs the reference, cuda:: the CUDA version on a Stream (through kernels/dispatch/base_ops.h),
// run() picks one by the stream's device.

#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/kernels/model_ops.h"

namespace loraplex::model::ops {

using kernels::AddRmsNormArgs;
using kernels::ArgmaxArgs;
using kernels::FeedTokensArgs;
using kernels::FillUniformArgs;
using kernels::FusedLoraExpand;
using kernels::KvCacheView;
using kernels::PagedAttentionArgs;
using kernels::QkRmsNormArgs;
using kernels::RopeKvWriteArgs;
using kernels::SiluMulArgs;
using kernels::uniform_at;

namespace cpu {
using kernels::cpu::add_rms_norm;
using kernels::cpu::argmax;
using kernels::cpu::feed_tokens;
using kernels::cpu::fill_uniform;
using kernels::cpu::paged_attention;
using kernels::cpu::qk_rms_norm;
using kernels::cpu::rope_kv_write;
using kernels::cpu::silu_mul;
}  // namespace cpu

namespace cuda {
Status fill_uniform(const FillUniformArgs& a, const Stream& stream);
Status add_rms_norm(const AddRmsNormArgs& a, const Stream& stream);
Status rope_kv_write(const RopeKvWriteArgs& a, const Stream& stream);
Status qk_rms_norm(const QkRmsNormArgs& a, const Stream& stream);
Status paged_attention(const PagedAttentionArgs& a, const Stream& stream);
Status silu_mul(const SiluMulArgs& a, const Stream& stream);
Status argmax(const ArgmaxArgs& a, const Stream& stream);
Status feed_tokens(const FeedTokensArgs& a, const Stream& stream);
}  // namespace cuda

/// Routes to cpu:: or cuda:: by the stream's device.
template <typename Args>
Status run(Status (*cpu_fn)(const Args&), Status (*cuda_fn)(const Args&, const Stream&),
           const Args& args, const Stream& stream) {
  return stream.device().is_cpu() ? cpu_fn(args) : cuda_fn(args, stream);
}

}  // namespace loraplex::model::ops
