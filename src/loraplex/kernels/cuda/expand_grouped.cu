// The expand for batches whose slots hold few tokens each (decode over many adapters: 256
// tokens over 64 slots is 4 a slot).
//
// The tensor-core expands work in 64-token tiles of one slot x 128 columns: with 4 tokens a
// slot a tile is mostly empty, the items are many (tiles x column tiles) and each costs a
// memory round trip, so they are latency-bound far above what the bytes need. Here a CTA
// takes kGroup consecutive tokens of the slot-sorted order and 512 columns of one slice, and
// multiplies each token's intermediate row with its slot's B columns (FMA, fp32) into y. Tokens
// of one slot are adjacent in the sorted order, so a slot's B columns come from memory once per
// CTA and from L1 for its other tokens. The intermediate is rounded to the weight dtype first, as
// the tensor-core expands (and vLLM) round it.

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

// kGroup x kThreads threads: thread group i takes the CTA's token i, each thread 4 columns of
// it, so the tokens run side by side (their B loads of one slot meet in L1) and every load of a
// thread is issued before its first wait: y and B's first 16 ranks once the token's slot is
// known, the intermediate row into shared memory before the barrier.
template <typename T, typename InT, int kGroup>
__global__ void __launch_bounds__(kThreads* kGroup) expand_grouped_kernel(GroupedParams p) {
  constexpr int kPre = 16;  // B ranks in registers before the barrier
  __shared__ __align__(16) float inter[kGroup][kMaxRank];
  const int chunk = static_cast<int>(blockIdx.y);
  int s = 0;
  while (chunk >= p.chunk_begin[s + 1]) ++s;
  const int i = static_cast<int>(threadIdx.x) / kThreads;
  const int tid = static_cast<int>(threadIdx.x) % kThreads;
  const int pos = static_cast<int>(blockIdx.x) * kGroup + i;
  const int tok = pos < p.num_tokens ? p.sorted[pos] : -1;
  int slot = tok >= 0 ? p.mapping[tok] : -1;
  if (!valid_slot(slot, p.max_loras)) slot = -1;
  const int64_t c =
      static_cast<int64_t>(chunk - p.chunk_begin[s]) * kCtaCols + tid * kColsPerThread;
  // Widths are multiples of kColsPerThread; a base-model token keeps its y.
  const bool active = slot >= 0 && c < p.width[s];
  T* yp = static_cast<T*>(p.y) + static_cast<int64_t>(tok) * p.y_stride + p.y_col[s] + c;
  uint2 yv = make_uint2(0, 0);
  if (active && p.add_inputs) yv = *reinterpret_cast<const uint2*>(yp);
  const int rank = slot >= 0 ? p.ranks[s * p.max_loras + slot] : 0;
  const T* bp = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + c) * p.max_rank;
  uint4 bv[kColsPerThread][kPre / 8];
#pragma unroll
  for (int j = 0; j < kColsPerThread; ++j) {
#pragma unroll
    for (int q = 0; q < kPre / 8; ++q) {
      bv[j][q] =
          active && q * 8 < rank ? ldg16(bp + j * p.max_rank + q * 8) : make_uint4(0, 0, 0, 0);
    }
  }
  const InT* in =
      static_cast<const InT*>(p.in) + (static_cast<int64_t>(s) * p.num_tokens + tok) * p.max_rank;
  for (int r = tid; r < rank; r += kThreads) inter[i][r] = to_float(from_float<T>(to_float(in[r])));
  __syncthreads();
  if (!active) return;
  float acc[kColsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  // B past the slot's rank may hold anything (NaN included): masked, not multiplied.
#pragma unroll
  for (int q = 0; q < kPre / 8; ++q) {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      float v[8];
      unpack8<T>(bv[j][q], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (q * 8 + k < rank) acc[j] = fmaf(inter[i][q * 8 + k], v[k], acc[j]);
      }
    }
  }
  for (int r0 = kPre; r0 < rank; r0 += 8) {
    uint4 hv[kColsPerThread];
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) hv[j] = ldg16(bp + j * p.max_rank + r0);
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      float v[8];
      unpack8<T>(hv[j], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (r0 + k < rank) acc[j] = fmaf(inter[i][r0 + k], v[k], acc[j]);
      }
    }
  }
  const float2 y01 = unpack2<T>(yv.x);
  const float2 y23 = unpack2<T>(yv.y);
  *reinterpret_cast<uint2*>(yp) = make_uint2(pack2<T>(y01.x + acc[0], y01.y + acc[1]),
                                             pack2<T>(y23.x + acc[2], y23.y + acc[3]));
}

template <typename T, typename InT>
Status launch_typed(const ExpandPlan& plan, const GroupedParams& p, int num_slices,
                    StreamHandle stream) {
  const dim3 grid(static_cast<unsigned>(plan.group_units),
                  static_cast<unsigned>(p.chunk_begin[num_slices]));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (plan.group) {
    case 2:
      expand_grouped_kernel<T, InT, 2><<<grid, kThreads * 2, 0, s>>>(p);
      break;
    case 4:
      expand_grouped_kernel<T, InT, 4><<<grid, kThreads * 4, 0, s>>>(p);
      break;
    default:
      expand_grouped_kernel<T, InT, 8><<<grid, kThreads * 8, 0, s>>>(p);
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
