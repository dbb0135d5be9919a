// PagedAttention's FlashInfer glue (flashinfer_attention.h): workspace bounds, FlashInfer's
// PrefillPlan on pinned staging, and the kernel launch from a plan. FlashInfer reports errors
// by throwing; they become a Status here and never cross into the rest of the project.

#include <cuda_runtime.h>

#include <algorithm>
#include <exception>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/utils.cuh>
#include <vector>

#include "loraplex/model/cuda/flashinfer_attention.h"
#include "loraplex/model/cuda/flashinfer_prefill.cuh"

namespace loraplex::model::flashinfer {
namespace {

namespace fi = ::flashinfer;

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  return Status(StatusCode::kCudaError, detail::concat(what, ": ", cudaGetErrorString(err)));
}

// Runs `fn` (returning Status), turning FlashInfer's exceptions into a Status.
template <typename Fn>
Status guarded(const char* what, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, detail::concat(what, ": ", e.what()));
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of an AlignedAllocator allocation, with the worst-case padding before it.
int64_t padded(int64_t bytes) { return ceil_div(bytes, 16) * 16 + 16; }

Status check_geometry(const Geometry& g, const char* what) {
  LORAPLEX_ENSURE(supports(g.dtype, g.head_dim) && g.num_kv_heads >= 1 &&
                      g.num_heads % g.num_kv_heads == 0 && g.page_size >= 1,
                  what, ": no FlashInfer kernel for ", g.dtype, ", head dim ", g.head_dim, ", ",
                  g.num_heads, "/", g.num_kv_heads, " heads, page size ", g.page_size);
  return Status();
}

// PrefillPlan's batch size bound when it splits the KV: two CTAs per SM, shared by the KV heads.
Status split_batch_size(const Geometry& g, int device, int64_t* out) {
  int num_sm = 0;
  LORAPLEX_RETURN_IF_ERROR(
      cuda_status(cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, device),
                  "flashinfer: SM count"));
  *out = 2 * static_cast<int64_t>(num_sm) / g.num_kv_heads;
  return Status();
}

// PrefillPlanInfo from the fields its ToVector() wrote (without FromVector's allocation, so
// that run() allocates nothing; plan() checks that the two agree).
fi::PrefillPlanInfo from_array(const PlanInfo& v) {
  fi::PrefillPlanInfo p;
  p.padded_batch_size = v[0];
  p.total_num_rows = v[1];
  p.total_num_rows_offset = v[2];
  p.cta_tile_q = v[3];
  p.request_indices_offset = v[4];
  p.qo_tile_indices_offset = v[5];
  p.kv_tile_indices_offset = v[6];
  p.merge_indptr_offset = v[7];
  p.o_indptr_offset = v[8];
  p.kv_chunk_size_ptr_offset = v[9];
  p.v_offset = v[10];
  p.s_offset = v[11];
  p.block_valid_mask_offset = v[12];
  p.enable_cuda_graph = v[13] != 0;
  p.split_kv = v[14] != 0;
  return p;
}

