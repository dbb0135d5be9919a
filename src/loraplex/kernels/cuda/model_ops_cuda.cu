// CUDA versions of the decoder's non-LoRA ops (kernels/model_ops.h), with the CPU versions'
// semantics: float32 arithmetic, one rounding per stored value, precise cosf/sinf/expf (no fast
// math), ties to the lowest index in argmax. Host-side checks read sizes only (device memory is
// never read on the host); kernels skip out-of-range ids and slots instead of reading past a
// buffer, so bad input cannot fault.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "loraplex/kernels/model_ops.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Element types as stored: float, or the raw 16 bits of a half / bfloat16.
struct F32 {
  using Storage = float;
  static __device__ float load(float v) { return v; }
  static __device__ float store(float v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  static __device__ float load(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  static __device__ uint16_t store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct BF16 {
  using Storage = uint16_t;
  static __device__ float load(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  static __device__ uint16_t store(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

// fp8 weights are only ever filled (random FP8 models), never loaded here.
struct E4M3 {
  using Storage = uint8_t;
  static __device__ uint8_t store(float v) {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  }
};

// Rounds through the storage type (what storing and reloading gives).
template <typename E>
__device__ float round_to(float v) {
  return E::load(E::store(v));
}

// The status of the kernel launched last on this thread.
Status launch_status(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status(StatusCode::kCudaError,
                  detail::concat(op, ": kernel launch failed: ", cudaGetErrorString(err)));
  }
  return Status();
}

template <typename Fn>
Status dispatch(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(F32{});
      break;
    case DType::kF16:
      fn(F16{});
      break;
    case DType::kBF16:
      fn(BF16{});
      break;
    default:
      return invalid_argument(op, ": dtype ", dtype, ", expected float32, float16 or bfloat16");
  }
  return launch_status(op);
}

cudaStream_t raw(cuda_rt::StreamHandle stream) { return static_cast<cudaStream_t>(stream); }

int blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 32 ? (b < 1 ? 1 : b) : 65535 * 32);
}

// Block-wide sum and max over kThreads threads (blockDim.x == kThreads).
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += shared[w];
  return total;
}

__device__ float block_max(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float m = -FLT_MAX;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) m = fmaxf(m, shared[w]);
  return m;
}

// ---------------------------------------------------------------------------------------------
template <typename E>
__global__ void fill_uniform_kernel(FillUniformArgs a) {
  using S = typename E::Storage;
  S* out = static_cast<S*>(a.out);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = E::store(uniform_at(a, i));
  }
}

// kVec consecutive elements as one access.
template <typename S, int kVec>
struct alignas(sizeof(S) * kVec) Pack {
  S v[kVec];
};

// ---------------------------------------------------------------------------------------------
// The fused LoRA expand (FusedLoraExpand): the consumer kernels add each token's expand to their
// input as they load it. Their LoRA forms take the tokens of one slot in groups (consecutive
// in the metadata's sorted order): a thread reads the B rows of its columns for the group's
// first token and finds them in L1 for the others, so a slot's B crosses from L2 about once a
// step however many of its tokens there are.

struct TokenGroup {
  int slot = -1;
  int begin = 0;  // first position in the sorted token order
  int count = 0;
};

// Group g of the step: the active slots' tokens cut into groups of at most `size`, slot by slot.
// Every warp finds it on its own, 32 active slots per round: a loop over the slots one by one is
// a chain of dependent loads as long as the slots, which dominated these short kernels (docs/
// model.md). False past the last group.
__device__ bool find_token_group(const LoraMetaView& m, int g, int size, TokenGroup& out) {
  const int active = *m.num_active_loras;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int a0 = 0; a0 < active; a0 += 32) {
    const int a = a0 + lane;
    const int n = a < active ? m.num_tokens_per_lora[a] : 0;
    const int groups = (n + size - 1) / size;
    int incl = groups;
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    const unsigned past = __ballot_sync(0xffffffffu, g < incl);
    if (past != 0) {
      const int owner = __ffs(past) - 1;
      const int first = __shfl_sync(0xffffffffu, incl - groups, owner);
      const int entry = a0 + owner;
      const int count = m.num_tokens_per_lora[entry];
      const int k = g - first;
      out.slot = m.active_lora_ids[entry];
      out.begin = m.lora_token_start_loc[entry] + k * size;
      out.count = min(size, count - k * size);
      return true;
    }
    g -= __shfl_sync(0xffffffffu, incl, 31);
  }
  return false;
}

// Groups any step of `tokens` tokens can have: sum over active entries of ceil(n / size).
int max_token_groups(int64_t tokens, int size, int max_loras) {
  return static_cast<int>((tokens + size - 1) / size + std::min<int64_t>(tokens, max_loras + 1));
}

// Stages a token's intermediate for every slice into `dst` as float32 [num_slices * max_rank],
// zero at and past each slice's rank (so a product with it never needs those B columns).
template <typename E>
__device__ void stage_shrink(const FusedLoraExpand& e, int64_t t, int slot, float* dst) {
  using S = typename E::Storage;
  const S* src = static_cast<const S*>(e.shrink) + t * e.shrink_row_stride + slot * e.slot_cols;
  const int cols = e.num_slices * e.max_rank;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    // Both loads at once: the value is read whatever the rank (it lies inside the slot's
    // columns) and dropped after.
    const float x = E::load(src[c]);
    const int rank = e.ranks[(c / e.max_rank) * e.max_loras + slot];
    dst[c] = c % e.max_rank < rank ? x : 0.0f;
  }
}

// The slice holding input column j, or -1 when none does.
__device__ int slice_of(const FusedLoraExpand& e, int64_t j) {
  int s = 0;
  while (s + 1 < e.num_slices && j >= e.offset[s + 1]) ++s;
  return j >= e.offset[s] && j < e.offset[s] + e.width[s] ? s : -1;
}

// How B rows are read (kBRows): 0 one element at a time; -1 16 bytes at a time in a loop over
// the rank (max_rank a multiple of the vector, rows 16-byte aligned); n > 0 as n 16-byte chunks,
// all of them loaded before the first product: these ops are short, and a load chain as long as
// the rank would be their running time.
constexpr int kBRowsScalar = 0;
constexpr int kBRowsLoop = -1;

// The B rows of the kVec columns from input column j (all in one slice) as kBRows 16-byte
// chunks each (kBRows > 0), all loaded by load() before add() multiplies: values past the
// slot's rank are loaded with the rest and discarded. Split in two so that a kernel can issue
// these loads beside its other loads and do the products later.
template <typename E, int kVec, int kBRows>
struct FusedBRows {
  using S = typename E::Storage;
  static constexpr int kN = 16 / static_cast<int>(sizeof(S));
  using P = Pack<S, kN>;
  P w[kVec][kBRows > 0 ? kBRows : 1];  // only kBRows > 0 loads
  int slice = -1;
  int rank = 0;

