#pragma once
// FP8 base weights: float8_e4m3 codes with float32 scales, as FP8 checkpoints store them
// (model/quant_config.h), and how a linear layer keeps the scales of the rows it holds.
//
// A checkpoint gives each projection its own scale grid: one scale for the tensor, one per
// output row, or one per block of bn x bk weights. A layer holds several projections' rows
// (q, k, v; gate, up) and, under tensor parallelism, only a shard of them, so it rebuilds one
// scale array over its own rows (kernels::Fp8WeightScales):
//   - per output row, when every projection has one scale per row or per tensor;
//   - blocks, when every projection has bn x bk blocks and each projection's rows start on a
//     block in this layer and in the checkpoint (the grids then line up); each row of column
//     groups padded to a multiple of 4 (cuBLASLt's layout for 128x128 block scales);
//   - one scale per (row, bk columns) otherwise (a 64-row k_proj after a 128-row q_proj).
// Each keeps the dequantised values exactly: w = q * scale with the checkpoint's scale.

#include <cstdint>
#include <string>
#include <vector>

#include "loraplex/core/tensor.h"
#include "loraplex/kernels/gemm.h"

namespace loraplex {

/// A full (unsharded) base weight as a checkpoint gives it: float, or float8_e4m3 with its
/// scales (dequantised w[r, c] = q[r, c] * scale[r / group_n, c / group_k]).
struct BaseWeight {
  Tensor weight;        // [out, in]: any float dtype, or float8_e4m3
  Tensor scale;         // fp8 only: float32 [ceil(out / group_n), ceil(in / group_k)], CPU
  int64_t group_n = 0;  // rows sharing a scale: out (per tensor), 1 (per row) or the block rows
  int64_t group_k = 0;  // columns sharing a scale: in, or the block columns
  Tensor input_scale;   // fp8 only: float32 [1] on the CPU (static activations), or undefined

  bool is_fp8() const { return weight.defined() && weight.dtype() == DType::kF8E4M3; }
};

/// The scales of a layer's fp8 weight for its GEMM, on the layer's device.
struct Fp8Scales {
  Tensor scale;                     // float32, laid out as `layout` says
  kernels::Fp8WeightScales layout;  // its `scale` pointer is ignored: `scale` holds the data
  Tensor input_scale;               // float32 [1]: static activations; undefined: per token
};

/// Rows [first_row, first_row + rows) of one projection, in the order the layer stacks them.
struct Fp8RowRange {
  const BaseWeight* weight = nullptr;
  int64_t first_row = 0;
  int64_t rows = 0;
};

/// The scales of the rows `ranges` (stacked) and columns [col0, col0 + cols) of fp8 weights, as
/// a float32 CPU tensor and its layout (see the header comment). Throws naming `what` when the
/// projections' scale kinds differ, or a column shard does not start on a block.
Fp8Scales fp8_local_scales(const std::vector<Fp8RowRange>& ranges, int64_t col0, int64_t cols,
                           const std::string& what);

/// The static activation scale of a layer whose projections bring theirs: the largest, as vLLM
/// takes for merged layers (each projection's own scale bounds its quantisation error, the
/// largest keeps every projection's input in range). Undefined when none has one; throws naming
/// `what` when only some do.
Tensor merged_input_scale(const std::vector<const BaseWeight*>& weights, const std::string& what);

}  // namespace loraplex