template <typename T>
Status run_typed(const RunArgs& a, const Stream& stream) {
  const fi::PrefillPlanInfo info = from_array(a.info);
  const Geometry& g = a.geometry;
  PagedParams<T> p;
  p.q = static_cast<T*>(const_cast<void*>(a.q));
  p.paged_kv = fi::paged_kv_t<T, int32_t>(
      static_cast<uint32_t>(g.num_kv_heads), static_cast<uint32_t>(g.page_size),
      static_cast<uint32_t>(g.head_dim), static_cast<uint32_t>(a.num_seqs), fi::QKVLayout::kNHD,
      static_cast<T*>(const_cast<void*>(a.k_cache)), static_cast<T*>(const_cast<void*>(a.v_cache)),
      const_cast<int32_t*>(a.page_indices), const_cast<int32_t*>(a.page_indptr),
      const_cast<int32_t*>(a.last_page_len));
  p.q_indptr = const_cast<int32_t*>(a.qo_indptr);
  p.o = static_cast<T*>(a.out);
  p.lse = nullptr;
  p.num_qo_heads = static_cast<uint32_t>(g.num_heads);
  p.group_size = fi::uint_fastdiv(static_cast<uint32_t>(g.num_heads / g.num_kv_heads));
  p.q_stride_n = static_cast<int32_t>(a.q_row_stride);
  p.q_stride_h = static_cast<int32_t>(g.head_dim);
  p.window_left = -1;
  p.logits_soft_cap = 0.0f;
  p.sm_scale = a.scale;
  p.rope_rcp_scale = 1.0f;
  p.rope_rcp_theta = 1.0f;

  void* ints = a.int_workspace;
  p.request_indices = fi::GetPtrFromBaseOffset<int32_t>(ints, info.request_indices_offset);
  p.qo_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(ints, info.qo_tile_indices_offset);
  p.kv_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(ints, info.kv_tile_indices_offset);
  p.o_indptr = fi::GetPtrFromBaseOffset<int32_t>(ints, info.o_indptr_offset);
  p.kv_chunk_size_ptr = fi::GetPtrFromBaseOffset<int32_t>(ints, info.kv_chunk_size_ptr_offset);
  T* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (info.split_kv) {
    p.merge_indptr = fi::GetPtrFromBaseOffset<int32_t>(ints, info.merge_indptr_offset);
    tmp_v = fi::GetPtrFromBaseOffset<T>(a.float_workspace, info.v_offset);
    tmp_s = fi::GetPtrFromBaseOffset<float>(a.float_workspace, info.s_offset);
  }
  p.padded_batch_size = static_cast<uint32_t>(info.padded_batch_size);
  p.max_total_num_rows = static_cast<uint32_t>(info.total_num_rows);
  if (info.enable_cuda_graph) {
    p.block_valid_mask = fi::GetPtrFromBaseOffset<bool>(ints, info.block_valid_mask_offset);
    p.total_num_rows = fi::GetPtrFromBaseOffset<uint32_t>(ints, info.total_num_rows_offset);
  }

  const auto s = static_cast<cudaStream_t>(stream.handle());
  cudaError_t err = cudaErrorInvalidConfiguration;
  auto launch = [&](auto head_dim) {
    constexpr uint32_t kHeadDim = decltype(head_dim)::value;
    switch (info.cta_tile_q) {
      case 16:
        err = prefill_paged<T, 16, kHeadDim>(p, tmp_v, tmp_s, s);
        return true;
      case 64:
        err = prefill_paged<T, 64, kHeadDim>(p, tmp_v, tmp_s, s);
        return true;
      case 128:
        err = prefill_paged<T, 128, kHeadDim>(p, tmp_v, tmp_s, s);
        return true;
      default:
        return false;
    }
  };
  bool known = false;
  if (g.head_dim == 64) known = launch(std::integral_constant<uint32_t, 64>{});
  if (g.head_dim == 128) known = launch(std::integral_constant<uint32_t, 128>{});
  LORAPLEX_ENSURE(known, "flashinfer: plan picked CTA_TILE_Q ", info.cta_tile_q, " for head dim ",
                  g.head_dim, ", which this build does not instantiate");
  return cuda_status(err, "flashinfer: batch prefill launch");
}

}  // namespace

bool supports(DType dtype, int64_t head_dim) {
  return (dtype == DType::kBF16 || dtype == DType::kF16) && (head_dim == 64 || head_dim == 128);
}

