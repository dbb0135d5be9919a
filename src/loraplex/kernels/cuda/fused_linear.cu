// One LoRA layer (shrink + expand, all slices) in one kernel for small batches.
//
// The grid is made of clusters of 8 CTAs. A cluster takes one work item: one active slot, a
// tile of up to `m_tile` of that slot's tokens, and one `part` of the layer's output columns.
// Each CTA of the cluster computes the shrink over its eighth of K for every slice (tensor
// cores, operands staged with cp.async, nothing loaded past a slot's rank), leaves the fp32
// partial sums in its shared memory, and after a cluster barrier sums the eight partials it
// needs through distributed shared memory. Then it expands its own columns (CUDA cores, B and
// y read with 16-byte loads, L2-prefetched while the shrink runs) and writes y. The rank-r
// intermediate never leaves the chip and the launch configuration depends only on host-known
// sizes, so the whole layer is one graph node. With fewer work tiles than clusters, a slot's
// columns are split into several parts; each part recomputes the (small) shrink and reads A
// from L2, so every SM has bytes to move.

#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace cg = cooperative_groups;

namespace loraplex::kernels::cuda {
namespace {

constexpr int kCluster = 8;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBK = 64;
constexpr int kPitch = kBK + 8;
constexpr int kMaxTile = 64;             // tokens per work item at most
constexpr int kMaxRows = 256;            // num_slices * max_rank at most (A rows staged)
constexpr int kMaxUnits = 4;             // MMA tiles (16 tokens x 8 ranks) per warp at most
constexpr int kMaxParts = 16;            // column parts per slot at most
constexpr int kSmemTarget = 110 * 1024;  // two CTAs per SM
constexpr int kDefaultMaxTokens = 128;

std::atomic<int> g_fused_max_tokens{kDefaultMaxTokens};

struct FusedParams {
  const void* x;
  int64_t x_stride;
  int64_t hidden;
  int num_slices;
  const void* a[kMaxSlices];
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];
  int64_t col_begin[kMaxSlices + 1];  // slices concatenated; col_begin[num_slices] = total
  int64_t y_col[kMaxSlices];          // first y column of each slice
  int max_loras;
  int max_rank;
  const int32_t* ranks;
  float scale;
  void* y;
  int64_t y_stride;
  bool add_inputs;
  LoraMetaView meta;
  int m_tile;         // tokens per work item (16, 32 or 64)
  int k_chunk;        // K per CTA of a cluster, a multiple of kBK
  int stages;         // cp.async pipeline depth, 2..8
  int region0_bytes;  // stages, reused for the partial sums
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) fused_lora_linear_kernel(FusedParams p) {
  cg::cluster_group cluster = cg::this_cluster();
  const int crank = static_cast<int>(cluster.block_rank());
  const int cid = static_cast<int>(blockIdx.x) / kCluster;
  const int nclusters = static_cast<int>(gridDim.x) / kCluster;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int S = p.num_slices;
  const int MR = p.max_rank;
  const int RA = S * MR;
  const int mt = p.m_tile;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* stages = reinterpret_cast<T*>(smem_raw);
  float* part_sums = reinterpret_cast<float*>(smem_raw);  // [mt][RA] after the K loop
  float* v_sums = reinterpret_cast<float*>(smem_raw + p.region0_bytes);  // [mt][RA]
  int* tok = reinterpret_cast<int*>(v_sums + mt * RA);                   // [kMaxTile]
  int* srank = tok + kMaxTile;                                           // [kMaxSlices]
  int* tile_row = srank + kMaxSlices;                                    // [kMaxRows / 8]
  int* prefix = tile_row + kMaxRows / 8;                                 // [max_loras + 2]
  const int stage_elems = (mt + RA) * kPitch;

  const int n_entries = build_tile_prefix(p.meta, mt, prefix);
  const int tiles = prefix[n_entries];
  if (tiles == 0) return;  // the same answer in every CTA: no cluster barrier is skipped alone
  const int parts = max(1, min(kMaxParts, nclusters / tiles));
  const int works = tiles * parts;

  const int64_t k_lo = static_cast<int64_t>(crank) * p.k_chunk;
  const int64_t k_hi = min(p.hidden, k_lo + p.k_chunk);
  const int nk = k_hi > k_lo ? static_cast<int>(ceil_div(k_hi - k_lo, kBK)) : 0;
  const int64_t n_groups = p.col_begin[S] / 8;  // 8-column groups of the concatenated slices
  const int64_t groups_per_cta = ceil_div(n_groups, static_cast<int64_t>(parts) * kCluster);
  const T* xg = static_cast<const T*>(p.x);
  T* yg = static_cast<T*>(p.y);

  for (int w = cid; w < works; w += nclusters) {
    const int tile = w / parts;
    const int part = w % parts;
    const int e = find_tile_entry(prefix, n_entries, tile);
    const int slot = p.meta.active_lora_ids[e];
    const int m0 = (tile - prefix[e]) * mt;
    const int n_tok = min(mt, p.meta.num_tokens_per_lora[e] - m0);
    const int start = p.meta.lora_token_start_loc[e] + m0;
    __syncthreads();  // the previous work item is done with the shared arrays
    if (tid < kMaxTile) tok[tid] = tid < n_tok ? p.meta.sorted_token_indices[start + tid] : 0;
    if (tid < S) srank[tid] = p.ranks[tid * p.max_loras + slot];
    __syncthreads();
    // Active MMA column tiles: ceil(rank_s / 8) per slice, as A-row offsets.
    int ta = 0;
    for (int s = 0; s < S; ++s) {
      const int n8 = (srank[s] + 7) / 8;
      if (tid < n8) tile_row[ta + tid] = s * MR + tid * 8;
      ta += n8;
    }
    __syncthreads();  // tile_row is complete
    const int64_t q = static_cast<int64_t>(part) * kCluster + crank;
    const int64_t g_lo = min(n_groups, q * groups_per_cta);
    const int64_t g_hi = min(n_groups, g_lo + groups_per_cta);

    // Warm the L2 with this CTA's expand operands while the shrink runs.
    for (int s = 0; s < S; ++s) {
      const int64_t c_lo = max(g_lo * 8, p.col_begin[s]) - p.col_begin[s];
      const int64_t c_hi = min(g_hi * 8, p.col_begin[s + 1]) - p.col_begin[s];
      if (c_hi <= c_lo || srank[s] == 0) continue;
      if (2 * srank[s] >= MR) {
        const char* b0 = reinterpret_cast<const char*>(static_cast<const T*>(p.b[s]) +
                                                       (slot * p.width[s] + c_lo) * MR);
        const int64_t lines = ceil_div((c_hi - c_lo) * MR * static_cast<int64_t>(sizeof(T)), 128);
        for (int64_t l = tid; l < lines; l += kThreads) prefetch_l2(b0 + l * 128);
      }
      if (p.add_inputs) {
        const int64_t row_bytes = (c_hi - c_lo) * static_cast<int64_t>(sizeof(T));
        const int64_t row_lines = row_bytes / 128 + 2;
        for (int64_t i = tid; i < n_tok * row_lines; i += kThreads) {
          const uintptr_t first =
              reinterpret_cast<uintptr_t>(yg + tok[i / row_lines] * p.y_stride + p.y_col[s] + c_lo);
          const uintptr_t line = (first & ~uintptr_t{127}) + (i % row_lines) * 128;
          if (line < first + row_bytes) prefetch_l2(reinterpret_cast<const void*>(line));
        }
      }
    }

    // ---- shrink: partial sums over this CTA's K range ----
    const int mgroups = (n_tok + 15) / 16;
    const int units = mgroups * ta;
    int unit_row[kMaxUnits];  // first token row of the unit's 16-row group
    int unit_a[kMaxUnits];    // first A row (slice * max_rank + rank) of its 8-rank tile
#pragma unroll
    for (int i = 0; i < kMaxUnits; ++i) {
      const int u = warp + i * kWarps;
      unit_row[i] = u < units ? (u / ta) * 16 : 0;
      unit_a[i] = u < units ? tile_row[u % ta] : 0;
    }
    float acc[kMaxUnits][4];
#pragma unroll
    for (int i = 0; i < kMaxUnits; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    auto load_stage = [&](int kt) {
      T* xs = stages + (kt % p.stages) * stage_elems;
      T* as = xs + mt * kPitch;
      const int64_t k0 = k_lo + static_cast<int64_t>(kt) * kBK;
      const int xrows = mgroups * 16;
      for (int i = tid; i < (xrows + RA) * 8; i += kThreads) {
        const int row = i >> 3;
        const int ch = i & 7;
        const int64_t k = k0 + ch * 8;
        const bool k_in = k < k_hi;
        if (row < xrows) {
          const bool ok = k_in && row < n_tok;
          cp_async16(xs + row * kPitch + ch * 8, ok ? xg + tok[row] * p.x_stride + k : xg,
                     ok ? 16 : 0);
        } else {
          const int ra = row - xrows;
          const int s = ra / MR;
          const int r = ra - s * MR;
          if (r < ((srank[s] + 7) & ~7)) {
            const T* ag = static_cast<const T*>(p.a[s]);
            const bool ok = k_in && r < srank[s];
            cp_async16(as + ra * kPitch + ch * 8,
                       ok ? ag + (static_cast<int64_t>(slot) * MR + r) * p.hidden + k : ag,
                       ok ? 16 : 0);
          }
        }
      }
    };

    for (int st = 0; st < p.stages - 1; ++st) {
      if (st < nk) load_stage(st);
      cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait_dyn(p.stages - 2);
      __syncthreads();
      if (kt + p.stages - 1 < nk) load_stage(kt + p.stages - 1);
      cp_async_commit();
      const T* xs = stages + (kt % p.stages) * stage_elems;
      const T* as = xs + mt * kPitch;
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
#pragma unroll
        for (int i = 0; i < kMaxUnits; ++i) {
          if (warp + i * kWarps < units) {
            uint32_t af[4];
            uint32_t bfr[2];
            load_a_frag(af, xs + unit_row[i] * kPitch + kk, kPitch, lane);
            load_b_frag(bfr, as + unit_a[i] * kPitch + kk, kPitch, lane);
            mma_16816<T>(acc[i], af, bfr);
          }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: they become the partial sums
    {
      const int g = lane >> 2;
      const int tq = (lane & 3) * 2;
#pragma unroll
      for (int i = 0; i < kMaxUnits; ++i) {
        if (warp + i * kWarps >= units) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* dst = part_sums + (unit_row[i] + g + h * 8) * RA + unit_a[i] + tq;
          dst[0] = p.scale * acc[i][h * 2];
          dst[1] = p.scale * acc[i][h * 2 + 1];
        }
      }
    }
    cluster.sync();  // all partial sums of the cluster are written

    // ---- reduce the slices this CTA expands ----
    for (int s = 0; s < S; ++s) {
      if (p.col_begin[s] >= g_hi * 8 || p.col_begin[s + 1] <= g_lo * 8) continue;
      const int rk = srank[s];
      for (int i = tid; i < n_tok * rk; i += kThreads) {
        const int off = (i / rk) * RA + s * MR + i % rk;
        float v = 0.0f;
#pragma unroll
        for (int c = 0; c < kCluster; ++c) v += cluster.map_shared_rank(part_sums, c)[off];
        v_sums[off] = v;
      }
    }
    cluster.sync();  // no CTA reads a partial sum any more; v_sums is complete

    // ---- expand this CTA's columns ----
    const int64_t ng = g_hi - g_lo;
    for (int64_t i = tid; i < n_tok * ng; i += kThreads) {
      const int m = static_cast<int>(i / ng);
      const int64_t col = (g_lo + i % ng) * 8;
      int s = 0;
      while (col >= p.col_begin[s + 1]) ++s;
      const int64_t j = col - p.col_begin[s];
      const int rk = srank[s];
      if (rk == 0 && p.add_inputs) continue;
      float out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      const T* brow = static_cast<const T*>(p.b[s]) + (slot * p.width[s] + j) * MR;
      const float* vrow = v_sums + m * RA + s * MR;
      for (int r0 = 0; r0 < rk; r0 += 8) {
        float vv[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) vv[q] = r0 + q < rk ? vrow[r0 + q] : 0.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          float bf[8];
          unpack8<T>(*reinterpret_cast<const uint4*>(brow + c * MR + r0), bf);
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            if (r0 + q < rk) out[c] += vv[q] * bf[q];
          }
        }
      }
      T* yrow = yg + tok[m] * p.y_stride + p.y_col[s] + j;
      if (p.add_inputs) {
        float yv[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(yrow), yv);
#pragma unroll
        for (int c = 0; c < 8; ++c) out[c] += yv[c];
      }
      *reinterpret_cast<uint4*>(yrow) = pack8<T>(out);
    }
  }
}

struct FusedPlan {
  bool ok = false;
  int m_tile = 0;
  int k_chunk = 0;
  int stages = 0;
  int region0_bytes = 0;
  int smem_bytes = 0;
  int clusters = 0;
};

bool half_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16; }

