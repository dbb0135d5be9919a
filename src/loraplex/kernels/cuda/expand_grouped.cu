// The expand for batches whose slots hold few tokens each (decode over many adapters: 256
// tokens over 64 slots is 4 a slot).
//
// The tensor-core expands work in 64-token tiles of one slot x 128 columns: with 4 tokens a
// slot a tile is mostly empty, the items are many (tiles x column tiles) and each costs a
// memory round trip, so they are latency-bound far above what the bytes need. Here a CTA
// takes kGroup consecutive tokens of the slot-sorted order and 512 columns of one slice: it
// stages the tokens' intermediate rows in shared memory, then per token multiplies them with
// the slot's B columns (FMA, fp32) and adds the result to y. Tokens of one slot are adjacent in
// the sorted order, so a slot's B columns come from memory once per CTA and from L1 for its
// other tokens. The intermediate is rounded to the weight dtype first, as the tensor-core
// expands (and vLLM) round it.

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"

namespace loraplex::kernels::cuda {
namespace {

using grouped_expand_kernel::kColsPerThread;
using grouped_expand_kernel::kCtaCols;
using grouped_expand_kernel::kMaxRank;
using grouped_expand_kernel::kThreads;

struct GroupedParams {
  const void* in;  // [num_slices, num_tokens, max_rank]
  const int32_t* mapping;
  const int32_t* sorted;
  const int32_t* ranks;  // [num_slices, max_loras]
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t y_col[kMaxSlices];        // y column of each slice's first column
  int chunk_begin[kMaxSlices + 1];  // prefix of 512-column chunks per slice
  int max_loras;
  int max_rank;
  int num_tokens;
  void* y;
  int64_t y_stride;
  bool add_inputs;
};

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <typename T, typename InT, int kGroup>
__global__ void __launch_bounds__(kThreads) expand_grouped_kernel(GroupedParams p) {
  __shared__ __align__(16) float inter[kGroup][kMaxRank];
  const int chunk = static_cast<int>(blockIdx.y);
  int s = 0;
  while (chunk >= p.chunk_begin[s + 1]) ++s;
  const int tid = static_cast<int>(threadIdx.x);
  const int first = static_cast<int>(blockIdx.x) * kGroup;
  int tok[kGroup];
  int slot[kGroup];
  int rank[kGroup];
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const int pos = first + i;
    tok[i] = pos < p.num_tokens ? p.sorted[pos] : -1;
    slot[i] = tok[i] >= 0 ? p.mapping[tok[i]] : -1;
    if (!valid_slot(slot[i], p.max_loras)) slot[i] = -1;
    rank[i] = slot[i] >= 0 ? p.ranks[s * p.max_loras + slot[i]] : 0;
  }
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const InT* in = static_cast<const InT*>(p.in) +
                    (static_cast<int64_t>(s) * p.num_tokens + tok[i]) * p.max_rank;
    for (int r = tid; r < rank[i]; r += kThreads)
      inter[i][r] = to_float(from_float<T>(to_float(in[r])));
  }
  __syncthreads();
  const int64_t c =
      static_cast<int64_t>(chunk - p.chunk_begin[s]) * kCtaCols + tid * kColsPerThread;
  if (c >= p.width[s]) return;  // widths are multiples of kColsPerThread
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    if (slot[i] < 0) continue;  // a base-model token keeps its y
    T* yp = static_cast<T*>(p.y) + tok[i] * p.y_stride + p.y_col[s] + c;
    uint2 yv = make_uint2(0, 0);
    if (p.add_inputs) yv = *reinterpret_cast<const uint2*>(yp);
    const T* bp = static_cast<const T*>(p.b[s]) + (slot[i] * p.width[s] + c) * p.max_rank;
    float acc[kColsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r0 = 0; r0 < rank[i]; r0 += 8) {
      uint4 bv[kColsPerThread];
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) bv[j] = ldg16(bp + j * p.max_rank + r0);
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        float v[8];
        unpack8<T>(bv[j], v);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          // B past the slot's rank may hold anything (NaN included): masked, not multiplied.
          if (r0 + k < rank[i]) acc[j] = fmaf(inter[i][r0 + k], v[k], acc[j]);
        }
      }
    }
    const float2 y01 = unpack2<T>(yv.x);
    const float2 y23 = unpack2<T>(yv.y);
    *reinterpret_cast<uint2*>(yp) = make_uint2(pack2<T>(y01.x + acc[0], y01.y + acc[1]),
                                               pack2<T>(y23.x + acc[2], y23.y + acc[3]));
  }
}

template <typename T, typename InT>
Status launch_typed(const ExpandPlan& plan, const GroupedParams& p, int num_slices,
                    StreamHandle stream) {
  const dim3 grid(static_cast<unsigned>(plan.group_units),
                  static_cast<unsigned>(p.chunk_begin[num_slices]));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (plan.group) {
    case 2:
      expand_grouped_kernel<T, InT, 2><<<grid, kThreads, 0, s>>>(p);
      break;
    case 4:
      expand_grouped_kernel<T, InT, 4><<<grid, kThreads, 0, s>>>(p);
      break;
    default:
      expand_grouped_kernel<T, InT, 8><<<grid, kThreads, 0, s>>>(p);
      break;
  }
  return launch_status("expand_grouped_kernel");
}

}  // namespace

Status launch_expand_grouped(const ExpandPlan& plan, const ExpandArgs& a, const LoraMetaView& meta,
                             StreamHandle stream) {
  GroupedParams p{};
  p.in = a.in;
  p.mapping = meta.token_lora_mapping;
  p.sorted = meta.sorted_token_indices;
  p.ranks = a.ranks;
  p.chunk_begin[0] = 0;
  int64_t col = a.offset_start;
  for (int s = 0; s < a.num_slices; ++s) {
    p.b[s] = a.lora_b[s];
    p.width[s] = a.slice_width[s];
    p.y_col[s] = col;
    col += a.slice_width[s];
    p.chunk_begin[s + 1] =
        p.chunk_begin[s] + static_cast<int>(ceil_div(a.slice_width[s], kCtaCols));
  }
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.num_tokens = static_cast<int>(a.num_tokens);
  p.y = a.y;
  p.y_stride = a.y_row_stride;
  p.add_inputs = a.add_inputs;
  const bool f32_in = a.in_dtype == DType::kF32;
  if (a.dtype == DType::kBF16) {
    return f32_in ? launch_typed<bf16, float>(plan, p, a.num_slices, stream)
                  : launch_typed<bf16, bf16>(plan, p, a.num_slices, stream);
  }
  return f32_in ? launch_typed<f16, float>(plan, p, a.num_slices, stream)
                : launch_typed<f16, f16>(plan, p, a.num_slices, stream);
}

}  // namespace loraplex::kernels::cuda
