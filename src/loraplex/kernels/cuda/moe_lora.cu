// Fused MoE LoRA on CUDA: the per-slot expert alignment (moe_lora_align_block_size) and the
// shrink + expand of the routed pairs. Small batches visit pairs directly (naive blocks, one
// CTA per pair); large batches visit the aligned blocks, one CTA per (slot, block) so that a
// block's rows share the slot/expert weights through L1/L2. In both, the rank-r intermediate
// of the CTA's rows stays in shared memory.

#include "loraplex/kernels/cuda/block_bucket.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr int kAlignThreads = 1024;
constexpr int kAlignMaxCounterInts = 16 * 1024;

struct AlignParams {
  int64_t num_pairs;
  int top_k;
  int num_experts;
  int block_size;
  int max_loras;
  const int32_t* topk_ids;
  const int32_t* mapping;
  const int32_t* adapter_enabled;
  int64_t max_num_tokens_padded;
  int64_t max_num_m_blocks;
  int32_t* sorted_ids;
  int32_t* expert_ids;
  int32_t* num_tokens_post_pad;
};

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(AlignParams p, int nw) {
  extern __shared__ int smem[];
  const int slot = static_cast<int>(blockIdx.x);
  const int ne = p.num_experts;
  int* wc = smem;
  int* total = wc + nw * ne;
  int* base = total + ne;
  int32_t* sorted = p.sorted_ids + slot * p.max_num_tokens_padded;
  int32_t* experts = p.expert_ids + slot * p.max_num_m_blocks;
  const int32_t pad = static_cast<int32_t>(p.num_pairs);
  for (int64_t i = threadIdx.x; i < p.max_num_tokens_padded; i += blockDim.x) sorted[i] = pad;
  for (int64_t i = threadIdx.x; i < p.max_num_m_blocks; i += blockDim.x) experts[i] = -1;
  const bool enabled = p.adapter_enabled == nullptr || p.adapter_enabled[slot] != 0;
  if (!enabled) {
    if (threadIdx.x == 0) p.num_tokens_post_pad[slot] = 0;
    return;
  }
  auto bucket = [&](int i) {
    const int32_t e = p.topk_ids[i];
    return p.mapping[i / p.top_k] == slot && e >= 0 && e < ne ? e : -1;
  };
  const int n = static_cast<int>(p.num_pairs);
  // bucket_count's first barrier also orders the fills above before the writes below.
  bucket_count(n, ne, nw, wc, bucket);
  bucket_offsets(ne, nw, wc, total);
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int run = 0;
    for (int e0 = 0; e0 < ne; e0 += 32) {
      const int e = e0 + lane;
      const int padded = e < ne ? (total[e] + p.block_size - 1) / p.block_size * p.block_size : 0;
      const int incl = warp_inclusive_sum(padded, lane);
      if (e < ne) base[e] = run + incl - padded;
      run += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) p.num_tokens_post_pad[slot] = run;
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < ne; e += blockDim.x) {
    const int blocks = (total[e] + p.block_size - 1) / p.block_size;
    for (int j = 0; j < blocks; ++j) experts[base[e] / p.block_size + j] = e;
  }
  bucket_scatter(n, ne, nw, wc, bucket, [&](int i, int e, int pos) { sorted[base[e] + pos] = i; });
}

constexpr int kMoeThreads = 256;

struct MoeParams {
  const void* x;
  bool x_rows_are_pairs;
  int64_t k_dim;
  int num_slices;
  const void* a[kMaxSlices];
  const void* b[kMaxSlices];
  int64_t n;
  int max_loras;
  int max_rank;
  int num_experts;
  int top_k;
  int64_t num_pairs;
  const int32_t* ranks;
  const int32_t* mapping;
  const int32_t* adapter_enabled;
  const int32_t* topk_ids;
  const float* topk_weights;
  bool mul_routed_weight;
  bool naive;
  int block_size;
  int64_t max_num_tokens_padded;
  int64_t max_num_m_blocks;
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* num_tokens_post_pad;
  void* out;
  int64_t out_row_width;
  int64_t offset;
  bool add_inputs;
};