  __device__ void load(const FusedLoraExpand& e, int slot, int64_t j) {
    slice = slice_of(e, j);
    if (slice < 0) return;
    rank = e.ranks[slice * e.max_loras + slot];
    const S* b = static_cast<const S*>(e.lora_b[slice]) +
                 (slot * e.width[slice] + (j - e.offset[slice])) * e.max_rank;
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
#pragma unroll
      for (int q = 0; q < kBRows; ++q)
        w[c][q] = *reinterpret_cast<const P*>(b + c * e.max_rank + q * kN);
    }
  }

  // v[c] = round(v[c] + sum_{i < rank} s[i] B[c, i]) with s the slice's staged intermediate.
  __device__ void add(const FusedLoraExpand& e, const float* s_all, float (&v)[kVec]) const {
    if (slice < 0 || rank <= 0) return;
    const float* sv = s_all + slice * e.max_rank;
    float acc[kVec] = {};
#pragma unroll
    for (int q = 0; q < kBRows; ++q) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int i = q * kN + k;
        const float x = sv[i];
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[c] += x * (i < rank ? E::load(w[c][q].v[k]) : 0.0f);
      }
    }
#pragma unroll
    for (int c = 0; c < kVec; ++c) v[c] = round_to<E>(v[c] + acc[c]);
  }
};

// v[c] = round(v[c] + sum_{i < rank} s[i] B_s[slot, j + c, i]) for the kVec columns from input
// column j (all in one slice), with s the staged intermediate of the token (zero past the
// rank). Values of B past the rank are loaded with the rest and discarded. The kBRows > 0 form
// repeats FusedBRows' loads and products inline: built on FusedBRows, the wide-step norm
// kernel (kNormVecs runs a thread, 128 registers) spilled about 1 KB a thread.
template <typename E, int kVec, int kBRows>
__device__ void add_fused_expand(const FusedLoraExpand& e, int slot, int64_t j, const float* s_all,
                                 float (&v)[kVec]) {
  using S = typename E::Storage;
  const int s = slice_of(e, j);
  if (s < 0) return;
  const int rank = e.ranks[s * e.max_loras + slot];
  const float* sv = s_all + s * e.max_rank;
  const S* b =
      static_cast<const S*>(e.lora_b[s]) + (slot * e.width[s] + (j - e.offset[s])) * e.max_rank;
  float acc[kVec] = {};
  if constexpr (kBRows > 0) {
    constexpr int kN = 16 / static_cast<int>(sizeof(S));
    using P = Pack<S, kN>;
    P w[kVec][kBRows];
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
#pragma unroll
      for (int q = 0; q < kBRows; ++q)
        w[c][q] = *reinterpret_cast<const P*>(b + c * e.max_rank + q * kN);
    }
    if (rank <= 0) return;
#pragma unroll
    for (int q = 0; q < kBRows; ++q) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int i = q * kN + k;
        const float x = sv[i];
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[c] += x * (i < rank ? E::load(w[c][q].v[k]) : 0.0f);
      }
    }
  } else if constexpr (kBRows == kBRowsLoop) {
    if (rank <= 0) return;
    constexpr int kN = 16 / static_cast<int>(sizeof(S));
    using P = Pack<S, kN>;
    for (int i0 = 0; i0 < rank; i0 += kN) {
      P w[kVec];
#pragma unroll
      for (int c = 0; c < kVec; ++c) w[c] = *reinterpret_cast<const P*>(b + c * e.max_rank + i0);
      float x[kN];
#pragma unroll
      for (int q = 0; q < kN; ++q) x[q] = sv[i0 + q];
      const bool whole = i0 + kN <= rank;
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
#pragma unroll
        for (int q = 0; q < kN; ++q) {
          acc[c] += x[q] * (whole || i0 + q < rank ? E::load(w[c].v[q]) : 0.0f);
        }
      }
    }
  } else {
    if (rank <= 0) return;
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
      for (int i = 0; i < rank; ++i) acc[c] += sv[i] * E::load(b[c * e.max_rank + i]);
    }
  }
#pragma unroll
  for (int c = 0; c < kVec; ++c) v[c] = round_to<E>(v[c] + acc[c]);
}

// Where the B tiles start after `floats` staged intermediates: a 16-byte boundary.
__host__ __device__ constexpr int64_t silu_tile_offset(int64_t floats) {
  return (floats + 3) / 4 * 4;
}

// The slot's B rows of input columns [first, first + count), staged transposed into shared
// memory so that a thread's kVec columns of one rank index are one vector:
//   bt[i * stride + c] = B_s[slot, first + c - offset[s], i]
// for c < stride, zero at and past slice s's rank and for columns past count or in no slice.
// The rows are read in 16-byte chunks when `vector_b` (vector_b_rows), consecutive threads on
// consecutive chunks, so the tile crosses from memory once, every load in flight together.
template <typename E>
__device__ void stage_b_tile(const FusedLoraExpand& e, int slot, int64_t first, int64_t count,
                             int stride, bool vector_b, typename E::Storage* bt) {
  using S = typename E::Storage;
  constexpr int kN = 16 / static_cast<int>(sizeof(S));
  const int per_row = vector_b ? e.max_rank / kN : e.max_rank;
  const int width = vector_b ? kN : 1;
  for (int idx = threadIdx.x; idx < stride * per_row; idx += blockDim.x) {
    const int c = idx / per_row;
    const int i0 = idx % per_row * width;
    const int s = c < count ? slice_of(e, first + c) : -1;
    Pack<S, kN> w{};
    int rank = 0;
    if (s >= 0) {
      rank = e.ranks[s * e.max_loras + slot];
      const S* b = static_cast<const S*>(e.lora_b[s]) +
                   (slot * e.width[s] + (first + c - e.offset[s])) * e.max_rank + i0;
      if (vector_b) {
        w = *reinterpret_cast<const Pack<S, kN>*>(b);
      } else {
        w.v[0] = *b;
      }
    }
    for (int k = 0; k < width; ++k) bt[(i0 + k) * stride + c] = i0 + k < rank ? w.v[k] : S{};
  }
}

// v[c] = round(v[c] + sum_i s[i] bt[i * stride + c0 + c]) over a staged tile (stage_b_tile),
// for the kVec columns from tile column c0 (input column j, all in one slice).
template <typename E, int kVec>
__device__ void add_tile_expand(const FusedLoraExpand& e, int64_t j, const float* s_all,
                                const typename E::Storage* bt, int stride, int c0,
                                float (&v)[kVec]) {
  using P = Pack<typename E::Storage, kVec>;
  const int s = slice_of(e, j);
  if (s < 0) return;
  const float* sv = s_all + s * e.max_rank;
  float acc[kVec] = {};
  for (int i = 0; i < e.max_rank; ++i) {
    const float x = sv[i];
    const P b = *reinterpret_cast<const P*>(bt + i * stride + c0);
#pragma unroll
    for (int c = 0; c < kVec; ++c) acc[c] += x * E::load(b.v[c]);
  }
#pragma unroll
  for (int c = 0; c < kVec; ++c) v[c] = round_to<E>(v[c] + acc[c]);
}

// The block's token group (blockIdx.y) with every token's intermediate staged in `staged`
// ([group_size, num_slices * max_rank]) and whatever `also_stage(slot)` stages for a slot in
// use; false past the last group. A slot the rows do not hold (at or past num_slots) leaves its
// tokens without LoRA. All threads call it (it synchronises).
template <typename E, typename AlsoStage>
__device__ bool begin_token_group(const FusedLoraExpand& e, int group_size, float* staged,
                                  TokenGroup& g, AlsoStage&& also_stage) {
  if (!find_token_group(e.meta, blockIdx.y, group_size, g)) return false;
  if (g.slot >= e.num_slots) g.slot = -1;
  const int cols = e.num_slices * e.max_rank;
  if (g.slot >= 0) {
    also_stage(g.slot);
    // Every token's intermediate at once (not token by token: each is a chain of two loads).
    using S = typename E::Storage;
    for (int idx = threadIdx.x; idx < g.count * cols; idx += blockDim.x) {
      const int i = idx / cols;
      const int c = idx % cols;
      const int64_t t = e.meta.sorted_token_indices[g.begin + i];
      const S* src =
          static_cast<const S*>(e.shrink) + t * e.shrink_row_stride + g.slot * e.slot_cols;
      const float x = E::load(src[c]);
      const int rank = e.ranks[(c / e.max_rank) * e.max_loras + g.slot];
      staged[idx] = c % e.max_rank < rank ? x : 0.0f;
    }
  }
  __syncthreads();
  return true;
}

