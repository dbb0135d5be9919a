// One LoRA layer for decode-sized batches as ONE kernel of thread-block clusters: the shrink's
// split-K partial sums are exchanged through distributed shared memory, so the rank-r
// intermediate never leaves the chip and nothing waits on another kernel or on a global
// counter.
//
// Why: at decode sizes a layer moves a few MB (about a microsecond at copy bandwidth) and the
// time goes to the chain of dependent steps. The kernel pair of
// gather_lora.cu walks launch -> metadata -> A and x -> partial sums to global memory -> PDL
// hand-off -> partial sums back -> y. Here every CTA walks launch -> metadata (one round trip:
// the sorted indices and the rank table of a decode batch are read with it) -> ALL of its
// loads at once (A for the shrink AND B and y for the expand) -> tensor cores -> partial sums
// to their owner CTA (st.async) -> the owner's rounded sums to every CTA (st.async) -> tensor
// cores -> y.
//
// Work: a unit is up to 16 tokens of one slot (one active metadata entry is
// ceil(tokens / 16) units), one cluster of C CTAs per unit (grid: C x units at most). CTA c of
// the cluster owns K chunk c of the shrink (every slice's A rows of the slot, at the slot's
// own rank, and the unit's x rows) and a run of output columns of ONE slice for the expand
// (their B rows at the slot's rank, and the unit's y values, loaded into registers). The
// partial sums [tokens][sum of ranks] are reduce-scattered: CTA q sends element e to the CTA
// that owns e, which adds the C values in a fixed order (the result does not depend on
// timing), scales and rounds them to the weight dtype (as the other paths and vLLM do) and
// sends them to every CTA of the cluster. Both exchanges are st.async stores that complete
// transactions on an mbarrier of the receiving CTA: no cluster-wide barrier (its release
// compiles to a GPU-scope memory barrier) after the one that publishes the mbarriers.
// A token with slot -1 is in no unit; a slice whose rank is 0 for the slot leaves y untouched;
// A rows and B columns past a slot's rank are never read.

#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_launch.h"

namespace loraplex::kernels::cuda {
namespace {

using namespace cluster_kernel;
constexpr int kPreSorted = 64;  // sorted indices read with the metadata (2 per lane)
constexpr int kPreRanks = 128;  // rank-table entries read with the metadata (4 per lane)

struct ClusterParams {
  const int32_t* sorted;
  const int32_t* active_ids;
  const int32_t* counts;
  const int32_t* start_loc;
  const int32_t* ranks;  // [num_slices, max_loras]
  int max_loras;
  int max_rank;
  int a_slot_rows;  // rows of A between slots (ShrinkArgs::a_slot_rows)
  int num_slices;
  int num_tokens;
  float scale;
  const void* x;
  int64_t x_stride;
  int hidden;
  int k_chunk;  // K per CTA, a multiple of 16
  bool early;   // the metadata and the weights are read before the PDL wait (see there)
  const void* a[kMaxSlices];
  const void* b[kMaxSlices];
  int64_t width[kMaxSlices];  // output columns of each slice
  int64_t y_col[kMaxSlices];  // the y column of each slice's first column
  // The expand's columns of CTA c: columns [cta_col0[c], + cta_cols[c]) of slice cta_slice[c]
  // (multiples of 8).
  int cta_slice[kMaxCluster];
  int cta_col0[kMaxCluster];
  int cta_cols[kMaxCluster];
  void* y;
  int64_t y_stride;
  // Shared memory: pitches in elements, offsets in bytes (x at 0).
  int x_pitch;
  int b_pitch;
  int inter_pitch;
  int off_a;
  int off_b;
  int off_inter;
  int off_recv;     // the partial sums this CTA owns, one row per CTA of the cluster
  uint64_t* trace;  // per-CTA timelines (kernel_trace.h) in the kTrace instantiation
};

// What warp 0 reads from the metadata for the CTA's unit.
struct UnitInfo {
  int slot;
  int n;  // tokens of the unit (0: no unit, the cluster exits)
  int tok[kUnitTokens];
  int rank[kMaxSlices];
  int row_off[kMaxSlices + 1];  // slice s's A rows / intermediate columns, each rounded to 16
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
/// The address of the same shared variable in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/// The one local arrival of the phase, with the bytes the other CTAs will store.
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar) {
  uint32_t done = 0;
  while (done == 0) {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar)
        : "memory");
  }
}
/// 4 bytes into another CTA's shared memory, completing 4 bytes of its mbarrier's transactions.
__device__ __forceinline__ void st_async(uint32_t addr, uint32_t v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr),
      "r"(v), "r"(bar)
      : "memory");
}