template <typename T>
__global__ void __launch_bounds__(kMoeThreads) fused_moe_lora_kernel(MoeParams p) {
  extern __shared__ float smem_f[];
  const int rows_max = p.naive ? 1 : p.block_size;
  float* v = smem_f;  // [rows_max][num_slices][max_rank]
  int* pairs = reinterpret_cast<int*>(v + rows_max * p.num_slices * p.max_rank);  // [rows_max]
  const int64_t item = blockIdx.x;
  int32_t slot;
  int32_t expert;
  if (p.naive) {
    slot = p.mapping[item / p.top_k];
    expert = p.topk_ids[item];
  } else {
    slot = static_cast<int32_t>(item / p.max_num_m_blocks);
    const int64_t block = item % p.max_num_m_blocks;
    if (block * p.block_size >= p.num_tokens_post_pad[slot]) return;
    expert = p.expert_ids[item];
  }
  if (!valid_slot(slot, p.max_loras)) return;
  if (p.adapter_enabled != nullptr && p.adapter_enabled[slot] == 0) return;
  if (expert < 0 || expert >= p.num_experts) return;
  for (int i = static_cast<int>(threadIdx.x); i < rows_max; i += blockDim.x) {
    int32_t pair = static_cast<int32_t>(item);
    if (!p.naive) {
      pair = p.sorted_ids[slot * p.max_num_tokens_padded +
                          (item % p.max_num_m_blocks) * p.block_size + i];
    }
    pairs[i] = pair >= 0 && pair < p.num_pairs ? pair : -1;
  }
  __syncthreads();
  const int64_t slot_expert = static_cast<int64_t>(slot) * p.num_experts + expert;
  const int S = p.num_slices;
  const int MR = p.max_rank;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  // Shrink: one warp per (row, slice, rank) dot product over K.
  for (int idx = warp; idx < rows_max * S * MR; idx += kMoeThreads / 32) {
    const int row = idx / (S * MR);
    const int s = (idx / MR) % S;
    const int r = idx % MR;
    const int pair = pairs[row];
    if (pair < 0 || r >= p.ranks[s * p.max_loras + slot]) continue;
    const T* x =
        static_cast<const T*>(p.x) + (p.x_rows_are_pairs ? pair : pair / p.top_k) * p.k_dim;
    const T* a = static_cast<const T*>(p.a[s]) + (slot_expert * MR + r) * p.k_dim;
    float acc = 0.0f;
    for (int64_t k = lane; k < p.k_dim; k += 32) acc += to_float(x[k]) * to_float(a[k]);
    acc = warp_sum(acc);
    if (lane == 0) v[idx] = acc;
  }
  __syncthreads();
  // Expand: one thread per output element of the rows.
  for (int64_t idx = threadIdx.x; idx < rows_max * S * p.n; idx += kMoeThreads) {
    const int row = static_cast<int>(idx / (S * p.n));
    const int s = static_cast<int>((idx / p.n) % S);
    const int64_t j = idx % p.n;
    const int pair = pairs[row];
    if (pair < 0) continue;
    const int rank = p.ranks[s * p.max_loras + slot];
    const T* b = static_cast<const T*>(p.b[s]) + (slot_expert * p.n + j) * MR;
    const float* vr = v + (row * S + s) * MR;
    float acc = 0.0f;
    for (int r = 0; r < rank; ++r) acc += vr[r] * to_float(b[r]);
    if (p.mul_routed_weight) acc *= p.topk_weights[pair];
    T* o = static_cast<T*>(p.out) + pair * p.out_row_width + p.offset + s * p.n + j;
    if (p.add_inputs) acc += to_float(*o);
    *o = from_float<T>(acc);
  }
}

}  // namespace

Status moe_lora_align_block_size(const MoeAlignArgs& a, StreamHandle stream) {
  const char* op = "moe_lora_align_block_size";
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.block_size >= 1 &&
                      a.max_loras >= 1,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", block ", a.block_size, ", max_loras ", a.max_loras, ")");
  const int64_t num_pairs = a.num_tokens * a.top_k;
  LORAPLEX_ENSURE(num_pairs < (int64_t{1} << 31), op, ": ", num_pairs, " pairs exceed int32");
  const MoeAlignSizes need = moe_align_sizes(num_pairs, a.num_experts, a.block_size);
  LORAPLEX_ENSURE(a.max_num_tokens_padded >= need.max_num_tokens_padded &&
                      a.max_num_m_blocks >= need.max_num_m_blocks,
                  op, ": buffers hold ", a.max_num_tokens_padded, " ids and ", a.max_num_m_blocks,
                  " blocks, need ", need.max_num_tokens_padded, " and ", need.max_num_m_blocks);
  LORAPLEX_ENSURE(
      a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr &&
          (num_pairs == 0 || (a.topk_ids != nullptr && a.token_lora_mapping != nullptr)),
      op, ": a pointer is null");
  AlignParams p{num_pairs,
                a.top_k,
                a.num_experts,
                a.block_size,
                a.max_loras,
                a.topk_ids,
                a.token_lora_mapping,
                a.adapter_enabled,
                a.max_num_tokens_padded,
                a.max_num_m_blocks,
                a.sorted_ids,
                a.expert_ids,
                a.num_tokens_post_pad};
  const int nw = bucket_sort_warps(a.num_experts, kAlignMaxCounterInts, kAlignThreads / 32);
  const int smem = (nw * a.num_experts + 2 * a.num_experts) * static_cast<int>(sizeof(int));
  LORAPLEX_RETURN_IF_ERROR(
      allow_dynamic_smem(reinterpret_cast<const void*>(&moe_align_kernel), smem));
  moe_align_kernel<<<a.max_loras, kAlignThreads, smem, static_cast<cudaStream_t>(stream)>>>(p, nw);
  return launch_status("moe_align_kernel");
}