// Whether B rows can be read 16 bytes at a time.
template <typename E>
bool vector_b_rows(const FusedLoraExpand& e) {
  constexpr int kN = 16 / static_cast<int>(sizeof(typename E::Storage));
  bool ok = e.max_rank % kN == 0;
  for (int s = 0; s < e.num_slices; ++s)
    ok = ok && reinterpret_cast<uintptr_t>(e.lora_b[s]) % 16 == 0;
  return ok;
}

// Calls f(std::integral_constant<int, kBRows>) with how add_fused_expand reads e's B rows: up
// to two 16-byte chunks a row (rank 16 in 16 bits) all at once, longer rows in a loop.
template <typename E, typename F>
void with_b_rows(const FusedLoraExpand& e, F&& f) {
  constexpr int kN = 16 / static_cast<int>(sizeof(typename E::Storage));
  if (!vector_b_rows<E>(e)) {
    f(std::integral_constant<int, kBRowsScalar>{});
  } else if (e.max_rank == kN) {
    f(std::integral_constant<int, 1>{});
  } else if (e.max_rank == 2 * kN) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, kBRowsLoop>{});
  }
}

// A LoRA consumer step with fewer threads than this at its widest vectors takes narrower ones.
constexpr int64_t kSmallStepThreads = int64_t{64} << 10;

// The shared memory a group's staged intermediates need.
size_t staged_shrink_bytes(const FusedLoraExpand& e, int group) {
  return static_cast<size_t>(group) * e.num_slices * e.max_rank * sizeof(float);
}

// ---------------------------------------------------------------------------------------------
// Residual add + RMSNorm. The common case (16-byte aligned rows of up to kNormVecs 16-byte
// vectors per thread) reads every input once with vector loads and keeps the sums in
// registers; other rows take a scalar kernel of the same math. One block per output row; with
// kLora the row's delta first takes its token's expand (its intermediate staged in shared
// memory).
constexpr int kNormVecs = 4;
constexpr int kNormItems = 16;

template <typename S>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / static_cast<int>(sizeof(S));
  S v[kN];
};

// The LoRA slot of row source `src` with its intermediate staged (-1: none). Every thread of the
// block calls it (it synchronises).
template <typename E, bool kLora>
__device__ int stage_norm_lora(const AddRmsNormArgs& a, int64_t src, float* staged) {
  if constexpr (!kLora) {
    return -1;
  } else {
    int slot = a.lora.meta.token_lora_mapping[src];
    if (slot >= a.lora.num_slots) slot = -1;
    if (slot >= 0) stage_shrink<E>(a.lora, src, slot, staged);
    __syncthreads();
    return slot;
  }
}

// Steps of at least this many rows fill the SMs with kThreads a row; a LoRA row of a smaller
// step is split over the kNormParts CTAs of a cluster (add_rms_norm_lora_split_kernel).
constexpr int64_t kNormWideRows = 128;
constexpr int kNormParts = 8;

template <typename E, bool kLora, int kBRows>
__global__ void __launch_bounds__(kThreads, 2) add_rms_norm_vec_kernel(AddRmsNormArgs a) {
  using S = typename E::Storage;
  using V = Vec16<S>;
  constexpr int kN = V::kN;
  __shared__ float shared[32];
  extern __shared__ float staged[];  // kLora: [num_slices * max_rank]
  const int64_t r = blockIdx.x;
  const int64_t src = a.rows != nullptr ? a.rows[r] : r;
  const int64_t vecs = a.hidden / kN;
  const int64_t dstride = a.delta_row_stride > 0 ? a.delta_row_stride : a.hidden;
  const int slot = stage_norm_lora<E, kLora>(a, src, staged);
  const V* res = reinterpret_cast<const V*>(static_cast<const S*>(a.residual) + src * a.hidden);
  const V* delta = a.delta != nullptr
                       ? reinterpret_cast<const V*>(static_cast<const S*>(a.delta) + src * dstride)
                       : nullptr;
  V* delta2 = a.delta2 != nullptr ? reinterpret_cast<V*>(static_cast<S*>(a.delta2) + src * a.hidden)
                                  : nullptr;
  float sum[kNormVecs][kN];
  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (i >= vecs) continue;
    const V x = res[i];
    float add[kN] = {};
    if (delta != nullptr) {
      const V d1 = delta[i];
#pragma unroll
      for (int e = 0; e < kN; ++e) add[e] = E::load(d1.v[e]);
      if (kLora && slot >= 0) add_fused_expand<E, kN, kBRows>(a.lora, slot, i * kN, staged, add);
    }
    if (delta2 != nullptr) {
      const V d2 = delta2[i];
      if (a.clear_delta2) delta2[i] = V{};
#pragma unroll
      for (int e = 0; e < kN; ++e) add[e] += E::load(d2.v[e]);
    }
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      float v = E::load(x.v[e]);
      if (delta != nullptr || delta2 != nullptr) v = round_to<E>(v + add[e]);
      sum[k][e] = v;
      squares += v * v;
    }
  }
  squares = block_sum(squares, shared);
  const float inv = 1.0f / sqrtf(squares / static_cast<float>(a.hidden) + a.eps);
  const V* w = reinterpret_cast<const V*>(a.weight);
  V* res_out = a.residual_out != nullptr
                   ? reinterpret_cast<V*>(static_cast<S*>(a.residual_out) + r * a.hidden)
                   : nullptr;
  V* out = reinterpret_cast<V*>(static_cast<S*>(a.out) + r * a.hidden);
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (i >= vecs) continue;
    const V wv = w[i];
    V o, keep;
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      keep.v[e] = E::store(sum[k][e]);
      o.v[e] = E::store(E::load(wv.v[e]) * round_to<E>(sum[k][e] * inv));
    }
    if (res_out != nullptr) res_out[i] = keep;
    out[i] = o;
  }
}