FusedPlan plan_fused(const ShrinkArgs& s, const ExpandArgs& e) {
  FusedPlan plan;
  if (!half_dtype(s.dtype) || e.dtype != s.dtype || s.num_slices != e.num_slices) return plan;
  if (s.num_tokens > g_fused_max_tokens.load() || s.num_tokens == 0) return plan;
  if (s.max_rank != e.max_rank || s.max_rank % 8 != 0) return plan;
  const int ra = s.num_slices * s.max_rank;
  if (ra > kMaxRows) return plan;
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !aligned16(s.x)) return plan;
  if (e.y_row_stride % 8 != 0 || e.offset_start % 8 != 0 || !aligned16(e.y)) return plan;
  for (int i = 0; i < s.num_slices; ++i) {
    if (!aligned16(s.lora_a[i]) || !aligned16(e.lora_b[i]) || e.slice_width[i] % 8 != 0)
      return plan;
  }
  // Largest token tile whose fp32 partial sums stay small; never larger than the batch.
  const int64_t t16 = ceil_div(s.num_tokens, 16) * 16;
  int mt = 64;
  while (mt > 16 && (mt > t16 || mt * ra * 4 > 16 * 1024)) mt /= 2;
  // MMA tiles of 16 tokens x 8 ranks, spread over the warps (mt * ra <= 4096 keeps it <= 32).
  if ((mt / 16) * (ra / 8) > kMaxUnits * kWarps) return plan;
  plan.m_tile = mt;
  plan.k_chunk = static_cast<int>(ceil_div(ceil_div(s.hidden, kCluster), kBK) * kBK);
  const int stage_bytes = (mt + ra) * kPitch * 2;
  const int sums_bytes = mt * ra * 4;
  const int tail_bytes = (kMaxTile + kMaxSlices + kMaxRows / 8 + s.max_loras + 2) * 4;
  const int nk = static_cast<int>(ceil_div(plan.k_chunk, kBK));
  int stages = (kSmemTarget - sums_bytes - tail_bytes) / stage_bytes;
  stages = std::max(2, std::min({stages, 8, nk + 1}));
  plan.stages = stages;
  plan.region0_bytes =
      static_cast<int>(ceil_div(std::max(stages * stage_bytes, sums_bytes), 16) * 16);
  plan.smem_bytes = plan.region0_bytes + sums_bytes + tail_bytes;
  if (plan.smem_bytes > 227 * 1024) return plan;
  const int per_sm = plan.smem_bytes <= kSmemTarget ? 2 : 1;
  plan.clusters = std::max(1, per_sm * sm_count() / kCluster);
  plan.ok = true;
  return plan;
}