__device__ __forceinline__ int round16(int v) { return (v + 15) & ~15; }

/// The slice that owns offset `v` of a prefix table (bounds[0] = 0, bounds[count] = total).
__device__ __forceinline__ int slice_of(const int* bounds, int count, int v) {
  int s = 0;
  while (s + 1 < count && v >= bounds[s + 1]) ++s;
  return s;
}

// Warp 0: the unit's slot, tokens and ranks. One round trip for a decode batch: the active
// entries, their counts and start offsets, the sorted indices (up to kPreSorted tokens) and
// the rank table (up to kPreRanks entries) are all loaded before any of them is used.
__device__ void read_unit(const ClusterParams& p, int unit, int lane, UnitInfo& info) {
  const bool pre_sorted = p.num_tokens <= kPreSorted;
  const int rank_entries = p.num_slices * p.max_loras;
  const bool pre_ranks = rank_entries <= kPreRanks;
  int sorted0 = 0;
  int sorted1 = 0;
  if (pre_sorted) {
    if (lane < p.num_tokens) sorted0 = p.sorted[lane];
    if (lane + 32 < p.num_tokens) sorted1 = p.sorted[lane + 32];
  }
  int rk[4] = {0, 0, 0, 0};
  if (pre_ranks) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (lane + 32 * j < rank_entries) rk[j] = p.ranks[lane + 32 * j];
    }
  }
  const int ne = p.max_loras + 1;
  int slot = -1;
  int first = 0;
  int n = 0;
  int running = 0;
  for (int base = 0; base < ne; base += 32) {
    const int e = base + lane;
    int id = -1;
    int cnt = 0;
    int st = 0;
    if (e < ne) {
      id = p.active_ids[e];
      cnt = p.counts[e];
      st = p.start_loc[e];
    }
    const int units = valid_slot(id, p.max_loras) ? (cnt + kUnitTokens - 1) / kUnitTokens : 0;
    const int incl = running + warp_inclusive_sum(units, lane);
    // The first entry whose units reach past `unit` holds it (incl is non-decreasing).
    const unsigned hit = __ballot_sync(kFullMask, incl > unit);
    if (hit != 0) {
      const int f = __ffs(static_cast<int>(hit)) - 1;
      const int j = unit - __shfl_sync(kFullMask, incl - units, f);
      slot = __shfl_sync(kFullMask, id, f);
      first = __shfl_sync(kFullMask, st, f) + j * kUnitTokens;
      n = min(kUnitTokens, __shfl_sync(kFullMask, cnt, f) - j * kUnitTokens);
      break;
    }
    running = __shfl_sync(kFullMask, incl, 31);
  }
  const int pos = first + (lane & (kUnitTokens - 1));
  int tok = -1;
  if (pre_sorted) {
    const int lo = __shfl_sync(kFullMask, sorted0, pos & 31);
    const int hi = __shfl_sync(kFullMask, sorted1, pos & 31);
    tok = pos < 32 ? lo : hi;
  } else if (lane < n) {
    tok = p.sorted[pos];
  }
  const int s = lane & (kMaxSlices - 1);
  const int idx = n > 0 ? s * p.max_loras + slot : 0;
  int r = 0;
  if (pre_ranks) {
    const int src = idx & 31;
    const int v0 = __shfl_sync(kFullMask, rk[0], src);
    const int v1 = __shfl_sync(kFullMask, rk[1], src);
    const int v2 = __shfl_sync(kFullMask, rk[2], src);
    const int v3 = __shfl_sync(kFullMask, rk[3], src);
    const int q = idx >> 5;
    r = q == 0 ? v0 : q == 1 ? v1 : q == 2 ? v2 : v3;
  } else if (n > 0 && lane < p.num_slices) {
    r = p.ranks[idx];
  }
  if (lane < kUnitTokens) info.tok[lane] = tok;
  if (lane < kMaxSlices)
    info.rank[lane] = lane < p.num_slices && n > 0 ? min(max(r, 0), p.max_rank) : 0;
  __syncwarp();
  if (lane == 0) {
    info.slot = slot;
    info.n = n;
    info.row_off[0] = 0;
    for (int i = 0; i < kMaxSlices; ++i)
      info.row_off[i + 1] = info.row_off[i] + round16(info.rank[i]);
  }
}

