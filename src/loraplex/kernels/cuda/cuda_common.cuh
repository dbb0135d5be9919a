#pragma once
// Helpers shared by the CUDA kernels: device element types, conversions, 16-byte async copies,
// the bf16/f16 tensor-core MMA, warp scans, the work-tile prefix over the batch metadata and
// error reporting through Status.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/kernels/cuda/kernel_trace.h"
#include "loraplex/kernels/lora_ops.h"

namespace loraplex::kernels::cuda {

using bf16 = __nv_bfloat16;
using f16 = __half;

inline constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Host side: status, dtype dispatch, device properties.

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  return Status(StatusCode::kCudaError,
                detail::concat(what, ": ", cudaGetErrorString(err), " (CUDA error ",
                               static_cast<int>(err), ")"));
}

/// The status of the launch just made (clears a pending launch error).
inline Status launch_status(const char* kernel) { return cuda_status(cudaGetLastError(), kernel); }

template <typename T>
struct DevTag {
  using type = T;
};

/// Calls fn(DevTag<T>) with the device element type of an activation dtype.
template <typename Fn>
bool dispatch_device_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(DevTag<float>{});
      return true;
    case DType::kF16:
      fn(DevTag<f16>{});
      return true;
    case DType::kBF16:
      fn(DevTag<bf16>{});
      return true;
    default:
      return false;
  }
}

/// Multiprocessor count of the current device (cached per device).
int sm_count();
/// Sets the largest dynamic shared memory `kernel` may use, once per kernel and device.
Status allow_dynamic_smem(const void* kernel, int bytes);

/// The activation dtypes the tensor-core and vectorised kernels take.
inline bool half_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16; }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Device side.

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, f16>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}

/// A slot read from device memory is used only when it is a real slot.
__device__ __forceinline__ bool valid_slot(int32_t slot, int max_loras) {
  return slot >= 0 && slot < max_loras;
}

/// 16-byte global -> shared copy; bytes past `src_bytes` (0..16) are zero-filled, and with
/// src_bytes 0 nothing is read.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/// cp.async.wait_group with a run-time count (0..7; larger waits for everything).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 1:
      cp_async_wait<1>();
      break;
    case 2:
      cp_async_wait<2>();
      break;
    case 3:
      cp_async_wait<3>();
      break;
    case 4:
      cp_async_wait<4>();
      break;
    case 5:
      cp_async_wait<5>();
      break;
    case 6:
      cp_async_wait<6>();
      break;
    case 7:
      cp_async_wait<7>();
      break;
    default:
      cp_async_wait<0>();
      break;
  }
}

/// The GPU's global timer in nanoseconds and this CTA's SM (per-CTA timelines, kernel_trace.h).
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
/// Slot k of this CTA's timeline (kernel_trace.h), in the row of its linear index (blockIdx.x in a
/// 1-D grid): the SM id for slot 0, else the global timer; written by thread 0. Only in the
/// kTrace instantiations that the launchers pick while a trace buffer is set: compiled into every
/// launch, the checks alone cost measurable time per prefill shrink.
template <bool kTrace>
__device__ __forceinline__ void trace_at(uint64_t* trace, int k) {
  if constexpr (kTrace) {
    if (threadIdx.x == 0) {
      const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
      trace[b * kTraceSlots + k] = k == 0 ? sm_id() : global_ns();
    }
  }
}

/// A cluster barrier without release semantics (cluster.sync()'s release compiles to
/// MEMBAR.ALL.GPU): for barriers that order nothing but the barrier itself, e.g. the one that
/// publishes initialised mbarriers (with their own fence) or keeps a CTA's shared memory alive
/// until the others' remote loads, whose values were already used, are done.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

/// Programmatic dependent launch (PDL). A kernel launched with the programmatic-serialization
/// attribute may start while the kernel before it in the stream still runs, once every CTA of
/// that one has called pdl_launch_dependents (or exited); pdl_wait then blocks until that
/// kernel has completed and its writes are visible. Nothing written by an earlier kernel may be
/// read before the wait, unless the kernel before it triggered only after its own wait.
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
/// The launch attribute that lets a kernel start under PDL (see pdl_wait).
inline cudaLaunchAttribute pdl_launch_attribute() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}
/// The order a layer's first kernel keeps: it lets its dependents launch only after its own
/// wait, so that a kernel launched after it starts only once the kernel before it has finished
/// (what LoraMetaView::settled relies on).
__device__ __forceinline__ void pdl_wait_then_launch_dependents() {
  pdl_wait();
  pdl_launch_dependents();
}

/// An int load from read-only global memory issued here: the compiler may sink a plain load to
/// its first use, past the barriers in between, which puts it back on the critical path (the
/// speculative token-index loads of the prefill kernels). Volatile asm keeps its place.
__device__ __forceinline__ int ld_early(const int32_t* p) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

