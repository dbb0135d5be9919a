#include "support/gpu_check.h"

#include <cstdlib>
#include <string>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"

namespace loraplex::test {
namespace {

std::string& probe_failure() {
  static std::string why;
  return why;
}

int probe() {
  const int count = cuda_device_count();
  if (count == 0) return 0;
  int current = 0;
  try {
    current = cuda_rt::current_device();
  } catch (const Error& e) {
    probe_failure() = std::string("CUDA does not answer: ") + e.what();
    return 0;
  }
  int working = 0;
  for (int d = 0; d < count; ++d) {
    try {
      cuda_rt::set_device(d);
      void* p = cuda_rt::device_malloc(256, d);
      cuda_rt::memset_async(p, 0, 256, nullptr);
      cuda_rt::stream_synchronize(nullptr);
      cuda_rt::device_free(p, d);
      ++working;
    } catch (const Error& e) {
      probe_failure() = "cuda:" + std::to_string(d) + " is broken: " + e.what();
      break;
    }
  }
  try {
    cuda_rt::set_device(current);
  } catch (const Error&) {
  }
  return working;
}

}  // namespace

int working_gpus() {
  static const int n = probe();
  return n;
}

int required_gpus() {
  const char* v = std::getenv("LORAPLEX_REQUIRE_GPU");
  if (v == nullptr) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && n > 0 && n < 1024 ? static_cast<int>(n) : 0;
}

std::string gpus_missing(int n) {
  const int have = working_gpus();
  if (have >= n) return "";
  std::string why = "needs " + std::to_string(n) + " working GPU(s), found " +
                    std::to_string(have) + " (of " + std::to_string(cuda_device_count()) + ")";
  if (!probe_failure().empty()) why += "; " + probe_failure();
  return why;
}

}  // namespace loraplex::test
