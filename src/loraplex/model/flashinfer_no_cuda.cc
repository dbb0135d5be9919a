// Without the CUDA backend there is no FlashInfer: supports() is false, so PagedAttention
// never calls the rest, which reports kUnsupported instead of failing to link.

#include "loraplex/model/cuda/flashinfer_attention.h"

namespace loraplex::model::flashinfer {
namespace {
Status no_cuda(const char* what) {
  return unsupported(what, ": this build of loraplex has no CUDA backend");
}
}  // namespace

bool supports(DType, int64_t) { return false; }
Status workspace_bytes(const Geometry&, int64_t, int64_t, int, WorkspaceBytes*) {
  return no_cuda("flashinfer workspace");
}
Status plan(const PlanArgs&, const Stream&, PlanInfo*) { return no_cuda("flashinfer plan"); }
Status run(const RunArgs&, const Stream&) { return no_cuda("flashinfer run"); }

}  // namespace loraplex::model::flashinfer
