#pragma once
// PagedAttention's FlashInfer side (paged_attention.h) behind plain C++ signatures: only the
// FlashInfer translation units (flashinfer_*.cu) see FlashInfer's headers and its CCCL, which
// come before the toolkit's on their include path and nowhere else. Without the CUDA backend
// the functions report kUnsupported (paged_attention_no_cuda.cc).

#include <array>
#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"

namespace loraplex::model::flashinfer {

/// FlashInfer's PrefillPlanInfo, in the order of its ToVector().
using PlanInfo = std::array<int64_t, 15>;

struct Geometry {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t page_size = 0;
  DType dtype = DType::kBF16;
};

/// True when this build has FlashInfer kernels for `dtype` and `head_dim` (bf16/f16, 64, 128).
bool supports(DType dtype, int64_t head_dim);

/// Workspace that every plan of at most max_num_tokens rows and max_num_seqs sequences fits,
/// eager or graph_batch (see plan()), on CUDA device `device`.
struct WorkspaceBytes {
  int64_t float_bytes = 0;
  int64_t int_bytes = 0;
};
Status workspace_bytes(const Geometry& g, int64_t max_num_tokens, int64_t max_num_seqs, int device,
                       WorkspaceBytes* out);

struct PlanArgs {
  Geometry geometry;
  int64_t num_seqs = 0;
  int64_t num_tokens = 0;
  int32_t* qo_indptr = nullptr;    // [num_seqs + 1] host in
  int32_t* page_indptr = nullptr;  // [num_seqs + 1] host in
  /// A fixed grid for a pure-decode batch (one row per sequence): the plan is then the same
  /// for every batch of num_seqs sequences, and a graph captured after one stays valid.
  bool cuda_graph = false;
  void* float_workspace = nullptr;  // device, float_bytes
  int64_t float_bytes = 0;
  void* int_workspace = nullptr;  // device, int_bytes: written by an H2D copy on the stream
  int64_t int_bytes = 0;
  void* int_staging = nullptr;  // pinned host, int_bytes: the copy's source
};
/// FlashInfer's PrefillPlan: work lists into int_staging, then one copy to int_workspace
/// enqueued on `stream`. Checks that the plan fits the workspace (never writes past it).
Status plan(const PlanArgs& a, const Stream& stream, PlanInfo* info);

struct RunArgs {
  Geometry geometry;
  PlanInfo info{};
  int64_t num_seqs = 0;
  float scale = 1.0f;
  const void* q = nullptr;  // [num_tokens, q_row_stride] device in; heads from column 0
  int64_t q_row_stride = 0;
  const void* k_cache = nullptr;           // [num_blocks, page_size, kv_heads, head_dim] device in
  const void* v_cache = nullptr;           // same
  const int32_t* qo_indptr = nullptr;      // [num_seqs + 1] device in
  const int32_t* page_indptr = nullptr;    // [num_seqs + 1] device in
  const int32_t* last_page_len = nullptr;  // [num_seqs] device in
  const int32_t* page_indices = nullptr;   // [page_indptr[num_seqs]] device in
  void* float_workspace = nullptr;
  void* int_workspace = nullptr;
  void* out = nullptr;  // [num_tokens, num_heads * head_dim] device out
};
/// One layer: FlashInfer's BatchPrefillWithPagedKVCacheDispatched (plus its merge kernel when
/// the plan splits the KV). Capturable.
Status run(const RunArgs& a, const Stream& stream);

}  // namespace loraplex::model::flashinfer