// A LoRA row of a step of few rows split over the `parts` CTAs of a thread-block cluster, one
// 16-byte run a thread: one SM reading a whole row's B rows (hidden x rank) is bound by the
// loads it can keep in flight, parts SMs share them. Every load that does not need the slot
// (residual, deltas, weight) is issued before the slot is known, the B rows and the
// intermediate right after it; the CTAs' sums of squares meet in distributed shared memory.
template <typename E, int kBRows>
__global__ void add_rms_norm_lora_split_kernel(AddRmsNormArgs a) {
  using S = typename E::Storage;
  using V = Vec16<S>;
  constexpr int kN = V::kN;
  __shared__ float shared[32];
  __shared__ float part_squares;
  extern __shared__ float staged[];  // [num_slices * max_rank]
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int parts = static_cast<int>(cluster.num_blocks());
  const int64_t r = blockIdx.x / parts;
  const int64_t src = a.rows != nullptr ? a.rows[r] : r;
  const int64_t vecs = a.hidden / kN;
  const int64_t per_part = (vecs + parts - 1) / parts;
  const int64_t i = static_cast<int64_t>(cluster.block_rank()) * per_part + threadIdx.x;
  const bool mine = threadIdx.x < per_part && i < vecs;
  const int64_t dstride = a.delta_row_stride > 0 ? a.delta_row_stride : a.hidden;
  const FusedLoraExpand& e = a.lora;
  int slot = e.meta.token_lora_mapping[src];
  V x{}, d1{}, d2{}, wv{};
  V* delta2 = a.delta2 != nullptr ? reinterpret_cast<V*>(static_cast<S*>(a.delta2) + src * a.hidden)
                                  : nullptr;
  if (mine) {
    x = reinterpret_cast<const V*>(static_cast<const S*>(a.residual) + src * a.hidden)[i];
    d1 = reinterpret_cast<const V*>(static_cast<const S*>(a.delta) + src * dstride)[i];
    if (delta2 != nullptr) d2 = delta2[i];
    wv = reinterpret_cast<const V*>(a.weight)[i];
  }
  if (slot >= e.num_slots) slot = -1;
  FusedBRows<E, kN, kBRows> b;
  if constexpr (kBRows > 0) {
    if (mine && slot >= 0) b.load(e, slot, i * kN);
  }
  if (slot >= 0) stage_shrink<E>(e, src, slot, staged);
  __syncthreads();
  float v[kN];
  float squares = 0.0f;
  if (mine) {
    float add[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) add[k] = E::load(d1.v[k]);
    if (slot >= 0) {
      if constexpr (kBRows > 0) {
        b.add(e, staged, add);
      } else {
        add_fused_expand<E, kN, kBRows>(e, slot, i * kN, staged, add);
      }
    }
    if (delta2 != nullptr && a.clear_delta2) delta2[i] = V{};
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      if (delta2 != nullptr) add[k] += E::load(d2.v[k]);
      v[k] = round_to<E>(E::load(x.v[k]) + add[k]);
      squares += v[k] * v[k];
    }
  }
  squares = block_sum(squares, shared);
  if (threadIdx.x == 0) part_squares = squares;
  cluster.sync();
  float total = 0.0f;
  for (int p = 0; p < parts; ++p) total += *cluster.map_shared_rank(&part_squares, p);
  cluster.sync();  // no CTA leaves while another reads its sum
  if (!mine) return;
  const float inv = 1.0f / sqrtf(total / static_cast<float>(a.hidden) + a.eps);
  V o, keep;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    keep.v[k] = E::store(v[k]);
    o.v[k] = E::store(E::load(wv.v[k]) * round_to<E>(v[k] * inv));
  }
  if (a.residual_out != nullptr)
    reinterpret_cast<V*>(static_cast<S*>(a.residual_out) + r * a.hidden)[i] = keep;
  reinterpret_cast<V*>(static_cast<S*>(a.out) + r * a.hidden)[i] = o;
}

template <typename E, bool kLora>
__global__ void add_rms_norm_kernel(AddRmsNormArgs a) {
  using S = typename E::Storage;
  __shared__ float shared[32];
  extern __shared__ float staged[];  // kLora: [num_slices * max_rank]
  const int64_t r = blockIdx.x;
  const int64_t src = a.rows != nullptr ? a.rows[r] : r;
  const int64_t dstride = a.delta_row_stride > 0 ? a.delta_row_stride : a.hidden;
  const int slot = stage_norm_lora<E, kLora>(a, src, staged);
  const S* res = static_cast<const S*>(a.residual) + src * a.hidden;
  const S* delta = a.delta != nullptr ? static_cast<const S*>(a.delta) + src * dstride : nullptr;
  S* delta2 = a.delta2 != nullptr ? static_cast<S*>(a.delta2) + src * a.hidden : nullptr;
  S* res_out = a.residual_out != nullptr ? static_cast<S*>(a.residual_out) + r * a.hidden : nullptr;
  const S* w = static_cast<const S*>(a.weight);
  S* out = static_cast<S*>(a.out) + r * a.hidden;
  auto sum_at = [&](int64_t j) {
    const float v = E::load(res[j]);
    if (delta == nullptr && delta2 == nullptr) return v;
    float add[1] = {delta != nullptr ? E::load(delta[j]) : 0.0f};
    if (kLora && slot >= 0) add_fused_expand<E, 1, kBRowsScalar>(a.lora, slot, j, staged, add);
    if (delta2 != nullptr) add[0] += E::load(delta2[j]);
    return round_to<E>(v + add[0]);
  };
  float kept[kNormItems];
  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormItems; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    kept[k] = j < a.hidden ? sum_at(j) : 0.0f;
    squares += kept[k] * kept[k];
  }
  for (int64_t j = threadIdx.x + static_cast<int64_t>(kNormItems) * blockDim.x; j < a.hidden;
       j += blockDim.x) {
    const float v = sum_at(j);
    squares += v * v;
  }
  squares = block_sum(squares, shared);
  const float inv = 1.0f / sqrtf(squares / static_cast<float>(a.hidden) + a.eps);
  // Each element's last read happens before its writes, by the same thread: in place is safe,
  // and delta2 is cleared here, after that read.
  auto emit = [&](int64_t j, float v) {
    if (res_out != nullptr) res_out[j] = E::store(v);
    if (delta2 != nullptr && a.clear_delta2) delta2[j] = E::store(0.0f);
    out[j] = E::store(E::load(w[j]) * round_to<E>(v * inv));
  };
