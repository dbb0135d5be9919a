// cuBLASLt for the base GEMM. Row-major y[m, n] = x[m, k] W[n, k]^T is, in cuBLAS's
// column-major terms, D(n x m) = op_T(A = W viewed k x n) * B (= x viewed k x m).
//
// Plans (descriptors, layouts and the algorithm) are cached per thread and per problem:
// heuristics are slow and the bias pointer is a descriptor attribute, so a plan is never shared
// between threads. Each (thread, device, stream) has its own workspace so that work queued on
// different streams never shares scratch memory.
//
// The algorithm is the fastest of the heuristic's first kCandidates, timed on the problem's own
// operands when the plan is made (not while a graph is being captured, and not for an
// accumulating product, whose output the trials would change): the heuristic's first choice
// is not always the fastest, notably for the odd widths of a base weight with LoRA-A rows after
// it. Only with LORAPLEX_GEMM_AUTOTUNE=1: the ranks of a tensor-parallel group could otherwise
// pick different algorithms for the same product.
//
// FP8 weights (W8A8): x is quantised to e4m3 into the caller's scratch first (fp8_quant.h),
// then one cuBLASLt matmul with e4m3 A (the weight, transposed: the TN layout fp8 needs) and B
// (x), float32 compute, the output and bias in the activation dtype, and the scales as
// cuBLASLt's scaling modes (kernels/gemm.h, Fp8WeightScales): the weight's per-row scales and
// x's per-token ones as OUTER_VEC_32F vectors, 128x128 weight blocks as BLK128x128_32F with x
// per token and 128 columns (VEC128_32F), or both per row (token) and 128 columns (VEC128_32F).
// The scale layouts are those PyTorch's torch._scaled_mm passes to cuBLASLt for the same
// recipes: vectors tokens / rows fastest, block rows of column groups padded to 4.

#include "loraplex/kernels/gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "loraplex/kernels/fp8_quant.h"

namespace loraplex::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kCandidates = 8;

#define LORAPLEX_CUBLAS(expr)                                                                 \
  do {                                                                                        \
    const cublasStatus_t _st = (expr);                                                        \
    if (_st != CUBLAS_STATUS_SUCCESS)                                                         \
      return Status(StatusCode::kCudaError,                                                   \
                    detail::concat("cuBLASLt: ", #expr, ": ", cublasLtGetStatusString(_st))); \
  } while (0)

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// How an fp8 GEMM scales A (the weight) and B (x), and the columns per activation scale.
struct Fp8Scaling {
  bool fp8 = false;
  int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  int64_t act_group = 0;
};

Status fp8_scaling(const GemmArgs& g, Fp8Scaling& out) {
  out = Fp8Scaling{};
  if (g.w_dtype != DType::kF8E4M3) return Status();
  out.fp8 = true;
  const Fp8WeightScales& s = g.w_scales;
  const int64_t k_groups = (g.k + 127) / 128;
  if (s.group_n == 1 && s.group_k >= g.k) {
    out.a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    out.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    out.act_group = g.k;
  } else if (s.group_n == 128 && s.group_k == 128 && s.stride_k == 1 &&
             s.stride_n == (k_groups + 3) / 4 * 4) {
    out.a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    out.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    out.act_group = 128;
  } else if (s.group_n == 1 && s.group_k == 128 && s.stride_n == 1 && s.stride_k == g.n) {
    out.a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    out.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    out.act_group = 128;
  } else {
    return unsupported("cuBLASLt fp8 gemm: weight scales in groups of ", s.group_n, " x ",
                       s.group_k, " (strides ", s.stride_n, ", ", s.stride_k,
                       ") have no cuBLASLt scaling mode (per row, 128x128 blocks with rows padded "
                       "to 4 column groups, or per row and 128 columns)");
  }
  LORAPLEX_ENSURE(g.input_scale == nullptr || out.act_group == g.k,
                  "cuBLASLt fp8 gemm: a static input scale goes with per-row weight scales, not "
                  "with 128-column groups");
  LORAPLEX_ENSURE(g.k % 16 == 0 && g.n % 16 == 0, "cuBLASLt fp8 gemm: n ", g.n, " and k ", g.k,
                  " must be multiples of 16 (fp8 operands need 16-byte rows)");
  LORAPLEX_ENSURE(!(g.dtype == DType::kF32 && g.bias != nullptr),
                  "cuBLASLt fp8 gemm: a bias with float32 output is not supported (cuBLASLt "
                  "wants a bfloat16 bias there); run the model in bfloat16 or float16");
  LORAPLEX_ENSURE(
      g.fp8_scratch != nullptr && g.fp8_scratch_bytes >= fp8_gemm_scratch_bytes(g.m, g.k),
      "cuBLASLt fp8 gemm: the activation scratch holds ", g.fp8_scratch_bytes, " bytes, ",
      fp8_gemm_scratch_bytes(g.m, g.k), " needed for ", g.m, " x ", g.k);
  return Status();
}

// Sets the scale pointers of an fp8 plan's descriptor (they differ between layers that share a
// plan, like the bias).
Status set_scale_pointers(cublasLtMatmulDesc_t desc, const void* a_scale, const void* b_scale) {
  LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                 &a_scale, sizeof(a_scale)));
  LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                 &b_scale, sizeof(b_scale)));
  return Status();
}

