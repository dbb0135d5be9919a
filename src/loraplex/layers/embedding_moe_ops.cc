#include "loraplex/layers/embedding_moe_ops.h"

#include <algorithm>

#include "loraplex/core/error.h"
#include "loraplex/kernels/dispatch/base_ops.h"

namespace loraplex::layer_ops {
namespace {

int64_t pitch(const Tensor& t) { return std::max(t.stride(0), t.size(1)); }

void check_rows(const Tensor& t, const char* op, const char* name) {
  LORAPLEX_CHECK(t.defined() && t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), op, ": ",
                 name, " must be 2-D with contiguous rows, got ",
                 t.defined() ? t.describe() : "undefined");
  LORAPLEX_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF16 || t.dtype() == DType::kBF16,
                 op, ": ", name, " has dtype ", t.dtype(),
                 ", expected float32, float16 or bfloat16");
}

void check_i32(const Tensor& t, int64_t n, const char* op, const char* name) {
  LORAPLEX_CHECK(t.defined() && t.dtype() == DType::kI32 && t.is_contiguous() && t.numel() == n, op,
                 ": ", name, " must be contiguous int32 with ", n, " elements, got ",
                 t.defined() ? t.describe() : "undefined");
}

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  LORAPLEX_CHECK(a.device() == b.device(), op, ": tensors on ", a.device(), " and ", b.device());
}

}  // namespace

void embedding_lookup(const Tensor& weight, const Tensor& ids, int64_t vocab_start, int64_t vocab,
                      Tensor& out, const Stream& stream) {
  const char* op = "embedding_lookup";
  check_rows(weight, op, "weight");
  check_rows(out, op, "out");
  check_same(weight, out, op);
  check_same(weight, ids, op);
  const int64_t t_count = out.size(0);
  check_i32(ids, t_count, op, "token ids");
  LORAPLEX_CHECK(out.size(1) == weight.size(1) && out.dtype() == weight.dtype(), op, ": out is ",
                 out.describe(), ", weight is ", weight.describe());
  kernels::EmbeddingRowsArgs a;
  a.dtype = weight.dtype();
  a.weight = weight.data_ptr();
  a.rows = weight.size(0);
  a.hidden = weight.size(1);
  a.ids = ids.data<int32_t>();
  a.num_tokens = t_count;
  a.vocab_start = vocab_start;
  a.vocab = vocab;
  a.out = out.data_ptr();
  a.out_stride = pitch(out);
  throw_if_error(kernels::dispatch_embedding_rows(a, stream));
}

void shard_token_ids(const Tensor& ids, int64_t vocab_start, int64_t rows, int32_t outside,
                     Tensor& local, const Stream& stream) {
  const char* op = "shard_token_ids";
  check_i32(ids, ids.numel(), op, "token ids");
  check_i32(local, ids.numel(), op, "local ids");
  check_same(ids, local, op);
  kernels::ShardTokenIdsArgs a;
  a.ids = ids.data<int32_t>();
  a.num_tokens = ids.numel();
  a.vocab_start = vocab_start;
  a.rows = rows;
  a.outside = outside;
  a.local = local.data<int32_t>();
  throw_if_error(kernels::dispatch_shard_token_ids(a, stream));
}

void topk_softmax(const Tensor& logits, int top_k, bool renormalize, Tensor& ids, Tensor& weights,
                  const Stream& stream) {
  const char* op = "topk_softmax";
  check_rows(logits, op, "router logits");
  const int64_t t_count = logits.size(0);
  const int num_experts = static_cast<int>(logits.size(1));
  LORAPLEX_CHECK(top_k >= 1 && top_k <= num_experts, op, ": top_k ", top_k, " outside [1, ",
                 num_experts, "]");
  check_i32(ids, t_count * top_k, op, "topk ids");
  LORAPLEX_CHECK(weights.defined() && weights.dtype() == DType::kF32 && weights.is_contiguous() &&
                     weights.numel() == t_count * top_k,
                 op, ": topk weights must be contiguous float32 [", t_count, ", ", top_k, "]");
  check_same(logits, ids, op);
  check_same(logits, weights, op);
  kernels::TopkSoftmaxArgs a;
  a.dtype = logits.dtype();
  a.logits = logits.data_ptr();
  a.logits_stride = pitch(logits);
  a.num_tokens = t_count;
  a.num_experts = num_experts;
  a.top_k = top_k;
  a.renormalize = renormalize;
  a.ids = ids.data<int32_t>();
  a.weights = weights.data<float>();
  throw_if_error(kernels::dispatch_topk_softmax(a, stream));
}