Status workspace_bytes(const Geometry& g, int64_t max_num_tokens, int64_t max_num_seqs, int device,
                       WorkspaceBytes* out) {
  LORAPLEX_RETURN_IF_ERROR(check_geometry(g, "flashinfer workspace"));
  return guarded("flashinfer workspace", [&]() -> Status {
    int64_t split_batch = 0;
    LORAPLEX_RETURN_IF_ERROR(split_batch_size(g, device, &split_batch));
    const int64_t group = g.num_heads / g.num_kv_heads;
    // PrefillPlan's padded batch (CTAs per KV head): when the KV is split, at most split_batch;
    // unsplit, one CTA per CTA_TILE_Q (>= 16) packed rows (row x group) of each sequence;
    // graph plans pad to at least split_batch.
    const int64_t tiles = ceil_div(max_num_tokens * group, 16) + max_num_seqs;
    const int64_t batch = std::max(split_batch, tiles);
    // Its int allocations: three work lists, o_indptr, the KV chunk size, the row count,
    // merge_indptr and the graph's valid-CTA mask.
    out->int_bytes = 3 * padded(4 * batch) + padded(4 * (max_num_seqs + 1)) + padded(4) +
                     padded(4) + padded(4 * (max_num_tokens + 1)) + padded(batch);
    // Split-KV partial outputs, ceil(padded batch x CTA_TILE_Q / group) rows of every head:
    // eager plans split only within split_batch CTAs (CTA_TILE_Q <= 128); graph plans (one row
    // per sequence) use the tile FlashInfer picks for a packed length of `group`.
    const int64_t graph_tile = fi::FA2DetermineCtaTileQ(group, static_cast<uint32_t>(g.head_dim));
    const int64_t graph_batch = std::max(split_batch, max_num_seqs * ceil_div(group, graph_tile));
    const int64_t rows =
        std::max(ceil_div(split_batch * 128, group), ceil_div(graph_batch * graph_tile, group));
    out->float_bytes = padded(g.num_heads * rows * g.head_dim * 4) + padded(g.num_heads * rows * 4);
    return Status();
  });
}

Status plan(const PlanArgs& a, const Stream& stream, PlanInfo* info) {
  LORAPLEX_RETURN_IF_ERROR(check_geometry(a.geometry, "flashinfer plan"));
  LORAPLEX_ENSURE(a.num_seqs >= 1 && a.num_tokens >= a.num_seqs, "flashinfer plan: ", a.num_seqs,
                  " sequences and ", a.num_tokens,
                  " tokens, expected at least one token per sequence");
  return guarded("flashinfer plan", [&]() -> Status {
    const Geometry& g = a.geometry;
    fi::PrefillPlanInfo pi;
    // The KV indptr counts pages (FlashInfer multiplies its KV chunk by the page size).
    // Overflowing either workspace throws (AlignedAllocator), before anything is written.
    LORAPLEX_RETURN_IF_ERROR(cuda_status(
        fi::PrefillPlan<int32_t>(
            a.float_workspace, static_cast<size_t>(a.float_bytes), a.int_workspace, a.int_staging,
            static_cast<size_t>(a.int_bytes), pi, a.qo_indptr, a.page_indptr,
            static_cast<uint32_t>(a.num_tokens), static_cast<uint32_t>(a.num_seqs),
            static_cast<uint32_t>(g.num_heads), static_cast<uint32_t>(g.num_kv_heads),
            static_cast<uint32_t>(g.head_dim), static_cast<uint32_t>(g.head_dim),
            static_cast<uint32_t>(g.page_size), a.cuda_graph, /*sizeof_dtype_o=*/2,
            /*window_left=*/-1, /*fixed_split_size=*/-1, /*disable_split_kv=*/false,
            /*num_colocated_ctas=*/0, /*uniform_q_len=*/a.cuda_graph ? 1 : 0,
            static_cast<cudaStream_t>(stream.handle()), /*kv_dtype_bytes=*/2),
        "flashinfer plan"));
    const std::vector<int64_t> v = pi.ToVector();
    LORAPLEX_ENSURE(v.size() == info->size(), "flashinfer plan: PrefillPlanInfo has ", v.size(),
                    " fields, expected ", info->size());
    std::copy(v.begin(), v.end(), info->begin());
    LORAPLEX_ENSURE(from_array(*info).ToVector() == v,
                    "flashinfer plan: PrefillPlanInfo's fields are not in the expected order");
    return Status();
  });
}

Status run(const RunArgs& a, const Stream& stream) {
  LORAPLEX_RETURN_IF_ERROR(check_geometry(a.geometry, "flashinfer run"));
  return guarded("flashinfer run", [&]() -> Status {
    if (a.geometry.dtype == DType::kBF16) return run_typed<__nv_bfloat16>(a, stream);
    return run_typed<half>(a, stream);
  });
}

}  // namespace loraplex::model::flashinfer
