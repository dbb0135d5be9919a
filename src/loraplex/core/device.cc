#include "loraplex/core/device.h"

#include <charconv>
#include <ostream>

#include "loraplex/core/error.h"

namespace loraplex {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

Device Device::parse(std::string_view text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.substr(0, 5) == "cuda:") {
    int index = -1;
    const std::string_view digits = text.substr(5);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc() && end == digits.data() + digits.size() && index >= 0) {
      return cuda(index);
    }
  }
  LORAPLEX_FAIL("unknown device '", std::string(text), "', expected cpu, cuda or cuda:N");
}

std::ostream& operator<<(std::ostream& os, const Device& device) { return os << device.str(); }

}  // namespace loraplex

#include "loraplex/core/cuda_runtime.h"

namespace loraplex {

bool built_with_cuda() { return LORAPLEX_WITH_CUDA != 0; }

int cuda_device_count() {
  static const int count = cuda_rt::device_count();
  return count;
}

}  // namespace loraplex