void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst, const Stream& stream) {
  const char* op = "gather_rows";
  check_rows(src, op, "src");
  check_rows(dst, op, "dst");
  check_same(src, dst, op);
  check_same(src, index, op);
  const int64_t n = dst.size(0);
  const int64_t width = dst.size(1);
  check_i32(index, n, op, "row index");
  LORAPLEX_CHECK(src.size(1) == width && src.dtype() == dst.dtype(), op, ": src ", src.describe(),
                 ", dst ", dst.describe());
  if (n == 0) return;
  kernels::GatherRowsArgs a;
  a.dtype = src.dtype();
  a.src = src.data_ptr();
  a.src_stride = pitch(src);
  a.src_rows = src.size(0);
  a.index = index.data<int32_t>();
  a.n = n;
  a.width = width;
  a.dst = dst.data_ptr();
  a.dst_stride = pitch(dst);
  throw_if_error(kernels::dispatch_gather_rows(a, stream));
}

void scatter_rows(const Tensor& src, const Tensor& index, const Tensor& row_scale, Tensor& dst,
                  const Stream& stream) {
  const char* op = "scatter_rows";
  check_rows(src, op, "src");
  check_rows(dst, op, "dst");
  check_same(src, dst, op);
  check_same(src, index, op);
  const int64_t n = src.size(0);
  const int64_t width = src.size(1);
  check_i32(index, n, op, "row index");
  LORAPLEX_CHECK(dst.size(1) == width && src.dtype() == dst.dtype(), op, ": src ", src.describe(),
                 ", dst ", dst.describe());
  if (row_scale.defined()) {
    LORAPLEX_CHECK(row_scale.dtype() == DType::kF32 && row_scale.is_contiguous() &&
                       row_scale.numel() >= dst.size(0) && row_scale.device() == dst.device(),
                   op, ": row scale must be contiguous float32 with ", dst.size(0),
                   " elements, got ", row_scale.describe());
  }
  if (n == 0) return;
  kernels::ScatterRowsArgs a;
  a.dtype = src.dtype();
  a.src = src.data_ptr();
  a.src_stride = pitch(src);
  a.index = index.data<int32_t>();
  a.n = n;
  a.width = width;
  a.row_scale = row_scale.defined() ? row_scale.data<float>() : nullptr;
  a.dst = dst.data_ptr();
  a.dst_stride = pitch(dst);
  a.dst_rows = dst.size(0);
  throw_if_error(kernels::dispatch_scatter_rows(a, stream));
}

void silu_and_mul(const Tensor& in, Tensor& out, const Stream& stream) {
  const char* op = "silu_and_mul";
  check_rows(in, op, "in");
  check_rows(out, op, "out");
  check_same(in, out, op);
  const int64_t n = in.size(0);
  const int64_t width = out.size(1);
  LORAPLEX_CHECK(out.size(0) == n && in.size(1) == 2 * width && in.dtype() == out.dtype(), op,
                 ": in ", in.describe(), " must be [n, 2 * width] for out ", out.describe());
  // The decoder's op (transformers' rounding: silu(gate) in the activation dtype), which reads
  // whole rows.
  LORAPLEX_CHECK(in.is_contiguous() && out.is_contiguous(), op, ": in ", in.describe(), " and out ",
                 out.describe(), " must be contiguous");
  if (n == 0) return;
  kernels::SiluMulArgs a;
  a.dtype = in.dtype();
  a.num_rows = n;
  a.n = width;
  a.x = in.data_ptr();
  a.out = out.data_ptr();
  throw_if_error(kernels::dispatch_silu_mul(a, stream));
}

void sum_topk(const Tensor& in, int top_k, Tensor& out, const Stream& stream) {
  const char* op = "sum_topk";
  check_rows(in, op, "in");
  check_rows(out, op, "out");
  check_same(in, out, op);
  LORAPLEX_CHECK(in.is_contiguous(), op, ": in must be contiguous, got ", in.describe());
  const int64_t t_count = out.size(0);
  const int64_t width = out.size(1);
  LORAPLEX_CHECK(top_k >= 1 && in.size(0) == t_count * top_k && in.size(1) == width &&
                     in.dtype() == out.dtype(),
                 op, ": in ", in.describe(), " must be [", t_count, " * top_k ", top_k, ", ", width,
                 "]");
  if (t_count == 0) return;
  kernels::SumTopkArgs a;
  a.dtype = in.dtype();
  a.in = in.data_ptr();
  a.num_tokens = t_count;
  a.top_k = top_k;
  a.width = width;
  a.out = out.data_ptr();
  a.out_stride = pitch(out);
  throw_if_error(kernels::dispatch_sum_topk(a, stream));
}