#pragma unroll
  for (int k = 0; k < kNormItems; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (j < a.hidden) emit(j, kept[k]);
  }
  for (int64_t j = threadIdx.x + static_cast<int64_t>(kNormItems) * blockDim.x; j < a.hidden;
       j += blockDim.x) {
    emit(j, sum_at(j));
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE + KV write. An item is kVec consecutive frequencies of one q or k head (its kVec rotation
// pairs: elements i.. and i + d/2..), then the v heads in runs of kVec; one thread per item, so
// a decode batch of a few tokens still spreads over the SMs. The k heads' rotated values and
// the v heads go to the token's cache slot. add(j, values) adds what the projection's LoRA
// contributes to the kVec values from column j; with `keep_v` the row keeps v plus that (what
// the cache holds), as the CPU op leaves it.
template <typename E, int kVec, typename Add>
__device__ void rope_kv_write_item(const RopeKvWriteArgs& a, int64_t t, int64_t item, bool keep_v,
                                   Add&& add) {
  using S = typename E::Storage;
  using P = Pack<S, kVec>;
  const KvCacheView& c = a.cache;
  const int64_t d = c.head_dim;
  const int64_t half = d / 2;
  const int64_t kv = c.num_kv_heads * d;
  const int64_t q_cols = a.num_heads * d;
  const int64_t per_head = half / kVec;
  const int64_t rot_items = (a.num_heads + c.num_kv_heads) * per_head;
  const int64_t slot = a.slot_mapping[t];
  const bool store = slot >= 0 && slot < c.num_blocks * c.block_size;
  S* row = static_cast<S*>(a.qkv) + t * a.qkv_row_stride;
  auto load = [&](int64_t j, float(&out)[kVec]) {
    const P v = *reinterpret_cast<const P*>(row + j);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = E::load(v.v[k]);
    add(j, out);
  };
  S* kc = static_cast<S*>(c.k) + (store ? slot : 0) * kv;
  S* vc = static_cast<S*>(c.v) + (store ? slot : 0) * kv;
  if (item < rot_items) {
    const int64_t h = item / per_head;
    const int64_t i = item % per_head * kVec;
    const float pos = static_cast<float>(a.positions[t]);
    float x0[kVec], x1[kVec];
    load(h * d + i, x0);
    load(h * d + i + half, x1);
    P y0, y1;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float sn, cs;
      sincosf(pos * a.inv_freq[i + k], &sn, &cs);
      y0.v[k] = E::store(x0[k] * cs - x1[k] * sn);
      y1.v[k] = E::store(x1[k] * cs + x0[k] * sn);
    }
    *reinterpret_cast<P*>(row + h * d + i) = y0;
    *reinterpret_cast<P*>(row + h * d + i + half) = y1;
    if (store && h >= a.num_heads) {
      const int64_t col = (h - a.num_heads) * d + i;
      *reinterpret_cast<P*>(kc + col) = y0;
      *reinterpret_cast<P*>(kc + col + half) = y1;
    }
    return;
  }
  const int64_t j = (item - rot_items) * kVec;
  float v[kVec];
  load(q_cols + kv + j, v);
  P out;
#pragma unroll
  for (int k = 0; k < kVec; ++k) out.v[k] = E::store(v[k]);
  if (store) *reinterpret_cast<P*>(vc + j) = out;
  if (keep_v) *reinterpret_cast<P*>(row + q_cols + kv + j) = out;
}

template <int kVec>
__host__ __device__ int64_t rope_items(const RopeKvWriteArgs& a) {
  const KvCacheView& c = a.cache;
  return (a.num_heads + c.num_kv_heads) * (c.head_dim / 2 / kVec) +
         c.num_kv_heads * c.head_dim / kVec;
}

// Grid x = token, y = a share of the token's items; the optional delta (a LoRA output computed
// apart) is added and cleared.
template <typename E, int kVec>
__global__ void rope_kv_write_kernel(RopeKvWriteArgs a) {
  using S = typename E::Storage;
  using P = Pack<S, kVec>;
  const int64_t t = blockIdx.x;
  const int64_t item = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (item >= rope_items<kVec>(a)) return;
  const int64_t width = (a.num_heads + 2 * a.cache.num_kv_heads) * a.cache.head_dim;
  S* add = a.delta != nullptr ? static_cast<S*>(a.delta) + t * width : nullptr;
  rope_kv_write_item<E, kVec>(a, t, item, add != nullptr, [&](int64_t j, float(&v)[kVec]) {
    if (add == nullptr) return;
    const P dv = *reinterpret_cast<const P*>(add + j);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = round_to<E>(v[k] + E::load(dv.v[k]));
    if (a.clear_delta) *reinterpret_cast<P*>(add + j) = P{};
  });
}

// Grid x = a share of the items, y = token group (find_token_group). The block's threads are
// group_size rows of blockDim / group_size items: the tokens of a group run side by side on the
// same items, so the B rows they share are read from L2 once and from L1 after.
template <typename E, int kVec, int kBRows>
__global__ void rope_kv_write_lora_kernel(RopeKvWriteArgs a, int group_size) {
  extern __shared__ float staged[];  // [group_size, num_slices * max_rank]
  const FusedLoraExpand& e = a.lora;
  TokenGroup g;
  if (!begin_token_group<E>(e, group_size, staged, g, [](int) {})) return;
  const int cols = e.num_slices * e.max_rank;
  const int per_token = static_cast<int>(blockDim.x) / group_size;
  const int i = static_cast<int>(threadIdx.x) / per_token;
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * per_token + static_cast<int>(threadIdx.x) % per_token;
  if (i >= g.count || item >= rope_items<kVec>(a)) return;
  const int64_t t = e.meta.sorted_token_indices[g.begin + i];
  rope_kv_write_item<E, kVec>(a, t, item, g.slot >= 0, [&](int64_t j, float(&v)[kVec]) {
    if (g.slot >= 0) add_fused_expand<E, kVec, kBRows>(e, g.slot, j, staged + i * cols, v);
  });
}

// One warp per (token, q or k head): lanes stride over head_dim and a shuffle sum gives the
// head's sum of squares; the second pass reloads the values and writes them normalised. Each
// element is read and written by the same lane, so in place (and clearing the delta after its
// last read) is safe.
constexpr int kQkNormThreads = 128;

template <typename E>
__global__ void qk_rms_norm_kernel(QkRmsNormArgs a) {
  using S = typename E::Storage;
  const int64_t heads = a.num_heads + a.num_kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kQkNormThreads / 32) + threadIdx.x / 32;
  if (item >= a.num_tokens * heads) return;  // the whole warp leaves together
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t = item / heads;
  const int64_t h = item % heads;
  const int64_t d = a.head_dim;
  S* x = static_cast<S*>(a.qkv) + t * a.qkv_row_stride + h * d;
  S* add = a.delta != nullptr
               ? static_cast<S*>(a.delta) + t * (a.num_heads + 2 * a.num_kv_heads) * d + h * d
               : nullptr;
  const S* w = static_cast<const S*>(h < a.num_heads ? a.q_weight : a.k_weight);
  auto value = [&](int64_t i) {
    const float v = E::load(x[i]);
    return add != nullptr ? round_to<E>(v + E::load(add[i])) : v;
  };
  float squares = 0.0f;
  for (int64_t i = lane; i < d; i += 32) {
    const float v = value(i);
    squares += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
  const float inv = 1.0f / sqrtf(squares / static_cast<float>(d) + a.eps);
  for (int64_t i = lane; i < d; i += 32) {
    const float v = value(i);
    if (add != nullptr && a.clear_delta) add[i] = E::store(0.0f);
    x[i] = E::store(E::load(w[i]) * round_to<E>(v * inv));
  }
}

// One block per (token, head). Pass 1: the maximum score. Pass 2: keys in chunks of blockDim:
// each thread scores one key into shared memory, then threads own output dimensions and
// accumulate p * v over the chunk. No scratch proportional to the context.
template <typename E>
__global__ void paged_attention_kernel(PagedAttentionArgs a) {
  using S = typename E::Storage;
  extern __shared__ float smem[];  // [head_dim] q, then [blockDim] p
  __shared__ float red[32];
  const KvCacheView& c = a.cache;
  const int64_t d = c.head_dim;
  float* q = smem;
  float* p = smem + d;
  const int64_t t = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t kvh = h / (a.num_heads / c.num_kv_heads);
  const int64_t kv_row = c.num_kv_heads * d;
  const int32_t seq = a.token_seq[t];
  const int64_t ctx = static_cast<int64_t>(a.positions[t]) + 1;
  S* out = static_cast<S*>(a.out) + t * a.num_heads * d + h * d;
  const bool valid = seq >= 0 && seq < a.num_seqs && ctx >= 1 && ctx <= a.max_context;
  const int64_t row = valid ? seq : 0;
  const int32_t* table = a.block_tables + (a.block_table_indptr != nullptr
                                               ? static_cast<int64_t>(a.block_table_indptr[row])
                                               : row * a.max_blocks_per_seq);
  const S* qrow = static_cast<const S*>(a.qkv) + t * a.qkv_row_stride + h * d;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) q[i] = E::load(qrow[i]);
  __syncthreads();
  const S* kc = static_cast<const S*>(c.k);
  const S* vc = static_cast<const S*>(c.v);
  auto slot_of = [&](int64_t j) -> int64_t {
    const int32_t block = table[j / c.block_size];
    if (block < 0 || block >= c.num_blocks) return -1;
    return static_cast<int64_t>(block) * c.block_size + j % c.block_size;
  };
  auto score = [&](int64_t j) -> float {
    const int64_t slot = slot_of(j);
    if (slot < 0) return -FLT_MAX;
    const S* k = kc + slot * kv_row + kvh * d;
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot += q[i] * E::load(k[i]);
    return dot * a.scale;
  };
  float m = -FLT_MAX;
  if (valid) {
    for (int64_t j = threadIdx.x; j < ctx; j += blockDim.x) m = fmaxf(m, score(j));
  }
  m = block_max(m, red);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // dims threadIdx.x + k * blockDim.x, d <= 4 * 256
  float denom = 0.0f;
  const int64_t n = valid ? ctx : 0;
  for (int64_t j0 = 0; j0 < n; j0 += blockDim.x) {
    const int64_t j = j0 + threadIdx.x;
    float pj = 0.0f;
    if (j < n) {
      const float s = score(j);
      pj = s == -FLT_MAX ? 0.0f : expf(s - m);
    }
    denom += pj;
    __syncthreads();
    p[threadIdx.x] = pj;
    __syncthreads();
    const int64_t chunk = n - j0 < blockDim.x ? n - j0 : blockDim.x;
    for (int k = 0; k < 4; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i >= d) break;
      float sum = acc[k];
      for (int64_t jj = 0; jj < chunk; ++jj) {
        const int64_t slot = slot_of(j0 + jj);
        if (slot < 0) continue;
        sum += p[jj] * E::load(vc[slot * kv_row + kvh * d + i]);
      }
      acc[k] = sum;
    }
  }
  denom = block_sum(denom, red);
  for (int k = 0; k < 4; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (i >= d) break;
    out[i] = E::store(denom > 0.0f ? acc[k] / denom : 0.0f);
  }
}

