#include "kernel_profile.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "loraplex/core/error.h"

#if LORAPLEX_WITH_CUPTI
#include <cuda_runtime.h>
#include <cupti.h>
#endif

namespace loraplex::cli {
namespace {

[[maybe_unused]] std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                           std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

#if LORAPLEX_WITH_CUPTI
std::mutex g_mutex;
std::vector<KernelRecord> g_records;

void check(CUptiResult r, const char* what) {
  if (r != CUPTI_SUCCESS) {
    const char* msg = nullptr;
    cuptiGetResultString(r, &msg);
    LORAPLEX_FAIL("CUPTI ", what, " failed: ", msg != nullptr ? msg : "?");
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = kBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
        record->kind != CUPTI_ACTIVITY_KIND_KERNEL) {
      continue;
    }
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    g_records.push_back({demangle(k->name), k->start, k->end, k->streamId});
  }
  std::free(buffer);
}
#endif

}  // namespace

bool KernelProfile::available() { return LORAPLEX_WITH_CUPTI != 0; }

void KernelProfile::start() {
#if LORAPLEX_WITH_CUPTI
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records.clear();
  }
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
        "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
#endif
}

std::vector<KernelRecord> KernelProfile::stop() {
#if LORAPLEX_WITH_CUPTI
  cudaDeviceSynchronize();
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable");
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<KernelRecord> out = std::move(g_records);
  g_records.clear();
  return out;
#else
  return {};
#endif
}

std::string kernel_component(const std::string& n) {
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("argmax") || has("sample_")) return "sampling";
  if (has("attention") || has("flashinfer") || has("MergeStates") || has("BatchPrefill") ||
      has("BatchDecode")) {
    return "attention";
  }
  // Our own kernels: the decoder's and the layers' elementwise and gather kernels by name,
  // the rest of kernels/ is the LoRA layer ("loraplex" itself contains "lora").
  for (const char* op :
       {"add_rms_norm", "rope_kv_write", "silu_mul", "embedding_kernel", "fill_uniform",
        "shard_ids", "topk_softmax", "sum_topk", "moe_expert_blocks"}) {
    if (has(op)) return "norm_rope_act";
  }
  if (has("moe_expert_gemm")) return "base_gemm";  // the MoE experts' base weights
  if (has("loraplex::kernels::")) return "lora";
  if (has("gemm") || has("nvjet") || has("cutlass") || has("xmma") || has("cublas") ||
      has("Kernel2")) {
    return "base_gemm";
  }
  return "other";
}

std::map<std::string, double> component_ms(const std::vector<KernelRecord>& records,
                                           double wall_ms) {
  std::map<std::string, double> out;
  for (const char* c : {"base_gemm", "attention", "lora", "norm_rope_act", "sampling", "other"}) {
    out[c] = 0.0;
  }
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  double total = 0.0;
  for (const KernelRecord& r : records) {
    const double ms = static_cast<double>(r.end_ns - r.start_ns) * 1e-6;
    out[kernel_component(r.name)] += ms;
    total += ms;
    spans.emplace_back(r.start_ns, r.end_ns);
  }
  std::sort(spans.begin(), spans.end());
  double busy = 0.0;
  uint64_t lo = 0, hi = 0;
  for (const auto& [s, e] : spans) {
    if (s > hi) {
      busy += static_cast<double>(hi - lo) * 1e-6;
      lo = s;
      hi = e;
    } else {
      hi = std::max(hi, e);
    }
  }
  busy += static_cast<double>(hi - lo) * 1e-6;
  out["kernels"] = total;
  out["busy"] = busy;
  out["host_gaps"] = std::max(0.0, wall_ms - busy);
  return out;
}

std::vector<KernelRecord> last_step(std::vector<KernelRecord> records,
                                    const std::string& first_kernel) {
  std::sort(records.begin(), records.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  size_t from = 0;
  for (size_t i = records.size(); i-- > 0;) {
    if (records[i].name.find(first_kernel) != std::string::npos) {
      from = i;
      break;
    }
  }
  records.erase(records.begin(), records.begin() + static_cast<std::ptrdiff_t>(from));
  return records;
}

std::vector<KernelTotal> top_kernels(const std::vector<KernelRecord>& records, size_t n) {
  std::map<std::string, KernelTotal> by_name;
  for (const KernelRecord& r : records) {
    // Demangled names carry every template argument and parameter type: the first 160
    // characters tell the kernels and their variants apart.
    std::string name = r.name.substr(0, std::min<size_t>(r.name.size(), 160));
    KernelTotal& t = by_name[name];
    t.name = name;
    t.ms += static_cast<double>(r.end_ns - r.start_ns) * 1e-6;
    ++t.launches;
  }
  std::vector<KernelTotal> out;
  for (auto& [name, t] : by_name) out.push_back(std::move(t));
  std::sort(out.begin(), out.end(),
            [](const KernelTotal& a, const KernelTotal& b) { return a.ms > b.ms; });
  if (out.size() > n) out.resize(n);
  return out;
}

}  // namespace loraplex::cli