template <typename T, bool kTrace>
__global__ void __launch_bounds__(kThreads) cluster_lora_kernel(ClusterParams p) {
  trace_at<kTrace>(p.trace, 0);
  trace_at<kTrace>(p.trace, 1);
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ UnitInfo info;
  __shared__ __align__(8) uint64_t bars[2];  // the two exchanges: partial sums, rounded sums
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int crank = static_cast<int>(blockIdx.x);  // rank in the cluster: clusters are (C, 1, 1)
  const int csize = static_cast<int>(gridDim.x);
  const uint32_t bar_part = smem_addr(&bars[0]);
  const uint32_t bar_sum = smem_addr(&bars[1]);
  if (tid == 0) {
    mbar_init(bar_part);
    mbar_init(bar_sum);
  }
  __syncthreads();
  cluster_arrive_relaxed();  // waited for just before the first store into another CTA
  // Launched with PDL (layer_pdl): the kernel before it may still run until this wait; the
  // next layer's kernel may launch from here on (it waits the same way). Nothing global is
  // read before it, except with p.early (settled metadata: LoraMetaView::settled) the
  // metadata, the ranks and the slot's A and B rows: the wait then comes after their copies
  // are issued, and the chain after it is x and y alone. Every CTA waits before it exits, so
  // that the next kernel launches only once the one before this has finished.
  if (!p.early) {
    pdl_wait_then_launch_dependents();
    trace_at<kTrace>(p.trace, 2);
  }
  if (warp == 0) read_unit(p, static_cast<int>(blockIdx.y), lane, info);
  __syncthreads();
  const int n = info.n;
  const int rows_a = info.row_off[p.num_slices];
  // The same decision in every CTA of the cluster, so nothing below waits for an exited CTA.
  if (n == 0 || rows_a == 0) {
    if (p.early) {
      pdl_wait_then_launch_dependents();
    }
    return;
  }
  const int slot = info.slot;
  // The partial sums [n][rows_a] as elements e: CTA q owns [q * chunk, (q + 1) * chunk), an
  // even count, so that the rounded sums travel in pairs (rows_a is a multiple of 16).
  const int elems = n * rows_a;
  const int chunk = ((elems + csize - 1) / csize + 1) & ~1;
  const int own = max(0, min(chunk, elems - crank * chunk));
  if (tid == 0) {
    mbar_arrive_expect(bar_part, static_cast<uint32_t>(csize * own * 4));
    mbar_arrive_expect(bar_sum, static_cast<uint32_t>(elems * 2));
  }

  T* xs = reinterpret_cast<T*>(smem);
  T* as = reinterpret_cast<T*>(smem + p.off_a);
  float* red = reinterpret_cast<float*>(smem + p.off_a);  // reuses A's space after the shrink
  T* bs = reinterpret_cast<T*>(smem + p.off_b);
  T* inter = reinterpret_cast<T*>(smem + p.off_inter);
  float* recv = reinterpret_cast<float*>(smem + p.off_recv);

  // ---- Every load of the CTA at once: A and B (cp.async) first, then x (cp.async) and this
  // warp's y values (into registers: the expand adds to them).
  const int k0 = crank * p.k_chunk;
  const int kc8 = p.k_chunk / 8;
  {
    int s = 0;
    for (int row = warp; row < rows_a; row += kWarps) {
      while (row >= info.row_off[s + 1]) ++s;
      const int j = row - info.row_off[s];
      if (j >= info.rank[s]) continue;  // rows past the rank are masked after the reduction
      const T* src =
          static_cast<const T*>(p.a[s]) + (int64_t{slot} * p.a_slot_rows + j) * p.hidden + k0;
      T* dst = as + row * p.x_pitch;
      for (int q = lane; q < kc8; q += 32) {
        const bool in = k0 + q * 8 < p.hidden;
        cp_async16(dst + q * 8, in ? src + q * 8 : src, in ? 16 : 0);
      }
    }
  }
  const int es = p.cta_slice[crank];  // this CTA's expand: one slice
  const int ers = info.rank[es];
  const int ncols = ers > 0 ? p.cta_cols[crank] : 0;
  const int ecol0 = p.cta_col0[crank];
  {
    const T* src =
        static_cast<const T*>(p.b[es]) + (int64_t{slot} * p.width[es] + ecol0) * p.max_rank;
    for (int lc = tid; lc < ncols; lc += kThreads) {
      const T* col = src + lc * p.max_rank;
      T* dst = bs + lc * p.b_pitch;
      for (int q = 0; q * 8 < ers; ++q) {
        cp_async16(dst + q * 8, col + q * 8, min((ers - q * 8) * 2, 16));
      }
      if ((ers & 15) != 0 && (ers & 15) <= 8) {  // the last 16-rank step's upper half: zeros
        cp_async16(dst + (ers & ~15) + 8, col, 0);
      }
    }
  }
  if (p.early) {
    pdl_wait_then_launch_dependents();
    trace_at<kTrace>(p.trace, 2);
  }
  for (int row = warp; row < n; row += kWarps) {
    const T* src = static_cast<const T*>(p.x) + info.tok[row] * p.x_stride + k0;
    T* dst = xs + row * p.x_pitch;
    for (int q = lane; q < kc8; q += 32) {
      const bool in = k0 + q * 8 < p.hidden;
      cp_async16(dst + q * 8, in ? src + q * 8 : src, in ? 16 : 0);
    }
  }
  cp_async_commit();
  const int g = lane >> 2;
  const int t2 = (lane & 3) * 2;
  // This warp's expand tiles are w, w + 8, ... (8 columns each); rows g and g + 8 of each.
  T* const yrow0 =
      g < n ? static_cast<T*>(p.y) + info.tok[g] * p.y_stride + p.y_col[es] + ecol0 + t2 : nullptr;
  T* const yrow1 =
      g + 8 < n ? static_cast<T*>(p.y) + info.tok[g + 8] * p.y_stride + p.y_col[es] + ecol0 + t2
                : nullptr;
  uint32_t yv[kMaxWarpTiles][2];
#pragma unroll
  for (int j = 0; j < kMaxWarpTiles; ++j) {
    const int c = (warp + kWarps * j) * 8;
    yv[j][0] = c < ncols && yrow0 != nullptr ? *reinterpret_cast<const uint32_t*>(yrow0 + c) : 0u;
    yv[j][1] = c < ncols && yrow1 != nullptr ? *reinterpret_cast<const uint32_t*>(yrow1 + c) : 0u;
  }
  cp_async_wait<0>();
  __syncthreads();
  trace_at<kTrace>(p.trace, 3);

  // ---- Shrink: [16 tokens] x [rows_a] over this CTA's K chunk. Warp items are (16-row tile of
  // A, part of the K steps); the parts are summed in shared memory, in a fixed order.
  const int nt16 = rows_a / 16;
  const int wk = nt16 >= kWarps ? 1 : kWarps / nt16;
  const int ksteps = p.k_chunk / 16;
  float acc[2][2][4];  // [item of this warp][n8 half][fragment]
  const int items = nt16 * wk;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int item = warp + it * kWarps;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[it][h][i] = 0.0f;
    }
    if (item >= items) continue;
    const int tile = item / wk;
    const int part = item - tile * wk;
    const uint32_t xa = smem_addr(xs + (lane & 15) * p.x_pitch + (lane >> 4) * 8);
    const uint32_t aa = smem_addr(as + (tile * 16 + (lane & 7) + ((lane >> 4) << 3)) * p.x_pitch +
                                  ((lane >> 3) & 1) * 8);
    for (int kk = part; kk < ksteps; kk += wk) {
      uint32_t af[4];
      uint32_t bf[4];
      ldmatrix_x4_at(af, xa + kk * 32);
      ldmatrix_x4_at(bf, aa + kk * 32);
      const uint32_t b0[2] = {bf[0], bf[1]};
      const uint32_t b1[2] = {bf[2], bf[3]};
      mma_16816<T>(acc[it][0], af, b0);
      mma_16816<T>(acc[it][1], af, b1);
    }
  }
  __syncthreads();  // A's space becomes `red`
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int item = warp + it * kWarps;
    if (item >= items) continue;
    const int tile = item / wk;
    float* r = red + (item - tile * wk) * kUnitTokens * rows_a;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = tile * 16 + h * 8 + t2;
      *reinterpret_cast<float2*>(r + g * rows_a + col) = make_float2(acc[it][h][0], acc[it][h][1]);
      *reinterpret_cast<float2*>(r + (g + 8) * rows_a + col) =
          make_float2(acc[it][h][2], acc[it][h][3]);
    }
  }
  __syncthreads();

  // ---- Exchange 1: this CTA's partial sum of element e goes to e's owner, row `crank`.
  cluster_wait();  // every CTA's mbarriers are initialised
  const uint32_t recv_base = smem_addr(recv);
  for (int e = tid; e < elems; e += kThreads) {
    float v = red[e];
    for (int q = 1; q < wk; ++q) v += red[q * kUnitTokens * rows_a + e];
    const int owner = e / chunk;
    const uint32_t at = recv_base + static_cast<uint32_t>(crank * chunk + e - owner * chunk) * 4u;
    st_async(map_to_rank(at, owner), __float_as_uint(v), map_to_rank(bar_part, owner));
  }
  // ---- Exchange 2: the owner adds its elements' C partial sums (in CTA order), scales and
  // rounds them, and sends each pair to every CTA's intermediate.
  trace_at<kTrace>(p.trace, 4);
  mbar_wait(bar_part);
  trace_at<kTrace>(p.trace, 5);
  const uint32_t inter_base = smem_addr(inter);
  for (int j = tid * 2; j < own; j += kThreads * 2) {
    const int e = crank * chunk + j;
    const int i = e / rows_a;
    const int c = e - i * rows_a;
    const int s = slice_of(info.row_off, p.num_slices, c);
    const int rank = info.rank[s] + info.row_off[s];  // columns past it are 0
    float v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = 0.0f;
      for (int q = 0; q < csize; ++q) sum += recv[q * chunk + j + h];
      v[h] = c + h < rank ? p.scale * sum : 0.0f;
    }
    const uint32_t word = pack2<T>(v[0], v[1]);
    const uint32_t at = inter_base + static_cast<uint32_t>(i * p.inter_pitch + c) * 2u;
    for (int q = 0; q < csize; ++q) st_async(map_to_rank(at, q), word, map_to_rank(bar_sum, q));
  }
  mbar_wait(bar_sum);
  trace_at<kTrace>(p.trace, 6);

  // ---- Expand: this warp's tiles of 8 columns of slice `es`; the y values start the sums.
  if (ncols == 0) return;
  const uint32_t ia =
      smem_addr(inter + (lane & 15) * p.inter_pitch + info.row_off[es] + (lane >> 4) * 8);
  const uint32_t ba = smem_addr(bs + (lane & 7) * p.b_pitch + ((lane >> 3) & 1) * 8);
  uint32_t a0[4];
  ldmatrix_x4_at(a0, ia);