template <typename E>
__device__ typename E::Storage silu_mul_one(float gv, float up) {
  // transformers rounds silu(gate) to the activation dtype before the multiply.
  const float g = round_to<E>(gv / (1.0f + expf(-gv)));
  return E::store(g * up);
}

// 16 bytes of gate and of up per thread when rows allow it (n a multiple of the vector width,
// 16-byte aligned rows), one element otherwise.
template <typename E, int kVec>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  using S = typename E::Storage;
  using P = Pack<S, kVec>;
  const int64_t per_row = a.n / kVec;
  const int64_t total = a.num_rows * per_row;
  const int64_t stride = a.x_row_stride > 0 ? a.x_row_stride : 2 * a.n;
  const S* x = static_cast<const S*>(a.x);
  S* delta = static_cast<S*>(a.delta);
  S* out = static_cast<S*>(a.out);
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / per_row;
    const int64_t j = (idx % per_row) * kVec;
    const P g = *reinterpret_cast<const P*>(x + r * stride + j);
    const P u = *reinterpret_cast<const P*>(x + r * stride + a.n + j);
    P dg{}, du{};
    if (delta != nullptr) {
      dg = *reinterpret_cast<const P*>(delta + r * 2 * a.n + j);
      du = *reinterpret_cast<const P*>(delta + r * 2 * a.n + a.n + j);
      if (a.clear_delta) {
        *reinterpret_cast<P*>(delta + r * 2 * a.n + j) = P{};
        *reinterpret_cast<P*>(delta + r * 2 * a.n + a.n + j) = P{};
      }
    }
    P o;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float gv = E::load(g.v[k]);
      float uv = E::load(u.v[k]);
      if (delta != nullptr) {
        gv = round_to<E>(gv + E::load(dg.v[k]));
        uv = round_to<E>(uv + E::load(du.v[k]));
      }
      o.v[k] = silu_mul_one<E>(gv, uv);
    }
    *reinterpret_cast<P*>(out + r * a.n + j) = o;
  }
}

// Grid x = tiles of `tile_cols` columns of the gate (and the same of up), y = token group. The
// block stages its slot's B rows of both tiles in shared memory (stage_b_tile), then its
// threads are group_size rows of tile_cols / kVec column runs: each B element crosses from
// memory once per block and is read from shared memory by every token of the group.
template <typename E, int kVec>
__global__ void silu_mul_lora_kernel(SiluMulArgs a, int group_size, int tile_cols, bool vector_b) {
  using S = typename E::Storage;
  using P = Pack<S, kVec>;
  extern __shared__ float staged[];  // [group_size, num_slices * max_rank], then 2 B tiles
  const FusedLoraExpand& e = a.lora;
  const int cols = e.num_slices * e.max_rank;
  S* tile = reinterpret_cast<S*>(staged + silu_tile_offset(group_size * cols));
  const int64_t first = static_cast<int64_t>(blockIdx.x) * tile_cols;
  const int64_t count = a.n - first < tile_cols ? a.n - first : tile_cols;
  TokenGroup g;
  const bool any = begin_token_group<E>(e, group_size, staged, g, [&](int slot) {
    stage_b_tile<E>(e, slot, first, count, tile_cols, vector_b, tile);
    stage_b_tile<E>(e, slot, a.n + first, count, tile_cols, vector_b,
                    tile + e.max_rank * tile_cols);
  });
  if (!any) return;
  const int per_token = tile_cols / kVec;
  const int i = static_cast<int>(threadIdx.x) / per_token;
  const int c0 = static_cast<int>(threadIdx.x) % per_token * kVec;
  const int64_t j = first + c0;
  if (i >= g.count || c0 >= count) return;
  const int64_t stride = a.x_row_stride > 0 ? a.x_row_stride : 2 * a.n;
  const int64_t t = e.meta.sorted_token_indices[g.begin + i];
  const S* row = static_cast<const S*>(a.x) + t * stride;
  const P gp = *reinterpret_cast<const P*>(row + j);
  const P up = *reinterpret_cast<const P*>(row + a.n + j);
  float gv[kVec], uv[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    gv[k] = E::load(gp.v[k]);
    uv[k] = E::load(up.v[k]);
  }
  if (g.slot >= 0) {
    add_tile_expand<E, kVec>(e, j, staged + i * cols, tile, tile_cols, c0, gv);
    add_tile_expand<E, kVec>(e, a.n + j, staged + i * cols, tile + e.max_rank * tile_cols,
                             tile_cols, c0, uv);
  }
  P o;
#pragma unroll
  for (int k = 0; k < kVec; ++k) o.v[k] = silu_mul_one<E>(gv[k], uv[k]);
  *reinterpret_cast<P*>(static_cast<S*>(a.out) + t * a.n + j) = o;
}

