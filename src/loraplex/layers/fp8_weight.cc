#include "loraplex/layers/fp8_weight.h"

#include <algorithm>

#include "loraplex/core/error.h"

namespace loraplex {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Scale of row `row`, column group `kg` of `w`'s own grid.
float grid_at(const BaseWeight& w, int64_t row, int64_t kg) {
  const int64_t cols = w.scale.size(1);
  return w.scale.data<float>()[(row / w.group_n) * cols + kg];
}

}  // namespace

Fp8Scales fp8_local_scales(const std::vector<Fp8RowRange>& ranges, int64_t col0, int64_t cols,
                           const std::string& what) {
  LORAPLEX_CHECK(!ranges.empty() && cols >= 1, what, ": no fp8 rows or columns");
  int64_t total = 0;
  bool per_row = true;
  bool blocks = true;
  const BaseWeight& first = *ranges.front().weight;
  for (const Fp8RowRange& r : ranges) {
    const BaseWeight& w = *r.weight;
    LORAPLEX_CHECK(w.is_fp8() && w.scale.defined() && w.scale.dtype() == DType::kF32 &&
                       w.scale.dim() == 2 && w.scale.device().is_cpu() && w.group_n >= 1 &&
                       w.group_k >= 1,
                   what, ": an fp8 weight needs float32 CPU scales [row groups, column groups]");
    LORAPLEX_CHECK(w.scale.size(0) == ceil_div(w.weight.size(0), w.group_n) &&
                       w.scale.size(1) == ceil_div(w.weight.size(1), w.group_k),
                   what, ": scales ", shape_str(w.scale.shape()), " do not cover the weight ",
                   shape_str(w.weight.shape()), " in groups of ", w.group_n, " x ", w.group_k);
    const bool one_group = w.group_k >= w.weight.size(1);
    per_row = per_row && one_group;
    blocks = blocks && !one_group && w.group_k == first.group_k && w.group_n == first.group_n &&
             total % w.group_n == 0 && r.first_row % w.group_n == 0;
    LORAPLEX_CHECK(one_group == (first.group_k >= first.weight.size(1)) &&
                       (one_group || w.group_k == first.group_k),
                   what, ": its projections' scales differ (", first.group_n, " x ", first.group_k,
                   " against ", w.group_n, " x ", w.group_k,
                   " weights a scale): one layer takes one FP8 scheme");
    total += r.rows;
  }
  Fp8Scales out;
  kernels::Fp8WeightScales& l = out.layout;
  if (per_row) {
    out.scale = Tensor::empty({total}, DType::kF32);
    float* s = out.scale.data<float>();
    int64_t at = 0;
    for (const Fp8RowRange& r : ranges) {
      for (int64_t i = 0; i < r.rows; ++i) s[at++] = grid_at(*r.weight, r.first_row + i, 0);
    }
    l.group_n = 1;
    l.group_k = cols;
    l.stride_n = 1;
    l.stride_k = 0;
    return out;
  }
  const int64_t bk = first.group_k;
  LORAPLEX_CHECK(col0 % bk == 0, what, ": this shard's columns start at ", col0,
                 ", not on a block of ", bk,
                 " columns: the tensor-parallel size must split the "
                 "input into whole blocks");
  const int64_t kg0 = col0 / bk;
  const int64_t kgs = ceil_div(cols, bk);
  if (blocks) {
    const int64_t bn = first.group_n;
    const int64_t row_blocks = ceil_div(total, bn);
    // Rows of column groups padded to a multiple of 4, as cuBLASLt reads 128x128 block scales.
    const int64_t pitch = ceil_div(kgs, 4) * 4;
    out.scale = Tensor::zeros({row_blocks, pitch}, DType::kF32);
    float* s = out.scale.data<float>();
    int64_t at = 0;
    for (const Fp8RowRange& r : ranges) {
      for (int64_t i = 0; i < r.rows; i += bn) {
        for (int64_t j = 0; j < kgs; ++j) {
          s[((at + i) / bn) * pitch + j] = grid_at(*r.weight, r.first_row + i, kg0 + j);
        }
      }
      at += r.rows;
    }
    l.group_n = bn;
    l.group_k = bk;
    l.stride_n = pitch;
    l.stride_k = 1;
    return out;
  }
  out.scale = Tensor::empty({kgs, total}, DType::kF32);
  float* s = out.scale.data<float>();
  int64_t at = 0;
  for (const Fp8RowRange& r : ranges) {
    for (int64_t i = 0; i < r.rows; ++i) {
      for (int64_t j = 0; j < kgs; ++j) {
        s[j * total + at + i] = grid_at(*r.weight, r.first_row + i, kg0 + j);
      }
    }
    at += r.rows;
  }
  l.group_n = 1;
  l.group_k = bk;
  l.stride_n = 1;
  l.stride_k = total;
  return out;
}

Tensor merged_input_scale(const std::vector<const BaseWeight*>& weights, const std::string& what) {
  int with = 0;
  float largest = 0.0f;
  for (const BaseWeight* w : weights) {
    if (!w->input_scale.defined()) continue;
    LORAPLEX_CHECK(w->input_scale.numel() == 1 && w->input_scale.dtype() == DType::kF32 &&
                       w->input_scale.device().is_cpu(),
                   what, ": an input scale is one float32 on the CPU, got ",
                   w->input_scale.describe());
    largest = std::max(largest, w->input_scale.data<float>()[0]);
    ++with;
  }
  if (with == 0) return Tensor();
  LORAPLEX_CHECK(with == static_cast<int>(weights.size()), what, ": ", with, " of its ",
                 weights.size(), " projections have a static input scale: all or none");
  return Tensor::from_vector(std::vector<float>{largest}, {1});
}

}  // namespace loraplex