Status fused_moe_lora(const FusedMoeLoraArgs& a, StreamHandle stream) {
  const char* op = "fused_moe_lora";
  LORAPLEX_ENSURE(a.dtype == DType::kF32 || a.dtype == DType::kF16 || a.dtype == DType::kBF16, op,
                  ": dtype ", a.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.top_k >= 1 && a.num_experts >= 1 && a.hidden_in >= 1 &&
                      a.n >= 1 && a.max_loras >= 1 && a.max_rank >= 1 && a.num_slices >= 1 &&
                      a.num_slices <= kMaxSlices,
                  op, ": bad sizes (tokens ", a.num_tokens, ", top_k ", a.top_k, ", experts ",
                  a.num_experts, ", K ", a.hidden_in, ", N ", a.n, ", slices ", a.num_slices, ")");
  LORAPLEX_ENSURE(a.offset >= 0 && a.offset + a.num_slices * a.n <= a.out_row_width, op,
                  ": slices cover columns [", a.offset, ", ", a.offset + a.num_slices * a.n,
                  ") of rows ", a.out_row_width, " wide");
  LORAPLEX_ENSURE(!a.mul_routed_weight || a.topk_weights != nullptr, op,
                  ": mul_routed_weight needs topk_weights");
  if (a.num_tokens == 0) return Status();
  if (!a.naive_blocks) {
    LORAPLEX_ENSURE(
        a.sorted_ids != nullptr && a.expert_ids != nullptr && a.num_tokens_post_pad != nullptr, op,
        ": aligned blocks need sorted_ids, expert_ids and num_tokens_post_pad");
    LORAPLEX_ENSURE(a.block_size >= 1 && a.max_num_m_blocks >= 1, op, ": block size ", a.block_size,
                    " and ", a.max_num_m_blocks, " blocks, expected >= 1");
  }
  MoeParams p{};
  p.x = a.x;
  p.x_rows_are_pairs = a.x_rows_are_pairs;
  p.k_dim = a.hidden_in;
  p.num_slices = a.num_slices;
  for (int s = 0; s < a.num_slices; ++s) {
    p.a[s] = a.lora_a[s];
    p.b[s] = a.lora_b[s];
  }
  p.n = a.n;
  p.max_loras = a.max_loras;
  p.max_rank = a.max_rank;
  p.num_experts = a.num_experts;
  p.top_k = a.top_k;
  p.num_pairs = a.num_tokens * a.top_k;
  p.ranks = a.ranks;
  p.mapping = a.token_lora_mapping;
  p.adapter_enabled = a.adapter_enabled;
  p.topk_ids = a.topk_ids;
  p.topk_weights = a.topk_weights;
  p.mul_routed_weight = a.mul_routed_weight;
  p.naive = a.naive_blocks;
  p.block_size = a.block_size;
  p.max_num_tokens_padded = a.max_num_tokens_padded;
  p.max_num_m_blocks = a.max_num_m_blocks;
  p.sorted_ids = a.sorted_ids;
  p.expert_ids = a.expert_ids;
  p.num_tokens_post_pad = a.num_tokens_post_pad;
  p.out = a.out;
  p.out_row_width = a.out_row_width;
  p.offset = a.offset;
  p.add_inputs = a.add_inputs;
  const int rows = a.naive_blocks ? 1 : a.block_size;
  const int64_t smem64 =
      static_cast<int64_t>(rows) * a.num_slices * a.max_rank * 4 + static_cast<int64_t>(rows) * 4;
  LORAPLEX_ENSURE(smem64 <= 200 * 1024, op, ": block of ", rows, " rows x ", a.num_slices,
                  " slices x rank ", a.max_rank, " needs ", smem64, " bytes of shared memory");
  const int smem = static_cast<int>(smem64);
  const int64_t grid = a.naive_blocks ? p.num_pairs : int64_t{a.max_loras} * a.max_num_m_blocks;
  LORAPLEX_ENSURE(grid < (int64_t{1} << 31), op, ": ", grid, " work items exceed one launch");
  auto s = static_cast<cudaStream_t>(stream);
  Status status;
  dispatch_device_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // (void): nvcc flags the discarded Status& of a [[nodiscard]] class's operator=.
    (void)(status =
               allow_dynamic_smem(reinterpret_cast<const void*>(&fused_moe_lora_kernel<T>), smem));
    if (status.ok()) {
      fused_moe_lora_kernel<T><<<static_cast<unsigned>(grid), kMoeThreads, smem, s>>>(p);
    }
  });
  LORAPLEX_RETURN_IF_ERROR(status);
  return launch_status("fused_moe_lora_kernel");
}

}  // namespace loraplex::kernels::cuda
