// Without the CUDA backend the cuda:: entries of model_ops.h report kUnsupported, so a CUDA
// tensor reaching them gives a clear error instead of a link failure.

#include "loraplex/model/model_ops.h"

namespace loraplex::model::ops::cuda {
namespace {
Status no_cuda(const char* op) {
  return unsupported(op, ": this build of loraplex has no CUDA backend");
}
}  // namespace

Status embedding(const EmbeddingArgs&, const Stream&) { return no_cuda("embedding"); }
Status rms_norm(const RmsNormArgs&, const Stream&) { return no_cuda("rms_norm"); }
Status rope(const RopeArgs&, const Stream&) { return no_cuda("rope"); }
Status kv_write(const KvWriteArgs&, const Stream&) { return no_cuda("kv_write"); }
Status paged_attention(const PagedAttentionArgs&, const Stream&) {
  return no_cuda("paged_attention");
}
Status silu_mul(const SiluMulArgs&, const Stream&) { return no_cuda("silu_mul"); }
Status add(const AddArgs&, const Stream&) { return no_cuda("add"); }

Status argmax(const ArgmaxArgs&, const Stream&) { return no_cuda("argmax"); }

}  // namespace loraplex::model::ops::cuda