/// 16- and 8-byte read-only loads issued where they are written (volatile asm, as ld_early):
/// neither repeated nor moved past the mma asm or the barriers after them.
__device__ __forceinline__ uint4 ldg16_now(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
/// A 16-byte load through L2 (ld.global.cg) issued where it is written, for data that the
/// kernel before may still write when this kernel starts (PDL): the read-only path
/// (ld.global.nc) is only for memory that stays unchanged for the kernel's whole lifetime, and a
/// PDL secondary's inputs do not. With the non-coherent x loads of gather_lora.cu's shrink after
/// griddepcontrol.wait, layers chained in a CUDA graph read stale x on the H200.
__device__ __forceinline__ uint4 ldcg16_now(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ uint2 ldg8_now(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

/// The value, with its origin hidden from the compiler: values derived from threadIdx are
/// otherwise recomputed at every use when registers are scarce (the prefill shrink's copy
/// addresses: ~25 instructions per copy and stage), where keeping them costs a register each.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ int64_t opaque(int64_t v) {
  asm volatile("" : "+l"(v));
  return v;
}
template <typename T>
__device__ __forceinline__ const T* opaque(const T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ uint32_t lds32(const void* smem) {
  return *static_cast<const uint32_t*>(smem);
}

/// Four 8x8 16-bit matrices from shared memory in one instruction: lanes 8i..8i+7 give the row
/// addresses of matrix i, and each lane receives the mma fragment element pair of each matrix.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
/// ldmatrix_x4 with a shared-memory address (bytes) computed by the caller.
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2_at(uint32_t (&r)[2], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(a));
}
/// cp_async16 with a shared-memory address (bytes) computed by the caller.
__device__ __forceinline__ void cp_async16_at(uint32_t smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
/// Two 8x8 matrices (row addresses from lanes 0..15).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(a));
}

/// A load with acquire semantics at GPU scope: what the releasing thread wrote before its
/// release is visible to this thread's later loads.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/// D += A(16x16, row) * B(16x8, col) with fp32 accumulation, T = bf16 or f16.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

/// A-operand fragment of a 16x16 tile at `tile` (row-major, `pitch` elements per row).
template <typename T>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const T* tile, int pitch, int lane) {
  const int g = lane >> 2;
  const int t = (lane & 3) * 2;
  a[0] = lds32(tile + g * pitch + t);
  a[1] = lds32(tile + (g + 8) * pitch + t);
  a[2] = lds32(tile + g * pitch + t + 8);
  a[3] = lds32(tile + (g + 8) * pitch + t + 8);
}

/// B-operand fragment of a 16(k)x8(n) tile stored n-major at `tile` (row n holds k values).
template <typename T>
__device__ __forceinline__ void load_b_frag(uint32_t (&b)[2], const T* tile, int pitch, int lane) {
  const int g = lane >> 2;
  const int t = (lane & 3) * 2;
  b[0] = lds32(tile + g * pitch + t);
  b[1] = lds32(tile + g * pitch + t + 8);
}

__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/// Work tiles of `tile_rows` tokens per metadata entry (entries with slot -1, and those past
/// the active ones, get none): prefix[e] = first tile of entry e, prefix[n] = total, over all
/// n = max_loras + 1 entries, so no load waits for the active count. Run by the whole block
/// (warp 0 scans, then a barrier). Returns n.
/// With `entries` (3 x n ints) non-null, each entry's slot, token count and first sorted
/// position are kept there too (entries[e], entries[n + e], entries[2n + e]), loaded in the
/// same round trip, so a work item finds its entry's data without another global load.
__device__ __forceinline__ int build_tile_prefix(const LoraMetaView& meta, int tile_rows,
                                                 int* prefix, int* entries = nullptr) {
  const int n = meta.max_loras + 1;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int running = 0;
    for (int base = 0; base < n; base += 32) {
      const int e = base + lane;
      int v = 0;
      if (e < n) {
        const int slot = meta.active_lora_ids[e];
        const int count = meta.num_tokens_per_lora[e];
        if (entries != nullptr) {
          entries[e] = slot;
          entries[n + e] = count;
          entries[2 * n + e] = meta.lora_token_start_loc[e];
        }
        if (valid_slot(slot, meta.max_loras)) v = (count + tile_rows - 1) / tile_rows;
      }
      v = warp_inclusive_sum(v, lane);
      if (e < n) prefix[e + 1] = running + v;
      running += __shfl_sync(kFullMask, v, 31);
    }
    if (lane == 0) prefix[0] = 0;
  }
  __syncthreads();
  return n;
}

/// The entry e with prefix[e] <= tile < prefix[e + 1] (tile < prefix[n]).
__device__ __forceinline__ int find_tile_entry(const int* prefix, int n, int tile) {
  int lo = 0;
  int hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

/// Eight consecutive 16-bit elements (one 16-byte access) to float.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&out)[8]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(in[i]);
  return v;
}

/// Two consecutive 16-bit elements (one 32-bit word) to float.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  const T* e = reinterpret_cast<const T*>(&v);
  return make_float2(to_float(e[0]), to_float(e[1]));
}

/// Two floats rounded to T (16-bit), packed low-first for one 32-bit store.
/// One conversion instruction for the pair (round to nearest even, as two scalar roundings).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

}  // namespace loraplex::kernels::cuda
