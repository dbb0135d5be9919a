#include "loraplex/model/decoder_ops.h"

#include "loraplex/kernels/dispatch/base_ops.h"

namespace loraplex::model::ops::cuda {

Status fill_uniform(const FillUniformArgs& a, const Stream& stream) {
  return kernels::dispatch_fill_uniform(a, stream);
}
Status add_rms_norm(const AddRmsNormArgs& a, const Stream& stream) {
  return kernels::dispatch_add_rms_norm(a, stream);
}
Status rope_kv_write(const RopeKvWriteArgs& a, const Stream& stream) {
  return kernels::dispatch_rope_kv_write(a, stream);
}
Status qk_rms_norm(const QkRmsNormArgs& a, const Stream& stream) {
  return kernels::dispatch_qk_rms_norm(a, stream);
}
Status paged_attention(const PagedAttentionArgs& a, const Stream& stream) {
  return kernels::dispatch_paged_attention(a, stream);
}
Status silu_mul(const SiluMulArgs& a, const Stream& stream) {
  return kernels::dispatch_silu_mul(a, stream);
}
Status argmax(const ArgmaxArgs& a, const Stream& stream) {
  return kernels::dispatch_argmax(a, stream);
}
Status feed_tokens(const FeedTokensArgs& a, const Stream& stream) {
  return kernels::dispatch_feed_tokens(a, stream);
}

}  // namespace loraplex::model::ops::cuda