// Largest power of two (<= 256) dividing the address: cuBLASLt must not pick kernels that
// assume more alignment than views at odd offsets have.
uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a /= 2;
  return a;
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr;
  cublasLtMatrixLayout_t b = nullptr;
  cublasLtMatrixLayout_t c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ready = false;
  ~Plan() {
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                           bool, uint32_t, uint32_t, uint32_t, uint32_t, int32_t, int32_t>;

struct Workspace {
  void* ptr = nullptr;
  int device = 0;
  ~Workspace() {
    if (ptr != nullptr) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaFree(ptr);
      cudaSetDevice(previous);
    }
  }
};

struct ThreadState {
  std::map<int, cublasLtHandle_t> handles;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<std::pair<int, void*>, std::unique_ptr<Workspace>> workspaces;
  ~ThreadState() {
    plans.clear();
    for (auto& [device, h] : handles) cublasLtDestroy(h);
  }
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

bool autotune_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("LORAPLEX_GEMM_AUTOTUNE");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// The fastest of `candidates` on g's operands (best of a few runs each), or the first when
// timing is not possible. Leaves g.y written by the last trial (g.accumulate is false).
int fastest_algo(cublasLtHandle_t handle, const Plan& p, const GemmArgs& g,
                 const cublasLtMatmulHeuristicResult_t* candidates, int found, void* workspace,
                 cudaStream_t stream) {
  if (found <= 1 || g.accumulate || !autotune_enabled()) return 0;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return 0;
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    cudaGetLastError();
    if (start != nullptr) cudaEventDestroy(start);
    return 0;
  }
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](int i) {
    return cublasLtMatmul(handle, p.desc, &alpha, g.w, p.a, g.x, p.b, &beta, g.y, p.c, g.y, p.c,
                          &candidates[i].algo, workspace, kWorkspaceBytes, stream);
  };
  int best = 0;
  float best_ms = 0.0f;
  for (int i = 0; i < found; ++i) {
    if (run(i) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; an algorithm that fails is skipped
    float ms_min = -1.0f;
    for (int rep = 0; rep < 3; ++rep) {
      cudaEventRecord(start, stream);
      run(i);
      cudaEventRecord(stop, stream);
      float ms = 0.0f;
      if (cudaEventSynchronize(stop) != cudaSuccess ||
          cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
        ms = -1.0f;
      }
      if (ms >= 0.0f && (ms_min < 0.0f || ms < ms_min)) ms_min = ms;
    }
    if (ms_min >= 0.0f && (best_ms == 0.0f || ms_min < best_ms)) {
      best = i;
      best_ms = ms_min;
    }
  }
  cudaGetLastError();
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

Status build_plan(Plan& p, cublasLtHandle_t handle, const GemmArgs& g, const Fp8Scaling& f8,
                  const void* b_scale, const uint32_t align[4], void* workspace,
                  cudaStream_t stream) {
  const cudaDataType_t t = cuda_type(g.dtype);
  const cudaDataType_t ab = f8.fp8 ? CUDA_R_8F_E4M3 : t;
  LORAPLEX_CUBLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  if (f8.fp8) {
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                   &f8.a_mode, sizeof(f8.a_mode)));
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                   &f8.b_mode, sizeof(f8.b_mode)));
    LORAPLEX_RETURN_IF_ERROR(set_scale_pointers(p.desc, g.w_scales.scale, b_scale));
  }
  const cublasOperation_t trans_a = CUBLAS_OP_T;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                                 sizeof(trans_a)));
  LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                                 sizeof(trans_b)));
  if (g.bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                   sizeof(epilogue)));
    const cudaDataType_t bias_type = t;
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                   &bias_type, sizeof(bias_type)));
  }
  LORAPLEX_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, ab, static_cast<uint64_t>(g.k),
                                             static_cast<uint64_t>(g.n), g.w_row_stride));
  LORAPLEX_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, ab, static_cast<uint64_t>(g.k),
                                             static_cast<uint64_t>(g.m), g.x_row_stride));
  LORAPLEX_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, t, static_cast<uint64_t>(g.n),
                                             static_cast<uint64_t>(g.m), g.y_row_stride));
  cublasLtMatmulPreference_t pref = nullptr;
  LORAPLEX_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kWorkspaceBytes;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof(align[i]));
  }
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, kCandidates,
                                        results, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  LORAPLEX_CUBLAS(st);
  if (found == 0) {
    const std::string modes = f8.fp8
                                  ? " (cublasLtMatmulMatrixScale_t " + std::to_string(f8.a_mode) +
                                        " for the weight, " + std::to_string(f8.b_mode) + " for x)"
                                  : "";
    return unsupported("cuBLASLt has no algorithm for y = x W^T with m ", g.m, ", n ", g.n, ", k ",
                       g.k, ", dtype ", g.dtype, ", weight dtype ", g.w_dtype, modes);
  }
  if (g.bias != nullptr) {
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &g.bias, sizeof(g.bias)));
  }
  p.algo = results[fastest_algo(handle, p, g, results, found, workspace, stream)].algo;
  p.ready = true;
  return Status();
}

}  // namespace