void moe_expert_blocks(const Tensor& topk_ids, int num_experts, Tensor& block_expert,
                       Tensor& block_pairs, const Stream& stream) {
  const char* op = "moe_expert_blocks";
  const int64_t pairs = topk_ids.defined() ? topk_ids.numel() : 0;
  check_i32(topk_ids, pairs, op, "topk ids");
  const int64_t max_blocks = block_expert.defined() ? block_expert.numel() : 0;
  check_i32(block_expert, max_blocks, op, "block experts");
  check_i32(block_pairs, max_blocks * kernels::kMoeExpertBlockRows, op, "block pairs");
  check_same(topk_ids, block_expert, op);
  check_same(topk_ids, block_pairs, op);
  LORAPLEX_CHECK(
      num_experts >= 1 && max_blocks >= kernels::moe_expert_max_blocks(pairs, num_experts), op,
      ": ", max_blocks, " blocks for ", pairs, " pairs over ", num_experts, " experts, need ",
      kernels::moe_expert_max_blocks(pairs, std::max(num_experts, 1)));
  kernels::MoeExpertBlocksArgs a;
  a.topk_ids = topk_ids.data<int32_t>();
  a.num_pairs = pairs;
  a.num_experts = num_experts;
  a.max_blocks = max_blocks;
  a.block_expert = block_expert.data<int32_t>();
  a.block_pairs = block_pairs.data<int32_t>();
  throw_if_error(kernels::dispatch_moe_expert_blocks(a, stream));
}

void moe_expert_gemm(const Tensor& x, bool x_rows_are_pairs, int top_k, const Tensor& w,
                     const Tensor& block_expert, const Tensor& block_pairs, const Tensor& row_scale,
                     Tensor& out, const Stream& stream) {
  const char* op = "moe_expert_gemm";
  check_rows(x, op, "x");
  check_rows(out, op, "out");
  check_same(x, out, op);
  check_same(x, w, op);
  check_same(x, block_expert, op);
  LORAPLEX_CHECK(w.defined() && w.dim() == 3 && w.is_contiguous() && w.dtype() == x.dtype() &&
                     out.dtype() == x.dtype(),
                 op, ": w must be contiguous [experts, n, k] of x's dtype ", x.dtype(), ", got ",
                 w.defined() ? w.describe() : "undefined", " (out ", out.describe(), ")");
  const int64_t pairs = out.size(0);
  LORAPLEX_CHECK(top_k >= 1 && w.size(2) == x.size(1) && w.size(1) == out.size(1) &&
                     x.size(0) == (x_rows_are_pairs ? pairs : pairs / top_k) && pairs % top_k == 0,
                 op, ": x ", x.describe(), ", w ", w.describe(), " and out ", out.describe(),
                 " do not fit top_k ", top_k, x_rows_are_pairs ? " (x rows are pairs)" : "");
  const int64_t max_blocks = block_expert.numel();
  check_i32(block_expert, max_blocks, op, "block experts");
  check_i32(block_pairs, max_blocks * kernels::kMoeExpertBlockRows, op, "block pairs");
  if (row_scale.defined()) {
    LORAPLEX_CHECK(
        row_scale.dtype() == DType::kF32 && row_scale.is_contiguous() && row_scale.numel() == pairs,
        op, ": row_scale must be contiguous float32 [", pairs, "], got ", row_scale.describe());
  }
  kernels::MoeExpertGemmArgs a;
  a.dtype = x.dtype();
  a.x = x.data_ptr();
  a.x_stride = pitch(x);
  a.x_rows_are_pairs = x_rows_are_pairs;
  a.top_k = top_k;
  a.w = w.data_ptr();
  a.num_experts = static_cast<int>(w.size(0));
  a.n = w.size(1);
  a.k = w.size(2);
  a.block_expert = block_expert.data<int32_t>();
  a.block_pairs = block_pairs.data<int32_t>();
  a.max_blocks = max_blocks;
  a.num_pairs = pairs;
  a.row_scale = row_scale.defined() ? row_scale.data<float>() : nullptr;
  a.out = out.data_ptr();
  a.out_stride = pitch(out);
  throw_if_error(kernels::dispatch_moe_expert_gemm(a, stream));
}

}  // namespace loraplex::layer_ops
