// CPU versions of the MoE expert block table and the expert GEMMs over it (kernels/layer_ops.h).
// They define the semantics the CUDA kernels follow; the MoE layer itself routes on the host on
// the CPU (one GEMM per expert), so these run in the op tests.

#include <algorithm>
#include <vector>

#include "loraplex/core/parallel.h"
#include "loraplex/kernels/layer_ops.h"

namespace loraplex::kernels::cpu {

Status moe_expert_blocks(const MoeExpertBlocksArgs& a) {
  const char* op = "moe_expert_blocks";
  LORAPLEX_ENSURE(a.num_pairs >= 0 && a.num_experts >= 1, op, ": ", a.num_pairs, " pairs over ",
                  a.num_experts, " experts");
  LORAPLEX_ENSURE(a.max_blocks >= moe_expert_max_blocks(a.num_pairs, a.num_experts), op,
                  ": max_blocks ", a.max_blocks, " below ",
                  moe_expert_max_blocks(a.num_pairs, a.num_experts), " for ", a.num_pairs,
                  " pairs over ", a.num_experts, " experts");
  const int64_t rows = kMoeExpertBlockRows;
  std::vector<std::vector<int32_t>> pairs(static_cast<size_t>(a.num_experts));
  for (int64_t p = 0; p < a.num_pairs; ++p) {
    const int32_t e = a.topk_ids[p];
    if (e >= 0 && e < a.num_experts)
      pairs[static_cast<size_t>(e)].push_back(static_cast<int32_t>(p));
  }
  std::fill(a.block_expert, a.block_expert + a.max_blocks, -1);
  std::fill(a.block_pairs, a.block_pairs + a.max_blocks * rows, -1);
  int64_t b = 0;
  for (int e = 0; e < a.num_experts; ++e) {
    const std::vector<int32_t>& list = pairs[static_cast<size_t>(e)];
    for (size_t i = 0; i < list.size(); ++i) {
      if (i % rows == 0) a.block_expert[b++] = e;
      a.block_pairs[(b - 1) * rows + static_cast<int64_t>(i % rows)] = list[i];
    }
  }
  return Status();
}

Status moe_expert_gemm(const MoeExpertGemmArgs& a) {
  const char* op = "moe_expert_gemm";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.n >= 1 && a.k >= 1 && a.top_k >= 1 && a.num_experts >= 1, op, ": n ", a.n,
                  ", k ", a.k, ", top_k ", a.top_k, ", ", a.num_experts, " experts");
  const int64_t rows = kMoeExpertBlockRows;
  for (int64_t b = 0; b < a.max_blocks; ++b) {
    const int32_t e = a.block_expert[b];
    LORAPLEX_ENSURE(e >= -1 && e < a.num_experts, op, ": block ", b, " names expert ", e,
                    " outside [0, ", a.num_experts, ")");
    for (int64_t i = 0; e >= 0 && i < rows; ++i) {
      const int32_t p = a.block_pairs[b * rows + i];
      LORAPLEX_ENSURE(p >= -1 && p < a.num_pairs, op, ": block ", b, " lists pair ", p,
                      " outside [0, ", a.num_pairs, ")");
    }
  }
  dispatch_activation_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.w);
    T* out = static_cast<T*>(a.out);
    parallel_for(0, a.max_blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        const int32_t e = a.block_expert[b];
        if (e < 0) continue;
        const T* we = w + static_cast<int64_t>(e) * a.n * a.k;
        for (int64_t i = 0; i < rows; ++i) {
          const int32_t p = a.block_pairs[b * rows + i];
          if (p < 0) continue;
          const T* xr = x + (a.x_rows_are_pairs ? p : p / a.top_k) * a.x_stride;
          const float scale = a.row_scale != nullptr ? a.row_scale[p] : 1.0f;
          for (int64_t j = 0; j < a.n; ++j) {
            const T* wr = we + j * a.k;
            float acc = 0.0f;
            for (int64_t c = 0; c < a.k; ++c) acc += load_float(xr[c]) * load_float(wr[c]);
            out[p * a.out_stride + j] = store_float<T>(acc * scale);
          }
        }
      }
    });
  });
  return Status();
}

}  // namespace loraplex::kernels::cpu