template <typename E>
__global__ void argmax_kernel(ArgmaxArgs a) {
  using S = typename E::Storage;
  __shared__ float best_v[kThreads];
  __shared__ int32_t best_i[kThreads];
  const int64_t r = blockIdx.x;
  const S* row = static_cast<const S*>(a.logits) + r * a.row_stride;
  float v = -INFINITY;
  int32_t idx = -1;
  for (int64_t j = threadIdx.x; j < a.vocab; j += blockDim.x) {
    const float x = E::load(row[j]);
    if (isnan(x)) continue;
    if (idx < 0 || x > v) {  // j increases within a thread: ties keep the lower index
      v = x;
      idx = static_cast<int32_t>(j);
    }
  }
  best_v[threadIdx.x] = v;
  best_i[threadIdx.x] = idx;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const int32_t oi = best_i[threadIdx.x + s];
      const float mv = best_v[threadIdx.x];
      const int32_t mi = best_i[threadIdx.x];
      const bool take = oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi));
      if (take) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) a.ids[r] = best_i[0] < 0 ? 0 : best_i[0];
}

}  // namespace

Status fill_uniform(const FillUniformArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.n >= 0 && (a.n == 0 || a.out != nullptr), "fill_uniform: bad arguments");
  if (a.n == 0) return Status();
  if (a.dtype == DType::kF8E4M3) {
    fill_uniform_kernel<E4M3><<<blocks_for(a.n), kThreads, 0, raw(stream)>>>(a);
    return Status();
  }
  return dispatch(a.dtype, "fill_uniform", [&](auto e) {
    fill_uniform_kernel<decltype(e)><<<blocks_for(a.n), kThreads, 0, raw(stream)>>>(a);
  });
}

namespace {

// The tokens a LoRA consumer takes per group: about a step's tokens per slot (a power of two
// up to 8, so that the block splits evenly; the slots in use are not known on the host), no
// more than the staged intermediates of a group fit in 48 KB of shared memory. 0: not even one.
int lora_group_tokens(const FusedLoraExpand& e, int64_t tokens) {
  const size_t per_token = std::max<size_t>(staged_shrink_bytes(e, 1), 1);
  const int64_t fits = static_cast<int64_t>((48u << 10) / per_token);
  const int64_t per_slot = tokens / std::max(e.num_slots, 1);
  int group = 1;
  while (group < 8 && group * 2 <= per_slot && group * 2 <= fits) group *= 2;
  return fits >= 1 ? group : 0;
}

// Whether every slice starts and ends on a multiple of `vec` columns (a vector of the consumer
// then lies in one slice).
bool slices_on_vectors(const FusedLoraExpand& e, int64_t vec) {
  bool ok = true;
  for (int s = 0; s < e.num_slices; ++s) ok = ok && e.offset[s] % vec == 0 && e.width[s] % vec == 0;
  return ok;
}

// silu_mul's LoRA blocks: `group` tokens side by side on tiles of `tile_cols` gate columns (and
// the same up columns), kThreads threads while the tiles of B fit the shared memory, fewer for
// long B rows. `smem`: the staged intermediates and the two tiles.
struct SiluLoraTiling {
  int group = 1;
  int tile_cols = 1;
  size_t smem = 0;
};

SiluLoraTiling silu_lora_tiling(const FusedLoraExpand& e, int64_t tokens, int64_t n, int vec,
                                size_t element_bytes) {
  SiluLoraTiling t;
  t.group = lora_group_tokens(e, tokens);
  const int64_t staged = silu_tile_offset(t.group * e.num_slices * e.max_rank);
  int per_token = kThreads / t.group;
  // No wider than the row (rounded up to the vector): a few columns need no 256 threads.
  const int64_t runs = (n + vec - 1) / vec;
  while (per_token > 32 / t.group && per_token / 2 >= runs) per_token /= 2;
  auto smem_of = [&](int cols) {
    return static_cast<size_t>(staged) * sizeof(float) +
           2 * static_cast<size_t>(e.max_rank) * cols * element_bytes;
  };
  while (per_token > 1 && smem_of(per_token * vec) > (48u << 10)) per_token /= 2;
  t.tile_cols = per_token * vec;
  t.smem = smem_of(t.tile_cols);
  return t;
}

}  // namespace

Status add_rms_norm(const AddRmsNormArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.hidden >= 1 && a.residual != nullptr &&
                      a.weight != nullptr && a.out != nullptr &&
                      !(a.lora.active() && a.delta == nullptr),
                  "add_rms_norm: bad arguments (rows ", a.num_rows, ", hidden ", a.hidden, ")");
  LORAPLEX_ENSURE(!(a.clear_delta2 && a.rows != nullptr),
                  "add_rms_norm: clear_delta2 needs rows == nullptr");
  LORAPLEX_RETURN_IF_ERROR(check_fused_lora_expand(a.lora, a.hidden, "add_rms_norm"));
  LORAPLEX_ENSURE(!a.lora.active() || lora_group_tokens(a.lora, 1) >= 1,
                  "add_rms_norm: a token's LoRA intermediate of ",
                  a.lora.num_slices * a.lora.max_rank,
                  " columns does not fit 48 KB of shared memory");
  if (a.num_rows == 0) return Status();
  const int64_t dstride = a.delta_row_stride > 0 ? a.delta_row_stride : a.hidden;
  const size_t smem = a.lora.active() ? staged_shrink_bytes(a.lora, 1) : 0;
  return dispatch(a.dtype, "add_rms_norm", [&](auto e) {
    using E = decltype(e);
    constexpr int kN = Vec16<typename E::Storage>::kN;
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vec = a.hidden % kN == 0 && a.hidden <= int64_t{kNormVecs} * kThreads * kN &&
                     dstride % kN == 0 && aligned(a.residual) && aligned(a.delta) &&
                     aligned(a.delta2) && aligned(a.residual_out) && aligned(a.weight) &&
                     aligned(a.out) && (!a.lora.active() || slices_on_vectors(a.lora, kN));
    const unsigned grid = static_cast<unsigned>(a.num_rows);
    if (!a.lora.active()) {
      if (vec) {
        add_rms_norm_vec_kernel<E, false, kBRowsScalar><<<grid, kThreads, 0, raw(stream)>>>(a);
      } else {
        add_rms_norm_kernel<E, false><<<grid, kThreads, 0, raw(stream)>>>(a);
      }
    } else if (!vec) {
      add_rms_norm_kernel<E, true><<<grid, kThreads, smem, raw(stream)>>>(a);
    } else if (a.num_rows < kNormWideRows) {
      // A few rows: each split over a cluster (add_rms_norm_lora_split_kernel).
      const int64_t per_part = (a.hidden / kN + kNormParts - 1) / kNormParts;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(grid * static_cast<unsigned>(kNormParts));
      cfg.blockDim = dim3(static_cast<unsigned>((per_part + 31) / 32 * 32));
      cfg.dynamicSmemBytes = smem;
      cfg.stream = raw(stream);
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(kNormParts);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      with_b_rows<E>(a.lora, [&](auto b_rows) {
        cudaLaunchKernelEx(&cfg, add_rms_norm_lora_split_kernel<E, decltype(b_rows)::value>, a);
      });
    } else {
      with_b_rows<E>(a.lora, [&](auto b_rows) {
        add_rms_norm_vec_kernel<E, true, decltype(b_rows)::value>
            <<<grid, kThreads, smem, raw(stream)>>>(a);
      });
    }
  });
}

