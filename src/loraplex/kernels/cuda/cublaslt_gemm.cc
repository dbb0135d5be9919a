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

#include "loraplex/kernels/gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>

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
                           bool, uint32_t, uint32_t, uint32_t, uint32_t>;

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

Status build_plan(Plan& p, cublasLtHandle_t handle, const GemmArgs& g, const uint32_t align[4],
                  void* workspace, cudaStream_t stream) {
  const cudaDataType_t t = cuda_type(g.dtype);
  LORAPLEX_CUBLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
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
  LORAPLEX_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, t, static_cast<uint64_t>(g.k),
                                             static_cast<uint64_t>(g.n), g.w_row_stride));
  LORAPLEX_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, t, static_cast<uint64_t>(g.k),
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
    return unsupported("cuBLASLt has no algorithm for y = x W^T with m ", g.m, ", n ", g.n, ", k ",
                       g.k, ", dtype ", g.dtype);
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

Status gemm_xwt(const GemmArgs& g, cuda_rt::StreamHandle stream) {
  LORAPLEX_ENSURE(g.dtype == DType::kF32 || g.dtype == DType::kF16 || g.dtype == DType::kBF16,
                  "cuBLASLt gemm: dtype ", g.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_ENSURE(g.m >= 0 && g.n >= 1 && g.k >= 1, "cuBLASLt gemm: bad sizes (m ", g.m, ", n ",
                  g.n, ", k ", g.k, ")");
  if (g.m == 0) return Status();
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
                    static_cast<int>(g.dtype),
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
                    align[3]};
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
    const Status st =
        build_plan(*plan, h->second, g, align, ws->ptr, static_cast<cudaStream_t>(stream));
    if (!st.ok()) {
      plan.reset();
      return st;
    }
  }

  if (g.bias != nullptr) {
    LORAPLEX_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &g.bias, sizeof(g.bias)));
  }
  const float alpha = 1.0f;
  const float beta = g.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(
      h->second, plan->desc, &alpha, g.w, plan->a, g.x, plan->b, &beta, g.y, plan->c, g.y, plan->c,
      &plan->algo, ws->ptr, kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  LORAPLEX_CUBLAS(st);
  return Status();
}

}  // namespace loraplex::kernels::cuda