Status gemm_xwt(const GemmArgs& args, cuda_rt::StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_gemm_args(args));
  LORAPLEX_ENSURE(args.n >= 1 && args.k >= 1, "cuBLASLt gemm: bad sizes (m ", args.m, ", n ",
                  args.n, ", k ", args.k, ")");
  if (args.m == 0) return Status();
  Fp8Scaling f8;
  LORAPLEX_RETURN_IF_ERROR(fp8_scaling(args, f8));
  // An fp8 GEMM multiplies the quantised copy of x (contiguous rows) by the weight.
  GemmArgs g = args;
  const float* x_scales = nullptr;
  if (f8.fp8) {
    QuantizeRowsFp8Args q;
    q.dtype = args.dtype;
    q.m = args.m;
    q.k = args.k;
    q.x = args.x;
    q.x_row_stride = args.x_row_stride;
    q.group = f8.act_group;
    q.static_scale = args.input_scale;
    q.q = static_cast<uint8_t*>(args.fp8_scratch);
    q.scale = reinterpret_cast<float*>(static_cast<uint8_t*>(args.fp8_scratch) +
                                       fp8_gemm_scales_offset(args.m, args.k));
    LORAPLEX_RETURN_IF_ERROR(quantize_rows_fp8(q, stream));
    g.x = q.q;
    g.x_row_stride = args.k;
    x_scales = q.scale;
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    return Status(StatusCode::kCudaError, "cuBLASLt gemm: no current CUDA device");
  }
  ThreadState& s = state();
  auto h = s.handles.find(device);
  if (h == s.handles.end()) {
    cublasLtHandle_t handle = nullptr;
    LORAPLEX_CUBLAS(cublasLtCreate(&handle));
    h = s.handles.emplace(device, handle).first;
  }
  const uint32_t align[4] = {alignment_of(g.w), alignment_of(g.x), alignment_of(g.y),
                             alignment_of(g.y)};
  const PlanKey key{device,
                    static_cast<int>(g.dtype) * 256 + static_cast<int>(g.w_dtype),
                    g.m,
                    g.n,
                    g.k,
                    g.x_row_stride,
                    g.w_row_stride,
                    g.y_row_stride,
                    g.bias != nullptr,
                    g.accumulate,
                    align[0],
                    align[1],
                    align[2],
                    align[3],
                    f8.a_mode,
                    f8.b_mode};
  std::unique_ptr<Workspace>& ws = s.workspaces[{device, stream}];
  if (ws == nullptr) {
    ws = std::make_unique<Workspace>();
    ws->device = device;
    if (cudaMalloc(&ws->ptr, kWorkspaceBytes) != cudaSuccess) {
      ws.reset();
      return Status(StatusCode::kCudaError,
                    detail::concat("cuBLASLt gemm: cannot allocate a ", kWorkspaceBytes >> 20,
                                   " MiB workspace on cuda:", device));
    }
  }
  std::unique_ptr<Plan>& plan = s.plans[key];
  if (plan == nullptr) plan = std::make_unique<Plan>();
  if (!plan->ready) {
    const Status st = build_plan(*plan, h->second, g, f8, x_scales, align, ws->ptr,
                                 static_cast<cudaStream_t>(stream));
    if (!st.ok()) {
      plan.reset();
      return st;
    }
  }

  if (g.bias != nullptr) {
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &g.bias, sizeof(g.bias)));
  }
  if (f8.fp8) LORAPLEX_RETURN_IF_ERROR(set_scale_pointers(plan->desc, g.w_scales.scale, x_scales));
  const float alpha = 1.0f;
  const float beta = g.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(
      h->second, plan->desc, &alpha, g.w, plan->a, g.x, plan->b, &beta, g.y, plan->c, g.y, plan->c,
      &plan->algo, ws->ptr, kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  LORAPLEX_CUBLAS(st);
  return Status();
}

}  // namespace loraplex::kernels::cuda