Status rope_kv_write(const RopeKvWriteArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_rope_kv_write_args(a));
  const KvCacheView& c = a.cache;
  LORAPLEX_ENSURE(!a.lora.active() || lora_group_tokens(a.lora, 1) >= 1,
                  "rope_kv_write: a token's LoRA intermediate of ",
                  a.lora.num_slices * a.lora.max_rank,
                  " columns does not fit 48 KB of shared memory");
  if (a.num_tokens == 0) return Status();
  return dispatch(a.dtype, "rope_kv_write", [&](auto e) {
    using E = decltype(e);
    constexpr int kVec = 4;
    constexpr uintptr_t kAlign = sizeof(typename E::Storage) * kVec;
    auto aligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; };
    const bool vec = c.head_dim % (2 * kVec) == 0 && a.qkv_row_stride % kVec == 0 &&
                     aligned(a.qkv) && aligned(c.k) && aligned(c.v) &&
                     (a.delta == nullptr || aligned(a.delta)) &&
                     (!a.lora.active() || slices_on_vectors(a.lora, kVec));
    constexpr int kRopeThreads = 128;
    const int64_t items = vec ? rope_items<kVec>(a) : rope_items<1>(a);
    const unsigned item_blocks = static_cast<unsigned>((items + kRopeThreads - 1) / kRopeThreads);
    if (!a.lora.active()) {
      const dim3 grid(static_cast<unsigned>(a.num_tokens), item_blocks);
      if (vec) {
        rope_kv_write_kernel<E, kVec><<<grid, kRopeThreads, 0, raw(stream)>>>(a);
      } else {
        rope_kv_write_kernel<E, 1><<<grid, kRopeThreads, 0, raw(stream)>>>(a);
      }
      return;
    }
    const int group = lora_group_tokens(a.lora, a.num_tokens);
    const int per_token = kRopeThreads / group;
    const dim3 grid(static_cast<unsigned>((items + per_token - 1) / per_token),
                    static_cast<unsigned>(max_token_groups(a.num_tokens, group, a.lora.max_loras)));
    const size_t smem = staged_shrink_bytes(a.lora, group);
    if (!vec) {
      rope_kv_write_lora_kernel<E, 1, kBRowsScalar>
          <<<grid, kRopeThreads, smem, raw(stream)>>>(a, group);
    } else {
      with_b_rows<E>(a.lora, [&](auto b_rows) {
        rope_kv_write_lora_kernel<E, kVec, decltype(b_rows)::value>
            <<<grid, kRopeThreads, smem, raw(stream)>>>(a, group);
      });
    }
  });
}

Status qk_rms_norm(const QkRmsNormArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_qk_rms_norm_args(a));
  const int64_t items = a.num_tokens * (a.num_heads + a.num_kv_heads);
  if (items == 0) return Status();
  constexpr int64_t kWarps = kQkNormThreads / 32;
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  LORAPLEX_ENSURE(blocks <= 0x7fffffff, "qk_rms_norm: ", items, " heads exceed one grid");
  return dispatch(a.dtype, "qk_rms_norm", [&](auto e) {
    qk_rms_norm_kernel<decltype(e)>
        <<<static_cast<unsigned>(blocks), kQkNormThreads, 0, raw(stream)>>>(a);
  });
}

Status paged_attention(const PagedAttentionArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_paged_attention_args(a));
  const KvCacheView& c = a.cache;
  LORAPLEX_ENSURE(c.head_dim <= 4 * kThreads, "paged_attention: head_dim ", c.head_dim, " exceeds ",
                  4 * kThreads);
  if (a.num_tokens == 0) return Status();
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_heads));
  const size_t shared = static_cast<size_t>(c.head_dim + kThreads) * sizeof(float);
  return dispatch(a.dtype, "paged_attention", [&](auto e) {
    paged_attention_kernel<decltype(e)><<<grid, kThreads, shared, raw(stream)>>>(a);
  });
}

Status silu_mul(const SiluMulArgs& a, cuda_rt::StreamHandle stream) {
  const int64_t stride = a.x_row_stride > 0 ? a.x_row_stride : 2 * a.n;
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.n >= 1 && stride >= 2 * a.n, "silu_mul: bad sizes (n ", a.n,
                  ", row stride ", stride, ")");
  LORAPLEX_RETURN_IF_ERROR(check_fused_lora_expand(a.lora, 2 * a.n, "silu_mul"));
  LORAPLEX_ENSURE(!a.lora.active() || lora_group_tokens(a.lora, 1) >= 1,
                  "silu_mul: a token's LoRA intermediate of ", a.lora.num_slices * a.lora.max_rank,
                  " columns does not fit 48 KB of shared memory");
  if (a.num_rows == 0) return Status();
  return dispatch(a.dtype, "silu_mul", [&](auto e) {
    using E = decltype(e);
    constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Storage));
    const bool aligned = a.n % kVec == 0 && stride % kVec == 0 &&
                         reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(a.out) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(a.delta) % 16 == 0 &&
                         (!a.lora.active() || slices_on_vectors(a.lora, kVec));
    if (!a.lora.active()) {
      if (aligned) {
        silu_mul_kernel<E, kVec>
            <<<blocks_for(a.num_rows * a.n / kVec), kThreads, 0, raw(stream)>>>(a);
      } else {
        silu_mul_kernel<E, 1><<<blocks_for(a.num_rows * a.n), kThreads, 0, raw(stream)>>>(a);
      }
      return;
    }
    // A few tokens spread over the SMs only with fewer columns a thread: each token's B is what
    // the step reads, and 16-byte runs of a few rows would leave most SMs idle.
    const int kv = !aligned ? 1 : a.num_rows * (a.n / kVec) < kSmallStepThreads ? 2 : kVec;
    const SiluLoraTiling tiling =
        silu_lora_tiling(a.lora, a.num_rows, a.n, kv, sizeof(typename E::Storage));
    const dim3 grid(
        static_cast<unsigned>((a.n + tiling.tile_cols - 1) / tiling.tile_cols),
        static_cast<unsigned>(max_token_groups(a.num_rows, tiling.group, a.lora.max_loras)));
    const unsigned threads = static_cast<unsigned>(tiling.group * tiling.tile_cols / kv);
    const bool vector_b = vector_b_rows<E>(a.lora);
    auto launch = [&](auto vec) {
      constexpr int kV = decltype(vec)::value;
      silu_mul_lora_kernel<E, kV><<<grid, threads, tiling.smem, raw(stream)>>>(
          a, tiling.group, tiling.tile_cols, vector_b);
    };
    if (kv == 1) {
      launch(std::integral_constant<int, 1>{});
    } else if (kv == 2) {
      launch(std::integral_constant<int, 2>{});
    } else {
      launch(std::integral_constant<int, kVec>{});
    }
  });
}

namespace {

__global__ void feed_tokens_kernel(FeedTokensArgs a) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < a.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t r = a.rows[t];
    if (r >= 0 && r < a.num_sampled) a.tokens[t] = a.sampled[r];
  }
}

}  // namespace

Status feed_tokens(const FeedTokensArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_feed_tokens_args(a));
  if (a.num_tokens == 0) return Status();
  feed_tokens_kernel<<<blocks_for(a.num_tokens), kThreads, 0, raw(stream)>>>(a);
  return launch_status("feed_tokens");
}

Status argmax(const ArgmaxArgs& a, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(a.num_rows >= 0 && a.vocab >= 1 && a.row_stride >= a.vocab, "argmax: bad sizes");
  if (a.num_rows == 0) return Status();
  return dispatch(a.dtype, "argmax", [&](auto e) {
    argmax_kernel<decltype(e)><<<static_cast<unsigned>(a.num_rows), kThreads, 0, raw(stream)>>>(a);
  });
}

}  // namespace loraplex::kernels::cuda