#pragma unroll
  for (int j = 0; j < kMaxWarpTiles; ++j) {
    const int tile = warp + kWarps * j;
    if (tile * 8 >= ncols) break;
    const float2 y0 = unpack2<T>(yv[j][0]);
    const float2 y1 = unpack2<T>(yv[j][1]);
    float out[4] = {y0.x, y0.y, y1.x, y1.y};
    const uint32_t bt = ba + tile * 8 * p.b_pitch * 2;
    uint32_t bf[2];
    ldmatrix_x2_at(bf, bt);
    mma_16816<T>(out, a0, bf);
    for (int kk = 1; kk * 16 < ers; ++kk) {
      uint32_t af[4];
      ldmatrix_x4_at(af, ia + kk * 32);
      ldmatrix_x2_at(bf, bt + kk * 32);
      mma_16816<T>(out, af, bf);
    }
    if (yrow0 != nullptr) *reinterpret_cast<uint32_t*>(yrow0 + tile * 8) = pack2<T>(out[0], out[1]);
    if (yrow1 != nullptr) *reinterpret_cast<uint32_t*>(yrow1 + tile * 8) = pack2<T>(out[2], out[3]);
  }
  trace_at<kTrace>(p.trace, 7);
}

template <typename T>
Status launch(const ClusterPlan& plan, const ClusterParams& p, StreamHandle stream) {
  // The traced instantiation only for bf16 (the benchmark's dtype) while tracing.
  auto kernel_fn = &cluster_lora_kernel<T, false>;
  if constexpr (std::is_same_v<T, bf16>) {
    if (p.trace != nullptr) kernel_fn = &cluster_lora_kernel<T, true>;
  }
  const void* kernel = reinterpret_cast<const void*>(kernel_fn);
  LORAPLEX_RETURN_IF_ERROR(allow_dynamic_smem(kernel, plan.smem));
  if (plan.cluster > 8) {
    // A function attribute, set once (the first call of every op is a warm-up outside any
    // capture).
    static std::mutex mutex;
    static std::map<std::pair<const void*, int>, bool> done;
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(mutex);
    bool& set = done[{kernel, device}];
    if (!set) {
      LORAPLEX_RETURN_IF_ERROR(cuda_status(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
          "cudaFuncSetAttribute(non-portable cluster size)"));
      set = true;
    }
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.cluster), static_cast<unsigned>(plan.units));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1] = pdl_launch_attribute();
  cfg.attrs = attr;
  cfg.numAttrs = plan.pdl ? 2 : 1;
  LORAPLEX_RETURN_IF_ERROR(cuda_status(cudaLaunchKernelEx(&cfg, kernel_fn, p), "cluster_lora"));
  return launch_status("cluster_lora_kernel");
}

}  // namespace

