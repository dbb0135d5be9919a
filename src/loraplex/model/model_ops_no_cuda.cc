// Without the CUDA backend the cuda:: entries of model_ops.h report kUnsupported, so a CUDA
// tensor reaching them gives a clear error instead of a link failure.

#include "loraplex/model/model_ops.h"

namespace loraplex::model::ops::cuda {
namespace {
Status no_cuda(const char* op) {
  return unsupported(op, ": this build of loraplex has no CUDA backend");
}
}  // namespace

Status fill_uniform(const FillUniformArgs&, const Stream&) { return no_cuda("fill_uniform"); }
Status embedding(const EmbeddingArgs&, const Stream&) { return no_cuda("embedding"); }
Status add_rms_norm(const AddRmsNormArgs&, const Stream&) { return no_cuda("add_rms_norm"); }
Status rope_kv_write(const RopeKvWriteArgs&, const Stream&) { return no_cuda("rope_kv_write"); }
Status paged_attention(const PagedAttentionArgs&, const Stream&) {
  return no_cuda("paged_attention");
}
Status silu_mul(const SiluMulArgs&, const Stream&) { return no_cuda("silu_mul"); }

Status argmax(const ArgmaxArgs&, const Stream&) { return no_cuda("argmax"); }

}  // namespace loraplex::model::ops::cuda