Status launch_fused(const ShrinkArgs& s, const ExpandArgs& e, const LoraMetaView& meta,
                    const FusedPlan& plan, StreamHandle stream) {
  FusedParams p{};
  p.x = s.x;
  p.x_stride = s.x_row_stride;
  p.hidden = s.hidden;
  p.num_slices = s.num_slices;
  p.col_begin[0] = 0;
  for (int i = 0; i < s.num_slices; ++i) {
    p.a[i] = s.lora_a[i];
    p.b[i] = e.lora_b[i];
    p.width[i] = e.slice_width[i];
    p.col_begin[i + 1] = p.col_begin[i] + e.slice_width[i];
    p.y_col[i] = e.offset_start + p.col_begin[i];
  }
  p.max_loras = s.max_loras;
  p.max_rank = s.max_rank;
  p.ranks = s.ranks;
  p.scale = s.scale;
  p.y = e.y;
  p.y_stride = e.y_row_stride;
  p.add_inputs = e.add_inputs;
  p.meta = meta;
  p.m_tile = plan.m_tile;
  p.k_chunk = plan.k_chunk;
  p.stages = plan.stages;
  p.region0_bytes = plan.region0_bytes;

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.clusters * kCluster));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem_bytes);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (s.dtype == DType::kBF16) {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(
        reinterpret_cast<const void*>(&fused_lora_linear_kernel<bf16>), plan.smem_bytes));
    LORAPLEX_RETURN_IF_ERROR(cuda_status(
        cudaLaunchKernelEx(&cfg, fused_lora_linear_kernel<bf16>, p), "fused_lora_linear_kernel"));
  } else {
    LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(
        reinterpret_cast<const void*>(&fused_lora_linear_kernel<f16>), plan.smem_bytes));
    LORAPLEX_RETURN_IF_ERROR(cuda_status(cudaLaunchKernelEx(&cfg, fused_lora_linear_kernel<f16>, p),
                                         "fused_lora_linear_kernel"));
  }
  return launch_status("fused_lora_linear_kernel");
}

}  // namespace

void set_fused_linear_max_tokens(int max_tokens) {
  g_fused_max_tokens.store(max_tokens < 0 ? kDefaultMaxTokens : max_tokens);
}

std::string lora_linear_path(const ShrinkArgs& shrink, const ExpandArgs& expand) {
  if (plan_fused(shrink, expand).ok) return "fused";
  const bool half = half_dtype(shrink.dtype);
  return half ? "split" : "generic";
}

Status lora_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                   StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(shrink));
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(expand));
  LORAPLEX_ENSURE(shrink.num_tokens == expand.num_tokens, "lora_linear: shrink has ",
                  shrink.num_tokens, " tokens, expand ", expand.num_tokens);
  LORAPLEX_ENSURE(meta.num_tokens == shrink.num_tokens, "lora_linear: metadata built for ",
                  meta.num_tokens, " tokens, the call has ", shrink.num_tokens);
  if (shrink.num_tokens == 0) return Status();
  const FusedPlan plan = plan_fused(shrink, expand);
  if (plan.ok) return launch_fused(shrink, expand, meta, plan, stream);
  LORAPLEX_RETURN_IF_ERROR(lora_shrink(shrink, meta, stream));
  return lora_expand(expand, meta, stream);
}

}  // namespace loraplex::kernels::cuda