Status launch_cluster(const ClusterPlan& plan, const ShrinkArgs& s, const ExpandArgs& e,
                      const LoraMetaView& meta, StreamHandle stream) {
  ClusterParams p{};
  const Layout& l = plan.layout;
  p.x_pitch = l.x_pitch;
  p.b_pitch = l.b_pitch;
  p.inter_pitch = l.inter_pitch;
  p.off_a = l.off_a;
  p.off_b = l.off_b;
  p.off_inter = l.off_inter;
  p.off_recv = l.off_recv;
  for (int c = 0; c < kMaxCluster; ++c) {
    p.cta_slice[c] = l.cta_slice[c];
    p.cta_col0[c] = l.cta_col0[c];
    p.cta_cols[c] = l.cta_cols[c];
  }
  p.sorted = meta.sorted_token_indices;
  p.active_ids = meta.active_lora_ids;
  p.counts = meta.num_tokens_per_lora;
  p.start_loc = meta.lora_token_start_loc;
  p.ranks = s.ranks;
  p.max_loras = s.max_loras;
  p.max_rank = s.max_rank;
  p.a_slot_rows = a_slot_rows(s);
  p.num_slices = s.num_slices;
  p.num_tokens = static_cast<int>(s.num_tokens);
  p.scale = s.scale;
  p.x = s.x;
  p.x_stride = s.x_row_stride;
  p.hidden = static_cast<int>(s.hidden);
  p.k_chunk = plan.k_chunk;
  p.early = plan.early;
  p.trace = kernel_trace();
  int64_t col = e.offset_start;
  for (int i = 0; i < s.num_slices; ++i) {
    p.a[i] = s.lora_a[i];
    p.b[i] = e.lora_b[i];
    p.width[i] = e.slice_width[i];
    p.y_col[i] = col;
    col += e.slice_width[i];
  }
  p.y = e.y;
  p.y_stride = e.y_row_stride;
  if (s.dtype == DType::kBF16) return launch<bf16>(plan, p, stream);
  return launch<f16>(plan, p, stream);
}

}  // namespace loraplex::kernels::cuda
